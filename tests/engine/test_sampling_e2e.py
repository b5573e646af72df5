"""Sampling through the whole engine: seeds do not depend on the batch, streams add up."""

from __future__ import annotations

import numpy as np
import pytest

import paxpage
from paxpage import SamplingParams
from tests.conftest import random_prompts


@pytest.mark.extended
def test_seeded_request_is_batch_independent(tiny_llama_dir):
    model = paxpage.load(tiny_llama_dir)
    target_prompt = random_prompts(1, 128, [13], seed=21)[0]
    target = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1234, max_tokens=16,
                            ignore_eos=True)
    engine_kw = dict(page_size=8, num_pages=256, max_num_batched_tokens=64)
    alone = paxpage.generate(model, [target_prompt], sampling_params=target, use_tqdm=False,
                             **engine_kw)[0]
    rng = np.random.default_rng(5)
    neighbours = random_prompts(31, 128, rng.integers(2, 60, size=31), seed=22)
    params = [SamplingParams(temperature=float(t), max_tokens=int(m), ignore_eos=True,
                             repetition_penalty=1.2 if i % 3 == 0 else 1.0,
                             seed=None if i % 2 else i)
              for i, (t, m) in enumerate(zip(rng.choice([0.0, 0.7, 1.3], 31), rng.integers(4, 30, 31)))]
    prompts = neighbours[:17] + [target_prompt] + neighbours[17:]
    params = params[:17] + [target] + params[17:]
    batched = paxpage.generate(model, prompts, sampling_params=params, use_tqdm=False, **engine_kw)
    assert batched[17].token_ids == alone.token_ids
    # Preempted and recomputed under a tiny pool: still the same tokens.
    tight = paxpage.generate(model, prompts, sampling_params=params, use_tqdm=False, page_size=8,
                             num_pages=12, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert tight[17].token_ids == alone.token_ids
    assert model.engine(paxpage.EngineConfig(page_size=8, num_pages=12, max_num_batched_tokens=64,
                                             enable_prefix_caching=False)).scheduler.num_preemptions > 0


def test_unseeded_sampling_differs_between_calls(tiny_llama_dir):
    model = paxpage.load(tiny_llama_dir)
    prompt = random_prompts(1, 128, [5], seed=1)[0]
    kw = dict(temperature=1.5, max_tokens=16, ignore_eos=True, use_tqdm=False, page_size=8, num_pages=16)
    a = paxpage.generate(model, [prompt], **kw)[0].token_ids
    b = paxpage.generate(model, [prompt], **kw)[0].token_ids
    assert a != b
