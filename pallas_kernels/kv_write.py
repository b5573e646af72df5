"""In-place KV write: store this step's K/V at their slots of one layer's pool.

Axis legend: T flat tokens, K kv heads, D head dim, P pages.
Semantics: `reference.write_kv`; slot = page_id * page_size + offset, slot -1 = padding, skipped.

The pool is aliased input -> output (`input_output_aliases`) and only the written rows are
touched; jit the caller with the pool donated and XLA updates it in place, never copying it.

GPU: Triton lowering, one program per (token, kv head) storing a [D] row through a pointer.
TPU: Mosaic TPU; slots are scalar-prefetched into SMEM, the pool stays in HBM (`pl.ANY`) and each
token's [K, D] rows are DMA'd from VMEM straight to their slot. On the tpu layout (kv_layout.py)
a token's row set is an in-place XLA scatter (`_kv_write_tpu_fused` says why).

Quantised pool (kv_quant.QuantizedKV): K/V are quantised per (token, kv head) in the wrapper
(kv_quant.quantize, jnp). The GPU kernel stores each row's int8/fp8 values and its scale
(kv_quant.SCALE_DTYPE) together, both buffers aliased. On TPU the kernel stores the values and the
scales go in by an in-place XLA scatter beside it: a scale row is one 16-bit element of a tiled
[page_size, K] slab, and Mosaic DMAs only at tile-aligned offsets along it. On the tpu layout the
values go in by the fused scatter and the scales by `_write_scale_rows_tpu`: each (1, W) row of
scales the step touches is read, updated and written back whole by DMA (`KVLayout.write_scales`,
an XLA scatter of single lanes, is its reference).
A plain pool traces exactly the unquantised kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import kv_layout, kv_quant, tpu_target
from pallas_kernels.decode_attention import (check_backend, check_pool, hbm_shape, interpret_arg, tpu_params,
                                              triton_params)


def _kv_write_kernel_gpu(slots_ref, k_ref, v_ref, *refs, page_size: int, quantized: bool):
    # slots_ref i32[T]; k_ref/v_ref [D] token t, kv head h; pool_ref [2, P, page_size, K, D] (aliased).
    # Quantised: ks_ref/vs_ref [1] the row's scales, scales_ref [2, P, page_size, K, 1] (SCALE_DTYPE) (aliased).
    if quantized:
        ks_ref, vs_ref, _, _, pool_ref, scales_ref = refs  # inputs 5, 6 are the aliased buffers
    else:
        _, pool_ref = refs
    t, h = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[t]

    @pl.when(slot >= 0)
    def _store():
        page, offset = lax.div(slot, page_size), lax.rem(slot, page_size)  # slot >= 0 here
        pool_ref[0, page, offset, h, :] = k_ref[...].astype(pool_ref.dtype)
        pool_ref[1, page, offset, h, :] = v_ref[...].astype(pool_ref.dtype)
        if quantized:
            scales_ref[0, page, offset, h, :] = ks_ref[...]
            scales_ref[1, page, offset, h, :] = vs_ref[...]


def _kv_write_gpu(kv_pages, k, v, slots, scales, ks, vs, *, interpret):
    num_tokens, num_kv_heads, head_dim = k.shape
    page_size = kv_pages.shape[2]
    quantized = scales is not None
    full = lambda x: pl.BlockSpec(x.shape, lambda t, h: (0,) * x.ndim)
    row = pl.BlockSpec((None, None, head_dim), lambda t, h: (t, h, 0))
    kernel = functools.partial(_kv_write_kernel_gpu, page_size=page_size, quantized=quantized)
    if not quantized:
        return pl.pallas_call(
            kernel,
            grid=(num_tokens, num_kv_heads),
            in_specs=[full(slots), row, row, full(kv_pages)],
            out_specs=full(kv_pages),
            out_shape=jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype),
            input_output_aliases={3: 0},
            compiler_params=triton_params(num_warps=1, num_stages=1),
            interpret=interpret_arg("gpu", interpret),
            name="paxpage_kv_write_gpu",
        )(slots, k, v, kv_pages)
    # Scales get a trailing axis of 1 (a free reshape) so each program stores a [1] row as it
    # stores its [D] row: Triton blocks are power-of-two vectors, K need not be one.
    scales = scales[..., None]  # [2, P, page_size, K, 1]
    scale_row = pl.BlockSpec((None, None, 1), lambda t, h: (t, h, 0))
    pages, scales = pl.pallas_call(
        kernel,
        grid=(num_tokens, num_kv_heads),
        in_specs=[full(slots), row, row, scale_row, scale_row, full(kv_pages), full(scales)],
        out_specs=[full(kv_pages), full(scales)],
        out_shape=[jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype),
                   jax.ShapeDtypeStruct(scales.shape, scales.dtype)],
        input_output_aliases={5: 0, 6: 1},
        compiler_params=triton_params(num_warps=1, num_stages=1),
        interpret=interpret_arg("gpu", interpret),
        name="paxpage_kv_write_quantized_gpu",
    )(slots, k, v, ks[..., None], vs[..., None], kv_pages, scales)
    return pages, scales[..., 0]


def _any_spec() -> pl.BlockSpec:
    """An operand left where it is (HBM), for the kernel's own DMAs."""
    return pl.BlockSpec(memory_space=getattr(pltpu, "ANY", None) or pl.ANY)


