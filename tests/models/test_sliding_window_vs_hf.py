"""Sliding-window models (Mistral, Qwen2 with use_sliding_window) and Gemma 2 / Gemma 3 against HF
transformers (f32, eager attention) on tiny random weights: every prompt token's logprob and the
greedy continuation, with prompts longer than the window, in one prefill, chunked prefill, with
prefix caching and under preemption."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import paxpage
from tests.conftest import hf_greedy, random_prompts, save_tiny_hf

WINDOW = 16
MODELS = {
    # A Mistral with sliding_window=16 and a 48-token prompt.
    "mistral": dict(sliding_window=WINDOW),
    # Layer 0 global, layer 1 sliding (max_window_layers=1).
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    # Local / global / local; small caps so soft-capping changes the numbers; a query scale
    # other than head_dim ** -0.5.
    "gemma2": dict(sliding_window=WINDOW, num_hidden_layers=3, attn_logit_softcapping=1.0,
                   final_logit_softcapping=2.0, query_pre_attn_scalar=24),
    # Dual RoPE bases (scaled global, local), qk-norm, tied embeddings.
    "gemma3": dict(sliding_window=WINDOW, num_hidden_layers=3, sliding_window_pattern=2, tie_word_embeddings=True,
                   final_logit_softcapping=3.0,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}),
}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """kind -> (kind, HF model, paxpage model), each saved and loaded once per module."""
    cache = {}

    def get(kind):
        if kind not in cache:
            path = tmp_path_factory.mktemp(f"tiny_{kind}")
            hf = save_tiny_hf(path, kind, **MODELS[kind])
            cache[kind] = (kind, hf, paxpage.load(path))
        return cache[kind]

    return get


@pytest.fixture(params=sorted(MODELS))
def tiny(request, tiny_models):
    return tiny_models(request.param)


# The engine-path variations run on two models that between them cover a window in every layer
# (Mistral) and mixed local / global layers with soft caps (Gemma 2); CI time stays small.
@pytest.fixture(params=["mistral", "gemma2"])
def tiny_engine(request, tiny_models):
    return tiny_models(request.param)


def _hf_logprobs(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1).numpy()  # [S, V]


def _check_prompt_logprobs(hf, prompt, out):
    ref = _hf_logprobs(hf, prompt)
    got = np.array([out.prompt_logprobs[p][prompt[p]] for p in range(1, len(prompt))])
    np.testing.assert_allclose(got, ref[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-4)


def test_config_reads_the_window(tiny):
    kind, hf, model = tiny
    cfg = model.config
    assert cfg.sliding_window == WINDOW
    want = [WINDOW if t == "sliding_attention" else None for t in getattr(hf.config, "layer_types", None)
            or ["sliding_attention"] * cfg.num_layers]
    if kind == "mistral":
        want = [WINDOW] * cfg.num_layers  # HF's Mistral slides everywhere
    assert [cfg.layer_window(i) for i in range(cfg.num_layers)] == want


def test_prompt_logprobs_and_greedy_match_hf(tiny):
    """One 48-token prefill (3 windows), then 20 decode steps far past the window."""
    _, hf, model = tiny
    prompt = random_prompts(1, 128, [48], seed=1)[0]
    out = paxpage.generate(model, [prompt], max_tokens=20, temperature=0, prompt_logprobs=0, ignore_eos=True,
                           page_size=8, num_pages=64, use_tqdm=False)[0]
    _check_prompt_logprobs(hf, prompt, out)
    assert out.token_ids == hf_greedy(hf, prompt, 20)


def test_chunked_prefill_and_batching_match_hf(tiny_engine):
    """8-token step budget: prompts are prefilled in chunks shorter than the window, batched with
    other rows' decode steps."""
    _, hf, model = tiny_engine
    prompts = random_prompts(3, 128, [40, 5, 23], seed=2)
    outs = paxpage.generate(model, prompts, max_tokens=12, temperature=0, prompt_logprobs=0, ignore_eos=True,
                            page_size=4, num_pages=128, max_num_batched_tokens=8, prefill_row_len=4,
                            use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        _check_prompt_logprobs(hf, prompt, out)
        assert out.token_ids == hf_greedy(hf, prompt, 12)


def test_prefix_cache_hits_match_hf(tiny_engine):
    _, hf, model = tiny_engine
    shared = random_prompts(1, 128, [37], seed=3)[0]
    prompts = [shared + [5, 6, 7], shared + [9]]
    config = paxpage.EngineConfig(page_size=4, num_pages=128, enable_prefix_caching=True)
    first = paxpage.generate(model, prompts[:1], max_tokens=10, temperature=0, ignore_eos=True,
                             engine_config=config, use_tqdm=False)[0]
    engine = model.engine(config)
    hits_before = engine.scheduler.page_manager.prefix_hit_tokens
    second = paxpage.generate(model, prompts[1:], max_tokens=10, temperature=0, ignore_eos=True,
                              engine_config=config, use_tqdm=False)[0]
    assert engine.scheduler.page_manager.prefix_hit_tokens > hits_before
    assert first.token_ids == hf_greedy(hf, prompts[0], 10)
    assert second.token_ids == hf_greedy(hf, prompts[1], 10)


def test_preemption_recomputes_the_same_tokens(tiny_engine):
    """A pool too small for all four sequences at once: some are preempted and recomputed. Mistral
    releases pages behind its window, so its pool is smaller still (and its chunks short)."""
    kind, hf, model = tiny_engine
    prompts = random_prompts(4, 128, [30, 26, 33, 20], seed=4)
    pool = dict(num_pages=12, max_num_batched_tokens=16, prefill_row_len=8) if kind == "mistral" else dict(num_pages=24)
    config = paxpage.EngineConfig(page_size=4, max_num_seqs=4, **pool)
    outs = paxpage.generate(model, prompts, max_tokens=24, temperature=0, ignore_eos=True,
                            engine_config=config, use_tqdm=False)
    assert model.engine(config).scheduler.stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 24)


