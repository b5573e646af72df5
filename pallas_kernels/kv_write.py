"""In-place KV write: store this step's K/V at their slots of one layer's pool.

Axis legend: T flat tokens, K kv heads, D head dim, P pages.
Semantics: `reference.write_kv`; slot = page_id * page_size + offset, slot -1 = padding, skipped.

The pool is aliased input -> output (`input_output_aliases`) and only the written rows are
touched; jit the caller with the pool donated and XLA updates it in place, never copying it.

GPU: Triton lowering, one program per (token, kv head) storing a [D] row through a pointer.
TPU: Mosaic TPU; slots are scalar-prefetched into SMEM, the pool stays in HBM (`pl.ANY`) and each
token's [K, D] rows are DMA'd from VMEM straight to their slot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.decode_attention import check_backend, interpret_arg, tpu_params, triton_params


def _kv_write_kernel_gpu(slots_ref, k_ref, v_ref, pool_in_ref, pool_ref, *, page_size: int):
    # slots_ref i32[T]; k_ref/v_ref [D] token t, kv head h; pool_ref [2, P, page_size, K, D] (aliased)
    del pool_in_ref  # same buffer as pool_ref
    t, h = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[t]

    @pl.when(slot >= 0)
    def _store():
        page, offset = lax.div(slot, page_size), lax.rem(slot, page_size)  # slot >= 0 here
        pool_ref[0, page, offset, h, :] = k_ref[...].astype(pool_ref.dtype)
        pool_ref[1, page, offset, h, :] = v_ref[...].astype(pool_ref.dtype)


def _kv_write_gpu(kv_pages, k, v, slots, *, interpret):
    num_tokens, num_kv_heads, head_dim = k.shape
    page_size = kv_pages.shape[2]
    full = lambda x: pl.BlockSpec(x.shape, lambda t, h: (0,) * x.ndim)
    row = pl.BlockSpec((None, None, head_dim), lambda t, h: (t, h, 0))
    return pl.pallas_call(
        functools.partial(_kv_write_kernel_gpu, page_size=page_size),
        grid=(num_tokens, num_kv_heads),
        in_specs=[full(slots), row, row, full(kv_pages)],
        out_specs=full(kv_pages),
        out_shape=jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype),
        input_output_aliases={3: 0},
        compiler_params=triton_params(num_warps=1, num_stages=1),
        interpret=interpret_arg("gpu", interpret),
        name="paxpage_kv_write_gpu",
    )(slots, k, v, kv_pages)


def _kv_write_kernel_tpu(slots_ref, k_ref, v_ref, pool_in_ref, pool_ref, sem, *, page_size: int):
    # slots_ref SMEM i32[T_pad]; k_ref/v_ref [block_t, K, D] VMEM; pool_ref HBM [2, P, page_size, K, D]
    del pool_in_ref  # same buffer as pool_ref
    block_t = k_ref.shape[0]
    t0 = pl.program_id(0) * block_t

    def copies(t):
        slot = slots_ref[t0 + t]
        page, offset = lax.div(slot, page_size), lax.rem(slot, page_size)  # slot >= 0 here
        return slot, (
            pltpu.make_async_copy(k_ref.at[t], pool_ref.at[0, page, offset], sem),
            pltpu.make_async_copy(v_ref.at[t], pool_ref.at[1, page, offset], sem),
        )

    def start(t, carry):
        slot, dmas = copies(t)

        @pl.when(slot >= 0)
        def _():
            for dma in dmas:
                dma.start()

        return carry

    def wait(t, carry):
        slot, dmas = copies(t)

        @pl.when(slot >= 0)
        def _():
            for dma in dmas:
                dma.wait()

        return carry

    # All DMAs of the block in flight at once, then drained; the shared semaphore counts bytes.
    lax.fori_loop(0, block_t, start, 0)
    lax.fori_loop(0, block_t, wait, 0)


def _kv_write_tpu(kv_pages, k, v, slots, *, block_t, interpret):
    num_tokens, num_kv_heads, head_dim = k.shape
    page_size = kv_pages.shape[2]
    num_blocks = pl.cdiv(num_tokens, block_t)
    pad = num_blocks * block_t - num_tokens
    slots = jnp.pad(slots, (0, pad), constant_values=-1)
    k = jnp.pad(k, ((0, pad), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, pad), (0, 0), (0, 0)))
    tok = pl.BlockSpec((block_t, num_kv_heads, head_dim), lambda i, slots_ref: (i, 0, 0))
    any_spec = pl.BlockSpec(memory_space=getattr(pltpu, "ANY", None) or pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(num_blocks,),
        in_specs=[tok, tok, any_spec],
        out_specs=any_spec,
        scratch_shapes=[pltpu.SemaphoreType.DMA(())],
    )
    return pl.pallas_call(
        functools.partial(_kv_write_kernel_tpu, page_size=page_size),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype),
        # Operand 3 counts the scalar-prefetch operand: (slots, k, v, kv_pages).
        input_output_aliases={3: 0},
        compiler_params=tpu_params(("arbitrary",)),
        interpret=interpret_arg("tpu", interpret),
        name="paxpage_kv_write_tpu",
    )(slots, k, v, kv_pages)


@functools.partial(jax.jit, static_argnames=("block_t", "backend", "interpret"), donate_argnums=(0,))
def write_kv(
    kv_pages: jax.Array,  # [2, P, page_size, K, D] one layer's pool; donated, updated in place
    k: jax.Array,  # [T, K, D] this step's keys, flat tokens
    v: jax.Array,  # [T, K, D]
    slot_mapping: jax.Array,  # i32[T] page_id * page_size + offset; -1 = padding, not written
    *,
    block_t: int = 8,  # TPU: tokens per grid step
    backend: str = "gpu",
    interpret: bool = False,
) -> jax.Array:  # the same pool with the T rows written
    check_backend(backend)
    two, num_pages, page_size, num_kv_heads, head_dim = kv_pages.shape
    if two != 2 or k.shape[1:] != (num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"k {k.shape} / v {v.shape} do not fit kv_pages {kv_pages.shape}; expected [T, {num_kv_heads}, {head_dim}]"
        )
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping has shape {slot_mapping.shape}; expected ({k.shape[0]},)")
    slots = slot_mapping.astype(jnp.int32)
    # Out-of-range slots would write outside the pool: treat them like padding, as the reference's
    # mode="drop" does.
    slots = jnp.where(slots < num_pages * page_size, slots, -1)
    k = k.astype(kv_pages.dtype)
    v = v.astype(kv_pages.dtype)
    if backend == "gpu":
        return _kv_write_gpu(kv_pages, k, v, slots, interpret=interpret)
    return _kv_write_tpu(kv_pages, k, v, slots, block_t=block_t, interpret=interpret)