def _kv_write_kernel_tpu(slots_ref, k_ref, v_ref, _, pool_ref, sem, *, page_size: int):
    # slots_ref SMEM i32[T_pad]; k_ref/v_ref [block_t, K, D] VMEM; pool_ref HBM [2, P, page_size, K, D]
    # (input 3 is the aliased pool). Canonical layout only (the tpu layout: _kv_write_tpu_fused).
    block_t = k_ref.shape[0]
    t0 = pl.program_id(0) * block_t

    def copies(t):
        slot = slots_ref[t0 + t]
        page, offset = lax.div(slot, page_size), lax.rem(slot, page_size)  # slot >= 0 here
        return slot, [pltpu.make_async_copy(k_ref.at[t], pool_ref.at[0, page, offset], sem),
                      pltpu.make_async_copy(v_ref.at[t], pool_ref.at[1, page, offset], sem)]

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


def _kv_write_tpu(kv_pages, k, v, slots, scales, ks, vs, *, block_t, interpret):
    num_tokens, num_kv_heads, head_dim = k.shape
    page_size = kv_pages.shape[2]
    num_blocks = pl.cdiv(num_tokens, block_t)
    pad = num_blocks * block_t - num_tokens
    padded_slots = jnp.pad(slots, (0, pad), constant_values=-1)
    k = jnp.pad(k, ((0, pad), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, pad), (0, 0), (0, 0)))
    tok = pl.BlockSpec((block_t, num_kv_heads, head_dim), lambda i, slots_ref: (i, 0, 0))
    any_spec = _any_spec()
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(num_blocks,),
        in_specs=[tok, tok, any_spec],
        out_specs=any_spec,
        scratch_shapes=[pltpu.SemaphoreType.DMA(())],
    )
    with tpu_target.pinned("tpu", interpret):  # lowered for the TPU this compiles for
        pages = pl.pallas_call(
            functools.partial(_kv_write_kernel_tpu, page_size=page_size),
            grid_spec=grid_spec,
            out_shape=jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype),
            input_output_aliases={3: 0},  # operand 3: the pool (the scalar-prefetch slots count)
            compiler_params=tpu_params(("arbitrary",)),
            interpret=interpret_arg("tpu", interpret),
            name="paxpage_kv_write_tpu",
        )(padded_slots, k, v, kv_pages)
    if scales is None:
        return pages
    return pages, kv_quant.write_scales(scales, slots, jnp.stack([ks, vs]))


