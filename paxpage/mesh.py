"""Device meshes for tensor and data parallelism, placing arrays on them, and attention under
`shard_map` so every kernel (XLA path and Pallas) sees only its device's heads.

Mesh shape: ("data", "model") = (data_parallel_size, tensor_parallel_size) over the first
dp * tp of `jax.devices()` (global devices: every process's, under jax.distributed). Replica
i of data parallelism runs on row i, a 1-D ("model",) mesh of tp devices; the engine's step
only ever sees that 1-D mesh. On a GPU node or a TPU slice `jax.devices()` lists devices in
the order jax considers closest, so each tensor-parallel group is a row of neighbours.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.quant import cast_params
from paxpage.sharding import DATA_AXIS, MODEL_AXIS, NEW_KV_AXES, Q_AXES, ShardingPlan

try:  # jax >= 0.7 has jax.shard_map (check_vma); older releases only the experimental one
    _shard_map = jax.shard_map
    _NO_CHECK = {"check_vma": False}
except AttributeError:  # pragma: no cover - depends on the installed jax
    from jax.experimental.shard_map import shard_map as _shard_map

    _NO_CHECK = {"check_rep": False}


def shard_map(f, *, mesh: Mesh, in_specs, out_specs):
    """`jax.shard_map` without replication checks (Pallas calls carry no such rules)."""
    return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **_NO_CHECK)


def replica_meshes(tensor_parallel_size: int, data_parallel_size: int,
                   mesh: Mesh | None = None) -> list[Mesh]:
    """One 1-D ("model",) mesh per data-parallel replica.

    `mesh`, when given, must have a "model" axis of size tensor_parallel_size and, if it has a
    "data" axis, that axis's size is data_parallel_size (a mesh without one means dp = 1)."""
    tp, dp = tensor_parallel_size, data_parallel_size
    if mesh is None:
        devices = jax.devices()
        if tp * dp > len(devices):
            raise ValueError(f"tensor_parallel_size {tp} x data_parallel_size {dp} needs {tp * dp} "
                             f"devices; jax sees {len(devices)} ({devices[0].platform})")
        grid = np.array(devices[:tp * dp], dtype=object).reshape(dp, tp)
    else:
        names = tuple(mesh.axis_names)
        if MODEL_AXIS not in names or set(names) - {MODEL_AXIS, DATA_AXIS}:
            raise ValueError(f"mesh axes are {names}; expected ('{MODEL_AXIS}',) or "
                             f"('{DATA_AXIS}', '{MODEL_AXIS}')")
        sizes = dict(zip(names, mesh.devices.shape))
        if sizes[MODEL_AXIS] != tp or sizes.get(DATA_AXIS, 1) != dp:
            raise ValueError(f"mesh has {sizes}; the engine config asks for "
                             f"{MODEL_AXIS}={tp}, {DATA_AXIS}={dp}")
        grid = mesh.devices if DATA_AXIS not in names else np.moveaxis(
            mesh.devices, names.index(DATA_AXIS), 0)
        grid = grid.reshape(dp, tp)
    return [Mesh(grid[i], (MODEL_AXIS,)) for i in range(dp)]


def full_mesh(tensor_parallel_size: int, data_parallel_size: int) -> Mesh:
    """The ("data", "model") mesh over the first dp * tp devices (what `replica_meshes` splits)."""
    devices = np.array(jax.devices()[:tensor_parallel_size * data_parallel_size], dtype=object)
    return Mesh(devices.reshape(data_parallel_size, tensor_parallel_size), (DATA_AXIS, MODEL_AXIS))


