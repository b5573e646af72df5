"""Quantised KV cache: one layer's pool stored as int8 or float8_e4m3fn with per-(token, kv head) scales.

Axis legend: T flat tokens, K kv heads, D head dim, P pages.

One layer's cache is either a plain array [2, P, page_size, K, D] (the model's dtype; "auto") or a
`QuantizedKV(pages, scales)`: `pages` [2, P, page_size, K, D] int8 / float8_e4m3fn and `scales`
SCALE_DTYPE[2, P, page_size, K] (bf16), so that row (half, page, slot, head) holds `pages[...] * scales[...]`.
That is the canonical layout; on the TPU kernels' layout the values are [P, K, page_size, 2D]
like a plain pool and the scales packed in pairs into i32 rows [K, R, 1, 128] (kv_layout.py says where a page's
scales are). Whatever moves pages (copy-on-write, sharding over K) asks the layout how
(`KVLayout.copy_scale_pages`, `scale_head_axis`).

Quantisation is symmetric absmax per (token, kv head): scale = max|x| / QMAX, x / scale rounded
(int8) or cast (fp8, e4m3 max 448), so an outlier token only coarsens its own row. Why per token
and not per page: docs/quantisation.md gives the measured errors. An all-zero row gets
scale 0 and stores zeros (never 0 / 0).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import kv_layout

# EngineConfig.kv_cache_dtype values other than "auto" -> storage dtype.
KV_CACHE_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
# bf16 scales: 2 bytes per 64-value row, so int8 holds 128 / 66 = 1.94x bf16's tokens at head_dim
# 64, on TPU too (its layout packs a key's and a value's bf16 scale in one 32-bit word); the
# CPU's XLA-ops path holds them in f32 (1.88x). The attention error is the same to the measured precision
# (scripts/kv_quant_error.py, docs/quantisation.md). The stored scale is the one values are divided by.
SCALE_DTYPE = kv_layout.SCALE_DTYPES["canonical"]
# Largest magnitude a stored value may have: int8 127 (symmetric: -128 never used), e4m3 448.
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """One layer's quantised pool (a pytree: both fields are traced arrays)."""

    pages: jax.Array  # int8 | float8_e4m3fn [2, P, page_size, K, D] (0 = K, 1 = V); tpu layout [P, K, page_size, 2D]
    scales: jax.Array  # SCALE_DTYPE[2, P, page_size, K] dequantised row = pages[..., :] * scales[...]; tpu layout
    # i32[K, R, 1, 128], each word a bf16 (key, value) pair (kv_layout.ScaleRows)


def split(kv):
    """(pages [2, P, page_size, K, D], scales SCALE_DTYPE[2, P, page_size, K] or None) of one layer's cache."""
    return (kv.pages, kv.scales) if isinstance(kv, QuantizedKV) else (kv, None)


def join(pages, scales):
    """Inverse of `split`: the plain array when scales is None."""
    return pages if scales is None else QuantizedKV(pages, scales)


def head_page_bytes(kv_cache_dtype: str, model_itemsize: int, head_dim: int, page_size: int, layout=None) -> int:
    """Bytes one kv head's K and V take in one page of the pool, in `layout` (None: canonical),
    a quantised pool's scales included."""
    if kv_cache_dtype == "auto":
        return 2 * page_size * head_dim * model_itemsize
    values = 2 * page_size * head_dim * jnp.dtype(KV_CACHE_DTYPES[kv_cache_dtype]).itemsize
    return values + kv_layout.get(layout).scale_bytes_per_page(page_size)


def scale_form(shape, layout=None) -> tuple[tuple[int, ...], jnp.dtype]:
    """(shape, dtype) of the scales beside values of pool shape `shape` in `layout` (None:
    canonical, whose scales drop the values' last axis: a stacked [2, L, P, ...] pool's too)."""
    layout = kv_layout.get(layout)
    if layout.name == "canonical":
        return tuple(shape[:-1]), layout.scale_dtype
    num_pages, page_size, num_kv_heads, _ = layout.dims(shape)
    return layout.scale_shape(num_pages, page_size, num_kv_heads), layout.scale_dtype


def zeros(shape, kv_cache_dtype: str, model_dtype, layout=None):
    """One layer's empty cache of pool shape `shape` in `layout` (None: canonical [2, P,
    page_size, K, D]; paxpage.mesh.cache_zeros: the same, split over devices)."""
    if kv_cache_dtype == "auto":
        return jnp.zeros(shape, jnp.dtype(model_dtype))
    return QuantizedKV(jnp.zeros(shape, KV_CACHE_DTYPES[kv_cache_dtype]), jnp.zeros(*scale_form(shape, layout)))


def write_scales(scales: jax.Array, slot_mapping: jax.Array, kv_scales: jax.Array) -> jax.Array:
    """Canonical scales SCALE_DTYPE[2, P, page_size, K] with kv_scales [2, T, K] stored at token
    t's slot (page_id * page_size + offset); padding (-1) and slots past the pool are dropped
    (KVLayout.write_scales for any layout)."""
    return kv_layout.CANONICAL.write_scales(scales, scales.shape[2], slot_mapping, kv_scales)


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (values [..., D] of `dtype`, scales SCALE_DTYPE[...]) with x ~= values * scales."""
    dtype = jnp.dtype(dtype)
    qmax = QMAX[dtype]
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1)
    # Values are divided by the scale as stored, so a narrower SCALE_DTYPE stays consistent.
    scale = (amax / qmax).astype(SCALE_DTYPE)
    s32 = scale.astype(jnp.float32)
    # A zero row keeps scale 0 and stores zeros; its reciprocal is never formed.
    inv = jnp.where(s32 > 0, 1.0 / jnp.where(s32 > 0, s32, 1.0), 0.0)
    y = jnp.clip(x32 * inv[..., None], -qmax, qmax)
    if dtype == jnp.int8:
        y = jnp.round(y)
    return y.astype(dtype), scale


def dequantize(values: jax.Array, scales: jax.Array) -> jax.Array:
    """values [..., D], scales [...] -> f32[..., D]."""
    return values.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]


def dequantize_pool(kv) -> jax.Array:
    """One layer's cache as f32 [2, P, page_size, K, D] (the plain pool as it is, cast)."""
    pages, scales = split(kv)
    return pages.astype(jnp.float32) if scales is None else dequantize(pages, scales)
