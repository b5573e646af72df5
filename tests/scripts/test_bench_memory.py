"""The KV memory scripts on a tiny random HF llama: paged against contiguous allocation, KV cache
dtypes, sliding windows and page sharing (prefix caching, forks), each with its record's table;
and latent against grouped-query attention on two tiny random-weight presets."""

from __future__ import annotations

import json
import os

import pytest

from tests.scripts.conftest import TINY_WORKLOAD, _check_record, _load_script


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


def test_bench_memory_mla_smoke(tmp_path):
    """--mla on the presets' tiny forms: the pools' bytes per token and layer, measured from their
    arrays, are the latent's (32 + 8) x 4 bytes against K and V of 1 kv head of 16 (2 x 1 x 16 x 4)."""
    bench = _load_script("bench_memory")
    out = tmp_path / "mla.json"
    # 40 GQA pages of 4 tokens: 2 layers x 4 tokens x 128 B = 1024 B each; MLA pages: 2 x 4 x 160 = 1280 B
    rc = bench.main(["--mla", "--mla-sizes", "tiny", *TINY_WORKLOAD, "--max-num-seqs", "8", "--no-warmup",
                     "--max-num-batched-tokens", "32", "--page-size", "4", "--kv-cache-bytes", str(40 * 1024),
                     "--max-model-len", "64", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())["mla"]
    mla, gqa = data["mla"], data["gqa"]
    assert (mla["values_per_token_layer"], gqa["values_per_token_layer"]) == (32 + 8, 2 * 1 * 16)
    assert (mla["bytes_per_token_layer"], gqa["bytes_per_token_layer"]) == ((32 + 8) * 4, 2 * 1 * 16 * 4)
    assert (mla["page_bytes"], gqa["page_bytes"]) == (1280, 1024)
    assert (mla["num_pages"], gqa["num_pages"]) == (40 * 1024 // 1280, 40)
    assert mla["ratios"]["bytes_per_token_layer"] == pytest.approx(160 / 128)
    assert mla["ratios"]["pages"] == pytest.approx(32 / 40)
    assert mla["max_running"] >= 1 and gqa["max_running"] >= 1
    rows = _check_record(json.loads(out.read_text()), "mla")
    assert [r[:4] for r in rows] == [["mla (deepseek-v2-lite)", 40, 160.0, 32], ["gqa (llama-3.2-1b)", 32, 128.0, 40]]


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
