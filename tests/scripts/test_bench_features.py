"""The feature scripts on tiny models: mixture of experts against dense, weight and KV
quantisation's quality, structured outputs and speculative decoding, each with its record's table."""

from __future__ import annotations

import json

import pytest

from tests.scripts.conftest import _check_record, _load_script


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
