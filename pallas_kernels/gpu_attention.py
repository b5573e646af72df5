"""Ragged paged attention for the GPU: one Pallas (Triton lowering) kernel for every step kind.

Axis legend: B rows, Tq query tokens per row, N query heads, K kv heads, G = N // K query heads per
kv head (Gp: G rounded up to a power of two), D head dim, P pages, S keys, C key segments,
Qb query blocks per row, R rows of one query tile (Bq tokens x Gp heads, at least 16).

Semantics and signature: `reference.paged_attention_ref` (row layout). Row b holds q_lens[b] new
tokens at positions kv_lens[b] - q_lens[b] .. kv_lens[b] - 1; a decode row has 1, a verify row a
few, a prefill chunk many. Padding tokens (and rows with q_lens[b] == 0) return zeros.

Work decomposition (grid B x K x Qb x C, one program each):
* A query tile is Bq consecutive tokens of ONE row times the Gp query heads of one kv head:
  row r of the tile is token r // Gp, head r % Gp. Tiles never straddle rows, and the G heads
  sharing a kv head read each K/V tile once.
* Keys are walked in tiles of `block_k` keys, independent of the page size: key s of row b is
  flat slot page_indices[b, s // page_size] * page_size + s % page_size of the pool viewed as
  [2, P * page_size, K, D] (a free reshape), gathered one key row (D contiguous values) at a time.
* Only the tiles a query tile can see are visited: causal (up to its last token's position), a
  sliding window (from its first token's window start) and the row's real length. That tile range
  is split into C segments of equal size computed from those REAL bounds, not the page table's
  width, so short rows in a wide table still spread over all C programs. C is static: enough
  programs to put `MIN_PROGRAMS` on the device (4 per SM of an H100/H200), capped by the table's
  width in tiles. With C > 1 each program writes its unnormalised f32 partial and running max /
  sum, merged exactly by a log-sum-exp reduce (`decode_attention.combine_splits`); with C == 1
  the program writes the normalised output directly.
* batch_invariant=True (EngineConfig.batch_invariant): a row's result must not depend on what
  else the launch holds, so nothing is derived from the batch, Tq or the table width. Segments
  have a fixed size, SPLIT_TILES tiles counted from key 0 (segment c: tiles c * SPLIT_TILES ..),
  C = enough of them to cover the table, and the partials are merged in segment order
  (`combine_splits(..., in_order=True)`); a segment the row does not reach adds exact zeros. Query tiles
  always hold TILE_ROWS // Gp tokens, so the score and P . V products have one shape.
* Scores: q . k^T on the tensor cores in q's dtype (bf16 x bf16 -> f32; f32 at full precision).
  The probabilities P are cast to the compute dtype (q's) before P . V, so bf16 pools run both
  products on bf16 tensor cores and f32 pools stay exact. A soft cap c maps scaled scores s to
  c * tanh(s / c) before the mask.
* Quantised pool (kv_quant.QuantizedKV, int8 / fp8 values with bf16 per-(token, kv head) scales):
  the stored values are cast to q's dtype (exact: int8 and e4m3 values fit in bf16), each key's
  column of scores is multiplied by its K scale, and P's columns by the V scales before P . V.
  No dequantised tile is formed.
* Attention sinks (gpt-oss, f32[N], a logit per query head in the denominator only): the sink is
  one more partial with max sinks[h], sum 1 and no value. With C == 1 it is folded into the
  program's final normalisation (an [R, 1] block of the tile rows' sinks); with C > 1 it joins the
  merge of the partials (last, in the in-order merge). Without sinks the kernel is unchanged.
* Keys outside a tile's visible range are never loaded from their pages (their slot index is
  replaced by slot 0 and the loaded values zeroed), so NaN page tails, stray table entries and
  pages released behind a sliding window do not leak.

Shapes: head_dim a power of two >= 16, page_size a power of two; any N // K. Runs in the generic
Pallas interpreter on CPU (`interpret=True`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import kv_quant
from pallas_kernels.decode_attention import (
    MASK_VALUE,
    cap_scores,
    check_sinks,
    check_window_and_cap,
    combine_splits,
    fold_sink,
    interpret_arg,
    next_pow2,
    triton_params,
)

NUM_SMS = 132  # H100 / H200
MIN_PROGRAMS = 4 * NUM_SMS  # programs a launch aims at: enough resident work to hide latency
MIN_DOT = 16  # Triton's smallest dot dimension
TILE_ROWS = 64  # query-tile rows for rows with several tokens (Bq = TILE_ROWS // Gp)
BLOCK_K = 64  # keys per K/V tile
SPLIT_TILES = 8  # batch_invariant: K/V tiles per key segment (512 keys at BLOCK_K)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static launch geometry of one call (what `scripts/kernel_report.py` prints)."""

    rows_per_tok: int  # Gp
    block_q: int  # Bq tokens per query tile
    rows: int  # R = max(16, Bq * Gp)
    num_q_blocks: int  # Qb = cdiv(Tq, Bq)
    block_k: int  # keys per K/V tile
    num_splits: int  # C
    split_tiles: int  # > 0: every segment SPLIT_TILES tiles from key 0 (batch_invariant); 0: the real range / C
    num_warps: int
    num_stages: int

    def grid(self, batch: int, num_kv_heads: int) -> tuple[int, int, int, int]:
        return (batch, num_kv_heads, self.num_q_blocks, self.num_splits)


