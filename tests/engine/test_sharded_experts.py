"""Routed experts split over each expert's width (paxpage/sharded_experts.py), checked without
devices: the placement regroup against hand-worked column orders, and the devices' partial sums,
added up as the psum does, against HF transformers' GptOssMLP (router and expert biases, the
clamped SwiGLU) through each grouped-matmul form. tests/parallel/test_moe_tensor_parallel.py runs
the split on a forced-device mesh."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import transformers as tf

from models.moe import clamped_swiglu, down_bias_sums, expert_sums, route
from paxpage.sharded_experts import regroup
from paxpage.sharding import ShardingPlan


def _plan(tp: int, split: bool = True) -> ShardingPlan:
    return ShardingPlan(tp, split_heads=False, split_mlp=False, split_vocab=False, split_experts=split)


def test_regroup_gives_each_device_its_gate_then_up_columns():
    bias = np.arange(2 * 8).reshape(2, 8)  # [E = 2, 2 * Fe], Fe = 4: gate columns 0..3, up 4..7
    params = {"layers_0": {"moe": {"gate_up_bias": bias, "down_bias": bias}}}
    out = regroup(_plan(2), params)["layers_0"]["moe"]
    np.testing.assert_array_equal(out["gate_up_bias"], bias[:, [0, 1, 4, 5, 2, 3, 6, 7]])  # [g0 u0 | g1 u1]
    assert out["down_bias"] is bias
    out = regroup(_plan(4), params)["layers_0"]["moe"]
    np.testing.assert_array_equal(out["gate_up_bias"], bias[:, [0, 4, 1, 5, 2, 6, 3, 7]])
    # stacked layers [L, E, H, 2 * Fe]: the last axis alone moves
    stacked = np.arange(2 * 3 * 1 * 4).reshape(2, 3, 1, 4)
    out = regroup(_plan(2), {"layers": {"moe": {"gate_up_proj": stacked}}})["layers"]["moe"]["gate_up_proj"]
    np.testing.assert_array_equal(out, stacked[..., [0, 2, 1, 3]])
    # abstract leaves keep their shape; a plan that keeps experts whole changes nothing
    abstract = jax.ShapeDtypeStruct((2, 8), np.float32)
    assert regroup(_plan(2), {"moe": {"gate_up_bias": abstract}})["moe"]["gate_up_bias"] is abstract
    assert regroup(_plan(2, split=False), params) is params


@pytest.fixture(scope="module")
def gpt_oss_mlp():
    """HF's GptOssMLP on random weights, biases drawn large enough to matter, and its output."""
    config = tf.GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                             swiglu_limit=1.5)
    torch.manual_seed(0)
    mlp = tf.models.gpt_oss.modeling_gpt_oss.GptOssMLP(config).eval()
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            p.normal_(0.0, 0.3 if name.endswith("bias") else 0.5)
    x = torch.randn(1, 24, 64)
    with torch.no_grad():
        want = mlp(x)[0][0].numpy()
    return config, mlp, x[0].numpy(), want


@pytest.mark.parametrize("impl", ["tiled", "ragged_dot", "dense"])
@pytest.mark.parametrize("tp", [2, 4])
def test_devices_partial_sums_add_up_to_hf(gpt_oss_mlp, impl, tp):
    """Each device's share (its block of the regrouped gate_up and bias, its rows of down) through
    expert_sums; the shares summed, then the down bias once, equal the unsplit MLP."""
    config, mlp, x, want = gpt_oss_mlp

    def gate_then_up(w):  # HF's interleaved gate / up columns, as the checkpoint loader regroups them
        w = w.detach().numpy()
        return np.concatenate([w[..., 0::2], w[..., 1::2]], axis=-1)

    placed = regroup(_plan(tp), {"moe": {"gate_up_proj": gate_then_up(mlp.experts.gate_up_proj),
                                         "gate_up_bias": gate_then_up(mlp.experts.gate_up_proj_bias)}})["moe"]
    down = mlp.experts.down_proj.detach().numpy()  # [E, Fe, H]
    weights, experts = route(x, mlp.router.weight.detach().numpy().T, 2, True, mlp.router.bias.detach().numpy())
    activation = clamped_swiglu(config.swiglu_limit, config.swiglu_alpha)
    shares = [expert_sums(x, weights, experts, gate_up, part, impl=impl, gate_up_bias=bias, activation=activation)
              for gate_up, bias, part in zip(np.split(placed["gate_up_proj"], tp, axis=-1),
                                             np.split(placed["gate_up_bias"], tp, axis=-1),
                                             np.split(down, tp, axis=1))]
    assert shares[0].dtype == np.float32
    got = sum(shares) + down_bias_sums(weights, experts, mlp.experts.down_proj_bias.detach().numpy())
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
