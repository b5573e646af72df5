"""Ragged paged attention for mixed steps (chunked prefill + decode) as a Pallas kernel for TPU.

Axis legend: T flat tokens, N query heads, K kv heads, G = N // K (Gp = G here), D head dim,
P pages, S_max sequence slots, Q = cdiv(T, block_q) query blocks, R = block_q * Gp rows of one
query block for one kv head, W = Q + S_max work items.

The GPU family runs `gpu_attention.paged_attention` for every step kind instead.

Sequence i owns flat tokens cu_q_lens[i] .. cu_q_lens[i+1]-1 (q_len = their count >= 1) and has
kv_lens[i] keys in its pages, this step's included. Its token j sits at position
kv_lens[i] - q_len + j and attends causally to keys 0..that position. Tokens past
cu_q_lens[num_seqs] return zeros. Shapes depend only on T and S_max; num_seqs is data.

The grid walks fixed query blocks of the flat token array, so every output block is written by
one run of consecutive grid steps. A block may hold tokens of
several sequences: each is attended separately and merged by a row mask. Queries are laid out
[Q, K, R, D] with row r = token * Gp + g, so the causal test needs no integer division:
key kp is visible to row r iff (kp - base) * Gp <= r, base = position of the block's token 0.
With a sliding window W also (kp - base + W) * Gp > r (i.e. kp > position - W), and key blocks
wholly before the window of the sequence's first token in the query block are never read (they
may be released pages). A soft cap c maps scaled scores s to c * tanh(s / c).

Quantised pool (kv_quant.QuantizedKV): each K/V block is read with its block of scales and
dequantised as in decode_attention.py (canonical: in the block; tpu layout: the scales on the
score columns and on P's columns). A plain pool traces the kernel it always did.

Attention sinks (gpt-oss, f32[N], a logit per query head in the denominator only): the rows'
sinks come in as one resident [K, R, 1] block, and each sequence's final normalisation folds its
sink in (a partial with max sinks[h], sum 1 and no value). Without sinks the kernel is unchanged.

Mosaic TPU: metadata and a precomputed work list (query block, sequence) are scalar-prefetch
SMEM inputs, the grid is (W, pages) and each step's page is fetched by the BlockSpec index map.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu_target
from pallas_kernels.decode_attention import (
    MASK_VALUE,
    PageReader,
    ScaleReader,
    cap_scores,
    check_backend,
    check_pool,
    check_sinks,
    check_window_and_cap,
    dequantize_rows,
    fold_sink,
    in_hbm,
    interpret_arg,
    online_softmax_step,
    page_specs,
    scale_specs,
    scores_nt,
    tpu_params,
)


def _seq_geometry(j, q_start, q_end, kv_len, *, block_q):
    """Scalars of sequence (q_start, q_end, kv_len) seen from query block j."""
    q_len = q_end - q_start
    row0 = (q_start - j * block_q)  # block-local token where the sequence starts (may be < 0)
    base = kv_len - q_len - row0  # position of block-local token 0 under this sequence
    last_tok = jnp.minimum(q_end, (j + 1) * block_q) - 1 - j * block_q
    num_keys = jnp.maximum(base + last_tok + 1, 0)  # keys the block's last token of this seq sees
    return row0, row0 + q_len, base, num_keys


def _first_key(base, row_lo, sliding_window):
    """First key any token of the sequence in this query block sees (0 without a window)."""
    if sliding_window is None:
        return 0
    return jnp.maximum(base + jnp.maximum(row_lo, 0) - sliding_window + 1, 0)


def _masked_scores(q, k, v, key0, kv_len, base, row_lo, row_hi, first_key, *, sm_scale, rows_per_tok,
                   sliding_window, soft_cap, k_scale=None):
    """Scores [R, S] with causal/window/sequence mask applied; v [S, D] with keys outside
    first_key..kv_len-1 zeroed. k_scale f32[1, S]: quantised keys' scales on the score columns."""
    rows, block_len = q.shape[0], k.shape[0]
    r = lax.broadcasted_iota(jnp.int32, (rows, block_len), 0)
    kp = key0 + lax.broadcasted_iota(jnp.int32, (rows, block_len), 1)
    visible = ((kp - base) * rows_per_tok <= r) & (r >= row_lo * rows_per_tok) & (r < row_hi * rows_per_tok)
    if sliding_window is not None:
        visible &= (kp - base + sliding_window) * rows_per_tok > r
    s = scores_nt(q, k)
    if k_scale is not None:
        s = s * k_scale  # NaN scales of unused slots are masked out below
    s = jnp.where(visible, cap_scores(s * sm_scale, soft_cap), MASK_VALUE)
    key = key0 + lax.broadcasted_iota(jnp.int32, (block_len, 1), 0)
    key_ok = (key < kv_len) & (key >= first_key)
    return s, jnp.where(key_ok, v, jnp.zeros_like(v))