def plan(batch: int, num_q: int, num_heads: int, num_kv_heads: int, head_dim: int, pages_per_seq: int,
         page_size: int, *, block_q: int | None = None, block_k: int | None = None,
         num_splits: int | None = None, batch_invariant: bool = False) -> Plan:
    """Launch geometry for q [B, Tq, N, D] over a page table of `pages_per_seq` pages per row.
    batch_invariant: fixed query tiles and key segments (module docstring); block_q and
    num_splits must then be left to it."""
    rows_per_tok = next_pow2(num_heads // num_kv_heads)
    if batch_invariant and (block_q is not None or num_splits is not None):
        raise ValueError(f"batch_invariant fixes block_q and num_splits; got block_q={block_q}, "
                         f"num_splits={num_splits}")
    if batch_invariant:
        block_q = max(1, TILE_ROWS // rows_per_tok)
    elif block_q is None:
        block_q = max(1, min(TILE_ROWS // rows_per_tok, next_pow2(num_q)))
    block_q = next_pow2(block_q)
    rows = max(MIN_DOT, block_q * rows_per_tok)
    num_q_blocks = pl.cdiv(num_q, block_q)
    block_k = max(MIN_DOT, next_pow2(block_k or BLOCK_K))
    max_tiles = max(1, pl.cdiv(pages_per_seq * page_size, block_k))
    programs = batch * num_kv_heads * num_q_blocks
    split_tiles = SPLIT_TILES if batch_invariant else 0
    if batch_invariant:
        num_splits = pl.cdiv(max_tiles, split_tiles)
    elif num_splits is None:
        num_splits = pl.cdiv(MIN_PROGRAMS, max(programs, 1))
    num_splits = max(1, min(num_splits, max_tiles))
    return Plan(rows_per_tok=rows_per_tok, block_q=block_q, rows=rows, num_q_blocks=num_q_blocks,
                block_k=block_k, num_splits=num_splits, split_tiles=split_tiles, num_warps=4, num_stages=2)


def _dot(a, b, contract):
    """f32 a . b contracting a's dim contract[0] with b's contract[1]; f32 inputs at full precision."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, ((contract[:1], contract[1:]), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _kernel(
    kv_lens_ref,  # i32[1] keys of row b, this step's included
    q_lens_ref,  # i32[1] new tokens of row b
    pt_ref,  # i32[pages_per_seq] row b's page table
    q_ref,  # [R, D] query tile (token r // Gp, head r % Gp)
    kv_ref,  # [2, P * page_size, K, D] the whole pool, read in place (kv head h of each key)
    *refs,  # quantised: scales_ref bf16[2, P * page_size, K]; with sinks (C == 1 only): sink_ref
    # f32[R, 1] each tile row's sink logit; then the outputs:
    # C == 1: o_ref [R, D]; C > 1: acc_ref f32[R, D], m_ref f32[R, 1], l_ref f32[R, 1]
    sm_scale: float, page_size: int, block_q: int, rows_per_tok: int, block_k: int, num_splits: int,
    split_tiles: int, sliding_window: int | None, soft_cap: float | None, quantized: bool, sinks: bool,
):
    refs = list(refs)
    scales_ref = refs.pop(0) if quantized else None
    sink_ref = refs.pop(0) if sinks else None
    out_refs = refs
    h, j, c = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    pages_per_seq = pt_ref.shape[0]
    kv_len = kv_lens_ref[0]
    q_len = q_lens_ref[0]
    q = q_ref[...]
    rows, head_dim = q.shape
    compute_dtype = q.dtype

    # Tokens of this tile and the keys they can see: [lo, hi).
    num_tok = jnp.clip(q_len - j * block_q, 0, block_q)
    pos0 = kv_len - q_len + j * block_q  # position of the tile's token 0
    hi = jnp.where(num_tok > 0, jnp.minimum(kv_len, pos0 + num_tok), 0)
    lo = 0 if sliding_window is None else jnp.clip(pos0 - sliding_window + 1, 0, hi)
    tile_lo, tile_hi = lo // block_k, pl.cdiv(hi, block_k)
    num_tiles = jnp.maximum(tile_hi - tile_lo, 0)
    if split_tiles:  # fixed segments from key 0: the same for this row in any launch
        start = jnp.maximum(tile_lo, c * split_tiles)
        end = jnp.minimum(tile_hi, (c + 1) * split_tiles)
    elif num_splits == 1:
        start, end = tile_lo, tile_lo + num_tiles
    else:  # equal segments of this tile's real range
        per_split = pl.cdiv(num_tiles, num_splits)
        start = tile_lo + c * per_split
        end = jnp.minimum(start + per_split, tile_hi)

    r = lax.broadcasted_iota(jnp.int32, (rows, block_k), 0)
    row_pos = pos0 + r // rows_per_tok  # [R, S] query position of each row
    row_real = r < num_tok * rows_per_tok

    def body(i, carry):
        m_prev, l_prev, acc_prev = carry
        key = i * block_k + lax.iota(jnp.int32, block_k)  # [S]
        key_ok = (key >= lo) & (key < hi)
        page = pt_ref[jnp.minimum(key // page_size, pages_per_seq - 1)]
        slot = jnp.where(key_ok, page * page_size + key % page_size, 0)
        k = kv_ref[0, slot, h]  # [S, D]
        v = kv_ref[1, slot, h]
        s = _dot(q, k.astype(compute_dtype), (1, 1))  # [R, S]
        if quantized:
            s = s * jnp.where(key_ok, scales_ref[0, slot, h], 0.0)[None, :]
        s = cap_scores(s * sm_scale, soft_cap)
        kp = key[None, :]
        visible = row_real & (kp <= row_pos) & (kp >= lo) & (kp < hi)
        if sliding_window is not None:
            visible &= kp > row_pos - sliding_window
        s = jnp.where(visible, s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.where(visible, jnp.exp(s - m_next), 0.0)
        l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        if quantized:
            p = p * jnp.where(key_ok, scales_ref[1, slot, h], 0.0)[None, :]
        v = jnp.where(key_ok[:, None], v.astype(compute_dtype), jnp.zeros((), compute_dtype))
        pv = _dot(p.astype(compute_dtype), v, (1, 0))  # [R, D]
        return m_next, l_next, alpha * acc_prev + pv

    init = (
        jnp.full((rows, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    m, l, acc = lax.fori_loop(start, jnp.maximum(start, end), body, init)
    if num_splits == 1:
        (o_ref,) = out_refs
        if sinks:
            l, acc = fold_sink(m, l, acc, sink_ref[...])
        o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


def _launch(qw, pool, scales, sink_rows, page_indices, kv_lens, q_lens, *, geometry: Plan, page_size, sm_scale,
            sliding_window, soft_cap, interpret):
    """sink_rows: None, or f32[K, R, 1] the sink logit of each query-tile row (head r % Gp)."""
    batch, num_kv_heads, num_q_blocks, rows, head_dim = qw.shape
    num_splits = geometry.num_splits
    quantized = scales is not None
    sink_in_kernel = sink_rows is not None and num_splits == 1  # else it joins the merge below
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, page_size=page_size, block_q=geometry.block_q,
        rows_per_tok=geometry.rows_per_tok, block_k=geometry.block_k, num_splits=num_splits,
        split_tiles=geometry.split_tiles, sliding_window=sliding_window, soft_cap=soft_cap, quantized=quantized,
        sinks=sink_in_kernel,
    )
    whole = lambda x: pl.BlockSpec(x.shape, lambda b, h, j, c: (0,) * x.ndim)  # read in place
    in_specs = [
        pl.BlockSpec((1,), lambda b, h, j, c: (b,)),
        pl.BlockSpec((1,), lambda b, h, j, c: (b,)),
        pl.BlockSpec((None, page_indices.shape[1]), lambda b, h, j, c: (b, 0)),
        pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, j, c: (b, h, j, 0, 0)),
        whole(pool),
    ]
    args = [kv_lens, q_lens, page_indices, qw, pool]
    if quantized:  # the scales, read in place like the pages
        in_specs.append(whole(scales))
        args.append(scales)
    if sink_in_kernel:  # kv head h's rows
        in_specs.append(pl.BlockSpec((None, rows, 1), lambda b, h, j, c: (h, 0, 0)))
        args.append(sink_rows)
    if num_splits == 1:
        out_specs = pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, j, c: (b, h, j, 0, 0))
        out_shape = jax.ShapeDtypeStruct(qw.shape, qw.dtype)
    else:
        split_shape = (batch, num_splits, num_kv_heads, num_q_blocks, rows)
        split_block = (None, None, None, None, rows)
        index = lambda b, h, j, c: (b, c, h, j, 0, 0)
        out_specs = [pl.BlockSpec((*split_block, head_dim), index), pl.BlockSpec((*split_block, 1), index),
                     pl.BlockSpec((*split_block, 1), index)]
        out_shape = [jax.ShapeDtypeStruct((*split_shape, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((*split_shape, 1), jnp.float32),
                     jax.ShapeDtypeStruct((*split_shape, 1), jnp.float32)]
    out = pl.pallas_call(
        kernel,
        grid=geometry.grid(batch, num_kv_heads),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_params(geometry.num_warps, geometry.num_stages),
        interpret=interpret_arg("gpu", interpret),
        name="paxpage_paged_attention_gpu",
    )(*args)
    if num_splits == 1:
        return out
    acc, m, l = out
    sink = None if sink_rows is None else sink_rows[:, None]  # [K, 1, R, 1] against [B, K, Qb, R, 1]
    return combine_splits(acc, m, l, sink, in_order=bool(geometry.split_tiles)).astype(qw.dtype)  # [B, K, Qb, R, D]


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret", "block_q", "block_k",
                              "num_splits", "batch_invariant"),
)
def paged_attention(
    q: jax.Array,  # [B, Tq, N, D] f32 / bf16; row b has q_lens[b] real tokens, the rest padding
    kv_pages,  # [2, P, page_size, K, D] one layer's pool holding this step's K/V, or a kv_quant.QuantizedKV
    page_indices: jax.Array,  # i32[B, pages_per_seq] logical -> physical page of row b
    kv_lens: jax.Array,  # i32[B] keys of row b including this step's (0 = padding row)
    q_lens: jax.Array,  # i32[B] new tokens of row b (<= kv_lens[b], <= Tq)
    *,
    sm_scale: float,
    sliding_window: int | None = None,  # W: a query at position p sees keys p - W + 1..p
    soft_cap: float | None = None,  # c: scaled scores s -> c * tanh(s / c)
    interpret: bool = False,
    block_q: int | None = None,  # Bq tokens per query tile (default: 64 rows' worth)
    block_k: int | None = None,  # keys per K/V tile (default BLOCK_K)
    num_splits: int | None = None,  # C key segments (default: `plan`)
    batch_invariant: bool = False,  # fixed query tiles and key segments (module docstring)
    sinks: jax.Array | None = None,  # f32[N] per query head: a logit in the denominator only
) -> jax.Array:  # [B, Tq, N, D] dtype of q; padding tokens are zeros
    check_window_and_cap(sliding_window, soft_cap)
    batch, num_q, num_heads, head_dim = q.shape
    pages, scales = kv_quant.split(kv_pages)
    two, num_pages, page_size, num_kv_heads, kv_dim = pages.shape
    if two != 2 or kv_dim != head_dim:
        raise ValueError(f"kv_pages has shape {pages.shape}; expected [2, P, page_size, K, {head_dim}]")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    if page_indices.shape[0] != batch or kv_lens.shape != (batch,) or q_lens.shape != (batch,):
        raise ValueError(f"page_indices {page_indices.shape}, kv_lens {kv_lens.shape}, q_lens {q_lens.shape} "
                         f"do not match {batch} rows")
    if page_size & (page_size - 1) or head_dim & (head_dim - 1) or head_dim < MIN_DOT:
        raise ValueError(f"GPU kernel needs a power-of-two page_size and head_dim >= {MIN_DOT}; "
                         f"got page_size {page_size}, head_dim {head_dim}")
    check_sinks(sinks, num_heads)
    group = num_heads // num_kv_heads
    geometry = plan(batch, num_q, num_heads, num_kv_heads, head_dim, page_indices.shape[1], page_size,
                    block_q=block_q, block_k=block_k, num_splits=num_splits, batch_invariant=batch_invariant)
    gp, bq, rows, qb = geometry.rows_per_tok, geometry.block_q, geometry.rows, geometry.num_q_blocks

    # [B, Tq, N, D] -> [B, K, Qb, R, D], row = token * Gp + head (zero padding rows).
    qw = jnp.pad(q, ((0, 0), (0, qb * bq - num_q), (0, 0), (0, 0)))
    qw = qw.reshape(batch, qb, bq, num_kv_heads, group, head_dim)
    qw = jnp.pad(qw, ((0, 0),) * 4 + ((0, gp - group), (0, 0)))
    qw = qw.transpose(0, 3, 1, 2, 4, 5).reshape(batch, num_kv_heads, qb, bq * gp, head_dim)
    qw = jnp.pad(qw, ((0, 0), (0, 0), (0, 0), (0, rows - bq * gp), (0, 0)))

    pool = pages.reshape(2, num_pages * page_size, num_kv_heads, head_dim)  # flat key slots (free)
    if scales is not None:
        scales = scales.reshape(2, num_pages * page_size, num_kv_heads)
    sink_rows = None
    if sinks is not None:  # [N] -> [K, R, 1], row = token * Gp + head like qw (padding rows: 0)
        sink_rows = jnp.pad(sinks.astype(jnp.float32).reshape(num_kv_heads, group), ((0, 0), (0, gp - group)))
        sink_rows = jnp.pad(jnp.tile(sink_rows, (1, bq)), ((0, 0), (0, rows - bq * gp)))[..., None]
    kv_lens = kv_lens.astype(jnp.int32)
    q_lens = q_lens.astype(jnp.int32)
    out = _launch(qw, pool, scales, sink_rows, page_indices.astype(jnp.int32), kv_lens, q_lens, geometry=geometry,
                  page_size=page_size, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                  interpret=interpret)  # [B, K, Qb, R, D]

    out = out[:, :, :, :bq * gp].reshape(batch, num_kv_heads, qb, bq, gp, head_dim)[:, :, :, :, :group]
    out = out.transpose(0, 2, 3, 1, 4, 5).reshape(batch, qb * bq, num_heads, head_dim)[:, :num_q]
    real = jnp.arange(num_q)[None, :] < q_lens[:, None]  # [B, Tq]
    return jnp.where(real[:, :, None, None], out, jnp.zeros((), out.dtype))