def _kv_write_tpu_fused(kv_pages, k, v, slots):
    """The tpu layout [P, K, page_size, 2D] (kv_layout.py): token t's keys and values are K
    [2D] rows at (page, h, offset), an in-place XLA scatter on the donated pool. One token is one
    sublane of each (page_size, 2D) tile, below the tile-aligned offsets a Mosaic DMA takes, so
    no Pallas kernel stores it. Indexed per head, the scatter's window is one [2D] row: with a
    [K, 2D] window XLA lays a pool it may choose (a scanned step's loop carry) out with K on the
    sublanes for the scatter and copies it back for the kernels in every layer."""
    num_pages, num_kv_heads, page_size, _ = kv_pages.shape
    page = jnp.where(slots < 0, num_pages, slots // page_size)  # padding: out of bounds, dropped
    rows = jnp.concatenate([k, v], axis=-1)  # [T, K, 2D]
    heads = jnp.arange(num_kv_heads)[None, :]
    return kv_pages.at[page[:, None], heads, (slots % page_size)[:, None]].set(rows, mode="drop")


def _scale_rows_kernel_tpu(rows_ref, new_ref, _, scales_ref, held_ref, sem):
    # rows_ref SMEM i32[U_pad]: the scale row entry u updates (-1: none); new_ref VMEM [K, block,
    # 1, W] entry u's new scale words, kv_layout.NO_PAIR where the row keeps its own; scales_ref HBM [K, R, 1, W]
    # (input 2 is the aliased scales); held_ref VMEM [K, block, 1, W].
    block = held_ref.shape[1]
    u0 = pl.program_id(0) * block

    def each(store: bool, wait: bool):
        def body(u, carry):
            row = rows_ref[u0 + u]
            held, pool = held_ref.at[:, pl.ds(u, 1)], scales_ref.at[:, pl.ds(row, 1)]

            @pl.when(row >= 0)
            def _():
                dma = pltpu.make_async_copy(held, pool, sem) if store else pltpu.make_async_copy(pool, held, sem)
                dma.wait() if wait else dma.start()

            return carry

        lax.fori_loop(0, block, body, 0)

    # The rows are distinct: the block's rows loaded at once, updated, stored at once.
    each(store=False, wait=False)
    each(store=False, wait=True)
    new = new_ref[...]
    held_ref[...] = jnp.where(new == kv_layout.NO_PAIR, held_ref[...], new)
    each(store=True, wait=False)
    each(store=True, wait=True)


SCALE_ROWS_BLOCK = 32  # scale rows updated per grid step


def _write_scale_rows_tpu(scales, page_size, slots, kv_scales, *, interpret):
    """The tpu layout's scales [K, R, 1, W] (kv_layout.ScaleRows) with kv_scales [2, T, K] at
    the tokens' slots, as `KVLayout.write_scales` stores them: each row the tokens touch is read,
    updated and written back whole by DMA, in place. XLA's scatter of single lanes staged a
    layer's scales through VMEM and wrote them back to a fresh HBM buffer (a temporary of the
    scales' size per layer, for the rest of the step). kv_layout.NO_PAIR, a word no packed pair
    is, marks the lanes a row keeps."""
    rows = kv_layout.ScaleRows(page_size)
    num_kv_heads, num_rows, _, width = scales.shape
    page = jnp.maximum(slots, 0) // page_size
    row = jnp.where(slots < 0, num_rows, page // rows.pages_per_row)  # padding: row R, never written
    # The distinct rows the tokens touch (entries; at most T, and at most R + 1 with padding's)
    # and each token's entry
    size = min(slots.shape[0], num_rows + 1)
    distinct, entry = jnp.unique(row, size=size, fill_value=num_rows, return_inverse=True)
    num_entries = pl.cdiv(size, SCALE_ROWS_BLOCK) * SCALE_ROWS_BLOCK
    target = jnp.full((num_entries,), -1, jnp.int32).at[:size].set(
        jnp.where(distinct < num_rows, distinct, -1).astype(jnp.int32))
    words = kv_layout.pack_scale_pairs(kv_scales[0], kv_scales[1])  # [T, K]
    lane = rows.lane(page, jnp.maximum(slots, 0) % page_size)[:, None]  # [T, 1] against [T, K]
    head = jnp.arange(num_kv_heads)[None, :]
    at = jnp.broadcast_to(entry.reshape(-1)[:, None], words.shape)
    new = jnp.full((num_kv_heads, num_entries, 1, width), kv_layout.NO_PAIR, scales.dtype)
    new = new.at[head, at, 0, lane].set(words)
    block = (num_kv_heads, SCALE_ROWS_BLOCK, 1, width)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(num_entries // SCALE_ROWS_BLOCK,),
        in_specs=[pl.BlockSpec(block, lambda i, rows_ref: (0, i, 0, 0)),
                  _any_spec()],
        out_specs=_any_spec(),
        scratch_shapes=[pltpu.VMEM(block, scales.dtype), pltpu.SemaphoreType.DMA(())],
    )
    with tpu_target.pinned("tpu", interpret):
        return pl.pallas_call(
            _scale_rows_kernel_tpu,
            grid_spec=grid_spec,
            out_shape=hbm_shape(scales),  # in place in HBM, not staged through VMEM
            input_output_aliases={2: 0},  # operand 2: the scales (the scalar-prefetch rows count)
            compiler_params=tpu_params(("arbitrary",)),
            interpret=interpret_arg("tpu", interpret),
            name="paxpage_kv_scale_rows_tpu",
        )(target, new, scales)


@functools.partial(jax.jit, static_argnames=("block_t", "backend", "interpret", "layout"), donate_argnums=(0,))
def write_kv(
    kv_pages,  # one layer's pool in `layout` (canonical [2, P, page_size, K, D]; tpu [P, K,
    # page_size, 2D]) or a QuantizedKV of that layout; donated, updated in place
    k: jax.Array,  # [T, K, D] this step's keys, flat tokens
    v: jax.Array,  # [T, K, D]
    slot_mapping: jax.Array,  # i32[T] page_id * page_size + offset; -1 = padding, not written
    *,
    block_t: int = 8,  # TPU: tokens per grid step
    backend: str = "gpu",
    interpret: bool = False,
    layout: str = "canonical",  # the pool's kv_layout name
) -> jax.Array:  # the same pool with the T rows written
    check_backend(backend)
    kv_pages, scales, layout = check_pool(kv_pages, layout, k.shape[-1])
    num_pages, page_size, num_kv_heads, head_dim = layout.dims(kv_pages.shape)
    if layout.name == "tpu" and backend != "tpu":
        raise ValueError(f"the tpu KV layout is the TPU family's; backend is {backend!r}")
    if k.shape[1:] != (num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"k {k.shape} / v {v.shape} do not fit kv_pages {kv_pages.shape}; expected [T, {num_kv_heads}, {head_dim}]"
        )
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping has shape {slot_mapping.shape}; expected ({k.shape[0]},)")
    slots = slot_mapping.astype(jnp.int32)
    # Out-of-range slots would write outside the pool: treat them like padding, as the reference's
    # mode="drop" does.
    slots = jnp.where(slots < num_pages * page_size, slots, -1)
    if layout.name == "tpu":  # XLA scatters: keep them scatters (kv_layout.two_token_scatter)
        slots, k, v = kv_layout.two_token_scatter(slots, k, v)
    ks = vs = None
    if scales is None:
        k = k.astype(kv_pages.dtype)
        v = v.astype(kv_pages.dtype)
    else:  # quantised here, per (token, kv head); the kernels store values and scales
        (k, v), (ks, vs) = kv_quant.quantize(jnp.stack([k, v]), kv_pages.dtype)
    if layout.name == "tpu":
        pages = _kv_write_tpu_fused(kv_pages, k, v, slots)
        if scales is None:
            return pages
        return kv_quant.join(pages, _write_scale_rows_tpu(scales, page_size, slots, jnp.stack([ks, vs]),
                                                          interpret=interpret))
    if backend == "gpu":
        out = _kv_write_gpu(kv_pages, k, v, slots, scales, ks, vs, interpret=interpret)
    else:
        out = _kv_write_tpu(kv_pages, k, v, slots, scales, ks, vs, block_t=block_t, interpret=interpret)
    return out if scales is None else kv_quant.join(*out)
