"""Under memory pressure nothing is lost: preemption, oversized requests, abort, prefix caching."""

from __future__ import annotations

import numpy as np
import pytest

import paxpage
from paxpage import SamplingParams
from tests.conftest import random_prompts

GREEDY = dict(temperature=0, ignore_eos=True, use_tqdm=False)
# Sharing, preemption and prefix-cache tests also run once on the Pallas kernels (interpreted on
# CPU), whose page-table reads and K/V writes are separate code from the XLA path's.
IMPLS = ["xla", "pallas-interpret"]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return paxpage.load(tiny_llama_dir)


@pytest.mark.extended
def test_64_requests_in_a_tenth_of_the_memory(tiny):
    rng = np.random.default_rng(0)
    lengths = rng.integers(4, 40, size=64)
    prompts = random_prompts(64, 128, lengths, seed=1)
    max_tokens = 24
    needed_pages = sum(-(-(len(p) + max_tokens) // 8) for p in prompts)
    ample = paxpage.generate(tiny, prompts, max_tokens=max_tokens, page_size=8,
                             num_pages=needed_pages + 8, **GREEDY)
    tight_config = paxpage.EngineConfig(page_size=8, num_pages=needed_pages // 10, max_num_seqs=32,
                                        max_num_batched_tokens=128, enable_prefix_caching=False)
    tight = paxpage.generate(tiny, prompts, max_tokens=max_tokens, engine_config=tight_config, **GREEDY)
    assert [o.token_ids for o in tight] == [o.token_ids for o in ample]
    assert all(len(o.token_ids) == max_tokens for o in tight)
    engine = tiny.engine(tight_config)
    assert engine.scheduler.stats().num_preemptions > 0
    assert engine.scheduler.page_manager.num_free_pages == tight_config.num_pages


@pytest.mark.parametrize("impl", ["pallas-interpret"])  # XLA: test_64_requests_in_a_tenth_of_the_memory
def test_preemption_keeps_hf_greedy_tokens(tiny, tiny_llama_dir, impl):
    """A pool of 12 pages for 6 sequences needing 4 to 6 each: sequences are preempted and
    recomputed, and every one still gets HF's greedy tokens."""
    import transformers

    from tests.conftest import hf_greedy

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    prompts = random_prompts(6, 128, [9, 20, 14, 30, 5, 25], seed=12)
    config = paxpage.EngineConfig(page_size=8, num_pages=12, max_num_seqs=6, max_num_batched_tokens=64,
                                  prefill_row_len=8, enable_prefix_caching=False, attention_impl=impl)
    outs = paxpage.generate(tiny, prompts, max_tokens=12, engine_config=config, **GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]
    engine = tiny.engine(config)
    assert engine.scheduler.stats().num_preemptions > 0
    assert engine.scheduler.page_manager.num_free_pages == config.num_pages


def test_oversized_request_fails_fast_while_others_finish(tiny):
    engine = tiny.engine(paxpage.EngineConfig(page_size=8, num_pages=16, max_model_len=256))
    ok = [engine.add_request(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
          for p in random_prompts(3, 128, [5, 9, 30], seed=2)]
    # 16 pages hold 128 tokens: a 200-token prompt can never fit.
    with pytest.raises(ValueError, match="208 tokens need 26 pages"):
        engine.add_request(list(range(100)) * 2, SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([1] * 250, SamplingParams(max_tokens=16))
    for params in (SamplingParams(max_tokens=8, n=2, prompt_logprobs=1), SamplingParams(max_tokens=8)):
        with pytest.raises(ValueError, match="pages"):  # rejected by Scheduler.add
            engine.add_request(list(range(100)) * 2, params)
    # a rejected request leaves nothing behind in the engine's per-sequence map
    assert engine.outputs.num_samples == len(ok) and len(engine.outputs) == len(ok)
    assert engine.scheduler.num_waiting + engine.scheduler.num_running == len(ok)
    requests = [engine.request(r) for r in ok]
    for _ in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    assert [len(engine.output(r).token_ids) for r in requests] == [8, 8, 8]
    assert engine.outputs.num_samples == 0 and len(engine.outputs) == 0
    with pytest.raises(ValueError, match="max_model_len"):
        paxpage.generate(tiny, [[1] * 250], max_tokens=16, max_model_len=256, use_tqdm=False)


def test_abort_frees_pages_at_once(tiny):
    config = paxpage.EngineConfig(page_size=8, num_pages=32, enable_prefix_caching=False)
    engine = tiny.engine(config)
    rid = engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=50, temperature=0))
    waiting = engine.add_request(list(range(1, 5)), SamplingParams(max_tokens=5, temperature=0))
    engine.step()
    engine.step()
    assert engine.scheduler.page_manager.num_free_pages < 32
    engine.abort(rid)
    engine.abort(waiting)
    assert engine.scheduler.page_manager.num_free_pages == 32
    assert not engine.has_unfinished()


@pytest.mark.parametrize("impl", IMPLS)
def test_prefix_caching_same_tokens_and_hits(tiny, impl):
    system = random_prompts(1, 128, [40], seed=3)[0]
    prompts = [system + q for q in random_prompts(6, 128, [3, 7, 12, 5, 9, 2], seed=4)]
    on = paxpage.EngineConfig(page_size=8, num_pages=64, enable_prefix_caching=True, max_num_seqs=2,
                              attention_impl=impl)
    off = paxpage.EngineConfig(page_size=8, num_pages=64, enable_prefix_caching=False, max_num_seqs=2,
                               attention_impl=impl)
    a = paxpage.generate(tiny, prompts, max_tokens=10, engine_config=on, **GREEDY)
    b = paxpage.generate(tiny, prompts, max_tokens=10, engine_config=off, **GREEDY)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert tiny.engine(on).scheduler.stats().prefix_hit_rate > 0
    assert sum(o.num_cached_tokens for o in a) >= 4 * 40 // 8 * 8


@pytest.mark.parametrize("impl", IMPLS)
def test_parallel_samples_equal_single_seeds_and_share_pages(tiny, impl):
    prompt = random_prompts(1, 128, [200], seed=6)[0]
    common = dict(max_tokens=6, temperature=0.9, top_p=0.95, use_tqdm=False, ignore_eos=True,
                  page_size=8, num_pages=128, max_model_len=256, enable_prefix_caching=False,
                  attention_impl=impl)
    four = paxpage.generate(tiny, [prompt], n=4, seed=100, **common)[0]
    singles = [paxpage.generate(tiny, [prompt], n=1, seed=100 + i, **common)[0] for i in range(4)]
    assert [c.token_ids for c in four.outputs] == [s.token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in four.outputs}) > 1  # they do diverge


def _peak_pages(tiny, prompt, n):
    config = paxpage.EngineConfig(page_size=8, num_pages=256, max_model_len=256,
                                  enable_prefix_caching=False)
    engine = tiny.engine(config)
    engine.add_request(prompt, SamplingParams(n=n, max_tokens=8, temperature=1.0, seed=0,
                                              ignore_eos=True))
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.scheduler.stats().num_used_pages)
    assert engine.scheduler.page_manager.num_free_pages == config.num_pages
    return peak


def test_parallel_sampling_memory(tiny):
    prompt = random_prompts(1, 128, [200], seed=8)[0]
    one, four = _peak_pages(tiny, prompt, 1), _peak_pages(tiny, prompt, 4)
    assert four < 1.5 * one, (one, four)
