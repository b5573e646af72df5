"""The KV write as a native CPU kernel (native/kv_write_cpu.cc, an XLA FFI custom call that
updates the pool in place): the KV write of the native and XLA-op attention paths and of a latent
pool on CPU.

Same signature and semantics as `reference.write_kv`. XLA CPU scatters a bf16 or fp8 array by
converting all of it to f32 / f16 and back, so the reference's scatter costs a bf16 pool, an
fp8 pool and a quantised pool's bf16 scales a pass over the whole pool in every layer of every
step (jax 0.10.2). The kernel copies each token's row of bytes to its slot, whatever the dtype.
A quantised pool's values are quantised here in XLA ops (`kv_quant.quantize`, as the reference
does), then the values and the scales are written by the kernel.

Built and loaded like the native attention kernel (native/build.py); when it cannot be, the
write is the reference's scatter.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels import kv_quant, latent_attention, reference
from pallas_kernels.native import build as native_build

TARGET = "paxpage_kv_write_cpu"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "kv_write_cpu.cc")
LIBRARY = native_build.NativeLibrary(SOURCE, {TARGET: "PaxpageKvWriteCpu"}, "the native CPU KV write")


def load(build_dir: str, compiler: str = "g++") -> bool:
    """Builds (cached in build_dir), loads and registers the kernel once per process; False, with
    one warning per process, when it cannot."""
    return LIBRARY.load(build_dir, compiler)


def write_slots(pool: jax.Array, rows: jax.Array, slots: jax.Array) -> jax.Array:
    """pool [H, R...] (each half R slot rows in order) with rows [H, T, W...] (W: a slot row's
    elements) at slot rows slots[t] (i32[T]; negative or past the pool: not written), in place when
    the pool is donated. The pool goes to the kernel in its own shape: reshaped, XLA copies it."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(pool.shape, pool.dtype), input_output_aliases={0: 0})
    return call(pool, rows.astype(pool.dtype), slots.astype(jnp.int32))


def write_kv(
    kv_pages,  # [2, P, page_size, K, D] one layer's pool, or a kv_quant.QuantizedKV
    k: jax.Array,  # [T, K, D] this step's keys, flat tokens
    v: jax.Array,  # [T, K, D]
    slot_mapping: jax.Array,  # i32[T] page_id * page_size + offset; -1 = padding, not written
) -> jax.Array:
    """`reference.write_kv`, each token's row copied to its slot by the native kernel."""
    if not LIBRARY.loaded():
        return reference.write_kv(kv_pages, k, v, slot_mapping)
    pages, scales = kv_quant.split(kv_pages)
    slots = slot_mapping.astype(jnp.int32)
    if scales is None:
        return write_slots(pages, jnp.stack([k, v]), slots)  # [2, T, K, D] rows
    kv, kv_scales = kv_quant.quantize(jnp.stack([k, v]), pages.dtype)  # [2, T, K, D], [2, T, K]
    return kv_quant.QuantizedKV(write_slots(pages, kv, slots), write_slots(scales, kv_scales, slots))


def write_latent(
    latent_pages: jax.Array,  # [1, P, page_size, 1, C] one layer's latent pool
    latent: jax.Array,  # [T, 1, C] this step's latents, flat tokens
    slot_mapping: jax.Array,  # i32[T] page_id * page_size + offset; -1 = padding, not written
) -> jax.Array:
    """`latent_attention.write_latent`, each token's latent copied to its slot by the native kernel."""
    if not LIBRARY.loaded():
        return latent_attention.write_latent(latent_pages, latent, slot_mapping)
    latent_attention.check_latent_rows(latent_pages, latent)
    return write_slots(latent_pages, latent[None], slot_mapping.astype(jnp.int32))