def place(x, sharding: NamedSharding) -> jax.Array:
    """Puts a host or device array on `sharding`; each device receives only its shard, and it
    also works when the mesh spans other processes (each process supplies its own shards)."""
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place_abstract(x, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    """`place` for ahead-of-time compilation: the shape, dtype and sharding, no array."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def place_params(params, mesh: Mesh, plan: ShardingPlan, place_fn=place):
    from paxpage.sharding import param_specs

    specs = param_specs(plan, params)
    return jax.tree.map(lambda x, spec: place_fn(x, NamedSharding(mesh, spec)), params, specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def zeros(shape, dtype, sharding: NamedSharding) -> jax.Array:
    """A sharded zero array, created on the devices (never whole on one of them)."""
    return jax.jit(functools.partial(jax.numpy.zeros, shape, dtype), out_shardings=sharding)()


def cache_zeros(shape, kv_cache_dtype: str, dtype, sharding, layout=None) -> object:
    """One layer's empty cache (kv_quant.zeros) of pool shape `shape` in `layout` (a kv_layout;
    None: canonical), each array created with its own sharding from `sharding`, a pytree like the
    cache (shard_runner_state's pool sharding)."""
    from pallas_kernels import kv_quant

    if kv_cache_dtype == "auto":
        return zeros(shape, dtype, sharding)
    scale_shape, scale_dtype = kv_quant.scale_form(shape, layout)
    return kv_quant.QuantizedKV(zeros(shape, kv_quant.KV_CACHE_DTYPES[kv_cache_dtype], sharding.pages),
                                zeros(scale_shape, scale_dtype, sharding.scales))


def shard_attention(attention, write_kv, mesh: Mesh, plan: ShardingPlan, kv_cache_dtype: str = "auto",
                    layout=None):
    """Wraps the model's attention and KV write so each device runs them on its own heads (all
    heads when the plan replicates attention). Page tables, lengths and slots are replicated.
    A quantised cache's scales split over their K axis like the pages. A latent pool
    (plan.latent_pool) is replicated: each device attends its query heads against all of it."""
    q_spec, kv_spec = plan.spec(Q_AXES), plan.spec(NEW_KV_AXES)
    pool_spec = plan.kv_cache_spec(kv_cache_dtype, layout=layout)  # layout: the pool's kv_layout
    rep = PartitionSpec()

    def sharded_attention(q, kv_pages, page_indices, kv_lens, q_lens, *, sm_scale, sinks=None, **masking):
        # masking: the layer's sliding_window / soft_cap, static per layer like sm_scale; sinks
        # (an array, one per query head) split over the heads with q
        local = functools.partial(attention, sm_scale=sm_scale, **masking)
        if sinks is None:
            return shard_map(local, mesh=mesh, in_specs=(q_spec, pool_spec, rep, rep, rep),
                             out_specs=q_spec)(q, kv_pages, page_indices, kv_lens, q_lens)
        with_sinks = lambda q, kv, pi, kl, ql, s: local(q, kv, pi, kl, ql, sinks=s)  # noqa: E731
        return shard_map(with_sinks, mesh=mesh, in_specs=(q_spec, pool_spec, rep, rep, rep, plan.spec(("heads",))),
                         out_specs=q_spec)(q, kv_pages, page_indices, kv_lens, q_lens, sinks)

    def sharded_write_kv(kv_pages, k, v, slot_mapping):
        return shard_map(write_kv, mesh=mesh, in_specs=(pool_spec, kv_spec, kv_spec, rep),
                         out_specs=pool_spec)(kv_pages, k, v, slot_mapping)

    def sharded_write_latent(latent_pages, latent, slot_mapping):
        # the replicated latent pool: every device writes the same latents into its whole copy
        return shard_map(write_kv, mesh=mesh, in_specs=(pool_spec, rep, rep),
                         out_specs=pool_spec)(latent_pages, latent, slot_mapping)

    return sharded_attention, sharded_write_latent if plan.latent_pool else sharded_write_kv


def bytes_per_device(tree) -> dict:
    """{device: bytes} held by the arrays of `tree`, from their real shardings."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def _host_array(x, dtype=None):
    return np.asarray(x) if dtype is None else np.asarray(x).astype(dtype)


def _abstract_array(x, dtype=None):
    return jax.ShapeDtypeStruct(x.shape, x.dtype if dtype is None else dtype)


def shard_runner_state(model_cfg, params, dtype, mesh: Mesh, attention, write_kv, kv_cache_dtype: str = "auto",
                       stacked_pool: bool = False, abstract: bool = False, layout=None,
                       expert_parallel: bool = False):
    """What ModelRunner needs on a tensor-parallel mesh: (model config the step runs, plan,
    sharded params, the KV cache's sharding, a pytree like one layer's cache (each layer's
    cache: `cache_zeros(shape, kv_cache_dtype, dtype, it)`; with stacked_pool the one stacked
    [2, L, P, ...] cache), attention and write_kv under shard_map, the routed experts' function
    (paxpage/sharded_experts.py), jit kwargs of the step, jit kwargs of the page copy). Stacked
    layer params (models/layer_stack.py) keep their leading layer axis unsharded. abstract:
    `params` may be jax.ShapeDtypeStructs and the params come back as ShapeDtypeStructs with their
    shardings (nothing placed: ahead-of-time compilation).
    layout: the pool's pallas_kernels.kv_layout (None: canonical), split on its kv-head axis.
    expert_parallel: routed experts split whole over the devices (sharding.ShardingPlan)."""
    from paxpage import sharded_experts
    from paxpage.sharding import replicate_kv_heads

    plan = ShardingPlan.for_model(model_cfg, mesh.shape[MODEL_AXIS], expert_parallel)
    to_array, place_fn = (_abstract_array, place_abstract) if abstract else (_host_array, place)
    params = cast_params(params, dtype, to_array=to_array)  # quantised: int8 values, f32 scales
    params = sharded_experts.regroup(plan, replicate_kv_heads(plan, model_cfg, params))
    params = place_params(params, mesh, plan, place_fn)
    model_cfg = plan.sharded_model_config(model_cfg)
    pool = jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                        plan.kv_cache_spec(kv_cache_dtype, stacked_pool, layout),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))
    attention, write_kv = shard_attention(attention, write_kv, mesh, plan, kv_cache_dtype, layout)
    pools = pool if stacked_pool else [pool] * model_cfg.num_layers
    replicated = NamedSharding(mesh, PartitionSpec())
    step = {"out_shardings": (pools, replicated, replicated)}
    copy = {"out_shardings": pools}
    experts_fn = sharded_experts.shard_experts(mesh, plan)
    return model_cfg, plan, params, pool, attention, write_kv, experts_fn, step, copy