def test_long_mistral_generation_holds_window_pages(tiny_models):
    """148 tokens need 37 pages of 4; with pages outside the 16-token window released, a 12-page
    pool (which the request is only admitted to because of the window) runs it to HF's tokens."""
    _, hf, model = tiny_models("mistral")
    assert model.config.max_window == WINDOW
    prompt = random_prompts(1, 128, [48], seed=6)[0]
    config = paxpage.EngineConfig(page_size=4, num_pages=12, max_num_batched_tokens=16, prefill_row_len=8)
    out = paxpage.generate(model, [prompt], max_tokens=100, temperature=0, ignore_eos=True,
                           engine_config=config, use_tqdm=False)[0]
    assert out.token_ids == hf_greedy(hf, prompt, 100)
    assert model.engine(config).scheduler.num_preemptions == 0


def test_models_with_global_layers_release_nothing(tiny_models):
    _, _, model = tiny_models("gemma2")
    assert model.config.max_window is None
    with pytest.raises(ValueError, match="pages"):
        paxpage.generate(model, [[1] * 48], max_tokens=100, page_size=4, num_pages=12,
                         max_num_batched_tokens=16, prefill_row_len=8, use_tqdm=False)


@pytest.mark.extended
def test_pallas_kernels_match_hf(tiny_engine):
    """The Pallas kernels (interpreted on CPU) through the whole engine: windows, soft caps and,
    for Mistral, released pages (their table entries read as page 0, never attended)."""
    _, hf, model = tiny_engine
    prompts = random_prompts(2, 128, [27, 5], seed=8)
    outs = paxpage.generate(model, prompts, max_tokens=10, temperature=0, prompt_logprobs=0, ignore_eos=True,
                            attention_impl="pallas-interpret", page_size=8, num_pages=32,
                            max_num_batched_tokens=16, prefill_row_len=8, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        _check_prompt_logprobs(hf, prompt, out)
        assert out.token_ids == hf_greedy(hf, prompt, 10)