def _key_row_mask(key0, block_len, kv_len, first_key):
    """bool[1, S]: the block's keys inside first_key..kv_len-1 (as a row, for per-key scales)."""
    key = key0 + lax.broadcasted_iota(jnp.int32, (1, block_len), 1)
    return (key < kv_len) & (key >= first_key)


def _row_mask(rows, row_lo, row_hi, rows_per_tok):
    r = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    return (r >= row_lo * rows_per_tok) & (r < row_hi * rows_per_tok)  # [R, 1]


# ---------------------------------------------------------------- TPU (Mosaic TPU)
def _work_geometry(w, cu_ref, kv_lens_ref, wb_ref, ws_ref, *, block_q):
    i = ws_ref[w]
    return _seq_geometry(wb_ref[w], cu_ref[i], cu_ref[i + 1], kv_lens_ref[i], block_q=block_q)


def _ragged_kernel_tpu(
    cu_ref, kv_lens_ref, pt_ref,  # SMEM i32[S_max + 1], i32[S_max], i32[S_max * pages_per_seq]
    wb_ref, ws_ref, wi_ref, wv_ref,  # SMEM i32[W]: query block, sequence, first-of-block, valid
    q_ref,  # [K, R, D]
    *refs,  # canonical layout: k_ref, v_ref [page_size, K, D] one page; tpu layout: kv_ref
    # [K, page_size, 2D] one page (K | V on lanes); quantised: the page's scales (canonical: ks_ref,
    # vs_ref [page_size, K]; tpu layout: one row block [K, 1, W], ScaleReader); with sinks: sink_ref
    # f32[K, R, 1] each row's sink logit; then o_ref [K, R, D] resident while consecutive work
    # items share the block, and VMEM scratch m_sc, l_sc, acc_sc f32[K, R, 1], f32[K, R, 1], f32[K, R, D]
    sm_scale: float, block_q: int, rows_per_tok: int, sliding_window: int | None, soft_cap: float | None,
    quantized: bool = False, sinks: bool = False, fused: bool = False, page_of=None,
):
    refs = list(refs)
    page_rows = PageReader(refs, fused)
    w, p = pl.program_id(0), pl.program_id(1)
    page_size, num_kv_heads = page_rows.page_size, page_rows.num_kv_heads
    ks_ref = vs_ref = scale_rows = None
    if quantized and fused:
        scale_rows = ScaleReader(refs.pop(0), page_of(w, p, cu_ref, kv_lens_ref, pt_ref, wb_ref, ws_ref, wi_ref,
                                                      wv_ref), page_size)
    elif quantized:
        ks_ref, vs_ref = refs.pop(0), refs.pop(0)
    sink_ref = refs.pop(0) if sinks else None
    o_ref, m_sc, l_sc, acc_sc = refs
    rows = q_ref.shape[1]
    kv_len = kv_lens_ref[ws_ref[w]]
    row_lo, row_hi, base, num_keys = _work_geometry(w, cu_ref, kv_lens_ref, wb_ref, ws_ref, block_q=block_q)
    first_key = _first_key(base, row_lo, sliding_window)

    @pl.when((p == 0) & (wi_ref[w] == 1))
    def _zero_block():
        o_ref[...] = jnp.zeros_like(o_ref)

    @pl.when(p == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros_like(l_sc)
        acc_sc[...] = jnp.zeros_like(acc_sc)

    @pl.when((wv_ref[w] == 1) & (p * page_size < num_keys) & ((p + 1) * page_size > first_key))
    def _compute():
        for h in range(num_kv_heads):  # K is small and static
            q, (k, v) = q_ref[h], page_rows(h)
            k_scale = v_scale = None
            if scale_rows is not None:  # scales on the score columns and on P's columns
                k_scale, v_scale = scale_rows(h)  # f32[1, page_size] each
                k = k.astype(q.dtype)  # int8 / fp8 values are exact in q's dtype
                key_ok = _key_row_mask(p * page_size, page_size, kv_len, first_key)
                v_scale = jnp.where(key_ok, v_scale, 0.0)  # unused slots' scales may be NaN
            elif quantized:  # dequantise the page's rows: [page_size, D] * [page_size, 1]
                k = dequantize_rows(k, ks_ref[:, h:h + 1], q.dtype)
                v = v.astype(jnp.float32) * vs_ref[:, h:h + 1]
            s, v = _masked_scores(
                q, k, v, p * page_size, kv_len, base, row_lo, row_hi,
                first_key, sm_scale=sm_scale, rows_per_tok=rows_per_tok, sliding_window=sliding_window,
                soft_cap=soft_cap, k_scale=k_scale,
            )
            m, l, acc = online_softmax_step(s, v, m_sc[h], l_sc[h], acc_sc[h], v_scale)
            m_sc[h] = m
            l_sc[h] = l
            acc_sc[h] = acc

    @pl.when((wv_ref[w] == 1) & (p == pl.num_programs(1) - 1))
    def _merge():
        in_seq = _row_mask(rows, row_lo, row_hi, rows_per_tok)
        for h in range(num_kv_heads):
            l, acc = l_sc[h], acc_sc[h]
            if sinks:
                l, acc = fold_sink(m_sc[h], l, acc, sink_ref[h])
            seq_out = acc / jnp.where(l == 0.0, 1.0, l)
            o_ref[h] = jnp.where(in_seq, seq_out, o_ref[h].astype(jnp.float32)).astype(o_ref.dtype)


def _work_list(first, last, num_q_blocks, num_slots):
    """Flatten (query block, sequence) pairs in block order; a block with no sequence gets one
    invalid item so its output is still zeroed. W = Q + S_max bounds the count."""
    count = jnp.maximum(last - first + 1, 1)  # [Q]
    ends = jnp.cumsum(count)
    w = jnp.arange(num_q_blocks + num_slots, dtype=jnp.int32)
    block = jnp.minimum(jnp.searchsorted(ends, w, side="right"), num_q_blocks - 1).astype(jnp.int32)
    local = w - (ends[block] - count[block])
    real = w < ends[-1]
    seq = first[block] + local
    valid = real & (seq <= last[block])
    seq = jnp.clip(jnp.where(valid, seq, 0), 0, num_slots - 1)
    is_first = real & (local == 0)
    return block, seq.astype(jnp.int32), is_first.astype(jnp.int32), valid.astype(jnp.int32)


def _ragged_tpu(qw, kv_pages, table, cu, kv_lens, first, last, scales, sink_rows, *, sm_scale, block_q,
                rows_per_tok, interpret, sliding_window, soft_cap, layout):
    num_q_blocks, num_kv_heads, rows, head_dim = qw.shape
    _, page_size, _, _ = layout.dims(kv_pages.shape)
    num_slots, pages_per_seq = table.shape
    wb, ws, wi, wv = _work_list(first, last, num_q_blocks, num_slots)
    geom = functools.partial(_work_geometry, block_q=block_q)

    def page_index(w, p, cu_r, kvl_r, pt_r, wb_r, ws_r, wi_r, wv_r):
        row_lo, _, base, num_keys = geom(w, cu_r, kvl_r, wb_r, ws_r)
        used = jnp.maximum(pl.cdiv(num_keys, page_size) - 1, 0)
        page = p
        if sliding_window is not None:  # before the window: its first page (released pages unread)
            # lax.div: both operands are >= 0; a floor division would lower through lax.sign
            page = jnp.maximum(p, lax.div(_first_key(base, row_lo, sliding_window), page_size))
        # Past the keys this item needs, repeat the last page: no new DMA, no stray read.
        return pt_r[ws_r[w] * pages_per_seq + jnp.minimum(page, used)]

    quantized = scales is not None
    # the page's scales, fetched by the same index as its values
    scale_block_specs = scale_specs(layout, page_size, num_kv_heads, page_index) if quantized else []
    sink_specs, sink_args = [], []
    if sink_rows is not None:  # [K, R, 1], the same block at every grid step: fetched once
        sink_specs = [pl.BlockSpec(sink_rows.shape, lambda w, p, *_: (0, 0, 0))]
        sink_args = [sink_rows]

    block_map = lambda w, p, cu_r, kvl_r, pt_r, wb_r, *_: (wb_r[w], 0, 0, 0)
    pool_specs = page_specs(layout, page_size, num_kv_heads, head_dim, page_index)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=7,
        grid=(wb.shape[0], pages_per_seq),
        in_specs=[
            pl.BlockSpec((None, num_kv_heads, rows, head_dim), block_map),
            *pool_specs,
            *scale_block_specs,
            *sink_specs,
        ],
        out_specs=pl.BlockSpec((None, num_kv_heads, rows, head_dim), block_map),
        scratch_shapes=[
            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
            pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),
        ],
    )
    kernel = functools.partial(_ragged_kernel_tpu, sm_scale=sm_scale, block_q=block_q, rows_per_tok=rows_per_tok,
                               sliding_window=sliding_window, soft_cap=soft_cap, quantized=quantized,
                               sinks=sink_rows is not None, fused=layout.name == "tpu", page_of=page_index)
    with tpu_target.pinned("tpu", interpret):  # lowered for the TPU this compiles for
        return pl.pallas_call(
            kernel,
            grid_spec=grid_spec,
            out_shape=jax.ShapeDtypeStruct(qw.shape, qw.dtype),
            # Output blocks are revisited by consecutive work items: both axes must run in order.
            compiler_params=tpu_params(("arbitrary", "arbitrary")),
            interpret=interpret_arg("tpu", interpret),
            name="paxpage_ragged_attention_tpu",
        )(cu, kv_lens, table.reshape(-1), wb, ws, wi, wv, qw, *[in_hbm(kv_pages, interpret)] * len(pool_specs),
          *[in_hbm(scales, interpret)] * len(scale_block_specs), *sink_args)


