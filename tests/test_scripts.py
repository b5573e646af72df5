"""Smoke tests of the benchmark scripts on a tiny random HF llama with tiny workloads:
they run end to end (paxpage, HF baseline, profile, plots) and write the JSON keys the
docs and CI read. The figures themselves mean nothing at this size."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time

import numpy as np
import pytest

from tests.conftest import save_tiny_hf

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
TINY_WORKLOAD = ["--num-requests", "6", "--prompt-range", "3", "20", "--output-range", "2", "9"]


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_tiny_llama")
    save_tiny_hf(path, "llama")
    return str(path)


def _check_record(data: dict, table: str) -> list:
    """The provenance every script's JSON carries (scripts/provenance.py) and one docs table's rows."""
    import jax

    p = data["provenance"]
    assert (p["jax"], p["backend"], p["source"]) == (jax.__version__, "cpu", "measured")
    assert p["machine"] and p["date"] and p["command"].startswith("python ")
    assert p["commit"] is None or len(p["commit"]) == 40
    assert data["measures"]
    t = data["tables"][table]
    assert t["rows"] and all(len(row) == len(t["columns"]) for row in t["rows"])
    # ... as the docs pages render it (scripts/docs_figures.py), machine and command beside it
    sys.path.insert(0, SCRIPTS)
    import docs_figures

    text = docs_figures.render_record("run", data, table, docs_figures.ROOT)
    assert p["machine"] in text and f"`{p['command']}`" in text
    return t["rows"]


def test_workload_lengths_are_seeded_and_clipped(tmp_path):
    workload = _load_script("workload")
    a = workload.sharegpt_lengths(200, 3, (16, 128), (8, 64))
    assert a == workload.sharegpt_lengths(200, 3, (16, 128), (8, 64))
    assert a != workload.sharegpt_lengths(200, 4, (16, 128), (8, 64))
    assert all(16 <= p <= 128 and 8 <= o <= 64 for p, o in a)
    path = tmp_path / "lengths.json"
    path.write_text("[[5, 3], [7, 1]]")
    work = workload.make_workload(workload.read_lengths(str(path)), 100, 0)
    assert work.prompt_lens == [5, 7] and work.output_lens == [3, 1]
    path.write_text("[[5, 0]]")
    with pytest.raises(ValueError, match="entry 0"):
        workload.read_lengths(str(path))


def test_bench_throughput_smoke(tiny_model_dir, tmp_path, capsys):
    bench = _load_script("bench_throughput")
    out = tmp_path / "throughput.json"
    rc = bench.main(["--model", tiny_model_dir, *TINY_WORKLOAD, "--max-num-seqs", "4",
                     "--max-num-batched-tokens", "32", "--page-size", "4", "--num-pages", "64",
                     "--hf-batch-sizes", "2", "4", "--profile-iters", "1", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["compiles_after_warmup"] == 0
    assert data["ratio"] > 0
    assert data["hf"]["best_batch_size"] in (2, 4)
    for key in ("requests_per_s", "output_tok_per_s", "total_tok_per_s", "host_share"):
        assert data["paxpage"][key] > 0
    assert set(data["paxpage"]["ttft_s"]) == {"p50", "p90", "p99"}
    assert set(data["paxpage"]["tpot_s"]) == {"p50", "p90", "p99"}
    assert set(data["profile"]["shares"]) == {"matmuls_and_rest", "attention_and_kv_write", "sampling",
                                              "host_packing"}
    assert "ratio paxpage / HF" in capsys.readouterr().out
    rows = _check_record(data, "throughput")
    assert rows[0][:3] == ["paxpage", round(data["paxpage"]["requests_per_s"], 2),
                           round(data["paxpage"]["output_tok_per_s"], 1)]
    assert rows[1][2] == round(data["hf"]["output_tok_per_s"], 1)


def test_bench_compile_smoke(tiny_model_dir, tmp_path):
    bench = _load_script("bench_compile")
    out = tmp_path / "compile.json"
    assert bench.main(["--model", tiny_model_dir, "--num-pages", "32", "--context", "9", "--shapes", "4,1",
                       "--iters", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r[:2] for r in _check_record(data, "compile")] == [["(4, 1)", "unrolled"], ["(4, 1)", "scan"]]
    assert data.pop("provenance")["command"].startswith("python ") and data.pop("measures") and data.pop("tables")
    assert set(data) == {"4,1,unrolled", "4,1,scan"}
    assert all(r["compile_s"] > 0 and r["step_ms"] > 0 for r in data.values())


def test_bench_moe_smoke(tmp_path, capsys):
    bench = _load_script("bench_moe")
    out = tmp_path / "moe.json"
    assert bench.main(["--layers", "1", "--hidden", "64", "--experts", "4", "--top-k", "2",
                       "--expert-width", "32", "--vocab", "128", "--num-requests", "3", "--prompt-len", "9",
                       "--output-len", "3", "--max-num-seqs", "4", "--repeats", "1", "--layer-tokens", "8",
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["compiles_after_warmup"] == 0
    assert data["identical_greedy_outputs"] == "3/3"
    assert data["ratio_output_tok_s"] > 0 and set(data["systems"]) == {data["grouped_impl"], "dense"}
    assert _check_record(data, "moe")[0][0] == "4 experts of width 32, top 2"
    assert "/ dense output tok/s" in capsys.readouterr().out


@pytest.mark.extended
def test_eval_quality_quick(tiny_model_dir, tmp_path):
    """Every row the checkout supports runs; the reference agrees with itself exactly."""
    script = _load_script("eval_quality")
    out = tmp_path / "quality.json"
    assert script.main(["--quick", "--model", tiny_model_dir, "--json", str(out),
                        "--variants", "int8 weights", "int8 KV", "GGUF-native"]) == 0
    data = json.loads(out.read_text())
    ref = data["rows"]["f32"]
    assert (ref["agree"], ref["prefix"], ref["kl"], ref["ppl_change"]) == (1.0, 1.0, 0.0, 0.0)
    assert data["skipped"]["GGUF-native"].startswith("n/a")
    assert "int8 KV" in data["rows"] or data["skipped"]["int8 KV"].startswith("unavailable")
    int8 = data["rows"]["int8 weights"]
    assert int8["finite"] and int8["kl"] > 0 and int8["weights_bytes"] < 0.5 * ref["weights_bytes"]
    rows = _check_record(data, "quality")
    assert rows[0][:3] == ["f32", "1.000 / 1.000", "0.00e+00"] and rows[-1][:2] == ["GGUF-native",
                                                                                   data["skipped"]["GGUF-native"]]


def test_bench_memory_smoke(tiny_model_dir, tmp_path):
    bench = _load_script("bench_memory")
    out = tmp_path / "memory.json"
    rc = bench.main(["--model", tiny_model_dir, *TINY_WORKLOAD, "--max-num-seqs", "8",
                     "--max-num-batched-tokens", "32", "--page-size", "4", "--num-pages", "32",
                     "--max-model-len", "64", "--out-dir", str(tmp_path), "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert 0 < data["contiguous_utilisation"] < data["paged_utilisation"] <= 1
    assert data["paged"]["max_running"] >= data["contiguous"]["max_running"]
    rows = _check_record(data, "memory")
    assert [r[:2] for r in rows] == [[name, data[name]["max_running"]] for name in ("paged", "contiguous")]
    for name in data["plots"].values():
        assert os.path.getsize(name) > 1000


def test_bench_memory_kv_dtypes_smoke(tiny_model_dir, tmp_path):
    bench = _load_script("bench_memory")
    out = tmp_path / "kv_dtypes.json"
    # 24 float32 pages of 4 tokens: 2 layers x 2 (K, V) x 4 tokens x 2 kv heads x 16 x 4 bytes = 2048 B each
    rc = bench.main(["--model", tiny_model_dir, *TINY_WORKLOAD, "--max-num-seqs", "8", "--no-warmup",
                     "--max-num-batched-tokens", "32", "--page-size", "4", "--kv-cache-bytes", str(24 * 2048),
                     "--max-model-len", "64", "--kv-dtypes", "float32,int8", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())["kv_dtypes"]
    # int8: rows of 16 bytes + a bf16 scale (2 bytes) instead of 64: 576 B pages, 24 * 2048 // 576 = 85 of them
    assert (data["float32"]["num_pages"], data["int8"]["num_pages"]) == (24, 85)
    assert data["int8"]["max_running"] >= data["float32"]["max_running"]
    assert data["int8"]["ratios"]["pages"] == pytest.approx(85 / 24)
    rows = _check_record(json.loads(out.read_text()), "kv_dtypes")
    assert [r[:3] for r in rows] == [["float32", 24, 2048], ["int8", 85, 576]]


def test_bench_window_smoke(tiny_model_dir, tmp_path):
    bench = _load_script("bench_window")
    out = tmp_path / "window.json"
    rc = bench.main(["--model", tiny_model_dir, "--num-requests", "3", "--prompt-len", "8", "--output-len", "24",
                     "--page-size", "4", "--sliding-window", "8", "--max-num-batched-tokens", "16",
                     "--out-dir", str(tmp_path), "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["full"]["max_pages_per_seq"] == 8  # 32 tokens in pages of 4
    assert data["window"]["max_pages_per_seq"] <= 7  # cdiv(8 - 1 + 16, 4) + 1
    rows = _check_record(data, "window")
    assert [r[:2] for r in rows] == [["full", 8], ["window of 8 in every layer", data["window"]["max_pages_per_seq"]]]
    for name in data["plots"].values():
        assert os.path.getsize(name) > 1000


def test_bench_sharing_smoke(tiny_model_dir, tmp_path):
    bench = _load_script("bench_sharing")
    out = tmp_path / "sharing.json"
    assert bench.main(["--model", tiny_model_dir, "--num-requests", "3", "--prefix", "16",
                       "--max-tokens", "3", "--fork-prompt", "40", "--fork-tokens", "4",
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["prefix_caching"]["identical_tokens"]
    assert data["prefix_caching"]["on"]["prefix_hit_rate"] > 0
    forks = data["forks"]
    assert forks["pages_n4"] < forks["pages_unshared_x4"] and forks["pages_beam4"] < forks["pages_unshared_x4"]
    rows = _check_record(data, "sharing")
    assert rows[2][1:] == [forks["pages_unshared_x4"], f"{forks['pages_beam4']} ({forks['saved_beam4']:.0%} saved)"]


@pytest.mark.extended
def test_bench_step_quick(tmp_path):
    # Through the CLI (`paxpage bench step`), in a subprocess bounded in time.
    import subprocess

    out = tmp_path / "step.json"
    root = os.path.dirname(SCRIPTS)
    command = [sys.executable, "-m", "paxpage.cli", "bench", "step", "--quick", "--json", str(out)]
    proc = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["read_bandwidth_gb_per_s"] > 0
    assert [c["case"] for c in data["cases"]] == ["tiny-8x32", "tiny-8x32-t0.7-p0.9", "tiny-8x32-mixed"]
    for case in data["cases"]:
        for key in ("host_s", "device_s", "wall_s", "attention_s", "attention_gb_per_s"):
            assert case[key] > 0, key
        assert case["host_cpu_max_s"] == max(case["step_host_cpu_s"]) >= case["host_cpu_s"]
        assert len(case["step_host_cpu_s"]) == len(case["step_compiles"]) == case["measured_steps"] == 2
        assert case["host_cpu_max_warm_s"] <= case["host_cpu_max_s"]
        assert 0 <= case["decode_batch_steps"] <= 2
        # 2 layers x 8 rows x 32 keys x 4 kv heads x 16 dims x K and V x 4 bytes
        assert case["attention_kv_bytes"] == 2 * 2 * 8 * 32 * 4 * 16 * 4
    assert "| tiny 8 x 32 |" in proc.stdout
    rows = _check_record(data, "step")
    assert [r[0] for r in rows][:2] == ["tiny 8 x 32", "tiny 8 x 32, temperature 0.7, top-p 0.9"]
    mixed = data["cases"][2]  # a request arrives before each measured step: both carry its prefill
    assert (mixed["arrival_steps"], mixed["decode_steps"]) == (2, 0) and mixed["step_arrival"] == [True, True]



def test_bench_step_pairs_contexts_and_bounds_overlap():
    bench = _load_script("bench_step")
    rows = [dict(dataclasses.asdict(case), case=case.key) for case in bench.CASES[:5]]
    pairs = [(a["case"], b["case"]) for a, b in bench.context_ratios(rows)]
    assert pairs == [("tiny-256x128", "tiny-256x1536")]  # only cases that differ in context alone
    # host 2 + busy 10 in a wall of 11: 1 of the shorter 2 hidden; serial and over-counted ends
    assert bench.overlap(2.0, 10.0, 11.0) == pytest.approx(0.5)
    assert bench.overlap(2.0, 10.0, 12.5) == 0.0 and bench.overlap(2.0, 10.0, 9.0) == 1.0

# ---------------------------------------------------------------------------------------- serving
def test_serving_metrics_hand_computed():
    load = _load_script("serving_load")
    R = load.RequestRecord
    records = [R(start=0.0, first_token=0.5, end=2.5, output_tokens=5, counted_from_usage=True),
               R(start=1.0, first_token=1.2, end=2.0, output_tokens=4, counted_from_usage=True),
               R(start=1.5, error="HTTP 500: boom")]
    specs = [load.RequestSpec({}, 5), load.RequestSpec({}, 8), load.RequestSpec({}, 3)]
    s = load.summarise(records, specs)
    assert (s["num_requests"], s["num_finished"], s["errors"]) == (3, 2, ["HTTP 500: boom"])
    assert s["duration_s"] == pytest.approx(2.5)  # first start 0.0 .. last end 2.5 (finished ones)
    assert s["requests_per_s"] == pytest.approx(2 / 2.5)
    assert s["output_tok_per_s"] == pytest.approx(9 / 2.5)
    # latencies 2.5 and 1.0 over 5 and 4 tokens
    assert s["normalised_latency_s"] == pytest.approx((2.5 / 5 + 1.0 / 4) / 2)
    assert s["ttft_s"]["p50"] == pytest.approx((0.5 + 0.2) / 2)
    assert s["ttft_s"]["p90"] == pytest.approx(0.2 + 0.9 * 0.3)  # numpy's linear interpolation
    # TPOT: (2.5 - 0.5) / 4 and (2.0 - 1.2) / 3
    assert s["tpot_s"]["p50"] == pytest.approx((0.5 + 0.8 / 3) / 2)
    assert s["share_exact_length"] == pytest.approx(1 / 3)

    a, b = load.poisson_offsets(4000, 2.0, 7), load.poisson_offsets(4000, 2.0, 7)
    assert a == b and a[0] == 0.0 and a != load.poisson_offsets(4000, 2.0, 8)
    assert np.mean(np.diff(a)) == pytest.approx(0.5, rel=0.06)  # mean gap 1 / rate
    assert load.poisson_offsets(3, float("inf"), 0) == [0.0, 0.0, 0.0]

    bench = _load_script("bench_serving")
    points = [dict(rate=r, normalised_latency_s=lat, num_finished=4, num_requests=4)
              for r, lat in ((1, 0.05), (2, 0.08), (4, 0.12), (8, 0.09))]
    cap = bench.capacity(points, 0.1)
    assert cap["highest_rate"] == 2 and cap["limit_reached"]
    assert cap["interpolated_rate"] == pytest.approx(2 * 2 ** 0.5)  # halfway from 0.08 to 0.12, log scale
    points[1]["num_finished"] = 3  # an unfinished request: that rate is not sustained
    assert bench.capacity(points, 0.1)["highest_rate"] == 1
    assert bench.capacity(points[:1], 0.1) == {"highest_rate": 1, "interpolated_rate": 1, "limit_reached": False}
    auto = {"a": [dict(rate=2, normalised_latency_s=0.05), dict(rate=1, normalised_latency_s=0.5)],
            "b": [dict(rate=1, normalised_latency_s=0.08), dict(rate=2, normalised_latency_s=None)]}
    assert bench.latency_limit("auto", auto) == pytest.approx(0.16)  # 2x the slower one's best
    assert bench.latency_limit("0.3", auto) == 0.3
    hf = bench.request_body("hf", "forced", "m", "x", 7)
    assert "ignore_eos" not in hf and json.loads(hf["generation_config"])["eos_token_id"] == -1
    assert bench.request_body("paxpage", "forced", "m", "x", 7)["ignore_eos"] is True
    assert "ignore_eos" not in bench.request_body("paxpage", "natural", "m", "x", 7)


FIRST_DELAY, TOKEN_GAP, NATURAL_EOS_AT = 0.05, 0.02, 3


def _fake_completions_app(seen: list):
    """An OpenAI-style SSE /v1/completions: the first token after FIRST_DELAY s, then one
    per TOKEN_GAP s; stops after NATURAL_EOS_AT tokens unless ignore_eos is set."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(body: dict):  # (not Request: this module's annotations are strings)
        seen.append(body)
        n = body["max_tokens"] if body.get("ignore_eos") else min(body["max_tokens"], NATURAL_EOS_AT)

        async def events():
            await asyncio.sleep(FIRST_DELAY)
            for i in range(n):
                if i:
                    await asyncio.sleep(TOKEN_GAP)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f' t{i}'}]})}\n\n"
            if body.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture
