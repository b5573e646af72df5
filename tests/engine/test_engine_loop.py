"""One engine loop, many callers: threads, interleaved streams, abandoned streams, the async
front end, and the bounded engine cache. Greedy outputs are checked against HF transformers'
greedy continuation of the same tiny model, so "each caller gets what it would get alone" is
tested against an independent reference, not against another paxpage run."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

import paxpage
from paxpage import EngineConfig, SamplingParams
from tests.conftest import hf_greedy, random_prompts

CONFIG = EngineConfig(page_size=8, num_pages=96, max_num_seqs=16, max_model_len=256)
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    model = paxpage.load(tiny_llama_dir)
    yield model
    model.close()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(8, 128, [5, 17, 9, 30, 3, 22, 12, 7], seed=11)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, prompts):
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()
    return [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


def _wait_until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def _all_pages_free(model):
    engine = model.engine(CONFIG)
    return engine.scheduler.page_manager.num_free_pages == CONFIG.num_pages and not engine.has_unfinished()


def test_threads_each_get_their_own_outputs(tiny, prompts, expected):
    results, errors = {}, []

    def worker(k):
        try:  # each thread sends two prompts; indices are the thread's own
            mine = [prompts[k], prompts[(k + 3) % len(prompts)]]
            results[k] = paxpage.generate(tiny, mine, sampling_params=GREEDY, engine_config=CONFIG,
                                          use_tqdm=False)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for k in range(8):
        assert [o.index for o in results[k]] == [0, 1]
        assert results[k][0].token_ids == expected[k]
        assert results[k][1].token_ids == expected[(k + 3) % len(prompts)]
        assert results[k][0].prompt_token_ids == prompts[k]
    _wait_until(lambda: _all_pages_free(tiny))


def test_interleaved_streams_and_generate_do_not_mix(tiny, prompts, expected):
    a = paxpage.stream(tiny, prompts[:3], sampling_params=GREEDY, engine_config=CONFIG)
    b = paxpage.stream(tiny, prompts[3:5], sampling_params=GREEDY, engine_config=CONFIG)
    got_a, got_b = {i: [] for i in range(3)}, {i: [] for i in range(2)}
    first = next(a)
    got_a[first.index] += first.token_ids
    # A generate call while both streams are suspended takes none of their deltas.
    mid = paxpage.generate(tiny, [prompts[5]], sampling_params=GREEDY, engine_config=CONFIG, use_tqdm=False)
    assert mid[0].token_ids == expected[5]
    done_a = done_b = False
    while not (done_a and done_b):
        if not done_a:
            d = next(a, None)
            done_a = d is None
            if d is not None:
                got_a[d.index] += d.token_ids
        if not done_b:
            d = next(b, None)
            done_b = d is None
            if d is not None:
                got_b[d.index] += d.token_ids
    assert [got_a[i] for i in range(3)] == expected[:3]
    assert [got_b[i] for i in range(2)] == expected[3:5]


@pytest.mark.parametrize("how", ["break", "close", "gc"])
def test_abandoned_stream_frees_its_pages_within_a_step(tiny, prompts, how):
    engine = tiny.engine(CONFIG)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    gen = paxpage.stream(tiny, [prompts[3]], sampling_params=long, engine_config=CONFIG)
    for _ in range(3):
        next(gen)
    assert engine.scheduler.page_manager.num_free_pages < CONFIG.num_pages
    steps = engine.stats.steps
    if how == "close":
        gen.close()
    elif how == "gc":
        del gen
        gc.collect()
    else:  # a for loop that breaks leaves the generator to be collected the same way
        for _ in gen:
            break
        del gen
    _wait_until(lambda: _all_pages_free(tiny))
    # Aborts are applied before the loop's next step; the step in flight may finish. The loop
    # keeps stepping while this thread abandons the stream, and a tiny model's step takes about a
    # millisecond, so that window holds a few steps (6 seen under a loaded full run); a missed
    # abort would run ~197 more.
    assert engine.stats.steps - steps <= 24


def test_validation_error_runs_none_of_the_call(tiny, prompts):
    with pytest.raises(ValueError, match="max_model_len"):
        paxpage.generate(tiny, [prompts[0], [1] * 250], sampling_params=GREEDY, engine_config=CONFIG,
                         use_tqdm=False)
    _wait_until(lambda: _all_pages_free(tiny))


def test_engine_cache_is_bounded_and_closable(tiny_llama_dir):
    model = paxpage.load(tiny_llama_dir)
    configs = [EngineConfig(page_size=8, num_pages=16 + i, max_model_len=128) for i in range(4)]
    for config in configs:
        out = paxpage.generate(model, [[1, 2, 3]], max_tokens=2, engine_config=config, use_tqdm=False)
        assert len(out[0].token_ids) == 2
    assert len(model._slots) == model.max_engines == 2
    loops = [model.loop(c) for c in configs[-2:]]
    model.close()
    assert not model._slots and not any(loop.alive for loop in loops)
    # a closed model builds a fresh engine on the next call
    assert len(paxpage.generate(model, [[1, 2, 3]], max_tokens=2, engine_config=configs[0],
                                use_tqdm=False)[0].token_ids) == 2
    model.close()


def test_engine_is_one_engine_and_replicas_a_list(tiny_llama_dir):
    model = paxpage.load(tiny_llama_dir)
    config = EngineConfig(page_size=8, num_pages=16, max_model_len=128)
    engine = model.engine(config)
    assert isinstance(engine, paxpage.engine.LLMEngine)
    assert model.replicas(config) == [engine]
    with pytest.raises(ValueError, match="data_parallel_size is 2: .*Model.replicas"):
        model.engine(EngineConfig(page_size=8, num_pages=16, data_parallel_size=2))
    model.close()


# ---- the asyncio front end -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def async_engine(tiny):
    engine = paxpage.AsyncEngine(tiny, CONFIG, max_waiting_requests=64)
    yield engine
    engine.shutdown()


def test_async_concurrent_streams_and_generate(async_engine, prompts, expected):
    async def one_stream(k):
        tokens, finish = [], None
        async for d in async_engine.stream(prompts[k], GREEDY, request_id=f"s{k}"):
            assert finish is None
            tokens += d.token_ids
            finish = d.finish_reason
        return tokens, finish

    async def main():
        streams = [one_stream(k) for k in range(6)]
        final = async_engine.generate(prompts[6], GREEDY.replace(logprobs=2), request_id="g")
        return await asyncio.gather(*streams, final)

    *streamed, out = asyncio.run(main())
    assert [t for t, _ in streamed] == expected[:6]
    assert all(f == "length" for _, f in streamed)
    assert out.token_ids == expected[6]
    assert len(out.outputs[0].logprobs) == MAX_TOKENS
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time


def test_async_cancel_aborts_and_frees_pages(async_engine, prompts):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        seen = asyncio.Event()

        async def consume():
            async for _ in async_engine.stream(prompts[1], long, request_id="cancel-me"):
                seen.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(seen.wait(), 60)
        assert async_engine.stats().num_running == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _wait_until(lambda: async_engine.stats().num_running == 0 and async_engine.stats().kv_cache_usage == 0)


def test_async_abort_by_id_ends_the_stream(async_engine, prompts):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        reasons = []
        async for d in async_engine.stream(prompts[2], long, request_id="x"):
            if not reasons:
                async_engine.abort("x")
            reasons.append(d.finish_reason)
        return reasons

    reasons = asyncio.run(asyncio.wait_for(main(), 60))
    assert reasons[-1] == "abort" and len(reasons) < 200


def test_async_errors(async_engine, tiny, prompts):
    async def too_long():
        return await async_engine.generate([1] * 250, GREEDY)

    with pytest.raises(ValueError, match="max_model_len is 256"):
        asyncio.run(too_long())
    with pytest.raises(TypeError, match="SamplingParams"):
        asyncio.run(async_engine.generate([1, 2], {"max_tokens": 3}))

    # One sequence runs at a time, so a second request waits; a third is turned away.
    one_at_a_time = EngineConfig(page_size=8, num_pages=96, max_num_seqs=1, max_model_len=256)
    small = paxpage.AsyncEngine(tiny, one_at_a_time, max_waiting_requests=1)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    try:
        async def overload():
            running = asyncio.create_task(small.generate(prompts[0], long))
            while small.stats().num_running < 1:
                await asyncio.sleep(0.01)
            waiting = asyncio.create_task(small.generate(prompts[1], long))
            await asyncio.sleep(0)
            try:
                with pytest.raises(paxpage.EngineOverloadedError, match="max_waiting_requests is 1"):
                    await small.generate(prompts[2], GREEDY)
            finally:
                running.cancel()
                waiting.cancel()

        asyncio.run(asyncio.wait_for(overload(), 60))
    finally:
        small.shutdown()
    with pytest.raises(paxpage.EngineDeadError):
        asyncio.run(small.generate(prompts[0], GREEDY))


def test_step_error_reaches_every_caller_and_the_loop_reports_dead(tiny_llama_dir, prompts):
    model = paxpage.load(tiny_llama_dir)
    engine = paxpage.AsyncEngine(model, CONFIG)
    try:
        def broken_step():
            raise RuntimeError("device fell over")

        engine.engine.step = broken_step

        async def main():
            return await asyncio.gather(engine.generate(prompts[0], GREEDY),
                                        engine.generate(prompts[1], GREEDY), return_exceptions=True)

        errors = asyncio.run(asyncio.wait_for(main(), 60))
        assert all(isinstance(e, paxpage.EngineDeadError) for e in errors), errors
        assert "device fell over" in str(errors[0])
        snap = engine.stats()
        assert not snap.alive and "device fell over" in snap.error
    finally:
        engine.shutdown()
