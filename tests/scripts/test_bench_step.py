"""The step scripts on a tiny model: bench_compile's unrolled and scanned steps, bench_step's quick
run through the CLI, and its context pairs and overlap worked by hand."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

from tests.scripts.conftest import SCRIPTS, _check_record, _load_script


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
