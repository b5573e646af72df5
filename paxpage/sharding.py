"""Tensor-parallel sharding rules: logical axes of every parameter and of the KV pool, mapped
to the mesh's "model" axis in one table.

Megatron's split, as tpu-inference and MaxText do it: q/k/v and gate/up are split on their
output (heads, MLP width), o_proj and down_proj on their input, the embedding and LM head on
the vocabulary. XLA inserts the collectives (an all-reduce after o_proj and after down_proj,
gathers around the vocabulary-split embedding and logits).

A logical axis is split only when the split is exact; otherwise it is replicated, never split
unevenly:
- "heads" and "kv_heads" go together (each device attends with whole GQA groups):
  * tp divides N and K: each device holds N / tp query heads and K / tp KV heads, and
    1 / tp of the KV pool.
  * tp divides N and K divides tp (more devices than KV heads, e.g. K = 8 at tp = 16, or a
    tiny K = 2 at tp = 4): each KV head is replicated r = tp / K times, as tpu-inference does,
    so the pool has K * r heads and each device holds one KV head: 1 / K of the one-device
    pool per device (r times the pool's one-device bytes over all devices). The k/v
    projections are widened to K * r heads when the weights are placed.
  * otherwise (SmolLM2: N = 9, K = 3 at tp = 2 or 4): attention runs replicated: every device
    holds q/k/v/o whole and the whole KV pool, i.e. per device what one device holds, tp
    times that in total. Only the MLP and the vocabulary are split then.
Parameters this table does not name (norm scales, future layer kinds) are replicated.

Latent attention (DeepSeek-V2 / V3, models/deepseek.py): the per-head projections (q_proj / q_b_proj,
kv_b_proj on their output, o_proj on its input) split over "heads" when tp divides N; the latent
pool has one latent shared by every head, so every device holds all of it (replicated), as do
the low-rank projections in front of it (q_a_proj, kv_a_proj_with_mqa). The MLP widths (dense
layers and shared experts) split when tp divides both.

Routed experts (Qwen3-MoE, Mixtral, gpt-oss, DeepSeek) split on each expert's MLP width Fe when tp
divides it ("expert_mlp"): every device holds Fe / tp columns of every expert, 1 / tp of the
expert bytes, and runs its share under shard_map with one psum per MoE layer
(paxpage/sharded_experts.py, which also regroups gate_up's columns per device at placement).
Otherwise they are replicated. The router and the down projection's bias stay replicated.

Axis legend: H hidden, N query heads, K kv heads, D head dim, F MLP width, V vocabulary,
P pages, E experts, Fe one expert's MLP width.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec

from models.config import ModelConfig
from pallas_kernels import kv_layout, kv_quant

MODEL_AXIS = "model"  # the mesh axis tensor parallelism splits over
DATA_AXIS = "data"  # the mesh axis data-parallel replicas sit along

# Parameter path suffix -> logical axis of each dimension (None: never split).
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embed_tokens/embedding": ("vocab", None),  # [V, H]
    "q_proj/kernel": (None, "heads"),  # [H, N*D]
    "q_proj/bias": ("heads",),
    "k_proj/kernel": (None, "kv_heads"),  # [H, K*D]
    "k_proj/bias": ("kv_heads",),
    "v_proj/kernel": (None, "kv_heads"),
    "v_proj/bias": ("kv_heads",),
    "o_proj/kernel": ("heads", None),  # [N*D, H]
    "attention_sinks": ("heads",),  # gpt-oss: one logit per query head [N]
    "q_b_proj/kernel": (None, "heads"),  # latent attention: [Q, N*(Dn+Dr)]
    "kv_b_proj/kernel": (None, "heads"),  # [Cr, N*(Dn+Dv)]
    "gate_proj/kernel": (None, "mlp"),  # [H, F]
    "up_proj/kernel": (None, "mlp"),
    "down_proj/kernel": ("mlp", None),  # [F, H]
    # Routed experts, split on Fe (gate_up's last axis regrouped per device first,
    # sharded_experts.regroup: device d's block holds its gate, then its up columns) or, with
    # expert parallelism, on E (whole experts per device). Never both.
    "moe/gate_up_proj": ("experts", None, "expert_mlp"),  # [E, H, 2*Fe]
    "moe/gate_up_bias": ("experts", "expert_mlp"),  # [E, 2*Fe]
    "moe/down_proj": ("experts", "expert_mlp", None),  # [E, Fe, H]
    "lm_head/kernel": (None, "vocab"),  # [H, V]
    # LoRA slabs (paxpage/lora_slab.py): lora_a [S, I, R], lora_b [S, R, O], split with their
    # layer's kernel (the rank axis never); the others' halves are replicated.
    "q_proj/lora_b": (None, None, "heads"),
    "k_proj/lora_b": (None, None, "kv_heads"),
    "v_proj/lora_b": (None, None, "kv_heads"),
    "o_proj/lora_a": (None, "heads", None),
    "gate_proj/lora_b": (None, None, "mlp"),
    "up_proj/lora_b": (None, None, "mlp"),
    "down_proj/lora_a": (None, "mlp", None),
}
# The stacked layer params' subtree (models/layer_stack.STACKED_KEY).
STACKED_LAYERS = "layers"
# One layer's KV pool [2, P, page_size, K, D] (the canonical layout; kv_pool_axes gives any
# layout's; kv_scale_axes those of a quantised pool's scales).
KV_POOL_AXES: tuple[str | None, ...] = (None, None, None, "kv_heads", None)
# Attention inputs inside the step: q [B, Tq, N, D], new k/v [T, K, D].
Q_AXES: tuple[str | None, ...] = (None, None, "heads", None)
NEW_KV_AXES: tuple[str | None, ...] = (None, "kv_heads", None)


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Which logical axes a tensor-parallel size splits for one model."""

    tensor_parallel_size: int
    split_heads: bool  # N and K over the model axis (else attention is replicated)
    split_mlp: bool | None  # None: the model has no dense MLP (every layer's MLP is routed experts)
    split_vocab: bool
    kv_replicas: int = 1  # r: each KV head repeated r times so K * r heads split over tp
    latent_pool: bool = False  # latent attention: the pool [1, P, page_size, 1, C] is replicated
    split_experts: bool | None = None  # routed experts over Fe; None: the model has none
    expert_parallel: bool = False  # routed experts over E instead: E / tp whole experts per device

    @classmethod
    def for_model(cls, cfg: ModelConfig, tensor_parallel_size: int,
                  expert_parallel: bool = False) -> "ShardingPlan":
        """expert_parallel: split the routed experts whole over the devices (E / tp each; E must
        be a multiple of tp) rather than each expert's width."""
        tp = tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {tp!r}")
        plan = cls._for_attention_and_mlp(cfg, tp)
        if expert_parallel:
            check_expert_parallel(cfg, tp)
        if not cfg.num_experts:
            return plan
        dense = cfg.num_shared_experts or any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers))
        whole = expert_parallel and tp > 1
        return dataclasses.replace(plan, split_experts=not whole and tp > 1 and cfg.moe_intermediate_size % tp == 0,
                                   expert_parallel=whole, split_mlp=plan.split_mlp if dense else None)

    @classmethod
    def _for_attention_and_mlp(cls, cfg: ModelConfig, tp: int) -> "ShardingPlan":
        if cfg.is_mla:
            widths = [cfg.intermediate_size] + [cfg.num_shared_experts * cfg.moe_intermediate_size] * bool(
                cfg.num_shared_experts)
            return cls(tp, split_heads=tp > 1 and cfg.num_heads % tp == 0,
                       split_mlp=tp > 1 and all(w % tp == 0 for w in widths),
                       split_vocab=tp > 1 and cfg.vocab_size % tp == 0, latent_pool=True)
        n, k = cfg.num_heads, cfg.num_kv_heads
        split_heads = tp > 1 and n % tp == 0 and (k % tp == 0 or tp % k == 0)
        return cls(tp, split_heads=split_heads,
                   split_mlp=tp > 1 and cfg.intermediate_size % tp == 0,
                   split_vocab=tp > 1 and cfg.vocab_size % tp == 0,
                   kv_replicas=tp // k if split_heads and k < tp else 1)

    def mesh_axis(self, logical: str | None) -> str | None:
        split = {"heads": self.split_heads, "kv_heads": self.split_heads,
                 "mlp": bool(self.split_mlp), "vocab": self.split_vocab,
                 "expert_mlp": bool(self.split_experts), "experts": self.expert_parallel}.get(logical, False)
        return MODEL_AXIS if split else None

    def spec(self, logical_axes: tuple[str | None, ...]) -> PartitionSpec:
        return PartitionSpec(*(self.mesh_axis(a) for a in logical_axes))

    def param_spec(self, path: str, ndim: int, shape: tuple[int, ...] | None = None) -> PartitionSpec:
        """PartitionSpec of the parameter at flat `path` ("layers_0/q_proj/kernel").

        A quantised weight (models/quant.py) shards as its float one: "kernel_q" exactly so, its
        scale / offset the same way along the output axis; along the contraction axis they hold
        one row per group, split only when `shape` says the groups divide evenly (per-channel
        int8 has one group: replicated there). Stacked layer params ("layers/0/q_proj/kernel",
        models/layer_stack.py) have a leading layer axis, never split."""
        from models import quant

        base = quant.base_name(path)
        stacked = path.startswith(STACKED_LAYERS + "/")
        for suffix, axes in PARAM_AXES.items():
            if base == suffix or base.endswith("/" + suffix):
                axes = ((None,) if stacked else ()) + axes
                assert len(axes) == ndim, (path, axes, ndim)
                if base != path and not path.endswith(quant.Q) and shape is not None:
                    axes = tuple(a if d % self.tensor_parallel_size == 0 else None for a, d in zip(axes, shape))
                return self.spec(axes)
        return PartitionSpec()

    @property
    def kv_pool_spec(self) -> PartitionSpec:
        """The canonical pool's spec (`layout_pool_spec` for any layout's)."""
        return self.layout_pool_spec(None)

    def layout_pool_spec(self, layout=None) -> PartitionSpec:
        """The pool's spec in `layout` (pallas_kernels.kv_layout; None: canonical): split on its
        kv-head axis; a latent pool is replicated."""
        if self.latent_pool:
            return PartitionSpec(*(None,) * len(KV_POOL_AXES))
        return self.spec(kv_pool_axes(layout))

    def kv_cache_spec(self, kv_cache_dtype: str = "auto", stacked: bool = False, layout=None):
        """One layer's cache spec as a pytree like the cache: the pool's spec, or for a quantised
        cache QuantizedKV(pool spec, scales spec), both split on their K axis. stacked: the
        stacked [2, L, P, ...] cache of scanned layers, whose layer axis is never split (in the
        tpu layout it is one cache of L * P pages, as a layer's: models/layer_stack.py).
        layout: the pool's kv_layout (None: canonical)."""
        pages, scales = self.layout_pool_spec(layout), self.spec(kv_scale_axes(layout))
        if stacked and kv_layout.get(layout).page_axis != 0:
            pages, scales = (PartitionSpec(s[0], None, *s[1:]) for s in (pages, scales))
        if kv_cache_dtype == "auto":
            return pages
        return kv_quant.QuantizedKV(pages, scales)

    def kv_heads_per_device(self, cfg: ModelConfig) -> int:
        """KV heads of the pool each device holds (its per-device pool bytes follow)."""
        heads = cfg.num_kv_heads * self.kv_replicas
        return heads // self.tensor_parallel_size if self.split_heads and not self.latent_pool else heads

    def sharded_model_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config the sharded model runs: K * r KV heads when KV heads are replicated."""
        if self.kv_replicas == 1:
            return cfg
        return dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * self.kv_replicas)

    def describe(self) -> str:
        if self.tensor_parallel_size == 1:
            return "tp=1: one device holds everything"
        heads = "heads (latent pool replicated)" if self.latent_pool else "heads/KV pool"
        experts = None if self.split_experts is None else self.split_experts or self.expert_parallel
        parts = [f"{name} {'split' if split else 'replicated'}" for name, split in
                 ((heads, self.split_heads), ("MLP", self.split_mlp), ("vocab", self.split_vocab),
                  ("experts", experts)) if split is not None]
        if self.expert_parallel:
            parts[-1] += " (whole experts per device)"
        if self.kv_replicas > 1:
            parts[0] += f" (each KV head x{self.kv_replicas})"
        return f"tp={self.tensor_parallel_size}: " + ", ".join(parts)


def check_expert_parallel(cfg: ModelConfig, tensor_parallel_size: int) -> None:
    """Expert parallelism needs routed experts, a whole number of them per device."""
    if not cfg.num_experts:
        raise ValueError(f"enable_expert_parallel is set but {cfg.model_type} has no routed experts")
    if cfg.num_experts % tensor_parallel_size:
        raise ValueError(f"enable_expert_parallel: {cfg.num_experts} routed experts do not split over "
                         f"tensor_parallel_size {tensor_parallel_size} (it must divide them)")


def kv_pool_axes(layout=None) -> tuple[str | None, ...]:
    """Logical axes of one layer's pool in `layout` (a kv_layout name or KVLayout; None: canonical)."""
    layout = kv_layout.get(layout)
    ndim = len(layout.shape(1, 1, 1, 1))
    return tuple("kv_heads" if axis == layout.head_axis else None for axis in range(ndim))


def kv_scale_axes(layout=None) -> tuple[str | None, ...]:
    """Logical axes of a quantised pool's scales in `layout` (None: canonical)."""
    layout = kv_layout.get(layout)
    ndim = len(layout.scale_shape(1, 1, 1))
    return tuple("kv_heads" if axis == layout.scale_head_axis else None for axis in range(ndim))


def param_specs(plan: ShardingPlan, params) -> dict:
    """The params tree with each leaf replaced by its PartitionSpec."""
    def walk(tree, prefix):
        if isinstance(tree, dict):
            return {k: walk(v, f"{prefix}{k}/") for k, v in tree.items()}
        return plan.param_spec(prefix[:-1], len(tree.shape), tuple(tree.shape))
    return walk(params, "")


def replicate_kv_heads(plan: ShardingPlan, cfg: ModelConfig, params) -> dict:
    """Widens every k/v projection from K to K * r heads (head j of the result is original head
    j // r), so query head h still reads original KV head h // (N / K). Host arrays in and out
    (or jax.ShapeDtypeStructs: their widened shapes)."""
    r = plan.kv_replicas
    if r == 1:
        return params
    import numpy as np

    def widen(x):  # [..., K*D] -> [..., K*r*D]
        lead = x.shape[:-1]
        if isinstance(x, jax.ShapeDtypeStruct):  # ahead-of-time compilation: the shape alone
            return jax.ShapeDtypeStruct((*lead, x.shape[-1] * r), x.dtype)
        x = np.asarray(x).reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
        return np.repeat(x, r, axis=-2).reshape(*lead, cfg.num_kv_heads * r * cfg.head_dim)

    def walk(tree, path):
        if isinstance(tree, dict):
            return {k: walk(v, f"{path}{k}/") for k, v in tree.items()}
        name = path[:-1]
        # quantised: models/quant.py; lora_b: a LoRA slab's output half (paxpage/lora_slab.py)
        leaves = ("kernel", "bias", "kernel_q", "kernel_scale", "kernel_offset", "lora_b")
        if any(name.endswith(f"{proj}/{leaf}") for proj in ("k_proj", "v_proj") for leaf in leaves):
            return widen(tree)
        return tree
    return walk(params, "")


def param_bytes_per_device(cfg: ModelConfig, plan: ShardingPlan, itemsize: int,
                           quantized: dict[str, tuple[int, int]] | None = None) -> int:
    """Bytes of weights each device holds under `plan`, from the shapes alone (the same rules
    the engine places real arrays by; the per-device tables of docs/parallelism.md come from here).
    quantized: {leaf suffix ("moe/down_proj"): (G, bits)} for kernels held as 8- or 4-bit values
    (int8, or two e2m1 codes a byte) with one f32 scale per G inputs (models/quant.py; gpt-oss's
    MXFP4 experts: (32, 4))."""
    from models import quant
    from models.param_layout import param_specs as layout

    heads_cfg = plan.sharded_model_config(cfg)  # k/v widened when KV heads are replicated
    quantized = quantized or {}

    def held(path, shape, size_of_item):
        spec = plan.param_spec(path, len(shape), shape)
        size = 1
        for dim, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
            size *= dim // plan.tensor_parallel_size if axis is not None else dim
        return size * size_of_item

    total = 0
    for path, (shape, _, _) in layout(heads_cfg).items():
        form = next((f for suffix, f in quantized.items() if path.endswith(suffix)), None)
        if form is None:
            total += held(path, shape, itemsize)
            continue
        group, bits = form
        values = (*shape[:-2], shape[-2] * bits // 8, shape[-1])  # bytes: 4-bit codes two a byte
        scale_shape = (*shape[:-2], shape[-2] // group, shape[-1])
        total += held(path + quant.Q, values, 1) + held(path + quant.SCALE, scale_shape, 4)
    return total


def kv_page_bytes_per_device(cfg: ModelConfig, plan: ShardingPlan, page_size: int, itemsize: int,
                             kv_cache_dtype: str = "auto", layout=None) -> int:
    """One page's K and V over all layers, on one device, in the pool's `layout` (a kv_layout;
    None: canonical). `itemsize`: the model dtype's; a quantised cache ("int8" / "fp8") counts 1
    byte per value plus its scales as the layout stores them (kv_quant.head_page_bytes)."""
    if cfg.is_mla:  # one latent of C values per token and layer, no V half (latent_attention.py)
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported with latent attention "
                             f"({cfg.model_type}); use 'auto'")
        halves, heads, width = cfg.kv_pool_dims
        return halves * cfg.num_layers * page_size * heads * width * itemsize
    head = kv_quant.head_page_bytes(kv_cache_dtype, itemsize, cfg.head_dim, page_size, layout)
    return cfg.num_layers * plan.kv_heads_per_device(cfg) * head
