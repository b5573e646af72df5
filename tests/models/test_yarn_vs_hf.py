"""YaRN RoPE scaling against HF transformers: the frequencies and the cos / sin magnitude against
HF's own `rope_init_fn`, and tiny random Llama and Qwen2 models (f32) read from `save_pretrained`,
prompt logprobs and greedy tokens at positions far beyond the original context."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import paxpage
from models.config import ModelConfig, RopeScaling
from models.rope import attention_factor, inverse_frequencies
from tests.conftest import hf_greedy, random_prompts, save_tiny_hf

ORIGINAL = 32  # the tiny models' "pretrained" context: prompts reach positions 3x beyond it


def _hf_config(rope: dict, max_pos: int = 256, head_dim: int = 16):
    return tf.LlamaConfig(hidden_size=64, num_attention_heads=64 // head_dim, head_dim=head_dim,
                          max_position_embeddings=max_pos, rope_parameters=rope)


@pytest.mark.parametrize("rope", [
    dict(factor=4.0, original_max_position_embeddings=ORIGINAL, rope_theta=500.0),
    dict(factor=8.0, original_max_position_embeddings=64, rope_theta=10000.0, beta_fast=16, beta_slow=2),
    dict(factor=4.0, original_max_position_embeddings=ORIGINAL, rope_theta=500.0, truncate=False),
    # DeepSeek-V3's form: mscale / mscale_all_dim set the magnitude
    dict(factor=8.0, original_max_position_embeddings=64, rope_theta=10000.0, mscale=0.707, mscale_all_dim=1.0),
    dict(factor=2.0, original_max_position_embeddings=ORIGINAL, rope_theta=500.0, attention_factor=1.25),
], ids=["plain", "betas", "untruncated", "deepseek-mscale", "explicit-factor"])
def test_frequencies_and_magnitude_equal_hf(rope):
    c = _hf_config(dict(rope_type="yarn", **rope))
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](c, "cpu")
    cfg = ModelConfig.from_hf_dict(c.to_dict())
    assert cfg.rope_scaling.kind == "yarn"
    np.testing.assert_allclose(inverse_frequencies(cfg), want_freq.numpy(), rtol=1e-6)
    assert attention_factor(cfg) == pytest.approx(want_factor, rel=1e-12)
    # interpolated and extrapolated pairs both occur, so the ramp is exercised
    base = 1.0 / (rope["rope_theta"] ** (np.arange(0, 16, 2) / 16))
    assert np.isclose(inverse_frequencies(cfg), base).any() and not np.isclose(inverse_frequencies(cfg), base).all()


def test_factor_defaults_to_the_ratio_of_the_context_lengths():
    """Checkpoints that state only the lengths (DeepSeek-V3: 163840 / 4096) get their ratio."""
    scaling = RopeScaling.from_hf({"type": "yarn", "original_max_position_embeddings": 4096}, 163840)
    assert (scaling.kind, scaling.factor, scaling.original_max_position_embeddings) == ("yarn", 40.0, 4096)
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        RopeScaling.from_hf({"rope_type": "dynamic", "factor": 2.0}, 256)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_yarn(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"yarn_{request.param}")
    rope = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL, rope_theta=500.0)
    hf = save_tiny_hf(path, request.param, rope_parameters=rope, max_position_embeddings=4 * ORIGINAL * 2)
    return hf, paxpage.load(path)


def test_prompt_logprobs_and_greedy_beyond_the_original_context(tiny_yarn):
    hf, model = tiny_yarn
    assert model.config.rope_scaling.kind == "yarn"
    prompts = random_prompts(2, 128, [100, 7], seed=4)
    outs = paxpage.generate(model, prompts, max_tokens=16, temperature=0, prompt_logprobs=0, ignore_eos=True,
                            page_size=8, num_pages=64, max_num_batched_tokens=32, prefill_row_len=16,
                            use_tqdm=False)  # the 100-token prompt prefills in chunks beside the other's decode
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1).numpy()
        got = np.array([out.prompt_logprobs[p][prompt[p]] for p in range(1, len(prompt))])
        np.testing.assert_allclose(got, ref[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-4)
        assert out.token_ids == hf_greedy(hf, prompt, 16)
