"""EngineConfig(batch_invariant=True): a request's sampled tokens and logprobs are bitwise those
it gets alone when it shares its steps with others (chunked prefill beside other rows' decodes),
where the default mode's logprobs move by rounding. A tiny Llama at SmolLM2's widths (576 / 1536),
where XLA's CPU matmuls depend on the number of rows."""

from __future__ import annotations

import pytest

import paxpage
from paxpage import attention_impl
from tests.conftest import random_prompts, save_tiny_hf


@pytest.fixture(scope="module")
def wide_tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("wide_tiny")
    save_tiny_hf(path, "llama", hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                 num_key_value_heads=3)
    return paxpage.load(path)


def _run(model, prompts, batch_invariant, attention="native", **config):
    outs = paxpage.generate(model, prompts, max_tokens=12, temperature=0.9, seed=7, logprobs=0, prompt_logprobs=0,
                            ignore_eos=True, batch_invariant=batch_invariant, attention_impl=attention, page_size=4,
                            num_pages=256, use_tqdm=False, **config)
    out = outs[0].outputs[0]
    prompt = [next(iter(d.values())) for d in outs[0].prompt_logprobs if d]
    return out.token_ids, [next(iter(d.values())) for d in out.logprobs], prompt


@pytest.mark.parametrize("batch_invariant,attention", [
    (True, "native"), (True, "xla"), pytest.param(False, "native", marks=pytest.mark.extended)],
    ids=["invariant", "invariant-xla", "default"])
def test_a_request_alone_and_batched(wide_tiny, batch_invariant, attention):
    prompts = random_prompts(6, 128, [23, 5, 40, 9, 17, 31], seed=3)
    alone = _run(wide_tiny, prompts[:1], batch_invariant, attention)
    batched = _run(wide_tiny, prompts, batch_invariant, attention, max_num_batched_tokens=16, prefill_row_len=8)
    assert alone[0] == batched[0]  # a near tie aside, even the default keeps the tokens
    if batch_invariant:
        assert alone[1] == batched[1]  # bitwise
        assert len(alone[2]) == 22 and alone[2] == batched[2]  # the prompt's logprobs too, chunked or not
    else:  # the default's logprobs move by rounding: what the mode exists to remove
        assert alone[1] != batched[1]
        assert max(abs(a - b) for a, b in zip(*[alone[1], batched[1]])) < 1e-4


@pytest.mark.parametrize("impl,family", [("pallas", "tpu"), ("xla", "gpu")])
def test_refused_where_it_cannot_hold(impl, family):
    """The TPU kernels have no fixed-order form; the XLA path's holds on XLA CPU's dots only."""
    with pytest.raises(ValueError, match=f"batch_invariant.*{impl!r} for {family}"):
        attention_impl.check_batch_invariant(impl, family)


def test_speculative_verify_rows_alone_and_batched(wide_tiny):
    """n-gram speculation: verify rows of k + 1 tokens beside other rows' prefills and decodes give
    the request's tokens and logprobs bitwise as alone (prompts repeat a pattern, so drafts are
    proposed; speculation stays on at the batch's size)."""
    stem = random_prompts(1, 128, [6], seed=9)[0]
    prompts = [stem * 4 + tail for tail in random_prompts(5, 128, [3, 11, 2, 7, 5], seed=10)]
    spec = dict(speculative_method="ngram", num_speculative_tokens=3, speculative_max_batch=8)
    alone = _run(wide_tiny, prompts[:1], True, **spec)
    batched = _run(wide_tiny, prompts, True, max_num_batched_tokens=16, prefill_row_len=8, **spec)
    assert alone == batched


def test_beam_search_alone_and_batched(wide_tiny):
    """A beam-search request's beams and their scores, bitwise, alone and beside sampled requests
    in chunked prefill (its candidates are the sampler's top logprobs)."""
    from paxpage.sampling.params import SamplingParams

    prompts = random_prompts(4, 128, [19, 6, 27, 9], seed=12)
    beam = SamplingParams(beam_width=3, max_tokens=8, ignore_eos=True)
    others = SamplingParams(max_tokens=8, temperature=0.9, seed=3, ignore_eos=True)
    config = dict(batch_invariant=True, attention_impl="native", page_size=4, num_pages=256, use_tqdm=False)

    def beams(prompt_list, params, **extra):
        out = paxpage.generate(wide_tiny, prompt_list, sampling_params=params, **config, **extra)[0]
        return [(c.token_ids, c.cumulative_logprob) for c in out.outputs]

    alone = beams(prompts[:1], [beam])
    batched = beams(prompts, [beam] + [others] * 3, max_num_batched_tokens=16, prefill_row_len=8)
    assert len(alone) == 3 and alone == batched
