"""Structured-output grammars compile on the AsyncEngine's grammar threads, never on the engine
loop's (whose every step all other requests wait on), and a compile past grammar_timeout_s fails
the request with a ValueError naming the limit. Tiny random llama with a real BPE tokenizer."""

from __future__ import annotations

import asyncio
import threading

import pytest

import paxpage
from paxpage.structured_backend import GrammarBackend

CONFIG = paxpage.EngineConfig(page_size=8, num_pages=32, max_model_len=64, max_num_seqs=2)


@pytest.fixture(scope="module")
def tiny_text_model(tiny_text_dir):
    return paxpage.load(tiny_text_dir)


def _schema(num_fields: int) -> dict:
    return {"type": "object", "properties": {f"f{i}": {"type": "string", "enum": [f"v{i}a", f"v{i}b"]}
                                             for i in range(num_fields)}, "required": ["f0"]}


def test_grammars_compile_off_the_engine_loop(tiny_text_model, monkeypatch):
    threads = []
    compile_ = GrammarBackend.compile

    def recording(self, spec):
        threads.append(threading.current_thread().name)
        return compile_(self, spec)

    monkeypatch.setattr(GrammarBackend, "compile", recording)
    engine = paxpage.AsyncEngine(tiny_text_model, CONFIG)
    try:
        params = paxpage.SamplingParams(max_tokens=8, temperature=0, structured_outputs={"json_schema": _schema(3)})
        out = asyncio.run(asyncio.wait_for(engine.generate([1, 2, 3], params), 120))
        assert out.outputs[0].token_ids
    finally:
        engine.shutdown()
    assert threads[0].startswith("paxpage-grammar"), threads
    # the engine loop's own call (add_request) found the grammar compiled: a cache hit
    assert all(t.startswith("paxpage-grammar") or t == "paxpage-engine-loop" for t in threads), threads


def test_grammar_compile_past_the_limit_is_a_value_error(tiny_text_model):
    engine = paxpage.AsyncEngine(tiny_text_model, CONFIG, grammar_timeout_s=1e-4)
    try:
        params = paxpage.SamplingParams(max_tokens=4, structured_outputs={"json_schema": _schema(2000)})
        with pytest.raises(ValueError, match=r"structured_outputs json_schema did not compile within 0.0001 s"):
            asyncio.run(asyncio.wait_for(engine.generate([1, 2, 3], params), 60))
        assert engine.stats().alive
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="grammar_timeout_s must be > 0"):
        paxpage.AsyncEngine(tiny_text_model, CONFIG, grammar_timeout_s=0)
