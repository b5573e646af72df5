"""Decoder layers under one `lax.scan`: stacked per-layer params and a stacked KV pool.

An unrolled stack of L layers traces, lowers and compiles L copies of the layer, so a step
shape's compile time grows with depth (SmolLM2, 30 layers: ~12 s on CPU against ~2.7 s for one
layer). Under a scan the layer is compiled once and the loop runs it L times.

Layers are scanned in groups of `period` consecutive layers when the layer kinds repeat with
that period (Llama / Mistral / Qwen: period 1; Gemma's local/global pattern: its period), so
every static choice inside a layer (its window, its RoPE base, dense or sparse MLP) is fixed
within the scanned body. Models whose kinds do not repeat (MoE models mixing dense and sparse
MLPs, a window pattern that does not divide the depth) keep the unrolled loop.

Layout:
- params: `layers_{i}` subtrees are replaced by one `layers` subtree {"0": ..., "period-1": ...},
  whose entry j stacks layers j, j + period, ... on a new leading axis [G, ...] (G = L / period
  groups). Any leaf a layer has stacks the same way (tree_map), quantized scales included.
- KV pool: every leaf of one layer's pool [2, P, ...] becomes [2, L, P, ...]. The scanned step
  views it as [2, L * P, ...] (a free reshape) and shifts layer l's page ids by l * P, so the
  attention and the KV write index one big pool with unchanged signatures and no layer's pages
  are ever sliced out (a per-layer dynamic slice would copy the layer's pages every layer).
  A pool whose page axis leads (the TPU kernels' layout, [P, K, page_size, 2D], and its scale
  rows, which index pages by their global id: pallas_kernels/kv_layout.py) is made in that
  merged form from the start, one pool of L * P pages: it has no layer axis to merge, and its
  scale rows would need P padded to whole rows to take one.

Axis legend: L layers, G groups of `period` layers, P pages per layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig

STACKED_KEY = "layers"
# The variable collection that holds a scanned stack's custom-call operands whole, every group's
# (`variables`): XLA copies a group's slice before a custom call takes it. Its leaves: kernels in
# column panels, quantised ones too (models/panel_layout.py), and LoRA slabs (paxpage/lora_slab.py).
WHOLE = "stacked_whole"
WHOLE_LEAVES = ("kernel_panels", "kernel_panels_q", "kernel_panels_scale", "kernel_panels_offset", "lora_a",
                "lora_b")


def _layer_kind(cfg: ModelConfig, layer: int) -> tuple:
    """Every static property that makes one layer's traced code differ from another's."""
    return (cfg.layer_window(layer), cfg.is_moe_layer(layer))


def scan_period(cfg: ModelConfig) -> int | None:
    """The shortest period p (dividing L) with which the layer kinds repeat, or None when the
    stack cannot be scanned: no such p with at least two groups."""
    num_layers = cfg.num_layers
    kinds = [_layer_kind(cfg, i) for i in range(num_layers)]
    for period in range(1, num_layers // 2 + 1):
        if num_layers % period == 0 and all(kinds[i] == kinds[i % period] for i in range(num_layers)):
            return period
    return None


def stack_layers(params: dict, num_layers: int, period: int, stack: Callable = jnp.stack) -> dict:
    """params with `layers_{i}` replaced by the stacked `layers` subtree (see the module doc).
    `stack`: jnp.stack (device arrays) or np.stack (host arrays, before sharding)."""
    assert num_layers % period == 0, (num_layers, period)
    out = {k: v for k, v in params.items() if not k.startswith("layers_")}
    assert len(out) + num_layers == len(params), "unexpected layers_* keys"
    out[STACKED_KEY] = {
        str(j): jax.tree.map(lambda *xs: stack(xs), *[params[f"layers_{i}"]
                                                     for i in range(j, num_layers, period)])
        for j in range(period)}
    return out


def stack_consuming(params: dict, num_layers: int, period: int) -> dict:
    """`stack_layers` (device arrays) that takes the per-layer subtrees out of `params` and lets go
    of each layer's leaf as soon as it is stacked: loading a model into the stacked form holds one
    weight's layers twice at a time, not every weight. `params` is emptied of its `layers_{i}`;
    the caller holds no other reference to them."""
    assert num_layers % period == 0, (num_layers, period)
    layers = [params.pop(f"layers_{i}") for i in range(num_layers)]
    assert not any(k.startswith("layers_") for k in params), "unexpected layers_* keys"
    out = dict(params)
    out[STACKED_KEY] = {}
    for j in range(period):
        members = list(range(j, num_layers, period))
        flat = [jax.tree_util.tree_flatten(layers[i]) for i in members]
        for i in members:
            layers[i] = None
        leaves = [f[0] for f in flat]
        stacked = []
        for k in range(len(leaves[0])):
            stacked.append(jnp.stack([group[k] for group in leaves]))
            for group in leaves:
                group[k] = None
        out[STACKED_KEY][str(j)] = jax.tree_util.tree_unflatten(flat[0][1], stacked)
    return out


def unstack_layers(params: dict, num_layers: int, host: bool = False) -> dict:
    """The inverse of `stack_layers`: per-layer `layers_{i}` subtrees again. Device arrays are
    sliced (copies); host=True gives numpy views of the stacked arrays instead (no copy on CPU,
    where a jax array's numpy form shares its buffer); jax.ShapeDtypeStructs lose their axis."""
    out = {k: v for k, v in params.items() if k != STACKED_KEY}
    out.update({f"layers_{i}": layer(params, i, host) for i in range(num_layers)})
    return out


def _group_entry(x, group: int, host: bool):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return np.asarray(x)[group] if host else x[group]


def period_of(params: dict) -> int:
    """The form a params tree is in: its stacked subtree's period, 0 for per-layer `layers_{i}`."""
    return len(params[STACKED_KEY]) if STACKED_KEY in params else 0


def restack(params: dict, num_layers: int, period: int, stack: Callable = jnp.stack,
            host: bool = False) -> dict:
    """`params` (per-layer, or stacked with any period) in the form of `period` (0: per-layer).
    The very same tree when it is in that form already; `stack` and `host` as in `stack_layers`
    and `unstack_layers`."""
    have = period_of(params)
    if have == period:
        return params
    if have:
        params = unstack_layers(params, num_layers, host=host)
    return stack_layers(params, num_layers, period, stack) if period else params


def layer(params: dict, index: int, host: bool = False) -> dict:
    """Layer `index`'s subtree from params in either form (stacked: sliced as `unstack_layers`)."""
    period = period_of(params)
    if not period:
        return params[f"layers_{index}"]
    return jax.tree.map(lambda x: _group_entry(x, index // period, host), params[STACKED_KEY][str(index % period)])


def stacked_pool_shape(layer_shape: tuple[int, ...], num_layers: int, merged: bool = False) -> tuple[int, ...]:
    """[2, P, ...] of one layer's pool leaf -> [2, L, P, ...] of the stacked pool; merged (a
    layout whose page axis leads, [P, ...]): [L * P, ...], the pool in the form the scan views it."""
    if merged:
        return (num_layers * layer_shape[0],) + tuple(layer_shape[1:])
    return (layer_shape[0], num_layers) + tuple(layer_shape[1:])


def is_merged(pool) -> bool:
    """Whether a stacked pool was made merged (stacked_pool_shape): its values leaf is the TPU
    layout's 4-D [L * P, K, page_size, 2D] (a stacked canonical one is 6-D [2, L, P, page_size, K, D])."""
    return jax.tree.leaves(pool)[0].ndim == 4


def pool_geometry(pool, num_layers: int) -> tuple[int, int]:
    """(pages per layer, page size) of a stacked pool, in either form."""
    leaf = jax.tree.leaves(pool)[0]
    if is_merged(pool):  # [L * P, K, page_size, 2D]
        return leaf.shape[0] // num_layers, leaf.shape[2]
    return leaf.shape[2], leaf.shape[3]


def merge_pool(pool):
    """[2, L, P, ...] -> [2, L * P, ...] for every leaf (a reshape: no copy); a merged pool as it is."""
    if is_merged(pool):
        return pool
    return jax.tree.map(lambda a: a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:]), pool)


def split_pool(pool, num_layers: int, merged: bool = False):
    """The inverse of `merge_pool` (merged: the pool was made merged, and stays so)."""
    if merged:
        return pool
    return jax.tree.map(lambda a: a.reshape(a.shape[0], num_layers, a.shape[1] // num_layers,
                                            *a.shape[2:]), pool)


def every_layer(src: jax.Array, dst: jax.Array, num_layers: int, pages_per_layer: int):
    """Page copies src -> dst (i32[C], pages of one layer) as copies in a merged pool of every
    layer's pages: i32[L * C] each; a dst past the layer (padding) goes past the whole pool."""
    offsets = (jnp.arange(num_layers, dtype=src.dtype) * pages_per_layer)[:, None]
    total = num_layers * pages_per_layer
    dst = jnp.where(dst[None, :] < pages_per_layer, dst[None, :] + offsets, total)
    return (src[None, :] + offsets).reshape(-1), dst.reshape(-1)


def shift_pages(batch, page_offset, page_size: int):
    """The batch as layer l sees the merged pool: page ids + l * P, slots + l * P * page_size
    (padding slots, -1, stay -1 so their writes are still dropped)."""
    slots = batch.slot_mapping
    return dataclasses.replace(
        batch,
        slot_mapping=jnp.where(slots < 0, slots, slots + page_offset * page_size),
        dec_page_indices=batch.dec_page_indices + page_offset,
        pre_page_indices=batch.pre_page_indices + page_offset)


class _LayerGroup(nn.Module):
    """`period` consecutive layers: the body of the scan. `make_layer(j, name)` builds the
    group's j-th layer module (called inside this module, so it becomes its child)."""

    make_layer: Callable[[int, str], nn.Module]
    period: int
    pages_per_layer: int
    page_size: int

    @nn.compact
    def __call__(self, carry, group, batch):  # carry: (x [T, H], merged pool); group: i32[]
        x, pool = carry
        for j in range(self.period):
            layer_batch = dataclasses.replace(
                shift_pages(batch, (group * self.period + j) * self.pages_per_layer, self.page_size), scan_group=group)
            x, pool = self.make_layer(j, str(j))(x, layer_batch, pool)
        return (x, pool), None


def run_scanned(make_layer: Callable[[int, str], nn.Module], num_layers: int, period: int,
                x: jax.Array, batch: Any, kv_cache: Any):
    """Runs the layers as a scan over L / period groups. Call inside a compact method; the params
    are the caller's `layers` subtree. kv_cache: the stacked pool [2, L, P, ...] (any pytree of
    such leaves), or one made merged (the module doc). Returns (x, kv_cache)."""
    merged = is_merged(kv_cache)
    pages_per_layer, page_size = pool_geometry(kv_cache, num_layers)
    # The custom calls' operands (`variables`) go to every group whole: a group's slice would be a copy.
    scanned = nn.scan(_LayerGroup, variable_axes={"params": 0}, variable_broadcast=WHOLE,
                      split_rngs={"params": True}, in_axes=(0, nn.broadcast), length=num_layers // period)
    groups = jnp.arange(num_layers // period, dtype=jnp.int32)
    (x, pool), _ = scanned(make_layer, period, pages_per_layer, page_size, name=STACKED_KEY)(
        (x, merge_pool(kv_cache)), groups, batch)
    return x, split_pool(pool, num_layers, merged)


def host_stack(params: dict, num_layers: int, period: int) -> dict:
    """`restack` on host arrays (the sharded path stacks before placing): params in either form."""
    return restack(params, num_layers, period, stack=lambda xs: np.stack([np.asarray(x) for x in xs]), host=True)


def variables(params: dict) -> dict:
    """The variables `model.apply` takes for `params`: {"params": params}, except that a stacked
    stack's WHOLE_LEAVES (kernels in panels, LoRA slabs) go in the collection WHOLE, at the same
    paths, which `run_scanned` passes whole to every group rather than slicing each group's out:
    XLA copies a slice before a custom call takes it, every group's weights in every step. The
    layers read them by the step's group (models/layers.MatmulStep)."""
    layers = params.get(STACKED_KEY)
    if not isinstance(layers, dict):
        return {"params": params}

    def split(tree):  # (the tree without those leaves, those leaves alone: {} when it has none)
        if not isinstance(tree, dict):
            return tree, None
        rest, whole = {}, {}
        for name, value in tree.items():
            if name in WHOLE_LEAVES:
                whole[name] = value
                continue
            r, w = split(value)
            if not (isinstance(r, dict) and not r):  # a subtree of such leaves alone leaves nothing
                rest[name] = r
            if w:
                whole[name] = w
        return rest, whole

    rest, whole = split(layers)
    if not whole:
        return {"params": params}
    return {"params": {**params, STACKED_KEY: rest}, WHOLE: {STACKED_KEY: whole}}


def run_layers(make_layer: Callable[[int, str], nn.Module], num_layers: int, period: int,
               x: jax.Array, batch: Any, kv_cache: Any):
    """The decoder stack: `run_scanned` when period > 0, else the unrolled loop over layers
    `layers_{i}` with kv_cache a list of per-layer caches. Call inside a compact method.
    Returns (x, kv_cache)."""
    if period:
        return run_scanned(make_layer, num_layers, period, x, batch, kv_cache)
    new_cache = []
    for i in range(num_layers):
        x, pages = make_layer(i, f"layers_{i}")(x, batch, kv_cache[i])
        new_cache.append(pages)
    return x, new_cache
