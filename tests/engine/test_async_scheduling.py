"""Async scheduling: step t+1 is dispatched while step t runs, its tokens read one step late.
Outputs must equal the synchronous engine's token for token (greedy, seeded sampling, stops,
min_tokens, n > 1, logprobs, penalties, beams) under preemption and prefix caching, and greedy
rows must equal HF transformers' greedy continuation."""

from __future__ import annotations

import numpy as np
import pytest

import paxpage
from paxpage import EngineConfig, SamplingParams as SP
from tests.conftest import hf_greedy, random_prompts


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    model = paxpage.load(tiny_llama_dir)
    yield model
    model.close()


def _workload():
    rng = np.random.default_rng(0)
    system = random_prompts(1, 128, [24], seed=5)[0]  # a shared prefix: prefix-cache hits
    prompts = [system + p if i % 3 == 0 else p
               for i, p in enumerate(random_prompts(18, 128, rng.integers(3, 40, 18), seed=6))]
    kinds = [
        SP(temperature=0, max_tokens=int(rng.integers(3, 30)), ignore_eos=True),
        SP(temperature=0.9, top_p=0.9, seed=1, max_tokens=20, stop_token_ids=[5, 7]),
        SP(temperature=1.0, top_k=20, seed=2, n=3, max_tokens=12, logprobs=2),
        SP(temperature=0.7, repetition_penalty=1.3, seed=3, max_tokens=15),
        SP(beam_width=2, max_tokens=8),
        SP(temperature=0, min_tokens=5, max_tokens=25, stop_token_ids=[3, 9, 11, 20]),
    ]
    params = [kinds[i % len(kinds)].replace(seed=i) if kinds[i % len(kinds)].seed is not None
              else kinds[i % len(kinds)] for i in range(len(prompts))]
    return prompts, params


# A pool a fifth of what the workload needs at once: preemptions; chunked prefill of 64 tokens.
TIGHT = dict(page_size=8, num_pages=48, max_model_len=256, max_num_batched_tokens=64,
             enable_prefix_caching=True)