# ---------------------------------------------------------------- public wrapper
@functools.partial(
    jax.jit, static_argnames=("sm_scale", "block_q", "backend", "interpret", "sliding_window", "soft_cap",
                              "layout")
)
def ragged_paged_attention(
    q: jax.Array,  # [T, N, D] f32 or bf16, flat tokens of all sequences back to back
    kv_pages,  # one layer's pool in `layout` (decode_attention's), already holding this step's K/V
    page_indices: jax.Array,  # i32[S_max, pages_per_seq] logical -> physical page of sequence i
    cu_q_lens: jax.Array,  # i32[S_max + 1] token offsets; cu_q_lens[0] = 0
    kv_lens: jax.Array,  # i32[S_max] keys of sequence i including its new tokens
    num_seqs: jax.Array,  # i32[1] sequences in use; slots past it are ignored
    *,
    sm_scale: float,
    block_q: int | None = None,  # tokens per query block
    backend: str = "tpu",
    interpret: bool = False,
    sliding_window: int | None = None,  # W: a token at position p sees keys p - W + 1..p
    soft_cap: float | None = None,  # c: scaled scores s -> c * tanh(s / c)
    sinks: jax.Array | None = None,  # f32[N] per query head: a logit in the denominator only
    layout: str = "canonical",  # the pool's kv_layout name
) -> jax.Array:  # [T, N, D] dtype of q
    check_backend(backend)
    if backend != "tpu":
        raise ValueError(f"backend is {backend!r}: the GPU family runs pallas_kernels.gpu_attention.paged_attention")
    check_window_and_cap(sliding_window, soft_cap)
    num_tokens, num_heads, head_dim = q.shape
    kv_pages, scales, layout = check_pool(kv_pages, layout, head_dim)
    _, page_size, num_kv_heads, _ = layout.dims(kv_pages.shape)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    num_slots, pages_per_seq = page_indices.shape
    if cu_q_lens.shape != (num_slots + 1,) or kv_lens.shape != (num_slots,):
        raise ValueError(
            f"cu_q_lens {cu_q_lens.shape} / kv_lens {kv_lens.shape} do not match {num_slots} sequence slots"
        )
    check_sinks(sinks, num_heads)
    group = num_heads // num_kv_heads
    rows_per_tok = group
    block_q = block_q or 8
    pages_pad = pages_per_seq
    num_q_blocks = pl.cdiv(num_tokens, block_q)

    # Clean the metadata so that slots past num_seqs are empty and never read pages.
    slot = jnp.arange(num_slots + 1, dtype=jnp.int32)
    num = jnp.clip(num_seqs.reshape(-1)[0].astype(jnp.int32), 0, num_slots)
    cu = cu_q_lens.astype(jnp.int32)
    cu = jnp.where(slot <= num, cu, cu[num])
    kv_lens = jnp.where(slot[:-1] < num, kv_lens.astype(jnp.int32), 0)
    table = jnp.pad(page_indices.astype(jnp.int32), ((0, 0), (0, pages_pad - pages_per_seq)))
    # Sequences touching query block j: those not ending before it, starting before its end.
    block_start = jnp.arange(num_q_blocks, dtype=jnp.int32) * block_q
    first = jnp.sum(cu[None, 1:] <= block_start[:, None], axis=1).astype(jnp.int32)
    last = (jnp.sum((cu[None, :-1] < block_start[:, None] + block_q) & (slot[None, :-1] < num), axis=1) - 1)
    last = last.astype(jnp.int32)

    # [T, N, D] -> [Q, K, block_q * Gp, D], row = token * Gp + g.
    qw = jnp.pad(q, ((0, num_q_blocks * block_q - num_tokens), (0, 0), (0, 0)))
    qw = qw.reshape(num_q_blocks, block_q, num_kv_heads, group, head_dim)
    qw = jnp.pad(qw, ((0, 0), (0, 0), (0, 0), (0, rows_per_tok - group), (0, 0)))
    qw = qw.transpose(0, 2, 1, 3, 4).reshape(num_q_blocks, num_kv_heads, block_q * rows_per_tok, head_dim)
    kw = dict(sm_scale=sm_scale, block_q=block_q, rows_per_tok=rows_per_tok, interpret=interpret,
              sliding_window=sliding_window, soft_cap=soft_cap, layout=layout)
    sink_rows = None
    if sinks is not None:  # [N] -> [K, R, 1], row = token * Gp + g like qw
        sink_rows = jnp.tile(sinks.astype(jnp.float32).reshape(num_kv_heads, group), (1, block_q))[..., None]
    out = _ragged_tpu(qw, kv_pages, table, cu, kv_lens, first, last, scales, sink_rows, **kw)
    out = out.reshape(num_q_blocks, num_kv_heads, block_q, rows_per_tok, head_dim)[:, :, :, :group]
    out = out.transpose(0, 2, 1, 3, 4).reshape(num_q_blocks * block_q, num_heads, head_dim)
    return out[:num_tokens]
