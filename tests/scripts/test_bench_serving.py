"""The serving scripts: the load generator's metrics worked by hand, bench_serving against a fake
OpenAI-style server, and latency_breakdown on a hand-made trace."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from tests.scripts.conftest import _check_record, _load_script


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
    # One word, one token. Requests of one run are sent concurrently, so they may arrive in any order.
    assert sorted(len(p.split()) for p in prompts[:len(lengths)]) == [3, 4, 6]
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
    # added at -0.4, step 0 begins at 0.0, the first token leaves in it at 0.9
    assert b["ttft_s"] == pytest.approx({"http_in": 0.1, "to_next_step": 0.4, "steps_to_first_token": 0.9,
                                         "delivery": 0.2})
    assert b["ttft_steps_mean"] == 1 and b["ttft_tail"] == [pytest.approx(
        {"ttft_s": 1.6, "steps": 1, "http_in": 0.1, "to_next_step": 0.4, "steps_to_first_token": 0.9,
         "delivery": 0.2})]
    assert (b["itl_client_s"], b["itl_engine_s"]) == (pytest.approx(1.1), pytest.approx(1.0))
    assert (b["decode_rows_real_mean"], b["decode_rows_padded_mean"]) == (1, 4)
    assert (b["compiles"], b["compile_s"]) == (2, 1.25)
    assert lb.window(trace, 1.0, 2.5)["steps"] == trace["steps"][1:]
    assert lb.window(trace, 1.0, 2.5)["compiles"] == trace["compiles"][:1]


def test_latency_trace_hooks_time_a_real_engine(tiny_text_dir):
    """scripts/latency_trace.py wraps the engine's methods by name: run in a process of its own (the
    hooks patch classes), a real engine's steps must show every engine phase and each request's
    add and token sends, or a renamed method has left the trace blind."""
    import subprocess
    import sys

    code = f"""
import sys
sys.path.insert(0, "scripts")
import latency_trace
trace = latency_trace.install()
import paxpage
model = paxpage.load({str(tiny_text_dir)!r})
paxpage.generate(model, [[5, 6, 7], [8, 9]], max_tokens=6, ignore_eos=True, use_tqdm=False)
phases = set().union(*(s["phases"] for s in trace.steps))
missing = {{"schedule", "pack", "dispatch", "device_wait", "outputs", "engine_other", "loop_send"}} - phases
assert not missing, missing
assert len(trace.adds) == 2 and all(trace.steps[-1]["end"] >= t for t in trace.adds.values())
assert any(s["batch"] for s in trace.steps)

import asyncio  # the server's way in: AsyncEngine.stream, its deltas timed as the event loop takes them
from paxpage.async_engine import AsyncEngine

async def stream():
    engine = AsyncEngine(model)
    params = paxpage.SamplingParams(max_tokens=4, ignore_eos=True)
    return [d async for d in engine.stream([5, 6, 7], params, request_id="r", lora=None)]

assert len(asyncio.run(stream())) == 4 and len(trace.yields["r"]) == 4 and len(trace.sends["r"]) == 4
print("ok", len(trace.steps))
"""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
