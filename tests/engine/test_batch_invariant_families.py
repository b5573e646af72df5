"""EngineConfig(batch_invariant=True) beyond the dense Llama layers: Gemma 2 / 3 (sandwich norms,
soft caps, windows), mixture-of-experts models (Qwen3-MoE; gpt-oss with its router and expert
biases, clamped SwiGLU, sinks and alternating windows), whose routing and grouped expert matmuls
otherwise follow the step's token count, and DeepSeek-V3 (latent attention, whose prefill rows
otherwise take the expanded form by the row width, grouped routing with a correction bias, shared
experts). A request's tokens, logprobs and prompt logprobs
are bitwise those it gets alone when its prefill is chunked beside other rows. Tiny random models
at widths (256 / 512) where XLA CPU's matmuls change their last bits with the row count."""

from __future__ import annotations

import pytest

import paxpage
from tests.conftest import random_prompts, save_tiny_deepseek, save_tiny_hf

FAMILIES = {
    "gemma2": dict(sliding_window=8),
    "gemma3": dict(sliding_window=8),
    "qwen3_moe": dict(moe_intermediate_size=64),
    "gpt_oss": dict(sliding_window=8),
    "deepseek_v3": dict(kv_lora_rank=128, q_lora_rank=128, moe_intermediate_size=64, n_routed_experts=4,
                        n_group=1, topk_group=1),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    widths = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, seed=2, **FAMILIES[request.param])
    if request.param == "deepseek_v3":
        save_tiny_deepseek(path, vocab_size=128, **widths)
    else:
        save_tiny_hf(path, request.param, num_key_value_heads=2, **widths)
    return paxpage.load(path)


def _run(model, prompts, batch_invariant, **config):
    outs = paxpage.generate(model, prompts, max_tokens=8, temperature=0.9, seed=5, logprobs=0, prompt_logprobs=0,
                            ignore_eos=True, batch_invariant=batch_invariant, page_size=4, num_pages=128,
                            use_tqdm=False, **config)
    out = outs[0].outputs[0]
    prompt = [next(iter(d.values())) for d in outs[0].prompt_logprobs if d]
    return out.token_ids, [next(iter(d.values())) for d in out.logprobs], prompt


@pytest.mark.parametrize("batch_invariant", [True, pytest.param(False, marks=pytest.mark.extended)],
                         ids=["invariant", "default"])
def test_a_request_alone_and_batched(family_model, batch_invariant):
    prompts = random_prompts(5, 128, [21, 6, 33, 11, 4], seed=8)
    alone = _run(family_model, prompts[:1], batch_invariant)
    batched = _run(family_model, prompts, batch_invariant, max_num_batched_tokens=16, prefill_row_len=8)
    if batch_invariant:
        assert alone == batched  # tokens, logprobs and the prompt's logprobs, bitwise
        assert len(alone[2]) == 20
    else:  # what the mode removes: the default's logprobs move by rounding
        assert alone[1] != batched[1] or alone[2] != batched[2]
