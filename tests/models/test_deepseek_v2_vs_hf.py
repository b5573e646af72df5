"""DeepSeek-V2 (latent attention as DeepSeek-V3's; softmax routing, greedy or group-limited, no
correction bias; RoPE rotating interleaved pairs in place) against HF transformers on tiny random
weights (f32): every prompt token's logprob and the greedy continuation, in one prefill, in a
chunked prefill beside decode rows and with a prefix-cache hit; the router against HF's
DeepseekV2TopkRouter for both top-k methods, where DeepSeek-V3's router chooses otherwise."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf

import paxpage
from models.config import ModelConfig
from models.moe import route_grouped
from models.param_layout import flatten
from models.rope import mla_softmax_scale
from tests.conftest import TINY_DEEPSEEK as BASE
from tests.conftest import (check_chunked_prefill_beside_decode, check_prefill_and_decode, hf_greedy, random_prompts,
                            tiny_deepseek_models)

VOCAB = BASE["vocab_size"]
V2 = dict(norm_topk_prob=False)  # the only value HF's DeepseekV2 and DeepSeek's own code agree on
MODELS = {
    # DeepSeek-V2-Lite's form: a plain q_proj, greedy top k over all experts, YaRN whose mscale and
    # mscale_all_dim are equal (cos / sin unscaled, the softmax scale times mscale_all_dim's factor squared).
    "lite": dict(V2, q_lora_rank=None, topk_method="greedy", n_group=None, topk_group=None,
                 routed_scaling_factor=2.0,
                 rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
                                      rope_theta=10000.0, mscale=0.707, mscale_all_dim=0.707, beta_fast=32,
                                      beta_slow=1)),
    # DeepSeek-V2's form: q through q_lora_rank, the top 2 from the best of 2 groups (the group limit
    # changes the choice whenever the second-best expert is in the other group).
    "grouped": dict(V2, topk_method="group_limited_greedy", n_group=2, topk_group=1, routed_scaling_factor=2.5,
                    rope_parameters=dict(rope_type="default", rope_theta=500.0)),
}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """kind -> (HF model, paxpage model), each saved and loaded once per module."""
    return tiny_deepseek_models(tmp_path_factory, MODELS, version=2)


def test_config_reads_deepseek_v2_fields(tiny_models):
    hf, model = tiny_models("grouped")
    cfg = model.config
    assert (cfg.model_type, cfg.is_mla, cfg.kv_pool_dims, cfg.rope_interleave) == ("deepseek_v2", True, (1, 1, 40), True)
    assert (cfg.router_scoring, cfg.topk_method, cfg.num_expert_groups, cfg.topk_groups, cfg.norm_topk_prob,
            cfg.routed_scaling_factor, cfg.num_shared_experts, cfg.dense_mlp_layers) == (
        "softmax", "group_limited_greedy", 2, 1, False, 2.5, 1, (0,))
    assert not any("e_score_correction_bias" in path for path in flatten(model.per_layer_params()))
    hf_lite, lite = tiny_models("lite")
    assert (lite.config.q_lora_rank, lite.config.topk_method, lite.config.num_expert_groups) == (None, "greedy", 1)
    assert mla_softmax_scale(lite.config) == pytest.approx(hf_lite.model.layers[0].self_attn.scaling, rel=1e-12)
    assert mla_softmax_scale(lite.config) != pytest.approx(24 ** -0.5)  # mscale_all_dim changed it


def test_one_step_prefill_and_decode_match_hf(tiny_models):
    """Greedy routing, plain q_proj, YaRN: two prompts (one past the original 32-token context)
    prefilled in one step, then 12 decode steps."""
    hf, model = tiny_models("lite")
    prompts = random_prompts(2, VOCAB, [45, 9], seed=1)
    check_prefill_and_decode(hf, model, prompts)


def test_chunked_prefill_beside_decode_matches_hf(tiny_models):
    """Group-limited routing: an 8-token step budget, so the long prompt prefills in chunks while
    the short one decodes."""
    hf, model = tiny_models("grouped")
    prompts = random_prompts(2, VOCAB, [60, 5], seed=2)
    check_chunked_prefill_beside_decode(hf, model, prompts)


def test_prefix_cache_hit_matches_hf(tiny_models):
    """A second request reuses the first's cached latent pages; both continue as HF does (a request
    asking for prompt logprobs computes its whole prompt, so the hit is checked on tokens)."""
    hf, model = tiny_models("grouped")
    shared = random_prompts(1, VOCAB, [29], seed=3)[0]
    config = paxpage.EngineConfig(page_size=4, num_pages=128, enable_prefix_caching=True)
    run = dict(max_tokens=8, temperature=0, ignore_eos=True, engine_config=config, use_tqdm=False)
    first = paxpage.generate(model, [shared + [5, 6]], **run)[0]
    engine = model.engine(config)
    hits_before = engine.scheduler.page_manager.prefix_hit_tokens
    second = paxpage.generate(model, [shared + [9]], **run)[0]
    assert engine.scheduler.page_manager.prefix_hit_tokens > hits_before
    assert first.token_ids == hf_greedy(hf, shared + [5, 6], 8)
    assert second.token_ids == hf_greedy(hf, shared + [9], 8)


def _hf_router(method: str):
    config = tf.DeepseekV2Config(**dict(BASE, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3,
                                        topk_method=method, norm_topk_prob=False))
    torch.manual_seed(0)
    router = tf.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_(0.0, 1.0)
    return router


def _sorted(weights, experts):
    """Weights and experts of each token in expert order (top-k order is not part of the contract)."""
    order = np.argsort(experts, axis=1)
    return np.take_along_axis(weights, order, 1), np.take_along_axis(experts, order, 1)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_routing_matches_hf_router_and_differs_from_v3(method):
    """route_grouped with DeepSeek-V2's settings against HF's DeepseekV2TopkRouter on the same
    weights; DeepSeek-V3's (sigmoid, renormalised, groups by their two best) and, for the grouped
    method, the greedy choice pick other experts or weights on the same tokens."""
    router = _hf_router(method)
    x = torch.randn(64, 64)
    with torch.no_grad():
        _, want_w, want_e = router(x)
    want_w, want_e = _sorted(want_w.numpy(), want_e.numpy())
    x_j, w_j = jnp.asarray(x.numpy()), jnp.asarray(router.weight.detach().numpy().T)
    groups = 4 if method == "group_limited_greedy" else 1

    def ours(**kw):
        args = dict(num_groups=groups, topk_groups=2, renormalize=False, scaling=2.5, scoring="softmax",
                    method=method)
        w, e = route_grouped(x_j, w_j, None, 3, **dict(args, **kw))
        return _sorted(np.asarray(w), np.asarray(e))

    got_w, got_e = ours()
    np.testing.assert_array_equal(got_e, want_e)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-7)
    v3 = route_grouped(x_j, w_j, jnp.zeros(16), 3, num_groups=4, topk_groups=2, renormalize=True, scaling=2.5)
    v3_w, v3_e = _sorted(*map(np.asarray, v3))
    assert not np.allclose(v3_w, want_w, atol=1e-3)
    if method == "group_limited_greedy":
        greedy_w, greedy_e = ours(num_groups=1, method="greedy")
        assert (greedy_e != want_e).any(axis=1).sum() >= 8  # the group limit changed the choice
        assert (v3_e != want_e).any()  # V3 ranks groups by their two best scores


def test_unsupported_deepseek_v2_settings():
    base = tf.DeepseekV2Config(**dict(BASE, **V2, topk_method="group_limited_greedy", n_group=2, topk_group=1))
    d = base.to_dict()
    assert ModelConfig.from_hf_dict(d).topk_method == "group_limited_greedy"
    for name, value in (("norm_topk_prob", True), ("mlp_bias", True), ("attention_bias", True),
                        ("scoring_func", "sigmoid")):
        with pytest.raises(ValueError, match=f"deepseek_v2 with {name}={value!r} is not supported"):
            ModelConfig.from_hf_dict(dict(d, **{name: value}))
    with pytest.raises(ValueError, match="topk_method='noaux_tc' is not supported"):
        ModelConfig.from_hf_dict(dict(d, topk_method="noaux_tc"))
    cfg = ModelConfig.from_hf_dict(d)
    with pytest.raises(ValueError, match="topk_method 'greedy' ignores groups"):
        dataclasses.replace(cfg, topk_method="greedy")
    with pytest.raises(ValueError, match="topk_method 'top2' is not supported"):
        dataclasses.replace(cfg, topk_method="top2")
