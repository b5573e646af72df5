"""gpt-oss against HF transformers on tiny random weights (f32): attention sinks, the o_proj and
expert biases, the clamped SwiGLU, alternating windowed / full layers and YaRN without truncation.
Every prompt token's logprob and the greedy continuation, in one prefill, chunked prefill beside
decode rows, past the window, with prefix-cache hits and under preemption, on the XLA and native
attention and the Pallas kernels (interpreted). The MoE block on its own
against HF's GptOssMLP, and the MXFP4 expert weights of released checkpoints decoded against
transformers' own dequantisation: held in their own 4 bits with f32 scales, a checkpoint in that
format gives HF's outputs on the weights transformers decodes from it."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import transformers as tf

import paxpage
from models.config import ModelConfig
from models.moe import clamped_swiglu, route, routed_experts
from models.moe_layout import decode_mxfp4, mxfp4_packed
from models.quant import unpack_e2m1
from models.param_layout import flatten
from tests.conftest import (check_chunked_prefill_beside_decode, check_prefix_hit_and_preemption,
                            check_prompt_logprobs, hf_greedy, random_prompts, save_tiny_hf, to_mxfp4_checkpoint)

VOCAB = 256
WINDOW = 8
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
            max_position_embeddings=128, swiglu_limit=1.5,  # low enough that the clamps bind
            rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
                                 rope_theta=10000.0, beta_fast=32.0, beta_slow=1.0, truncate=False),
            tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    return save_tiny_hf(path, "gpt_oss", seed=1, **TINY), paxpage.load(path)


def test_config_reads_gpt_oss_fields(tiny):
    _, model = tiny
    cfg = model.config
    assert (cfg.model_type, cfg.attention_sinks, cfg.qkv_bias, cfg.o_proj_bias, cfg.moe_bias) == (
        "gpt_oss", True, True, True, True)
    assert (cfg.swiglu_limit, cfg.swiglu_alpha, cfg.num_experts, cfg.norm_topk_prob) == (1.5, 1.702, 4, True)
    assert [cfg.layer_window(i) for i in range(3)] == [WINDOW, None, WINDOW]
    assert (cfg.rope_scaling.kind, cfg.rope_scaling.truncate) == ("yarn", False)
    with pytest.raises(ValueError, match="moe_bias / swiglu_limit describe experts"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                    head_dim=8, moe_bias=True)


@pytest.mark.parametrize("impl", ["xla", "native", "pallas-interpret"])
def test_prefill_and_decode_past_the_window_match_hf(tiny, impl):
    """Two prompts prefilled in one step (the 40-token one past the window and YaRN's original
    context), then 12 decode steps."""
    hf, model = tiny
    prompts = random_prompts(2, VOCAB, [40, 9], seed=1)
    outs = paxpage.generate(model, prompts, max_tokens=12, temperature=0, prompt_logprobs=0, ignore_eos=True,
                            page_size=4, num_pages=64, attention_impl=impl, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        check_prompt_logprobs(hf, prompt, out)
        assert out.token_ids == hf_greedy(hf, prompt, 12)


def test_chunked_prefill_prefix_cache_and_preemption_match_hf(tiny):
    """An 8-token step budget (the long prompt prefills in chunks while the short one decodes); a
    second request reusing the first's cached pages; four sequences in a pool too small for all."""
    hf, model = tiny
    prompts = random_prompts(2, VOCAB, [45, 5], seed=2)
    check_chunked_prefill_beside_decode(hf, model, prompts)

    check_prefix_hit_and_preemption(hf, model, VOCAB)


def test_gpu_and_tpu_default_to_the_pallas_kernels(tiny):
    _, model = tiny
    for backend in ("gpu", "tpu"):
        assert paxpage.EngineConfig().resolve(model.config, backend=backend).attention_impl == "pallas"