def fake_server():
    import socket
    import threading

    import uvicorn

    seen = []
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_fake_completions_app(seen), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", seen
    server.should_exit = True
    thread.join(10)
    sock.close()


def _tiny_word_tokenizer(path):
    """A byte-level word tokenizer of 200 lowercase words: ' abc' is one token."""
    import itertools

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["".join(w) for w in itertools.islice(itertools.product("abcdefgh", repeat=4), 200)]
    vocab = {"<unk>": 0, **{f"\u0120{w}": i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)


def test_bench_serving_against_fake_server(fake_server, tmp_path, capsys):
    url, seen = fake_server
    _tiny_word_tokenizer(tmp_path / "tok")
    bench = _load_script("bench_serving")
    lengths = [[4, 5], [6, 4], [3, 6]]
    (tmp_path / "lengths.json").write_text(json.dumps(lengths))
    out, png = tmp_path / "serving.json", tmp_path / "serving.png"
    rc = bench.main(["--base-url", url, "--api", "paxpage", "--tokenizer", str(tmp_path / "tok"),
                     "--lengths", str(tmp_path / "lengths.json"), "--request-rates", "20,80",
                     "--warmup-requests", "2", "--warmup-rates", "80", "--latency-limit", "1.0",
                     "--request-timeout", "20",
                     "--rate-timeout", "30", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["servers"]["paxpage"]["model"] == "fake"
    assert len(seen) == 2 + len(lengths) + 2 * 2 * len(lengths)  # warm-ups, then 2 modes x 2 rates
    assert all(b["model"] == "fake" and b["stream"] and b["temperature"] == 0 for b in seen)
    assert sum(bool(b.get("ignore_eos")) for b in seen) == 2 * len(lengths)  # forced mode only
    prompts = [b["prompt"] for b in seen[2:]]
    assert len(set(prompts)) == len(prompts)  # fresh prompts per run: no prefix-cache hits
    assert [len(p.split()) for p in prompts[:len(lengths)]] == [4, 6, 3]  # one word, one token
    for mode, tokens in (("natural", [3, 3, 3]), ("forced", [5, 4, 6])):
        for point in data["results"][mode]["paxpage"]:
            assert point["num_finished"] == 3 and point["tokens_from_usage"]
            assert point["mean_output_tokens"] == pytest.approx(np.mean(tokens))
            assert point["share_exact_length"] == pytest.approx(np.mean([t == o for t, (_, o) in
                                                                        zip(tokens, lengths)]))
            # The server's sleeps bound what the client measures from below: the first token and
            # the whole stream (single gaps can shrink when a late chunk meets the next one).
            assert point["ttft_s"]["p50"] >= FIRST_DELAY
            assert 0 < point["tpot_s"]["p50"] < 1 and 0 < point["max_token_gap_s"] < 1
            floor = np.mean([(FIRST_DELAY + (t - 1) * TOKEN_GAP) / t for t in tokens])
            assert floor <= point["normalised_latency_s"] < floor + 1.0
        assert data["capacity"][mode]["paxpage"] == {"highest_rate": 80, "interpolated_rate": 80,
                                                     "limit_reached": False}
    assert os.path.getsize(png) > 1000
    assert data["latency_limit_s_per_token"] == {"natural": 1.0, "forced": 1.0}
    rows = _check_record(data, "serving")
    assert [r[:3] for r in rows] == [["natural", "paxpage", "20 / 80"], ["forced", "paxpage", "20 / 80"]]
    assert "sustained" not in data["tables"]  # one system: nothing to set it against
    assert [s["x"] for p in data["charts"]["latency"]["panels"] for s in p["series"]] == [[20, 80], [20, 80]]
    assert "natural, limit 1 s/token: paxpage 80.00 req/s" in capsys.readouterr().out
    # Re-reported from the JSON under another limit: nothing is measured again.
    again = tmp_path / "again.json"
    assert bench.main(["--from-json", str(out), "--latency-limit", "1e-9", "--json", str(again)]) == 0
    redo = json.loads(again.read_text())
    assert redo["results"] == data["results"] and len(seen) == 2 + len(lengths) + 2 * 2 * len(lengths)
    assert redo["capacity"]["forced"]["paxpage"] == {"highest_rate": None, "interpolated_rate": None,
                                                     "limit_reached": True}


@pytest.mark.extended
def test_bench_structured_smoke(tiny_text_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PAXPAGE_CACHE_DIR", str(tmp_path / "cache"))  # its workers' XLA cache
    bench = _load_script("bench_structured")
    out = tmp_path / "structured.json"
    rc = bench.main(["--model", str(tiny_text_dir), "--num-requests", "4", "--output-len", "6",
                     "--repeats", "1", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert set(data["tok_s"]) == {"none", "quarter", "all"}
    assert [r[0] for r in _check_record(data, "structured")] == ["none", "a quarter", "all"]
    assert data["masks"]["all"]["steps"] >= 6 and data["masks"]["all"]["us_per_row"] > 0


@pytest.mark.extended
def test_bench_speculative_quick(tiny_model_dir, tmp_path, capsys):
    bench = _load_script("bench_speculative")
    out = tmp_path / "spec.json"
    assert bench.main(["--model", tiny_model_dir, "--quick", "-k", "4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["workload"], r["batch"], r["method"]) for r in rows] == [
        (w, b, m) for w in ("grounded", "random") for b in (1, 8) for m in ("none", "ngram")]
    assert all(r["identical"] for r in rows)  # greedy: the same tokens with and without
    grounded = rows[1]  # batch 1, n-gram, on repetitive prompts: drafts proposed and accepted
    assert grounded["draft_tokens"] > 0 and 0 < grounded["acceptance_rate"] <= 1
    assert rows[3]["spec_steps"] == 0  # saturation: past the adaptive threshold
    assert "| grounded | 1 | ngram |" in capsys.readouterr().out
    table = _check_record(json.loads(out.read_text()), "speculative")
    assert [r[:3] for r in table] == [[r["workload"], r["batch"], r["method"]] for r in rows]


def test_vllm_peer_skipped_without_its_venv(tmp_path, capsys, monkeypatch):
    """Without a vLLM venv both scripts go on without the peer and say why."""
    monkeypatch.delenv("PAXPAGE_VLLM_PYTHON", raising=False)
    peer = _load_script("vllm_peer")
    assert peer.find_python(None)[0] is None and "PAXPAGE_VLLM_PYTHON" in peer.find_python(None)[1]
    missing = str(tmp_path / "no-venv" / "python")
    assert peer.find_python(missing) == (None, f"--vllm-python {missing!r} is not an executable file")
    python, why = peer.find_python(sys.executable)  # this python has no vllm
    assert python is None and why.endswith("cannot run vLLM: it has no vllm module")
    env = peer.environment("/v/bin/python", 0.5)
    assert (env["VLLM_CPU_NUM_OF_RESERVED_CPU"], env["VLLM_CPU_KVCACHE_SPACE"]) == ("0", "0.5")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, sorted(os.sched_getaffinity(0))))

    throughput = _load_script("bench_throughput")
    args = argparse.Namespace(no_vllm=False, vllm_python=missing, vllm_model=None)
    assert throughput.start_vllm(args, None, None) == (None, None)
    assert f"vLLM peer skipped: --vllm-python {missing!r}" in capsys.readouterr().err
    serving = _load_script("bench_serving")
    args = serving.parse_args(["--systems", "paxpage,vllm", "--vllm-python", missing])
    assert args.systems == ["paxpage"]
    assert "vLLM peer skipped" in capsys.readouterr().err
    rows = serving.rate_ratios([dict(rate=1, requests_per_s=2.0, normalised_latency_s=0.05, ttft_s={"p99": 0.4})],
                               [dict(rate=1, requests_per_s=1.0, normalised_latency_s=0.1, ttft_s={"p99": 0.2})])
    assert rows == [{"rate": 1, "requests_per_s": 2.0, "normalised_latency_s": 0.5, "ttft_p99_s": 2.0}]


def test_latency_breakdown_attributes_each_token():
    """A hand-made trace of three engine steps and one request's three tokens."""
    lb = _load_script("latency_breakdown")
    load = _load_script("serving_load")
    batch = {"decode_rows": 1, "decode_row_slots": 4, "tokens": 1, "token_slots": 4}
    trace = {"steps": [{"begin": 0.0, "end": 1.0, "phases": {"device_wait": 0.6, "pack": 0.1}, "batch": batch},
                       {"begin": 1.2, "end": 2.0, "phases": {"device_wait": 0.5}, "batch": batch},
                       {"begin": 2.1, "end": 3.0, "phases": {"device_wait": 0.7, "schedule": 0.05}, "batch": batch}],
             "adds": {"cmpl-a-0": -0.4}, "sends": {"cmpl-a-0": [0.9, 1.9, 2.9]},
             "yields": {"cmpl-a-0": [0.95, 1.95, 2.95]}, "events": {"cmpl-a": [1.0, 2.0, 3.0]},
             "compiles": [[1.5, 0.25, "step"], [9.0, 1.0, "step"]]}
    record = load.RequestRecord(start=-0.5, first_token=1.1, end=3.4, output_tokens=3, response_id="cmpl-a",
                                chunk_times=[1.1, 2.2, 3.3])
    b = lb.breakdown([record], trace)
    assert (b["num_requests"], b["num_tokens"], b["steps"], b["mismatched_requests"]) == (1, 2, 2, 0)
    # token 2 left in step 1 (after step 0's end, 0.2 s between steps), token 3 in step 2 (0.1 s)
    engine = b["engine_s_per_token"]
    assert engine["device_wait"] == pytest.approx(0.6) and engine["schedule"] == pytest.approx(0.025)
    assert engine["loop_between_steps"] == pytest.approx(0.15) and engine["pack"] == 0
    assert b["delivery_s_per_token"] == pytest.approx({"handoff": 0.05, "sse": 0.05, "http": 0.2})
    assert b["ttft_s"] == pytest.approx({"http_in": 0.1, "queue_and_prefill": 1.3, "delivery": 0.2})
    assert (b["itl_client_s"], b["itl_engine_s"]) == (pytest.approx(1.1), pytest.approx(1.0))
    assert (b["decode_rows_real_mean"], b["decode_rows_padded_mean"]) == (1, 4)
    assert (b["compiles"], b["compile_s"]) == (2, 1.25)
    assert lb.window(trace, 1.0, 2.5)["steps"] == trace["steps"][1:]
    assert lb.window(trace, 1.0, 2.5)["compiles"] == trace["compiles"][:1]
