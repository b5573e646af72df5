"""The engine gives the same greedy tokens with every attention impl: the Pallas kernels
(interpret mode) and the native CPU kernel against XLA ops, across prefill, chunked prefill
(prompts longer than the step budget) and decode; "native" falls back to "xla" when turned off."""

from __future__ import annotations

import logging
import shutil

import jax
import pytest

import paxpage
from tests.conftest import random_prompts

COMMON = dict(max_tokens=6, temperature=0, ignore_eos=True, use_tqdm=False, page_size=8,
              num_pages=32, max_num_batched_tokens=16, prefill_row_len=8)


def _generate(model, impl, **kw):
    prompts = random_prompts(3, 128, [3, 21, 45], seed=11)
    return [o.token_ids for o in paxpage.generate(model, prompts, attention_impl=impl, **{**COMMON, **kw})]


@pytest.mark.extended
def test_pallas_interpret_matches_xla(tiny_llama_dir):
    model = paxpage.load(tiny_llama_dir)
    assert _generate(model, "pallas-interpret") == _generate(model, "xla")


@pytest.mark.skipif(shutil.which("g++") is None or jax.default_backend() != "cpu",
                    reason="the native kernel needs g++ and the CPU backend")
def test_native_matches_xla(tiny_llama_dir):
    model = paxpage.load(tiny_llama_dir)
    assert _generate(model, "native") == _generate(model, "xla")
    engine = model.engine(paxpage.EngineConfig(attention_impl="native", page_size=8, num_pages=32,
                                               max_num_batched_tokens=16, prefill_row_len=8))
    assert engine.runner.cfg.attention_impl == "native"  # it ran the native kernel, not the fallback


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="attention_impl 'native' is for the CPU backend")
def test_native_turned_off_runs_xla(tiny_llama_dir, monkeypatch, caplog):
    monkeypatch.setenv("PAXPAGE_NATIVE_ATTENTION", "0")
    model = paxpage.load(tiny_llama_dir)
    with caplog.at_level(logging.INFO, logger="paxpage"):
        engine = model.engine(paxpage.EngineConfig(attention_impl="native", page_size=8, num_pages=33))
    assert engine.runner.cfg.attention_impl == "xla"
    # the log says what runs and that it is not what was asked
    assert any("attention xla" in r.getMessage() and "asked for 'native'" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert _generate(model, "native", num_pages=33) == _generate(model, "xla", num_pages=33)