@pytest.mark.parametrize("impl", ["tiled", "ragged_dot", "dense"])
def test_moe_block_matches_hf(impl):
    """Router bias, expert biases and the clamped SwiGLU, through each grouped-matmul form, against
    HF's GptOssMLP; HF's interleaved gate / up columns regrouped as the checkpoint loader does."""
    config = tf.GptOssConfig(**TINY)
    torch.manual_seed(0)
    mlp = tf.models.gpt_oss.modeling_gpt_oss.GptOssMLP(config).eval()
    with torch.no_grad():  # a module built on its own starts uninitialised
        for name, p in mlp.named_parameters():
            p.normal_(0.0, 0.3 if name.endswith("bias") else 0.5)
    x = torch.randn(1, 24, 64)
    with torch.no_grad():
        want = mlp(x)[0][0].numpy()

    def regroup(w):  # [..., 2F] gate / up interleaved -> gate columns, then up
        w = w.detach().numpy()
        return np.concatenate([w[..., 0::2], w[..., 1::2]], axis=-1)

    weights, experts = route(x[0].numpy(), mlp.router.weight.detach().numpy().T, 2, True,
                             mlp.router.bias.detach().numpy())
    got = routed_experts(x[0].numpy(), weights, experts, regroup(mlp.experts.gate_up_proj),
                         mlp.experts.down_proj.detach().numpy(), impl=impl,
                         gate_up_bias=regroup(mlp.experts.gate_up_proj_bias),
                         down_bias=mlp.experts.down_proj_bias.detach().numpy(),
                         activation=clamped_swiglu(config.swiglu_limit, config.swiglu_alpha))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_mxfp4_decode_matches_transformers():
    """decode_mxfp4 against transformers' convert_moe_packed_tensors on random codes and exponents
    (every 4-bit code, exponents on both sides of the bias), in the [E, in, out] form it returns."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(3, 20, 2, 16), dtype=np.uint8)  # E=3, out=20, in=64
    scales = rng.integers(115, 140, size=(3, 20, 2), dtype=np.uint8)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                      dtype=torch.float32).numpy()
    got = decode_mxfp4(blocks, scales).swapaxes(-1, -2)
    assert got.shape == want.shape == (3, 64, 20)
    np.testing.assert_array_equal(got, want)
    # the held form: the codes as stored, [E, I / 2, O], unpacked on the host and in jnp (the
    # arithmetic decoding the step fuses into its matmuls) to twice each value, times the scale
    packed, scale = mxfp4_packed(blocks, scales)
    assert (packed.dtype, packed.shape, scale.dtype, scale.shape) == (np.uint8, (3, 20, 32), np.float32, (3, 20, 2))
    held = packed.swapaxes(-1, -2)  # [E, I / 2, O]
    for q in (unpack_e2m1(held), np.asarray(unpack_e2m1(jax.numpy.asarray(held)))):
        assert (q.dtype, q.shape) == (np.int8, (3, 64, 20))
        assert set(np.unique(np.abs(q))) == {0, 1, 2, 3, 4, 6, 8, 12}
        np.testing.assert_array_equal((q.reshape(3, 2, 32, 20) * scale.swapaxes(-1, -2)[:, :, None]).reshape(3, 64, 20),
                                      want)
    with pytest.raises(ValueError, match="do not pair"):
        decode_mxfp4(blocks, scales[..., :1])
    with pytest.raises(ValueError, match="do not pair"):
        mxfp4_packed(blocks[..., :8], scales)


MXFP4_TINY = dict(TINY, intermediate_size=64)  # two blocks of 32 along both projections' inputs


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """A tiny gpt-oss whose checkpoint stores its experts as MXFP4, and HF on transformers'
    decoding of them."""
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    hf = save_tiny_hf(path, "gpt_oss", seed=3, **MXFP4_TINY)
    to_mxfp4_checkpoint(path, hf)
    return path, hf, paxpage.load(path)


def _regrouped(w):  # HF's [..., 2F] gate / up interleaved -> gate columns, then up
    w = w.detach().numpy()
    return np.concatenate([w[..., 0::2], w[..., 1::2]], axis=-1)


def test_mxfp4_experts_are_held_in_4_bits_and_match_hf(mxfp4):
    """The experts stay half a byte a weight (the codes as stored) plus one f32 scale per 32, which
    decode to transformers' decoding exactly; prompt logprobs and greedy tokens are HF's, on the
    XLA and native attention paths (the tiled grouped matmul expanding each tile's expert)."""
    _, hf, model = mxfp4
    flat = flatten(model.params)
    E, H, F = 4, 64, 64
    assert not any(name.endswith(("gate_up_proj", "down_proj")) for name in flat)
    for i in range(3):
        layer = hf.model.layers[i].mlp.experts
        for name, shape, want in (("gate_up_proj", (E, H, 2 * F), _regrouped(layer.gate_up_proj)),
                                  ("down_proj", (E, F, H), layer.down_proj.detach().numpy())):
            codes, scale = (np.asarray(flat[f"layers_{i}/moe/{name}{suffix}"]) for suffix in ("_q", "_scale"))
            assert (codes.dtype, codes.shape) == (np.uint8, (E, shape[1] // 2, shape[2]))
            assert (scale.dtype, scale.shape) == (np.float32, (E, shape[1] // 32, shape[2]))
            # e2m1 by hand: input 2j in byte j's low nibble, 2j + 1 in its high one
            nibbles = np.stack([codes & 15, codes >> 4], axis=2).reshape(shape)
            values = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])[nibbles]
            expanded = (values.reshape(E, -1, 32, shape[2]) * 2 * scale[:, :, None]).reshape(shape)
            np.testing.assert_array_equal(expanded, want)
    prompts = random_prompts(2, VOCAB, [40, 9], seed=4)
    for impl in ("xla", "native"):
        outs = paxpage.generate(model, prompts, max_tokens=10, temperature=0, prompt_logprobs=0, ignore_eos=True,
                                page_size=4, num_pages=64, attention_impl=impl, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            check_prompt_logprobs(hf, prompt, out)
            assert out.token_ids == hf_greedy(hf, prompt, 10), impl


def test_mxfp4_experts_expand_with_quantization_none_and_stay_exact_with_int8(mxfp4):
    path, hf, held = mxfp4
    floats = flatten(paxpage.load(path, quantization="none").params)
    np.testing.assert_array_equal(np.asarray(floats["layers_1/moe/gate_up_proj"]),
                                  _regrouped(hf.model.layers[1].mlp.experts.gate_up_proj))
    int8 = flatten(paxpage.load(path, quantization="int8").params)
    held = flatten(held.params)
    for suffix in ("_q", "_scale"):  # the exact 4-bit form kept, not re-quantised per channel
        np.testing.assert_array_equal(np.asarray(int8["layers_1/moe/down_proj" + suffix]),
                                      np.asarray(held["layers_1/moe/down_proj" + suffix]))
    # the attention's kernels quantised per channel (held as they run: panels for the native matmul)
    assert {name.split("/")[1] for name in int8 if name.startswith("layers_1/") and name.endswith("_q")} == {
        "moe", "q_proj", "k_proj", "v_proj", "o_proj"}
