"""scripts/device_check.sh --quick: every stage of the device check rehearsed on CPU (tiny random
models, Pallas interpreted), each writing its JSON with status ok, the summary table last."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import device_check  # noqa: E402


def test_quick_run_writes_every_stage_and_the_summary(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "device_check.sh"), str(tmp_path), "--quick"],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    records = {s.name: json.loads((tmp_path / f"{s.name}.json").read_text()) for s in device_check.STAGES}
    for name, record in records.items():
        assert record["status"] == "ok" and record["quick"] and record["headline"], (name, record)
        assert (tmp_path / f"{name}.log").exists()
    e2e = records["e2e"]
    assert set(e2e["runs"]) == {"pallas", "xla", "pallas-int8-kv", "pallas-ngram"}
    for run in e2e["runs"].values():
        assert run["nan_logprobs"] == 0 and run["steady_compiles"] == 0 and run["passes_agree"]
    assert e2e["runs"]["xla"]["vs_pallas"]["tokens"] == e2e["prompts"] * e2e["max_tokens"]
    for name in ("decode_8b", "moe"):
        assert records[name]["step_ms"] > 0 and records[name]["temp_bytes"] > 0 and records[name]["params_shared"]
    assert records["kernel_tests"]["passed"] >= 2 and not records["kernel_tests"]["failed"]
    tail = proc.stdout[proc.stdout.rindex("device check summary"):]
    assert [line.split()[0] for line in tail.splitlines()[3:]] == [s.name for s in device_check.STAGES]
    assert (tmp_path / device_check.SUMMARY_FILE).read_text().strip() == tail.strip()


def test_a_failing_stage_records_its_error_and_the_next_still_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(device_check, "STAGES", (device_check.Stage("nonesuch", 30, 30),
                                                 device_check.Stage("env", 30, 30)))
    rc = device_check.main([str(tmp_path), "--quick"])
    assert rc == 1
    failed = json.loads((tmp_path / "nonesuch.json").read_text())
    assert failed["status"] == "error" and "nonesuch" in failed["error"]
    assert json.loads((tmp_path / "env.json").read_text())["status"] == "ok"
    assert "nonesuch  error" in (tmp_path / device_check.SUMMARY_FILE).read_text()


def test_agreement_counts_positions_and_first_divergence():
    import device_stages

    a = device_stages.agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 0, 6]])
    assert (a["tokens_agreeing"], a["tokens"], a["first_divergence"], a["identical_prompts"]) == (5, 6, [None, 1], 1)
