"""The executable cache (paxpage/exec_cache.py): a hit runs what a fresh compile runs, and
anything that changes the computation (arguments' shapes, static arguments, the caller's
context, the engine config) misses; a damaged file falls back to compiling."""

from __future__ import annotations

import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paxpage
from paxpage import EngineConfig, SamplingParams as SP
from paxpage.engine import LLMEngine
from paxpage.exec_cache import ExecutableCache
from paxpage.packing import bucket
from tests.conftest import hf_greedy, jax_persistent_cache_off, random_prompts


@pytest.fixture(scope="module", autouse=True)
def _without_jax_persistent_cache():
    with jax_persistent_cache_off():
        yield


def _scale(x, n):
    return x * n + 1.0


def test_hits_and_misses_on_a_small_function(tmp_path):
    fn = jax.jit(_scale, static_argnums=(1,))
    x4 = np.arange(4, dtype=np.float32)

    cold = ExecutableCache(tmp_path, "ctx-a").wrap("scale", fn, (1,))
    np.testing.assert_array_equal(cold(x4, 2), x4 * 2 + 1)  # numpy reference
    assert cold.cache.stats["compiled"] == 1 and cold.cache.stats["stored"] == 1

    warm = ExecutableCache(tmp_path, "ctx-a").wrap("scale", fn, (1,))
    np.testing.assert_array_equal(warm(x4, 2), x4 * 2 + 1)
    assert (warm.cache.stats["loaded"], warm.cache.stats["compiled"]) == (1, 0)
    # another shape, dtype or static argument: a miss each (then compiled and stored)
    np.testing.assert_array_equal(warm(np.arange(8, dtype=np.float32), 2), np.arange(8) * 2 + 1)
    np.testing.assert_array_equal(warm(x4.astype(np.int32), 2), x4.astype(np.int32) * 2 + 1)
    np.testing.assert_array_equal(warm(x4, 3), x4 * 3 + 1)
    assert (warm.cache.stats["loaded"], warm.cache.stats["compiled"]) == (1, 3)

    other = ExecutableCache(tmp_path, "ctx-b").wrap("scale", fn, (1,))  # another context
    np.testing.assert_array_equal(other(x4, 2), x4 * 2 + 1)
    assert (other.cache.stats["loaded"], other.cache.stats["compiled"]) == (0, 1)


def test_a_damaged_file_falls_back_to_compiling(tmp_path, caplog):
    fn = jax.jit(_scale, static_argnums=(1,))
    x = np.ones(4, np.float32)
    ExecutableCache(tmp_path, "ctx").wrap("scale", fn, (1,))(x, 5)
    (path,) = glob.glob(os.path.join(tmp_path, "scale-*.jaxexe"))
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\0garbage\0" * 8)
    cached = ExecutableCache(tmp_path, "ctx").wrap("scale", fn, (1,))
    with caplog.at_level("WARNING", logger="paxpage"):
        np.testing.assert_array_equal(cached(x, 5), x * 5 + 1)
    assert cached.cache.stats["failed"] == 1 and cached.cache.stats["compiled"] == 1
    assert "cannot load" in caplog.text


def test_a_loaded_executable_that_cannot_run_is_dropped(tmp_path, monkeypatch, caplog):
    """A file that deserialises but fails at its first run (as a re-serialised executable did on
    CPU) is removed, and the call compiles afresh and answers."""
    from jax.experimental import serialize_executable

    fn = jax.jit(_scale, static_argnums=(1,))
    x = np.arange(3, dtype=np.float32)
    ExecutableCache(tmp_path, "ctx").wrap("scale", fn, (1,))(x, 4)

    def broken(*args, **kwargs):
        def run(*a):
            raise RuntimeError("INTERNAL: Error dispatching computation: Function wrapped_iota not found")
        return run

    monkeypatch.setattr(serialize_executable, "deserialize_and_load", broken)
    cached = ExecutableCache(tmp_path, "ctx").wrap("scale", fn, (1,))
    with caplog.at_level("WARNING", logger="paxpage"):
        np.testing.assert_array_equal(cached(x, 4), x * 4 + 1)
        np.testing.assert_array_equal(cached(x, 4), x * 4 + 1)  # the fresh compile from now on
    assert cached.cache.stats["loaded"] == 1 and cached.cache.stats["failed"] == 1
    assert cached.cache.stats["compiled"] == 1 and "failed to run" in caplog.text
    assert len(glob.glob(os.path.join(tmp_path, "scale-*.jaxexe"))) == 1  # stored anew


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    model = paxpage.load(tiny_llama_dir)
    yield model
    model.close()


SMALL = dict(page_size=8, num_pages=48, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)


