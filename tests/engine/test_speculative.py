"""Speculative decoding end to end (n-gram proposals) on tiny random models: greedy and seeded
sampled outputs equal the non-speculative engine's token for token (stop ids, stop strings,
min_tokens, max_tokens, logprobs, penalties, n > 1, a tight pool that preempts, prefix caching),
greedy ones HF transformers' greedy continuation; every page comes back; the adaptive threshold
turns speculation off for large batches."""

from __future__ import annotations

import dataclasses

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


def _repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase (n-gram hits) after some random tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        phrase = rng.integers(0, 128, int(rng.integers(3, 9))).tolist()
        out.append(rng.integers(0, 128, int(rng.integers(1, 20))).tolist() + phrase * int(rng.integers(2, 5)))
    return out


KINDS = [
    SP(temperature=0, max_tokens=24, ignore_eos=True),
    SP(temperature=0, min_tokens=7, max_tokens=20, stop_token_ids=[3, 9, 11, 20, 99, 5, 7]),
    SP(temperature=0.8, top_p=0.95, n=2, max_tokens=16, logprobs=2, ignore_eos=True),
    SP(temperature=0, max_tokens=14, repetition_penalty=1.2, ignore_eos=True),
]
# A pool a third of what the workload holds at once: preemptions; shared prefixes: cache hits.
# Few sequences and tokens per step: few step shapes to compile.
TIGHT = dict(page_size=8, num_pages=24, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, max_prefill_rows=4,
             enable_prefix_caching=True)


def _run(model, prompts, params, **config):
    config = EngineConfig(**TIGHT, **config)
    outs = paxpage.generate(model, prompts, sampling_params=params, engine_config=config, use_tqdm=False)
    return outs, model.engine(config)


@pytest.mark.extended
def test_outputs_equal_no_speculation_under_preemption_and_prefix_caching(tiny, tiny_llama_dir):
    """Greedy and seeded sampled requests (n-gram drafts are accepted when the plain sampler's
    draw equals them, so a seeded request's tokens do not change either)."""
    system = random_prompts(1, 128, [17], seed=3)[0]
    prompts = [system + p if i % 3 == 0 else p for i, p in enumerate(_repetitive_prompts(8))]
    params = [KINDS[i % len(KINDS)].replace(seed=i) for i in range(len(prompts))]
    base, _ = _run(tiny, prompts, params)
    spec, engine = _run(tiny, prompts, params, speculative_method="ngram", num_speculative_tokens=5,
                        speculative_max_batch=64)
    for b, s in zip(base, spec):
        assert [c.token_ids for c in s.outputs] == [c.token_ids for c in b.outputs]
        assert [(c.finish_reason, c.stop_reason) for c in s.outputs] == \
            [(c.finish_reason, c.stop_reason) for c in b.outputs]
        for cb, cs in zip(b.outputs, s.outputs):
            if cb.logprobs is not None:  # the target's logprobs at each accepted position
                assert len(cs.logprobs) == len(cb.logprobs)
                for eb, es in zip(cb.logprobs, cs.logprobs):
                    assert list(eb) == list(es)
                    np.testing.assert_allclose(list(es.values()), list(eb.values()), atol=2e-4)
    stats = engine.stats
    assert stats.spec_steps > 0 and stats.accepted_tokens > 0 and stats.accepted_tokens < stats.draft_tokens
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.stats().prefix_hit_rate > 0
    assert engine.scheduler.page_manager.num_free_pages == TIGHT["num_pages"]  # rollback lost nothing
    engine.scheduler.check_invariants()
    # independently: HF transformers' greedy continuation of the plain greedy prompts
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    for i in (0, 4):
        assert spec[i].outputs[0].token_ids == hf_greedy(hf, prompts[i], KINDS[0].max_tokens)


def test_stop_strings_cut_inside_accepted_drafts(tiny_text_dir):
    model = paxpage.load(tiny_text_dir)
    try:
        prompt = "yes no maybe yes no maybe yes no maybe"
        free = paxpage.generate(model, [prompt], temperature=0, max_tokens=40, ignore_eos=True,
                                use_tqdm=False)[0].outputs[0].text
        assert len(free) > 12, free
        stops = [free[6:9], free[-6:-3]]  # stop strings met at two places in the text
        results = []
        for method in (None, "ngram"):
            out = paxpage.generate(model, [prompt] * 2, sampling_params=[
                SP(temperature=0, max_tokens=40, ignore_eos=True, stop=[stops[0]]),
                SP(temperature=0, max_tokens=40, ignore_eos=True, stop=[stops[1]], include_stop_str_in_output=True)],
                engine_config=EngineConfig(speculative_method=method, num_speculative_tokens=6), use_tqdm=False)
            results.append([(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].stop_reason) for o in out])
        assert results[0] == results[1]
        assert results[0][0][2] == stops[0]
    finally:
        model.close()


def test_many_sequences_decode_on_the_persistent_batch_then_speculate_as_they_finish(tiny):
    # speculative_max_batch 2, four requests ending at different steps: while more than two run,
    # steps are the persistent batch's (no drafts); once two are left they speculate. Greedy
    # tokens equal a run without speculation.
    prompts = _repetitive_prompts(4, seed=5)
    params = [SP(temperature=0, max_tokens=m, ignore_eos=True) for m in (5, 8, 30, 30)]
    base, _ = _run(tiny, prompts, params)
    config = dict(speculative_method="ngram", speculative_max_batch=2, num_speculative_tokens=3)
    engine = tiny.engine(EngineConfig(**TIGHT, **config))
    before = dataclasses.replace(engine.stats)
    spec, _ = _run(tiny, prompts, params, **config)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    assert engine.stats.decode_batch_steps > before.decode_batch_steps
    assert engine.stats.spec_steps > before.spec_steps


def test_adaptive_threshold_turns_speculation_off(tiny):
    prompts = _repetitive_prompts(4, seed=2)
    params = SP(temperature=0, max_tokens=12, ignore_eos=True)
    config = dict(speculative_method="ngram", speculative_max_batch=2)
    _, engine = _run(tiny, prompts, params, **config)
    # 4 sequences run at once until they finish together: no step speculates, steps overlap
    assert engine.stats.spec_steps == 0 and engine.stats.overlapped_steps > 0
    overlapped = engine.stats.overlapped_steps
    _run(tiny, prompts[:2], params, **config)  # the same engine: 2 sequences speculate
    assert engine.stats.spec_steps > 0 and engine.stats.overlapped_steps == overlapped
