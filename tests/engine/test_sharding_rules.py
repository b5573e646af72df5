"""Sharding rules from shapes alone (no devices needed): which axes split at which TP size, the
KV-head replication, bytes per device against published parameter counts, config validation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig
from paxpage.config import EngineConfig
from paxpage.sharding import (ShardingPlan, kv_page_bytes_per_device, param_bytes_per_device,
                              replicate_kv_heads)

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True)
LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                        num_heads=32, num_kv_heads=8, head_dim=128)


def test_smollm2_plans():
    p2 = ShardingPlan.for_model(SMOLLM2, 2)
    assert (p2.split_heads, p2.split_mlp, p2.split_vocab, p2.kv_replicas) == (False, True, True, 1)
    assert p2.param_spec("layers_3/q_proj/kernel", 2) == P(None, None)
    assert p2.param_spec("layers_3/down_proj/kernel", 2) == P("model", None)
    assert p2.param_spec("embed_tokens/embedding", 2) == P("model", None)
    assert p2.param_spec("layers_3/input_layernorm/scale", 1) == P()
    assert p2.kv_pool_spec == P(None, None, None, None, None)
    p3 = ShardingPlan.for_model(SMOLLM2, 3)
    assert (p3.split_heads, p3.split_mlp, p3.split_vocab) == (True, True, True)
    assert p3.param_spec("layers_0/k_proj/kernel", 2) == P(None, "model")
    assert p3.param_spec("layers_0/o_proj/kernel", 2) == P("model", None)
    assert p3.kv_pool_spec == P(None, None, None, "model", None)
    # one page, all layers: 2 * 30 * 16 tokens * K * 64 * 4 bytes
    assert kv_page_bytes_per_device(SMOLLM2, p2, 16, 4) == 2 * 30 * 16 * 3 * 64 * 4
    assert kv_page_bytes_per_device(SMOLLM2, p3, 16, 4) == 2 * 30 * 16 * 1 * 64 * 4


def test_quantized_params_shard_like_float_ones():
    """kernel_q as the kernel; scales / offsets along the output axis, and along the contraction
    axis only where their group rows divide evenly (models/quant.py's form)."""
    p3 = ShardingPlan.for_model(SMOLLM2, 3)
    assert p3.param_spec("layers_0/k_proj/kernel_q", 2, (576, 192)) == P(None, "model")
    assert p3.param_spec("layers_0/k_proj/kernel_scale", 2, (18, 192)) == P(None, "model")
    assert p3.param_spec("layers_0/o_proj/kernel_q", 2, (576, 576)) == P("model", None)
    assert p3.param_spec("layers_0/o_proj/kernel_offset", 2, (18, 576)) == P("model", None)  # 18 groups / 3
    assert p3.param_spec("layers_0/o_proj/kernel_scale", 2, (1, 576)) == P(None, None)  # per channel
    p2 = ShardingPlan.for_model(SMOLLM2, 2)
    assert p2.param_spec("layers_0/down_proj/kernel_scale", 2, (48, 576)) == P("model", None)
    assert p2.param_spec("embed_tokens/embedding_q", 2, (49152, 576)) == P("model", None)
    assert p2.param_spec("embed_tokens/embedding_scale", 2, (49152, 18)) == P("model", None)


def test_llama3_8b_bytes_match_published_parameter_count():
    total = 8_030_261_248  # Llama-3-8B parameters
    norms = (2 * 32 + 1) * 4096  # the only replicated weights at tp = 8
    assert param_bytes_per_device(LLAMA3_8B, ShardingPlan.for_model(LLAMA3_8B, 1), 2) == 2 * total
    assert param_bytes_per_device(LLAMA3_8B, ShardingPlan.for_model(LLAMA3_8B, 8), 2) == 2 * ((total - norms) // 8 + norms)
    assert kv_page_bytes_per_device(LLAMA3_8B, ShardingPlan.for_model(LLAMA3_8B, 8), 1, 2) == 2 * 32 * 128 * 2


def test_routed_experts_split_on_their_width_when_tp_divides_it():
    """Qwen3-30B-A3B (Fe = 768) splits its experts at tp 2 / 8 and 3; DeepSeek-V2-Lite (Fe = 1408)
    not at tp 3, where they stay whole like everything else that does not divide."""
    from models.random_init import PRESETS

    qwen = PRESETS["qwen3-30b-a3b"]
    assert param_bytes_per_device(qwen, ShardingPlan.for_model(qwen, 1), 1) == 30_532_122_624  # published count
    experts = qwen.num_layers * qwen.num_experts * 3 * qwen.hidden_size * qwen.moe_intermediate_size
    for tp in (2, 3, 8):
        plan = ShardingPlan.for_model(qwen, tp)
        assert plan.split_experts and plan.describe().endswith("experts split"), tp
        assert plan.param_spec("layers_5/moe/gate_up_proj", 3) == P(None, None, "model")
        assert plan.param_spec("layers_5/moe/down_proj", 3) == P(None, "model", None)
        assert plan.param_spec("layers/5/moe/down_proj", 4) == P(None, None, "model", None)  # stacked
        assert plan.param_spec("layers_5/moe/router", 2) == P()
        # each device holds 1 / tp of the expert bytes; the rest as with whole experts
        whole = dataclasses.replace(plan, split_experts=False)
        saved = 2 * experts * (tp - 1) // tp  # bf16
        assert param_bytes_per_device(qwen, plan, 2) == param_bytes_per_device(qwen, whole, 2) - saved
    oss = ShardingPlan.for_model(PRESETS["gpt-oss-20b"], 4)
    assert oss.param_spec("layers_0/moe/gate_up_bias", 2) == P(None, "model")
    assert oss.param_spec("layers_0/moe/down_bias", 2) == P()  # added once, after the sum
    lite = PRESETS["deepseek-v2-lite"]
    assert ShardingPlan.for_model(lite, 2).split_experts and not ShardingPlan.for_model(lite, 3).split_experts
    assert ShardingPlan.for_model(lite, 3).param_spec("layers_1/moe/gate_up_proj", 3) == P(None, None, None)
    assert ShardingPlan.for_model(SMOLLM2, 2).split_experts is None  # no experts: not in describe()
    assert "experts" not in ShardingPlan.for_model(SMOLLM2, 2).describe()
    assert ShardingPlan.for_model(qwen, 1).describe() == "tp=1: one device holds everything"
    # every Qwen3-30B-A3B layer's MLP is routed experts: no dense MLP to name; DeepSeek-V2-Lite's
    # first layer and shared experts are one
    assert ShardingPlan.for_model(qwen, 2).describe() == "tp=2: heads/KV pool split, vocab split, experts split"
    assert "MLP split" in ShardingPlan.for_model(lite, 2).describe()


def test_expert_parallel_splits_whole_experts():
    """enable_expert_parallel: Qwen3-30B-A3B's 128 experts split 128 / tp per device on E, each
    device holding 1 / tp of the expert bytes; DeepSeek-V2-Lite's 64 at tp 2 too (at tp 3 they
    do not divide: refused, as for a model with no experts)."""
    from models.random_init import PRESETS

    from paxpage.config import EngineConfig

    qwen = PRESETS["qwen3-30b-a3b"]
    experts = qwen.num_layers * qwen.num_experts * 3 * qwen.hidden_size * qwen.moe_intermediate_size
    for tp in (2, 8):
        plan = ShardingPlan.for_model(qwen, tp, expert_parallel=True)
        assert plan.expert_parallel and not plan.split_experts
        assert plan.describe().endswith("experts split (whole experts per device)")
        assert plan.param_spec("layers_5/moe/gate_up_proj", 3) == P("model", None, None)
        assert plan.param_spec("layers/5/moe/down_proj", 4) == P(None, "model", None, None)  # stacked
        assert plan.param_spec("layers_5/moe/router", 2) == P()
        whole = dataclasses.replace(plan, expert_parallel=False)
        assert param_bytes_per_device(qwen, plan, 2) == param_bytes_per_device(qwen, whole, 2) - 2 * experts * (tp - 1) // tp
    oss = ShardingPlan.for_model(PRESETS["gpt-oss-20b"], 4, expert_parallel=True)
    assert oss.param_spec("layers_0/moe/gate_up_bias", 2) == P("model", None)
    assert oss.param_spec("layers_0/moe/down_bias", 2) == P()  # added once, after the sum
    lite = PRESETS["deepseek-v2-lite"]
    assert ShardingPlan.for_model(lite, 2, expert_parallel=True).expert_parallel
    assert not ShardingPlan.for_model(qwen, 1, expert_parallel=True).expert_parallel  # one device: nothing to split
    with pytest.raises(ValueError, match="64 routed experts do not split over tensor_parallel_size 3"):
        ShardingPlan.for_model(lite, 3, expert_parallel=True)
    with pytest.raises(ValueError, match="enable_expert_parallel is set but llama has no routed experts"):
        ShardingPlan.for_model(SMOLLM2, 2, expert_parallel=True)
    with pytest.raises(TypeError, match="enable_expert_parallel must be a bool"):
        EngineConfig(enable_expert_parallel="yes")


def test_kv_heads_replicated_when_tp_exceeds_them():
    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=4)
    plan = ShardingPlan.for_model(cfg, 4)
    assert plan.split_heads and plan.kv_replicas == 2
    assert plan.sharded_model_config(cfg).num_kv_heads == 4
    assert plan.kv_heads_per_device(cfg) == 1
    kernel = np.arange(16 * 8).reshape(16, 8)  # [H, K*D]: head 0 = columns 0..3, head 1 = 4..7
    out = replicate_kv_heads(plan, cfg, {"layers_0": {"k_proj": {"kernel": kernel}, "q_proj": {"kernel": kernel}}})
    assert out["layers_0"]["k_proj"]["kernel"].shape == (16, 16)
    np.testing.assert_array_equal(out["layers_0"]["k_proj"]["kernel"],
                                  np.concatenate([kernel[:, :4], kernel[:, :4], kernel[:, 4:], kernel[:, 4:]], 1))
    assert out["layers_0"]["q_proj"]["kernel"] is kernel
    # N = 6 is not a multiple of 4: attention stays replicated, no widening
    cfg6 = ModelConfig(vocab_size=64, hidden_size=24, intermediate_size=32, num_layers=1, num_heads=6,
                       num_kv_heads=2, head_dim=4)
    assert not ShardingPlan.for_model(cfg6, 4).split_heads


def test_engine_config_validation():
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int, got 0"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size must be a positive int"):
        EngineConfig(data_parallel_size=-1)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        EngineConfig(mesh="model")
    assert not EngineConfig().is_parallel and EngineConfig(tensor_parallel_size=2).is_parallel
    # kv_cache_bytes is per device: a split pool fits 3x the pages at tp = 3
    one = EngineConfig(kv_cache_bytes=1 << 26).resolve(SMOLLM2)
    three = EngineConfig(kv_cache_bytes=1 << 26, tensor_parallel_size=3).resolve(SMOLLM2)
    assert three.page_bytes * 3 == one.page_bytes and three.num_pages == 3 * one.num_pages


def test_too_many_devices_is_a_user_error():
    from paxpage.mesh import replica_meshes

    with pytest.raises(ValueError, match="needs 64 devices; jax sees"):
        replica_meshes(32, 2)
