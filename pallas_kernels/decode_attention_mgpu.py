"""Paged decode attention (one query token per row) as a Mosaic GPU Pallas kernel (Hopper).

Axis legend: B rows, N query heads, K kv heads, G = N // K query heads per kv head, D head dim,
P pages, S key length, C splits of the key length (flash-decoding), M = 64 padded query rows.

Semantics: `reference.paged_attention_ref` with Tq == 1 (same as `decode_attention.decode_attention`
with backend="gpu"): row b attends to keys 0..lengths[b]-1 of its pages; lengths[b] == 0 -> zeros.
A sliding window W limits that to keys lengths[b]-W..lengths[b]-1, and key blocks wholly before
it are neither copied nor read; a soft cap c maps scaled scores s to c * tanh(s / c).

Layout of one program (grid B x K x C, one warpgroup each):
* q's G heads of kv head h (padded to 64 rows) are TMA-copied to SMEM once.
* The split's keys are walked in blocks of BLOCK_KEYS = 64 keys (64 // page_size pages). Each page
  of a block is its own TMA copy `kv_pages[0|1, page_id, :, h, :] -> smem[slot, rows of page]`,
  the page id read as a scalar from the page table in GMEM. All 2 * pages_per_block copies of a
  block arrive on one barrier. Two slots: block i + 1 is in flight while block i is computed
  (block i - 1, the last reader of that slot, finished reading it synchronously).
* Math in registers, f32, no MMA: per query head g, scores = sum(k * q_g, D), an online softmax
  over the block, acc += sum(p * v, keys). The C splits merge exactly by log-sum-exp afterwards
  (`decode_attention.combine_splits`). Keys past the row's length (NaN page tails, stray pages)
  get MASK_VALUE scores and zeroed V rows.
* Attention sinks (gpt-oss, f32[N]) join in that merge as one more part (max sinks[h], sum 1, no
  value): the kernel is the same with or without them.

Why no wgmma: Mosaic GPU interpret mode (jax 0.10.2), the only way to run this on a CPU, executes
wgmma only with both operands as untransposed SMEM refs (`transpose_ref` fails in
`interpret.utils.to_range`: "'TransposeTransform' object has no attribute 'indices'"; a register
LHS is not accepted; `run_state`, which `ACC.init` needs, raises "Higher-order primitive
run_state"). Flash attention needs K^T for q @ k^T (or P^T / V^T for the other orientation), so
a tested wgmma formulation is not possible here. Decode is bandwidth-bound and G <= 8 rows would
fill at most 8 of wgmma's 64 rows, so the VPU formulation costs little; it also makes f32 exact
(wgmma would take f32 only as tf32). The real lowering of all of this is checked by jax.export
for "cuda" in tests/kernels/test_decode_mgpu.py; no GPU has run it yet.

Dtypes: f32, bf16, f16 (math in f32). Not int8 / fp8 pools (QUANTIZED_REASON): dispatch.py sends
those to the Triton kernel. Shapes: head_dim a multiple of 64 (128-byte swizzle tiles),
page_size in {8, 16, 32, 64}, G = N // K <= 8 (per-head carries live in registers).
layout_cast has no interpreter rule, so interpret mode skips the register-layout annotations; the
rest of the kernel is the same code. `unsupported_reason()` says whether a problem can run.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.decode_attention import (
    MASK_VALUE,
    cap_scores,
    check_sinks,
    check_window_and_cap,
    combine_splits,
    default_num_splits,
    window_start,
)

try:  # Mosaic GPU Pallas: experimental, its API moves between jax releases.
    from jax.experimental.pallas import mosaic_gpu as plgpu
except Exception as e:  # noqa: BLE001 - missing module or a broken import both mean "unavailable"
    plgpu = None
    IMPORT_ERROR: str | None = f"{type(e).__name__}: {e}"
else:
    IMPORT_ERROR = None

try:  # Not exported publicly in jax 0.10; guarded so a rename only disables interpret mode.
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except Exception:  # noqa: BLE001
    InterpretGPUParams = None

# Why quantised pools (kv_quant.QuantizedKV) go to the Triton kernel instead (dispatch.py routes them).
QUANTIZED_REASON = (
    "one page's scales of kv head h, scales[half, page, :, h], are strided by K floats, and a TMA "
    "copy needs a contiguous innermost dimension; 1-byte K/V tiles also need another swizzle and "
    "register layout than this kernel's, which no GPU has checked yet")
ROWS = 64  # the G query heads of a kv head are padded to one [64, D] register tile
BLOCK_KEYS = 64  # keys per inner block: one [64, D] tile (the WGMMA register layout's row count)
MAX_GROUP = 8  # query heads per kv head; each carries acc, m, l in registers
NUM_SLOTS = 2  # SMEM buffers per K / V: double buffering
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
PAGE_SIZES = (8, 16, 32, 64)


def unsupported_reason(q_dtype, kv_dtype, page_size: int, num_heads: int, num_kv_heads: int,
                       head_dim: int, *, interpret: bool = False) -> str | None:
    """Why the Mosaic GPU kernel cannot run this problem, or None if it can."""
    if plgpu is None:
        return f"jax.experimental.pallas.mosaic_gpu does not import ({IMPORT_ERROR})"
    if interpret and InterpretGPUParams is None:
        return "this jax has no Mosaic GPU interpret mode (InterpretGPUParams)"
    if jnp.dtype(kv_dtype).itemsize == 1:
        return f"kv dtype {jnp.dtype(kv_dtype)} (a quantised cache): {QUANTIZED_REASON}"
    if jnp.dtype(q_dtype) != jnp.dtype(kv_dtype) or jnp.dtype(q_dtype) not in map(jnp.dtype, DTYPES):
        return f"dtypes q={jnp.dtype(q_dtype)}, kv={jnp.dtype(kv_dtype)}; need equal, one of {DTYPES}"
    if page_size not in PAGE_SIZES:
        return f"page_size {page_size} not in {PAGE_SIZES}"
    if head_dim % 64:
        return f"head_dim {head_dim} is not a multiple of 64"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        return f"{num_heads} query heads per {num_kv_heads} kv heads: need a multiple, at most {MAX_GROUP} per kv head"
    return None


def interpret_arg(interpret: bool):
    return InterpretGPUParams() if interpret else None


def _kernel_fn(body, *, out_type, grid, grid_names, interpret):
    """plgpu.kernel across jax versions (`out_type` replaced `out_shape` in 0.10)."""
    params = inspect.signature(plgpu.kernel).parameters
    out_kw = "out_type" if "out_type" in params else "out_shape"
    kwargs = dict(grid=grid, grid_names=grid_names, compiler_params=plgpu.CompilerParams())
    if interpret is not None:
        kwargs["interpret"] = interpret
    return plgpu.kernel(body, **{out_kw: out_type}, **kwargs)


def _decode_body(
    lens_gmem,  # i32[B]
    table_gmem,  # i32[B, C * pages_per_split]
    q_gmem,  # [B, K, M, D] rows >= G are zero
    kv_gmem,  # [2, P, page_size, K, D]
    acc_gmem,  # f32[B, C, K, G, D]
    m_gmem,  # f32[B, C, K, G, D] (all D entries equal)
    l_gmem,  # f32[B, C, K, G, D]
    *, sm_scale: float, pages_per_split: int, group: int, interpret: bool,
    sliding_window: int | None, soft_cap: float | None,
):
    b, h, c = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("c")
    _, _, page_size, _, head_dim = kv_gmem.shape
    dtype = q_gmem.dtype
    pages_per_block = BLOCK_KEYS // page_size
    split_keys = pages_per_split * page_size
    length = lens_gmem[b]
    start = c * split_keys
    end = jnp.minimum(length, start + split_keys)
    num_blocks = jnp.where(end > start, lax.div(end - start + BLOCK_KEYS - 1, BLOCK_KEYS), 0)
    lo = window_start(length, sliding_window)
    first_block = 0
    if sliding_window is not None:  # blocks wholly before the window: released pages, never copied
        first_block = jnp.clip(lax.div(jnp.maximum(lo - start, 0), BLOCK_KEYS), 0, num_blocks)
    # 128-byte swizzle, tiles of (8 rows, 128 bytes): loads from SMEM then come in the WGMMA layout.
    swizzle_elems = 128 // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(128))
    # Register layouts: [64, D] tiles in the WGMMA layout, their row / column reductions in its
    # reduce(1) / reduce(0). The interpreter has no rule for layout_cast (layouts mean nothing
    # there), so it gets plain values.
    tile = None if interpret else plgpu.Layout.WGMMA
    cast = (lambda x, layout: x) if interpret else plgpu.layout_cast

    def iota(dim):  # i32[64, D] row or column index
        return plgpu.broadcasted_iota(jnp.int32, (BLOCK_KEYS, head_dim), dim, layout=tile)

    def bcast_rows(x):  # [D] (a column reduction) -> [64, D]
        return lax.broadcast_in_dim(x, (BLOCK_KEYS, head_dim), [1])

    def scoped(q_smem, k_smem, v_smem, out_smem, q_bar, kv_bars):
        def fetch(block, slot):
            for j in range(pages_per_block):
                page = table_gmem[b, c * pages_per_split + block * pages_per_block + j]
                rows = pl.ds(j * page_size, page_size)
                plgpu.copy_gmem_to_smem(kv_gmem.at[0, page, :, h, :], k_smem.at[slot, rows], kv_bars.at[slot])
                plgpu.copy_gmem_to_smem(kv_gmem.at[1, page, :, h, :], v_smem.at[slot, rows], kv_bars.at[slot])

        plgpu.copy_gmem_to_smem(q_gmem.at[b, h], q_smem, q_bar)

        @pl.when(num_blocks > first_block)
        def _():
            fetch(first_block, lax.rem(first_block, NUM_SLOTS))

        plgpu.barrier_wait(q_bar)
        # Head g's query as a [D] column reduction, so it broadcasts over a block's 64 keys.
        q_all = q_smem[...].astype(jnp.float32)  # [M, D]
        row = iota(0)
        qs = [jnp.sum(jnp.where(row == g, q_all, 0.0), axis=0) * sm_scale for g in range(group)]

        def body(i, carry):
            slot = lax.rem(i, NUM_SLOTS)

            @pl.when(i + 1 < num_blocks)
            def _():
                fetch(i + 1, lax.rem(i + 1, NUM_SLOTS))

            plgpu.barrier_wait(kv_bars.at[slot])
            key = i * BLOCK_KEYS + start + iota(0)  # [64, D] key position of each row
            valid = key < end
            if sliding_window is not None:
                valid &= key >= lo
            k = k_smem[slot].astype(jnp.float32)  # [64, D]
            # Keys past the end (NaN tails of pages, stray pages) must not reach p @ v: 0 * NaN.
            v = jnp.where(valid, v_smem[slot].astype(jnp.float32), 0.0)
            new_carry = []
            for g in range(group):
                acc, m_prev, l_prev = carry[g]  # [D] each; m, l constant along D
                s = cap_scores(jnp.sum(k * bcast_rows(qs[g]), axis=1), soft_cap)  # [64] this block's keys
                s = jnp.where(valid, lax.broadcast_in_dim(s, (BLOCK_KEYS, head_dim), [0]), MASK_VALUE)
                m_next = jnp.maximum(m_prev, jnp.max(s, axis=0))  # [64, D] -> [D]
                correction = jnp.exp(m_prev - m_next)
                p = jnp.exp(s - bcast_rows(m_next))  # [64, D], constant along D
                l_next = correction * l_prev + jnp.sum(p, axis=0)
                new_carry.append((correction * acc + jnp.sum(p * v, axis=0), m_next, l_next))
            return tuple(new_carry)

        def col(value):  # [D] in the layout of a column reduction of a WGMMA tile
            return cast(jnp.full((head_dim,), value, jnp.float32), plgpu.Layout.WGMMA.reduce(0))

        init = tuple((col(0.0), col(MASK_VALUE), col(0.0)) for _ in range(group))
        carry = lax.fori_loop(first_block, num_blocks, body, init)
        for which, out_gmem in enumerate((acc_gmem, m_gmem, l_gmem)):
            for g in range(group):
                out_smem[which, g] = carry[g][which]
        plgpu.commit_smem()
        for which, out_gmem in enumerate((acc_gmem, m_gmem, l_gmem)):
            plgpu.copy_smem_to_gmem(out_smem.at[which], out_gmem.at[b, c, h])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scoped,
        plgpu.SMEM((ROWS, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((NUM_SLOTS, BLOCK_KEYS, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((NUM_SLOTS, BLOCK_KEYS, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((3, group, head_dim), jnp.float32),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=2 * pages_per_block, num_barriers=NUM_SLOTS),
    )


@functools.partial(jax.jit, static_argnames=("sm_scale", "num_splits", "interpret", "sliding_window", "soft_cap"))
def decode_attention_mgpu(
    q: jax.Array,  # [B, N, D] bf16 or f16
    kv_pages: jax.Array,  # [2, P, page_size, K, D] one layer's pool (0 = K, 1 = V), dtype of q
    page_indices: jax.Array,  # i32[B, pages_per_seq] logical -> physical page of row b
    lengths: jax.Array,  # i32[B] keys of row b (0 = padding row -> zeros)
    *,
    sm_scale: float,
    num_splits: int | None = None,  # C: parts of the key range run in parallel, merged by LSE
    interpret: bool = False,
    sliding_window: int | None = None,  # W: row b sees keys lengths[b]-W..lengths[b]-1
    soft_cap: float | None = None,  # c: scaled scores s -> c * tanh(s / c)
    sinks: jax.Array | None = None,  # f32[N] per query head: a logit in the denominator only
) -> jax.Array:  # [B, N, D] dtype of q
    check_window_and_cap(sliding_window, soft_cap)
    if not hasattr(kv_pages, "shape"):  # a kv_quant.QuantizedKV
        raise ValueError(f"Mosaic GPU decode kernel cannot run a quantised KV cache: {QUANTIZED_REASON}")
    batch, num_heads, head_dim = q.shape
    two, _, page_size, num_kv_heads, kv_dim = kv_pages.shape
    if two != 2 or kv_dim != head_dim:
        raise ValueError(f"kv_pages has shape {kv_pages.shape}; expected [2, P, page_size, K, {head_dim}]")
    if page_indices.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(
            f"page_indices {page_indices.shape} / lengths {lengths.shape} do not match batch {batch}"
        )
    reason = unsupported_reason(q.dtype, kv_pages.dtype, page_size, num_heads, num_kv_heads, head_dim,
                                interpret=interpret)
    if reason:
        raise ValueError(f"Mosaic GPU decode kernel cannot run this: {reason}")
    check_sinks(sinks, num_heads)
    group = num_heads // num_kv_heads
    pages_per_block = BLOCK_KEYS // page_size
    pages_per_seq = page_indices.shape[1]
    num_blocks = pl.cdiv(pages_per_seq, pages_per_block)
    if num_splits is None:
        num_splits = default_num_splits("gpu", batch, num_kv_heads, num_blocks)
    num_splits = max(1, min(num_splits, num_blocks))
    pages_per_split = pl.cdiv(num_blocks, num_splits) * pages_per_block
    # Padding entries point at page 0: copied whole-block but masked (past every row's length).
    table = jnp.pad(page_indices.astype(jnp.int32), ((0, 0), (0, num_splits * pages_per_split - pages_per_seq)))
    q4 = q.reshape(batch, num_kv_heads, group, head_dim)
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, ROWS - group), (0, 0)))  # [B, K, M, D]
    split_out = jax.ShapeDtypeStruct((batch, num_splits, num_kv_heads, group, head_dim), jnp.float32)
    body = functools.partial(
        _decode_body, sm_scale=sm_scale, pages_per_split=pages_per_split, group=group, interpret=interpret,
        sliding_window=sliding_window, soft_cap=soft_cap,
    )
    acc, m, l = _kernel_fn(
        body,
        out_type=(split_out, split_out, split_out),
        grid=(batch, num_kv_heads, num_splits),
        grid_names=("b", "h", "c"),
        interpret=interpret_arg(interpret),
    )(lengths.astype(jnp.int32), table, q4, kv_pages)
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(num_kv_heads, group, 1)
    out = combine_splits(acc, m[..., :1], l[..., :1], sink)  # [B, K, G, D]
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)
