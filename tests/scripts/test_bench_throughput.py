"""Smoke tests of the throughput comparison's scripts on a tiny random HF llama with tiny workloads:
the workload's lengths, bench_throughput end to end (paxpage, HF baseline, profile), and the vLLM
peer skipped when it cannot run. The figures themselves mean nothing at this size."""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest

from tests.conftest import jax_persistent_cache_off
from tests.scripts.conftest import TINY_WORKLOAD, _check_record, _load_script


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
    assert data["matmuls"]["paxpage_gflops"] > 0 and data["matmuls"]["sgemm_gflops"] > 0
    out = capsys.readouterr().out
    assert "ratio paxpage / HF" in out and "TFLOP a pass" in out
    rows = _check_record(data, "throughput")
    assert rows[0][:3] == ["paxpage", round(data["paxpage"]["requests_per_s"], 2),
                           round(data["paxpage"]["output_tok_per_s"], 1)]
    assert rows[1][2] == round(data["hf"]["output_tok_per_s"], 1)


def test_bench_throughput_warms_up_from_its_executable_cache(tiny_model_dir, tmp_path, capsys):
    """--exec-cache: the first run compiles its executables into the directory, a second run's
    warm-up loads every one of them and compiles none (the record and the docs' row say which)."""
    bench, report = _load_script("bench_throughput"), _load_script("throughput_report")
    warmups = []
    with jax_persistent_cache_off():
        for run in range(2):
            out = tmp_path / f"throughput{run}.json"
            rc = bench.main(["--model", tiny_model_dir, *TINY_WORKLOAD, "--max-num-seqs", "4",
                             "--max-num-batched-tokens", "32", "--page-size", "4", "--num-pages", "64", "--no-hf",
                             "--no-profile", "--repeats", "1", "--exec-cache", str(tmp_path / "exe"),
                             "--json", str(out)])
            assert rc == 0, capsys.readouterr().err
            warmups.append(json.loads(out.read_text())["warmup"])
    cold, warm = (w["executable_cache"] for w in warmups)
    assert cold["loaded"] == 0 and cold["compiled"] > 0 and cold["stored"] == cold["compiled"]
    assert warm["compiled"] == 0 and warm["loaded"] == cold["stored"]
    assert f"cold (empty; {cold['compiled']} executables compiled" in report.warm_cache_note(warmups[0])
    assert f"{warm['loaded']} executables loaded" in report.warm_cache_note(warmups[1])
    assert report.warm_cache_note({"executable_cache": None}) == ""


def test_side_by_side_table_and_chart_of_a_run_with_the_vllm_peer():
    """The docs' peers table and bar chart from a record with the vLLM peer (hand-made figures):
    each system's range over its passes, its warm-up and start-up; none without the peer."""
    report = _load_script("throughput_report")
    run = {"model": "M", "workload": {"num_requests": 4, "prompt_tokens": 40, "output_tokens": 30},
           "paxpage": {"requests_per_s": 1.0, "output_tok_per_s": 311.5, "total_tok_per_s": 500.0,
                       "passes_output_tok_per_s": [291.3, 311.5]},
           "warmup": {"wall_s": 11.52, "compiles": 5,
                      "executable_cache": {"loaded": 23, "load_s": 0.2, "compiled": 0}},
           "vllm": {"version": "0.32.0", "requests_per_s": 1.0, "output_tok_per_s": 303.8, "total_tok_per_s": 500.0,
                    "passes_output_tok_per_s": [277.7, 303.8], "warmup_pass_s": 12.12, "startup_s": 92.9},
           "hf": {"best_batch_size": 32, "output_tok_per_s": 43.9}}
    rows = report.peers_table(run)["rows"]
    assert rows[0][:3] == ["paxpage", "291-312", "11.5 s (executables from its cache)"]
    assert rows[1] == ["vLLM 0.32.0 (CPU build, tuned)", "278-304", "12.1 s", "93 s (load, torch.compile)"]
    assert rows[2][:2] == ["HF transformers `generate`, batch 32", "44"]
    bars = report.doc_charts(run)["throughput"]["panels"][0]["bars"]
    assert [(b["low"], b["value"]) for b in bars] == [(291.3, 311.5), (277.7, 303.8), (43.9, 43.9)]
    assert report.doc_charts(dict(run, vllm=None)) is None
    pcts = {"p50": 1.0, "p90": 2.0, "p99": 3.0}
    assert "peers" not in report.doc_tables(dict(run, vllm=None, hf=None, profile=None,
                                                 compiles_after_warmup=0,
                                                 paxpage=dict(run["paxpage"], ttft_s=pcts, tpot_s=pcts, host_share=0.5,
                                                              padding={"tokens": 1, "token_slots": 2})))


def test_matmul_flops_are_twice_the_hf_linear_weights_each_row_multiplies(tiny_model_dir):
    """A pass's matmul FLOPs: every layer token multiplies each decoder layer's nn.Linear weights
    once (2 FLOPs a weight), every sampled row the LM head's, counted on HF's own model."""
    import torch
    from transformers import AutoModelForCausalLM

    import paxpage

    report = _load_script("throughput_report")
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    layer_weights = sum(m.weight.numel() for m in hf.model.layers.modules() if isinstance(m, torch.nn.Linear))
    assert report.matmul_flops(paxpage.load(tiny_model_dir).config, 7, 3) == \
        2 * (7 * layer_weights + 3 * hf.lm_head.weight.numel())


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
