"""DeepSeek-V3 (multi-head latent attention, grouped sigmoid routing with shared experts) against HF
transformers on tiny random weights (f32): every prompt token's logprob and the greedy continuation,
in one prefill, chunked prefill beside decode rows (prefill rows in the absorbed and in the expanded
form), with prefix-cache hits and under preemption;
YaRN with mscale; q_lora_rank None; the latent pool's bytes per token; the grouped router against
HF's. The latent attention itself is tested in tests/kernels/test_latent_attention.py."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf

import paxpage
from models.config import ModelConfig
from models.deepseek import prefill_uses_expanded
from models.moe import route_grouped
from models.rope import mla_softmax_scale
from paxpage.sharding import ShardingPlan
from tests.conftest import TINY_DEEPSEEK as BASE
from tests.conftest import (check_chunked_prefill_beside_decode, check_prefill_and_decode,
                            check_prefix_hit_and_preemption, check_prompt_logprobs, hf_greedy, random_prompts,
                            tiny_deepseek_models)

VOCAB = BASE["vocab_size"]
ORIGINAL = 32  # the yarn model's "pretrained" context: prompts reach beyond it
MODELS = {
    # YaRN whose magnitude comes from mscale / mscale_all_dim (DeepSeek-V3's form): the softmax scale
    # gets mscale_all_dim's factor squared.
    "yarn": dict(rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL,
                                      rope_theta=10000.0, mscale=0.707, mscale_all_dim=1.0, beta_fast=32,
                                      beta_slow=1)),
    # A plain q_proj (q_lora_rank None), unnormalised top k, rotate-half RoPE.
    "no_q_lora": dict(q_lora_rank=None, norm_topk_prob=False, rope_interleave=False,
                      rope_parameters=dict(rope_type="default", rope_theta=500.0)),
}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """kind -> (HF model, paxpage model), each saved and loaded once per module."""
    return tiny_deepseek_models(tmp_path_factory, MODELS)


def test_config_reads_deepseek_fields(tiny_models):
    hf, model = tiny_models("yarn")
    cfg = model.config
    assert (cfg.model_type, cfg.is_mla, cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim) == (
        "deepseek_v3", True, 32, 32, 8)
    assert (cfg.num_expert_groups, cfg.topk_groups, cfg.num_shared_experts, cfg.dense_mlp_layers) == (2, 1, 1, (0,))
    assert cfg.rope_interleave and cfg.kv_pool_dims == (1, 1, 40)
    assert mla_softmax_scale(cfg) == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert mla_softmax_scale(cfg) != pytest.approx(24 ** -0.5)  # mscale_all_dim changed it


def test_one_step_prefill_and_decode_match_hf(tiny_models):
    """Two prompts prefilled in one step, then 12 decode steps (q_lora_rank None, rotate-half RoPE)."""
    hf, model = tiny_models("no_q_lora")
    prompts = random_prompts(2, VOCAB, [40, 9], seed=1)
    check_prefill_and_decode(hf, model, prompts)


def test_chunked_prefill_beside_decode_matches_hf(tiny_models):
    """YaRN, prompts past the original context: an 8-token step budget, so the long prompt prefills
    in chunks while the short one decodes."""
    hf, model = tiny_models("yarn")
    prompts = random_prompts(2, VOCAB, [70, 5], seed=2)
    check_chunked_prefill_beside_decode(hf, model, prompts)


def test_expanded_chunked_prefill_beside_decode_matches_hf(tiny_models):
    """Rows of 32 tokens, which run the expanded form at these widths: the long prompt prefills in
    chunks whose rows read the earlier chunks' latents from the pool, while the short one decodes."""
    hf, model = tiny_models("yarn")
    assert prefill_uses_expanded(model.config, 32) and not prefill_uses_expanded(model.config, 4)
    prompts = random_prompts(2, VOCAB, [90, 5], seed=4)
    outs = paxpage.generate(model, prompts, max_tokens=8, temperature=0, prompt_logprobs=0, ignore_eos=True,
                            page_size=8, num_pages=64, max_num_batched_tokens=64, prefill_row_len=32,
                            use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        check_prompt_logprobs(hf, prompt, out)
        assert out.token_ids == hf_greedy(hf, prompt, 8)


def test_prefix_cache_hit_and_preemption_match_hf(tiny_models):
    """A second request reuses the first's cached latent pages; then four sequences share a pool
    too small for all of them, so some are preempted and recomputed."""
    hf, model = tiny_models("yarn")
    check_prefix_hit_and_preemption(hf, model, VOCAB)


def test_pool_holds_one_latent_per_token_and_layer(tiny_models):
    """The allocated pool's bytes per token and layer are (kv_lora_rank + qk_rope_head_dim) x the
    dtype's size, and the engine's page bytes say the same."""
    _, model = tiny_models("yarn")
    cfg = model.config
    config = paxpage.EngineConfig(page_size=4, num_pages=16)
    engine = model.engine(config)
    pools = engine.runner.kv_cache
    assert len(pools) == cfg.num_layers
    per_layer_token = [p.size * p.dtype.itemsize // (16 * 4) for p in pools]
    assert per_layer_token == [(32 + 8) * 4] * cfg.num_layers
    assert pools[0].shape == (1, 16, 4, 1, 40)
    assert engine.config.page_bytes == 4 * cfg.num_layers * 40 * 4
    assert cfg.kv_bytes_per_token == cfg.num_layers * 40 * 4


def test_sharding_plan_and_unsupported_settings(tiny_models):
    _, model = tiny_models("yarn")
    cfg = model.config
    plan = ShardingPlan.for_model(cfg, 2)  # heads split, the latent pool whole on every device
    assert (plan.split_heads, plan.split_mlp, plan.latent_pool, tuple(plan.kv_pool_spec)) == (
        True, True, True, (None,) * 5)
    assert not ShardingPlan.for_model(cfg, 3).split_heads  # 4 heads: attention replicated at tp 3
    for impl in ("pallas", "pallas-interpret"):
        with pytest.raises(ValueError, match=f"attention_impl '{impl}' has no kernel for multi-head latent"):
            paxpage.EngineConfig(attention_impl=impl).resolve(cfg, backend="cpu")
    assert paxpage.EngineConfig(attention_impl="native").resolve(cfg, backend="cpu").attention_impl == "xla"
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is not supported with latent attention"):
        paxpage.EngineConfig(kv_cache_dtype="int8").resolve(cfg, backend="cpu")
    with pytest.raises(ValueError, match="LoRA adapters are not supported with latent attention"):
        paxpage.EngineConfig(max_loras=1).resolve(cfg, backend="cpu")
    d = dict(tf.DeepseekV3Config(**BASE).to_dict(), scoring_func="softmax")
    with pytest.raises(ValueError, match="scoring_func='softmax' is not supported"):
        ModelConfig.from_hf_dict(d)
    with pytest.raises(ValueError, match="num_expert_groups 3 must divide num_experts"):
        dataclasses.replace(cfg, num_expert_groups=3)


def test_grouped_routing_matches_hf_router():
    """route_grouped against HF's DeepseekV3TopkRouter on the same weights and bias (a bias large
    enough to steer the choice, yet the weights are the unbiased scores)."""
    config = tf.DeepseekV3Config(**dict(BASE, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3))
    torch.manual_seed(0)
    router = tf.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_(0.0, 1.0)
        router.e_score_correction_bias.normal_(0.0, 1.0)
    x = torch.randn(32, 64)
    with torch.no_grad():
        _, want_w, want_e = router(x)
    w, e = route_grouped(jnp.asarray(x.numpy()), jnp.asarray(router.weight.detach().numpy().T),
                         jnp.asarray(router.e_score_correction_bias.numpy()), 3, num_groups=4, topk_groups=2,
                         renormalize=True, scaling=2.5)
    order = np.argsort(want_e.numpy(), axis=1)
    np.testing.assert_array_equal(np.sort(np.asarray(e), axis=1), np.take_along_axis(want_e.numpy(), order, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), np.argsort(np.asarray(e), axis=1), 1),
                               np.take_along_axis(want_w.numpy(), order, 1), rtol=1e-5, atol=1e-6)


def test_int8_weights_and_experts_match_hf_on_the_rounded_weights(tmp_path):
    """quantization="int8" on latent attention's kernels, the shared and routed experts (per expert
    and output channel; the router and the correction bias stay float): HF on the same weights
    rounded by that rule gives the same prompt logprobs and greedy tokens."""
    from models.param_layout import flatten
    from tests.conftest import round_to_int8_per_channel, save_tiny_deepseek

    hf = save_tiny_deepseek(tmp_path, **MODELS["no_q_lora"])
    model = paxpage.load(tmp_path, quantization="int8")
    flat = flatten(model.per_layer_params())
    assert flat["layers_1/moe/gate_up_proj_q"].dtype == np.int8
    assert flat["layers_1/moe/down_proj_scale"].shape == (8, 1, 64)
    assert flat["layers_1/moe/router"].dtype == np.float32
    round_to_int8_per_channel(hf)
    check_prefill_and_decode(hf, model, random_prompts(2, VOCAB, [40, 9], seed=1))
