"""The engine on the TPU kernel family (interpreted here) runs its pool in the tpu KV layout
(pallas_kernels/kv_layout.py) and gives XLA's greedy tokens across prefill, chunked prefill and
decode, plain or quantised (int8 values beside f32 scale rows)."""

from __future__ import annotations

import pytest

import paxpage
from paxpage.config import EngineConfig
from tests.conftest import random_prompts

COMMON = dict(page_size=8, num_pages=32, max_num_batched_tokens=16, prefill_row_len=8, max_num_seqs=4,
              precompile=False)


def _tokens(model, prompts, impl, **kw):
    outs = paxpage.generate(model, prompts, attention_impl=impl, max_tokens=5, temperature=0, ignore_eos=True,
                            use_tqdm=False, **COMMON, **kw)
    return [c.token_ids for o in outs for c in o.outputs]


@pytest.mark.extended
def test_tpu_family_engine_uses_the_tpu_layout_and_matches_xla(tiny_llama_dir, monkeypatch):
    model = paxpage.load(tiny_llama_dir)
    prompts = random_prompts(2, 128, [3, 21], seed=5)
    want = _tokens(model, prompts, "xla")
    resolve = EngineConfig.resolve
    monkeypatch.setattr(EngineConfig, "resolve", lambda self, m, backend=None: resolve(self, m, backend="tpu"))
    assert _tokens(model, prompts, "pallas-interpret") == want
    runner = model.engine(EngineConfig(attention_impl="pallas-interpret", **COMMON)).runner
    assert runner.cfg.backend == "tpu" and runner.kv_layout.name == "tpu"
    m = runner.step_model_cfg
    assert runner.kv_cache[0].shape == (32, m.num_kv_heads, 8, 2 * m.head_dim)


@pytest.mark.extended
@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
def test_tpu_family_engine_runs_an_int8_pool_on_the_tpu_layout_and_matches_xla(tiny_llama_dir, monkeypatch,
                                                                                 scan_layers):
    """XLA reads the same int8 values and bf16 scales from the canonical layout; the 29-token
    prompt is prefilled in chunks across four pages of one scale row, and n=2 forks each prompt
    (its last, partly filled page copied on write, scales and all, in every layer). Scanned
    layers hold one tpu-layout pool of L * 32 pages (models/layer_stack.py)."""
    from pallas_kernels.kv_quant import QuantizedKV

    model = paxpage.load(tiny_llama_dir)
    prompts = random_prompts(2, 128, [5, 29], seed=6)
    want = _tokens(model, prompts, "xla", kv_cache_dtype="int8", n=2)
    assert len(want) == 4
    resolve = EngineConfig.resolve
    monkeypatch.setattr(EngineConfig, "resolve", lambda self, m, backend=None: resolve(self, m, backend="tpu"))
    got = _tokens(model, prompts, "pallas-interpret", kv_cache_dtype="int8", n=2, scan_layers=scan_layers)
    assert got == want
    runner = model.engine(EngineConfig(attention_impl="pallas-interpret", kv_cache_dtype="int8",
                                       scan_layers=scan_layers, **COMMON)).runner
    m = runner.step_model_cfg
    assert runner.kv_layout.name == "tpu" and runner.scanned == scan_layers
    layer, pages = (runner.kv_cache, m.num_layers * 32) if scan_layers else (runner.kv_cache[0], 32)
    assert isinstance(layer, QuantizedKV)
    assert layer.pages.shape == (pages, m.num_kv_heads, 8, 2 * m.head_dim)
    assert layer.scales.shape == (m.num_kv_heads, pages // 16, 1, 128)  # 8 lanes (words) a page, 16 pages a row
