"""Smoke tests of the benchmark scripts on a tiny random HF llama with tiny workloads:
they run end to end (paxpage, HF baseline, profile, plots) and write the JSON keys the
README and CI read. The figures themselves mean nothing at this size."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

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
    assert [c["case"] for c in data["cases"]] == ["tiny-8x32", "tiny-8x32-t0.7-p0.9"]
    for case in data["cases"]:
        for key in ("host_s", "device_s", "wall_s", "attention_s", "attention_gb_per_s"):
            assert case[key] > 0, key
        # 2 layers x 8 rows x 32 keys x 4 kv heads x 16 dims x K and V x 4 bytes
        assert case["attention_kv_bytes"] == 2 * 2 * 8 * 32 * 4 * 16 * 4
    assert "| tiny-8x32 |" in proc.stdout
