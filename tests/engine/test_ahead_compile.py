"""The decode shapes a shrinking batch meets, compiled in the background (paxpage/ahead_compile.py):
what is queued and in which order, a step meeting a shape that is being compiled or still queued,
and an engine whose batch shrinks as requests finish, against HF transformers."""

from __future__ import annotations

import logging
import threading
import time

import pytest

import paxpage
from paxpage import EngineConfig, SamplingParams as SP, compile_counter
from paxpage.ahead_compile import AheadCompiler
from tests.conftest import hf_greedy, random_prompts, save_tiny_hf


class _Jobs:
    """A stand-in for the runner's compiles: records each shape's job, can hold the first one
    until released, and fails the shapes in `fail`."""

    def __init__(self, fail=(), hold=False):
        self.calls, self.fail = [], set(fail)
        self.started, self.release = threading.Event(), threading.Event()
        if not hold:
            self.release.set()

    def __call__(self, dec, pre, rows):
        def job():
            self.started.set()
            self.release.wait(10)
            self.calls.append((dec, pre, rows))
            if (dec, pre, rows) in self.fail:
                raise RuntimeError("no")
        return [job]


def _smaller(dec):
    return [(d, 0, d) for d in (48, 32, 16, 8, 4) if d < dec]


def test_a_decode_step_queues_the_next_two_smaller_decode_shapes_nearest_first():
    jobs = _Jobs()
    compiler = AheadCompiler(jobs, _smaller)
    compiler.saw(48, 0, 48)
    assert compiler.wait(10)
    assert jobs.calls == [(32, 0, 32), (16, 0, 16)]
    assert compiler.ready == {(48, 0, 48), (32, 0, 32), (16, 0, 16)} and compiler.compiled == 2
    compiler.saw(32, 0, 32)  # compiled by the worker; once a step runs it, the next ones are queued
    compiler.saw(0, 16, 16)  # a step with prefill rows queues nothing
    assert compiler.wait(10) and jobs.calls == [(32, 0, 32), (16, 0, 16), (8, 0, 8)]
    compiler.saw(4, 0, 4)  # nothing below 4
    assert compiler.wait(10) and len(jobs.calls) == 3

    jobs = _Jobs()
    compiler = AheadCompiler(jobs, _smaller)
    compiler.saw(16, 0, 16)
    compiler.saw(48, 0, 48)  # 16 ran already: only 32 is new
    assert compiler.wait(10) and jobs.calls == [(8, 0, 8), (4, 0, 4), (32, 0, 32)]


def test_a_step_waits_for_the_shape_being_compiled_and_compiles_a_queued_one_itself():
    jobs = _Jobs(hold=True)
    compiler = AheadCompiler(jobs, _smaller)
    compiler.saw(48, 0, 48)
    assert jobs.started.wait(10)  # the worker holds (32, 0, 32); (16, 0, 16) is queued
    compiler.before(16, 0, 16)  # queued: taken off the queue, for the step to compile
    threading.Timer(0.3, jobs.release.set).start()
    t = time.monotonic()
    compiler.before(32, 0, 32)  # being compiled: waits for it
    assert time.monotonic() - t >= 0.2 and (32, 0, 32) in compiler.ready
    assert compiler.wait(10)
    assert jobs.calls == [(32, 0, 32)] and (16, 0, 16) not in compiler.ready


def test_a_failed_background_compile_leaves_the_shape_to_the_foreground(caplog):
    jobs = _Jobs(fail=[(32, 0, 32)])
    compiler = AheadCompiler(jobs, lambda dec: [(32, 0, 32)] if dec > 32 else [])
    with caplog.at_level(logging.WARNING, logger="paxpage"):
        compiler.saw(48, 0, 48)
        assert compiler.wait(10)
    assert "background compile of step shape (32, 0, 32) failed" in caplog.text
    assert (32, 0, 32) not in compiler.ready and compiler.compiled == 0
    compiler.before(32, 0, 32)  # nothing to wait for
    compiler.saw(64, 0, 64)  # not tried again
    assert compiler.wait(10) and jobs.calls == [(32, 0, 32)]


def test_an_ahead_executable_runs_for_its_key_and_the_call_for_any_other(caplog):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from paxpage.ahead_compile import AheadCall

    jitted = jax.jit(lambda pool, x, scale: (pool + 1, x * scale), donate_argnums=(0,), static_argnums=(2,))
    call = AheadCall(jitted, key=lambda pool, x, scale: (x.shape[0] % 4, scale), static_argnums=(2,))
    args = (jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.float32), 2.0)
    call.add(args, jitted.lower(*args).compile())
    pool, x = call(jnp.zeros(4), np.arange(3, dtype=np.float32), 2.0)
    np.testing.assert_array_equal(x, [0, 2, 4])
    pool, x = call(pool, np.ones(5, np.float32), 3.0)  # no executable for this key
    np.testing.assert_array_equal(x, [3] * 5)
    # a key that does not tell (7,) from (3,) apart: the executable refuses before the pool is
    # donated, and the call runs them instead
    with caplog.at_level(logging.WARNING, logger="paxpage"):
        pool, x = call(pool, np.ones(7, np.float32), 2.0)
    assert "does not take these arguments" in caplog.text and not call.executables
    np.testing.assert_array_equal(x, [2] * 7)
    np.testing.assert_array_equal(pool, [3] * 4)  # three calls, each adding 1


# ---------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("ahead_llama")
    save_tiny_hf(path, "llama", seed=3)
    model = paxpage.load(path)
    yield model, AutoModelForCausalLM.from_pretrained(path).eval()
    model.close()


def test_a_shrinking_batch_borrows_compiled_shapes_and_matches_hf(llama):
    model, hf = llama
    vocab = model.config.vocab_size
    lengths = [3, 20, 5, 18, 7, 16, 9, 14, 11, 12, 2, 19]
    prompts = random_prompts(12, vocab, [6 + i % 5 for i in range(12)], seed=5)
    greedy = [SP(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths]
    config = EngineConfig(page_size=4, num_pages=256, max_model_len=64, max_num_seqs=16,
                          max_num_batched_tokens=128, enable_prefix_caching=False)
    outs = paxpage.generate(model, prompts, sampling_params=greedy, engine_config=config, use_tqdm=False)
    ahead = model.engine(config).runner.ahead
    assert ahead.wait(120)
    # 12 decode rows (bucket 16) shrink to 8, 4 and 1: shapes the worker compiled, or the step
    assert ahead.compiled >= 1 and {(8, 0, 8), (4, 0, 4), (1, 0, 1)} <= ahead.ready
    for prompt, m, out in zip(prompts, lengths, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, m)

    # Seeded sampled rows, twice: once the worker is done, nothing compiles (its executables
    # serve the shapes it compiled), and the draws are the same either way.
    sampled = [SP(temperature=0.8, top_p=0.9, seed=i, max_tokens=m, ignore_eos=True) for i, m in enumerate(lengths)]
    first = paxpage.generate(model, prompts, sampling_params=sampled, engine_config=config, use_tqdm=False)
    assert ahead.wait(120)
    before = compile_counter.compiles()
    again = paxpage.generate(model, prompts, sampling_params=sampled, engine_config=config, use_tqdm=False)
    greedy_again = paxpage.generate(model, prompts, sampling_params=greedy, engine_config=config, use_tqdm=False)
    assert compile_counter.compiles() == before
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert [o.outputs[0].token_ids for o in greedy_again] == [o.outputs[0].token_ids for o in outs]
