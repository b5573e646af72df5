"""The KV pool's form: the arrays a step writes K/V into, and the page copy over them.

A pool is a pytree the step takes donated and returns: a list of L per-layer caches, or with
scanned layers (models/layer_stack.py) one stacked cache. Each layer's cache is
    - canonical [2, P, page_size, K, D] (0 = K, 1 = V), or the TPU kernels' [P, K, page_size, 2D]
      (pallas_kernels/kv_layout.py),
    - kv_quant.QuantizedKV(pages, scales) for an int8 / fp8 cache (values in either layout, the
      scales in that layout's form),
    - a latent-attention model's [1, P, page_size, 1, C] latent pool,
and a stacked cache has [2, L, P, ...] leaves, or in the tpu layout is one cache of L * P pages
(layer l's are l * P ..; models/layer_stack.py says why). A page copy moves a page's values and
scales alike, in every layer (`copy_pages`: along the page axis, and the tpu layout's scale rows
as the layout says).

How many pages a pool gets is kv_sizing.py's question; `KVPoolSpec` only makes one of a given size.
Axis legend: L layers, P pages, K kv heads, D head dim, C latent width.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from models import layer_stack
from models.config import ModelConfig
from pallas_kernels import kv_layout, kv_quant


@dataclasses.dataclass(frozen=True)
class KVPoolSpec:
    """What one pool looks like, for any number of pages; makes it empty, real or abstract."""

    model: ModelConfig  # the step's config (sharded: its KV heads maybe replicated)
    page_size: int
    kv_cache_dtype: str  # "auto" (the values' dtype) or a kv_quant.KV_CACHE_DTYPES name
    dtype: Any  # the values' dtype (jnp.dtype) when kv_cache_dtype is "auto"
    layout: kv_layout.KVLayout
    scanned: bool  # one stacked [2, L, P, ...] cache instead of a list of L
    sharding: Any = None  # one layer's cache sharding (mesh.shard_runner_state); None: the default device

    def copy(self, kv_cache, src, dst):
        """`copy_pages` on a pool of this spec (jit it with the pool donated); src, dst: i32[C]
        pages of a layer."""
        if self.merged:
            pages_per_layer, _ = layer_stack.pool_geometry(kv_cache, self.model.num_layers)
            src, dst = layer_stack.every_layer(src, dst, self.model.num_layers, pages_per_layer)
        return copy_pages(kv_cache, src, dst, self.page_axis, self.layout)

    @property
    def merged(self) -> bool:
        """A stacked pool made as one pool of L * P pages (a layout whose page axis leads)."""
        return self.scanned and self.layout.page_axis == 0

    @property
    def page_axis(self) -> int:
        """The axis a page copy indexes in every leaf: the layout's, or 2 in a stacked [2, L, P, ...] leaf."""
        return 2 if self.scanned and not self.merged else self.layout.page_axis

    def layer_shape(self, num_pages: int) -> tuple[int, ...]:
        """One layer's pages array shape (a quantised cache's scales drop the last axis)."""
        halves, heads, width = self.model.kv_pool_dims  # (2, K, D); latent attention (1, 1, C)
        if self.layout.name != "canonical":
            return self.layout.shape(num_pages, self.page_size, heads, width)
        return (halves, num_pages, self.page_size, heads, width)

    def zeros(self, num_pages: int):
        """An empty pool, each array created where (and split as) the step expects it."""
        return self._build(num_pages, self._layer_zeros)

    def abstract(self, num_pages: int):
        """The pool as jax.ShapeDtypeStructs with the step's shardings: for lowering, nothing allocated."""
        return self._build(num_pages, self._layer_abstract)

    def _build(self, num_pages: int, make: Callable):
        shape = self.layer_shape(num_pages)
        if self.scanned:
            return make(layer_stack.stacked_pool_shape(shape, self.model.num_layers, self.merged))
        return [make(shape) for _ in range(self.model.num_layers)]

    def _layer_zeros(self, shape):
        if self.sharding is None:
            return kv_quant.zeros(shape, self.kv_cache_dtype, self.dtype, self.layout)
        from paxpage import mesh as mesh_lib  # the sharded path only

        return mesh_lib.cache_zeros(shape, self.kv_cache_dtype, self.dtype, self.sharding, self.layout)

    def _layer_abstract(self, shape):
        cache = jax.eval_shape(lambda: kv_quant.zeros(shape, self.kv_cache_dtype, self.dtype, self.layout))
        if self.sharding is None:
            return cache
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), cache, self.sharding)


def copy_pages(kv_cache, src, dst, page_axis: int, layout=None):  # src, dst: i32[C]
    """Copies pages src -> dst in every array of the pool along `page_axis` (KVPoolSpec.page_axis);
    a quantised cache's scales in the tpu layout (`layout`, a kv_layout name or KVLayout; None:
    canonical) as that layout keeps them. A dst past the pool is dropped, so padding copies cost
    nothing."""
    layout = kv_layout.get(layout)
    lead = (slice(None),) * page_axis

    def array(pages):
        return pages.at[lead + (dst,)].set(pages[lead + (src,)], mode="drop")

    def layer(cache):
        pages, scales = kv_quant.split(cache)
        if scales is None or layout.name == "canonical":
            return jax.tree.map(array, cache)
        _, page_size, _, _ = layout.dims(pages.shape)
        return kv_quant.join(array(pages), layout.copy_scale_pages(scales, page_size, src, dst))

    return [layer(cache) for cache in kv_cache] if isinstance(kv_cache, list) else layer(kv_cache)