@pytest.mark.extended
def test_async_equals_sync_under_preemption_and_prefix_caching(tiny, tiny_llama_dir):
    prompts, params = _workload()
    results, engines = {}, {}
    for mode in (False, True):
        config = EngineConfig(async_scheduling=mode, **TIGHT)
        outs = paxpage.generate(tiny, prompts, sampling_params=params, engine_config=config, use_tqdm=False)
        results[mode] = [[(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs]
                         for o in outs]
        engines[mode] = tiny.engine(config)
    assert results[True] == results[False]
    eng = engines[True]
    assert eng.stats.overlapped_steps > 0 and eng.scheduler.num_preemptions > 0
    assert eng.scheduler.stats().prefix_hit_rate > 0
    assert eng.scheduler.page_manager.num_free_pages == TIGHT["num_pages"]
    # the greedy ones, independently: HF transformers on the same weights
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()
    for i in range(0, len(prompts), 6):
        assert results[True][i][0][0] == hf_greedy(hf, prompts[i], params[i].max_tokens)


def test_plain_decoding_overlaps_nearly_every_step(tiny):
    config = EngineConfig(page_size=8, num_pages=128, max_model_len=256)
    engine = tiny.engine(config)
    before = (engine.stats.steps, engine.stats.overlapped_steps)
    outs = paxpage.generate(tiny, random_prompts(6, 128, [4, 9, 13, 6, 20, 3], seed=9), temperature=0,
                            max_tokens=24, ignore_eos=True, engine_config=config, use_tqdm=False)
    assert all(len(o.token_ids) == 24 for o in outs)
    steps = engine.stats.steps - before[0]
    overlapped = engine.stats.overlapped_steps - before[1]
    assert overlapped >= steps - 2, (steps, overlapped)  # all but the steps that fork or finish



@pytest.mark.extended
def test_penalised_rows_overlap_and_equal_the_synchronous_engine(tiny):
    # Penalised rows stay in flight: the host's counts lack the token the device still has, and
    # the sampler adds it there. Repetition (prompt too), presence and frequency penalties,
    # greedy and seeded, one below min_tokens, one that stops on a token, under preemption.
    prompts = random_prompts(8, 128, [4, 9, 13, 6, 20, 3, 11, 7], seed=14)
    kinds = [
        SP(temperature=0, repetition_penalty=1.6, max_tokens=30, ignore_eos=True),
        SP(temperature=0.9, seed=3, presence_penalty=0.8, frequency_penalty=0.6, max_tokens=28),
        SP(temperature=0, frequency_penalty=1.5, min_tokens=12, max_tokens=26, stop_token_ids=[5, 17]),
        SP(temperature=1.0, seed=4, repetition_penalty=0.8, presence_penalty=-0.5, max_tokens=30, ignore_eos=True),
    ]
    params = [kinds[i % len(kinds)] for i in range(len(prompts))]
    results, stats = {}, {}
    for mode in (False, True):
        config = EngineConfig(async_scheduling=mode, page_size=8, num_pages=24, max_model_len=256,
                              max_num_batched_tokens=64)
        engine = tiny.engine(config)
        before = (engine.stats.steps, engine.stats.overlapped_steps, engine.scheduler.num_preemptions)
        outs = paxpage.generate(tiny, prompts, sampling_params=params, engine_config=config, use_tqdm=False)
        results[mode] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        stats[mode] = (engine.stats.steps - before[0], engine.stats.overlapped_steps - before[1],
                       engine.scheduler.num_preemptions - before[2])
    assert results[True] == results[False]
    steps, overlapped, preempted = stats[True]
    assert overlapped > steps // 2 and preempted > 0, stats[True]
    unpenalised = paxpage.generate(tiny, prompts[:1], temperature=0, max_tokens=30, ignore_eos=True, use_tqdm=False)
    assert unpenalised[0].token_ids != results[True][0][0]  # the penalty changed the tokens

def test_forking_steps_stay_in_flight_and_equal_the_synchronous_engine(tiny):
    # A request's n samples start in the step its prompt ends: with async scheduling that step
    # stays in flight too, its children forked with pending tokens. Seeded samples, logprobs, a
    # penalty, stop tokens, and children that end by length at once (max_tokens 1).
    prompts = random_prompts(5, 128, [5, 9, 4, 12, 7], seed=21)
    params = [SP(temperature=1.0, seed=1, n=3, max_tokens=10, ignore_eos=True),
              SP(temperature=0.8, seed=2, n=2, max_tokens=1),
              SP(temperature=0.9, seed=3, n=2, max_tokens=12, logprobs=2, stop_token_ids=[5, 9, 17]),
              SP(temperature=0.7, seed=4, n=2, max_tokens=8, repetition_penalty=1.3, ignore_eos=True),
              SP(temperature=0, max_tokens=9, ignore_eos=True)]
    results, stats = {}, {}
    for mode in (False, True):
        # 8 tokens a step: the prompts end, and fork, in different steps
        config = EngineConfig(async_scheduling=mode, page_size=8, num_pages=64, max_model_len=256,
                              max_num_batched_tokens=8, prefill_row_len=8, enable_prefix_caching=False)
        engine = tiny.engine(config)
        before = (engine.stats.steps, engine.stats.overlapped_steps)
        outs = paxpage.generate(tiny, prompts, sampling_params=params, engine_config=config, use_tqdm=False)
        results[mode] = [[(c.token_ids, c.finish_reason, c.logprobs, c.cumulative_logprob) for c in o.outputs]
                         for o in outs]
        stats[mode] = (engine.stats.steps - before[0], engine.stats.overlapped_steps - before[1])
        assert engine.scheduler.page_manager.num_free_pages == 64
    assert results[True] == results[False]
    assert [len(r) for r in results[True]] == [3, 2, 2, 2, 1]
    assert len({tuple(c[0]) for c in results[True][0]}) == 3  # the samples differ
    steps, overlapped = stats[True]
    assert overlapped == steps, stats[True]  # the four forking steps included


def test_abort_while_a_step_is_in_flight(tiny):
    config = EngineConfig(page_size=8, num_pages=64, max_model_len=256, enable_prefix_caching=False)
    engine = tiny.engine(config)
    keep = engine.add_request([1, 2, 3, 4], SP(temperature=0, max_tokens=6, ignore_eos=True))
    drop = engine.add_request([5, 6, 7], SP(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    request = engine.request(drop)
    engine.abort(drop)
    out = engine.output(request)
    assert out.finish_reason == "abort" and -1 not in out.token_ids
    kept = engine.request(keep)
    while engine.has_unfinished():
        engine.step()
    assert len(engine.output(kept).token_ids) == 6
    assert engine.scheduler.page_manager.num_free_pages == 64


def test_stop_strings_cut_exactly_with_async(smollm2):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    kw = dict(max_tokens=20, temperature=0, stop=["is Par"], use_tqdm=False)
    sync = paxpage.generate(smollm2, [chat, "Once upon a time"],
                            engine_config=EngineConfig(async_scheduling=False, max_num_seqs=8), **kw)
    fast = paxpage.generate(smollm2, [chat, "Once upon a time"],
                            engine_config=EngineConfig(async_scheduling=True, max_num_seqs=8), **kw)
    assert [o.text for o in fast] == [o.text for o in sync]
    assert fast[0].text == "The capital of France " and fast[0].stop_reason == "is Par"
    assert [o.token_ids for o in fast] == [o.token_ids for o in sync]


@pytest.mark.extended
def test_precompile_leaves_nothing_to_compile(tiny):
    from paxpage import compile_counter

    config = EngineConfig(page_size=8, num_pages=64, max_model_len=256, max_num_seqs=4,
                          max_num_batched_tokens=64, precompile=True, async_scheduling=False)
    engine = tiny.engine(config)
    shapes, _ = engine.precompiled
    assert shapes == len(engine.runner.step_shapes()) > 4
    before = compile_counter.compiles()
    prompts = random_prompts(7, 128, [3, 40, 9, 60, 17, 5, 33], seed=12)
    params = [SP(temperature=0, max_tokens=9, ignore_eos=True), SP(temperature=0.8, top_p=0.9, seed=1, max_tokens=5),
              SP(temperature=0.8, seed=2, repetition_penalty=1.2, max_tokens=5)]
    paxpage.generate(tiny, prompts, sampling_params=[params[i % 3] for i in range(7)], engine_config=config,
                     use_tqdm=False)
    assert compile_counter.compiles() == before
