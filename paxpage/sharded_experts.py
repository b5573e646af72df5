"""Routed MoE experts split over the mesh's "model" axis on each expert's MLP width Fe: Megatron's
split of an MLP, applied to every expert. Each device holds Fe / tp columns of every expert's gate
and up projections and the matching Fe / tp rows of its down projection, runs models/moe.py's
grouped matmuls over every token's routed rows with them, and one all-reduce (a psum over "model")
per MoE layer adds the devices' partial outputs. Routing runs replicated (the router is [H, E]);
gpt-oss's down-projection bias is added once, after the sum.

The experts run under `shard_map` rather than by GSPMD's reading of the sharded weights: the
"tiled" implementation loops over tiles of rows, and a partitioned loop body would all-reduce every
tile; under shard_map the partial sums stay local until the one psum of f32[T, H].

gate_up_proj [E, H, 2*Fe] holds all gate columns, then all up columns, so a plain split of its
last axis would give some devices only gate columns. `regroup` reorders it (and gpt-oss's
gate_up_bias [E, 2*Fe]) as the weights are placed, so that device d's contiguous block is its own
gate columns, then its own up columns: each device sees the one-device layout at width Fe / tp,
and the expert code runs on it unchanged. Only the placed arrays are regrouped; checkpoints,
caches and one-device runs keep the gate-then-up layout.

Expert parallelism (EngineConfig.enable_expert_parallel) splits the experts whole instead: device
d holds experts d * E / tp .. (d + 1) * E / tp - 1 with their full width (gate_up, its bias and
down split on E). Under tensor parallelism every device already holds every token's hidden state,
so no token is sent anywhere: each device groups the rows routed to its own experts, multiplies
only those (models/moe.expert_sums' expert_offset; the rest cost nothing where the loop stops at
the tiles in use), and the same one psum adds the devices' outputs. Worth it where Fe does not
split (DeepSeek-V2-Lite's 1408 at tp 3 keeps whole experts on every device otherwise) and where
wide experts multiply faster than narrow slices.

Axis legend: T tokens, H hidden, E experts, k experts per token, Fe one expert's MLP width.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from models import quant
from models.moe import ExpertsFn, down_bias_sums, expert_sums, routed_experts, swiglu
from paxpage.mesh import shard_map
from paxpage.sharding import MODEL_AXIS, PARAM_AXES, ShardingPlan

# The leaves `regroup` reorders: their last axis is gate columns, then up columns (a quantised
# gate_up_proj's values, scales and offsets alike, models/quant.py).
GATE_UP_LEAVES = ("moe/gate_up_proj", "moe/gate_up_bias") + tuple(
    "moe/gate_up_proj" + suffix for suffix in (quant.Q, quant.SCALE, quant.OFFSET))


def regroup(plan: ShardingPlan, params) -> dict:
    """Reorders the last axis of every expert gate / up leaf from [gate (Fe), up (Fe)] to tp
    blocks [gate_d (Fe / tp), up_d (Fe / tp)], d = 0 .. tp - 1, so that a plain split over tp
    devices gives device d its own gate and up columns. Unchanged when the plan keeps experts
    whole. Host arrays in and out (or jax.ShapeDtypeStructs: unchanged, their shape is kept)."""
    if not plan.split_experts:
        return params
    tp = plan.tensor_parallel_size
    check_groups(plan, params)

    def blocks(x):  # [..., 2*Fe] -> [..., tp * 2 * (Fe / tp)]
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        x = np.asarray(x)
        lead, width = x.shape[:-1], x.shape[-1]
        x = x.reshape(*lead, 2, tp, width // (2 * tp))
        return np.ascontiguousarray(np.swapaxes(x, -3, -2)).reshape(*lead, width)

    def walk(tree, path):
        if isinstance(tree, dict):
            return {k: walk(v, f"{path}{k}/") for k, v in tree.items()}
        return blocks(tree) if path[:-1].endswith(GATE_UP_LEAVES) else tree
    return walk(params, "")


def check_groups(plan: ShardingPlan, params) -> None:
    """ValueError when quantised experts' groups of inputs (models/quant.py: one scale per G
    inputs) would not split whole over the devices that split the inputs (down_proj's Fe under
    a split of the experts' width). One group per output (per-channel int8) is held whole."""
    def walk(tree, path):
        if isinstance(tree, dict):
            for key, value in tree.items():
                walk(value, f"{path}/{key}" if path else key)
            return
        base = quant.base_name(path)
        if base == path or not path.endswith(quant.SCALE):
            return
        name = next((n for n in ("moe/gate_up_proj", "moe/down_proj") if base.endswith(n)), None)
        groups = tree.shape[-2]
        if name is not None and plan.mesh_axis(PARAM_AXES[name][-2]) and groups > 1 \
                and groups % plan.tensor_parallel_size:
            raise ValueError(f"{base} holds {groups} groups of inputs per expert (one scale each), which do not "
                             f"split over tensor_parallel_size {plan.tensor_parallel_size}; use "
                             "enable_expert_parallel (whole experts per device) or another tensor_parallel_size")
    walk(params, "")


def shard_experts(mesh: Mesh, plan: ShardingPlan, experts_fn: ExpertsFn = routed_experts) -> ExpertsFn:
    """models/moe.py's routed_experts, each device running its own share of every expert's width
    (weights placed by `regroup` and sharding.PARAM_AXES) or, with expert parallelism, its own
    whole experts, then one psum. `experts_fn` itself when the plan keeps every expert on every
    device (GSPMD then runs them replicated)."""
    if not (plan.split_experts or plan.expert_parallel):
        return experts_fn
    rep = PartitionSpec()
    bias_spec = plan.spec(PARAM_AXES["moe/gate_up_bias"])

    def weight_spec(name: str, w):
        """The spec of expert weights `w` (float, or quant.QuantizedWeight: each leaf as the
        weights were placed, ShardingPlan.param_spec)."""
        if not isinstance(w, quant.QuantizedWeight):
            return plan.spec(PARAM_AXES[name])
        return quant.QuantizedWeight(*(None if leaf is None else plan.param_spec(name + suffix, leaf.ndim, leaf.shape)
                                       for leaf, suffix in zip(w, (quant.Q, quant.SCALE, quant.OFFSET))))

    def sharded(x, weights, experts, gate_up, down, *, impl="auto", gate_up_bias=None, down_bias=None,
                activation=swiglu):
        def local(x, weights, experts, gate_up, down, *bias):  # this device's share -> its partial sum
            # expert parallelism: this device's experts start at d * E_local
            offset = jax.lax.axis_index(MODEL_AXIS) * gate_up.shape[0] if plan.expert_parallel else None
            part = expert_sums(x, weights, experts, gate_up, down, impl=impl,
                               gate_up_bias=bias[0] if bias else None, activation=activation,
                               expert_offset=offset)
            return jax.lax.psum(part, MODEL_AXIS)

        args = (x, weights, experts, gate_up, down)
        specs = (rep, rep, rep, weight_spec("moe/gate_up_proj", gate_up), weight_spec("moe/down_proj", down))
        if gate_up_bias is not None:
            args, specs = (*args, gate_up_bias), (*specs, bias_spec)
        y = shard_map(local, mesh=mesh, in_specs=specs, out_specs=rep)(*args)  # f32[T, H]
        if down_bias is not None:
            y = y + down_bias_sums(weights, experts, down_bias, in_order=impl == "stable")
        return y.astype(x.dtype)

    return sharded