def _greedy(model, config, prompts, max_tokens=10):
    engine = LLMEngine(model.config, model.params, model.tokenizer, config)  # a fresh runner each time
    ids = [engine.add_request(p, SP(temperature=0, max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    requests = [engine.request(i) for i in ids]
    while engine.has_unfinished():
        engine.step()
    return [engine.output(r).outputs[0].token_ids for r in requests], engine.runner.exec_cache.stats


def test_engine_hit_equals_fresh_compile_and_config_change_misses(tiny, tiny_llama_dir, tmp_path):
    import transformers

    prompts = random_prompts(3, 128, [5, 21, 40], seed=3)
    cold, cold_stats = _greedy(tiny, EngineConfig(executable_cache_dir=str(tmp_path), **SMALL), prompts)
    assert cold_stats["compiled"] >= 3 and cold_stats["loaded"] == 0 and cold_stats["failed"] == 0
    warm, warm_stats = _greedy(tiny, EngineConfig(executable_cache_dir=str(tmp_path), precompile=False,
                                                  async_scheduling=True, **SMALL), prompts)
    assert warm_stats["loaded"] == cold_stats["compiled"] and warm_stats["compiled"] == 0
    assert warm == cold
    # a config that changes the step (the pool's page size): nothing of the old one is loaded
    changed, changed_stats = _greedy(tiny, EngineConfig(executable_cache_dir=str(tmp_path),
                                                        **dict(SMALL, page_size=16)), prompts)
    assert changed_stats["loaded"] == 0 and changed_stats["compiled"] >= 3
    # both against HF transformers' greedy continuation on the same weights
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    want = [hf_greedy(hf, p, 10) for p in prompts]
    assert cold == want and changed == want


def test_a_changed_parameter_shape_misses(tmp_path):
    """Same context and function, parameters of another shape (a model with a wider MLP whose
    config the caller forgot to key on): the arguments' signature alone makes it miss."""
    def forward(params, x):
        return jnp.tanh(x @ params["w_in"]) @ params["w_out"]

    fn = jax.jit(forward)
    x = np.ones((2, 4), np.float32)
    small = {"w_in": np.full((4, 8), 0.1, np.float32), "w_out": np.full((8, 4), 0.1, np.float32)}
    wide = {"w_in": np.full((4, 16), 0.1, np.float32), "w_out": np.full((16, 4), 0.1, np.float32)}
    ExecutableCache(tmp_path, "same").wrap("forward", fn)(small, x)
    cached = ExecutableCache(tmp_path, "same").wrap("forward", fn)
    np.testing.assert_allclose(cached(wide, x), np.tanh(x @ wide["w_in"]) @ wide["w_out"], rtol=1e-6)
    np.testing.assert_allclose(cached(small, x), np.tanh(x @ small["w_in"]) @ small["w_out"], rtol=1e-6)
    assert (cached.cache.stats["loaded"], cached.cache.stats["compiled"]) == (1, 1)


def test_precompile_through_the_cache_leaves_nothing_to_compile(tiny, tmp_path):
    """precompile=True with the cache: a cold engine compiles and stores every executable without
    running it, a warm one loads them all, and serving greedy, sampled and penalised requests
    compiles nothing more (compile_counter counts jax's backend compiles)."""
    from paxpage import compile_counter

    config = EngineConfig(executable_cache_dir=str(tmp_path), precompile=True, **SMALL)
    cold = LLMEngine(tiny.config, tiny.params, tiny.tokenizer, config).runner.exec_cache.stats
    assert cold["compiled"] == cold["stored"] >= 4 and cold["loaded"] == 0
    engine = LLMEngine(tiny.config, tiny.params, tiny.tokenizer, config)
    warm = engine.runner.exec_cache.stats
    # the steps and greedy samplers are loaded now; the samplers that draw (unpenalised and
    # penalised, two per logits-row count) at first use
    num_full = 2 * len({bucket(d + p) for d, p in engine.runner.step_shapes()})
    assert warm["loaded"] == cold["compiled"] - num_full and warm["compiled"] == 0
    warm_loaded = warm["loaded"]
    before = compile_counter.compiles()
    prompts = random_prompts(5, 128, [3, 40, 9, 60, 17], seed=12)
    kinds = [SP(temperature=0, max_tokens=9, ignore_eos=True), SP(temperature=0.8, top_p=0.9, seed=1, max_tokens=5),
             SP(temperature=0.8, seed=2, presence_penalty=0.5, max_tokens=5)]  # penalised, in flight
    for i, p in enumerate(prompts):
        engine.add_request(p, kinds[i % 3])
    while engine.has_unfinished():
        engine.step()
    assert compile_counter.compiles() == before
    assert engine.runner.exec_cache.stats["compiled"] == 0
    assert engine.runner.exec_cache.stats["loaded"] > warm_loaded  # a full sampler, read from disk
