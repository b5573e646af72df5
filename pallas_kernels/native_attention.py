"""Paged attention as a native CPU kernel (native/paged_attention_cpu.cc, an XLA FFI custom call).

Same signature and semantics as `reference.paged_attention_ref` / `xla_attention.paged_attention_xla`
(row layout, causal, static sliding window and soft cap, GQA, optional per-head sinks). The kernel walks each (row, kv head)
pair's pages once, with an online softmax in f32, and splits the pairs across XLA's intra-op
thread pool; keys past a row's length are never read.

The library is compiled with g++ on first use into a directory the caller names (paxpage passes
its cache directory + /native), keyed by source, flags, compiler, jaxlib and CPU (native/build.py),
and registered with `jax.ffi.register_ffi_target` for the CPU platform. `load` says whether that
worked; when it did not (no compiler, a failed build) it warns once and the caller uses the XLA-ops
path. Pools are f32 or bf16, or int8 / fp8 (kv_quant.QuantizedKV, canonical layout) read as stored
with their f32 or bf16 per-token scales: a key's score is scaled, and a value's weight, so no
dequantised copy of the pool is made. Other pools take the XLA-ops path.

Axis legend: B rows, Tq query tokens per row, N query heads, K kv heads, D head dim, P pages.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_quant
from pallas_kernels.native import build as native_build
from pallas_kernels.xla_attention import paged_attention_xla

TARGET = "paxpage_paged_attention_cpu"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "paged_attention_cpu.cc")
_SYMBOL = "PaxpagePagedAttentionCpu"
KV_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
QUANTISED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
SCALE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

LIBRARY = native_build.NativeLibrary(SOURCE, {TARGET: _SYMBOL}, "the native CPU attention kernel")


def load(build_dir: str, compiler: str = "g++") -> bool:
    """Builds (cached in build_dir), loads and registers the kernel once per process. False, with
    one warning per process, when it cannot be built or loaded."""
    return LIBRARY.load(build_dir, compiler)


def loaded() -> bool:
    return LIBRARY.loaded()


def paged_attention_native(
    q: jax.Array,  # [B, Tq, N, D]
    kv_pages,  # [2, P, page_size, K, D] already holding this step's K/V, or a QuantizedKV
    page_indices: jax.Array,  # i32[B, pages_per_seq]
    kv_lens: jax.Array,  # i32[B] cached tokens incl. this step's; 0 = padding row
    q_lens: jax.Array,  # i32[B] new tokens this step
    *,
    sm_scale: float,
    sliding_window: int | None = None,  # W: a query sees its last W keys (itself included)
    soft_cap: float | None = None,  # c: scores -> c * tanh(scores / c)
    sinks: jax.Array | None = None,  # f32[N] per query head: a logit in the denominator only
) -> jax.Array:  # [B, Tq, N, D]; padding query tokens are zeros
    masking = dict(sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    pages, scales = kv_quant.split(kv_pages)
    if not _native_pool(pages, scales):
        return paged_attention_xla(q, kv_pages, page_indices, kv_lens, q_lens, sm_scale=sm_scale, **masking)
    if not loaded():
        raise RuntimeError("paged_attention_native: call native_attention.load(build_dir) first")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window is {sliding_window}; it must be >= 1 or None")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap is {soft_cap}; it must be > 0 or None")
    num_heads = q.shape[2]
    if sinks is not None and sinks.shape != (num_heads,):
        raise ValueError(f"sinks has shape {sinks.shape}; expected ({num_heads},), one per query head")
    # No sinks: an empty operand, and the kernel's final normalisation is the plain one.
    sinks = jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    if scales is None:  # a plain pool: an empty scales operand
        scales = jnp.zeros((0,), jnp.float32)
    out = call(q.astype(jnp.float32), pages, scales, page_indices.astype(jnp.int32), kv_lens.astype(jnp.int32),
               q_lens.astype(jnp.int32), sinks, sm_scale=np.float32(sm_scale),
               sliding_window=np.int64(sliding_window or 0), soft_cap=np.float32(soft_cap or 0.0))
    return out.astype(q.dtype)


def _native_pool(pages, scales) -> bool:
    """Whether the kernel reads this pool: f32 / bf16 values, or int8 / fp8 values with f32 / bf16
    scales [2, P, page_size, K] (the canonical layout)."""
    if scales is None:
        return jnp.dtype(pages.dtype) in KV_DTYPES
    return (jnp.dtype(pages.dtype) in QUANTISED_DTYPES and jnp.dtype(scales.dtype) in SCALE_DTYPES
            and pages.ndim == 5 and scales.shape == pages.shape[:4])
