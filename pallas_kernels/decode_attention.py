"""Paged decode attention (one query token per row) as a Pallas kernel for TPU.

Axis legend: B rows, N query heads, K kv heads, G = N // K query heads per kv head, D head dim,
P pages, S key length, C splits of the key length (flash-decoding).

Semantics: `reference.paged_attention_ref` with Tq == 1 and q_lens == 1: row b attends to keys
0..lengths[b]-1 of its pages (with a sliding window W only to keys lengths[b]-W..lengths[b]-1,
and pages wholly before those are never read); a row with lengths[b] == 0 returns zeros. A soft
cap c maps scaled scores s to c * tanh(s / c).

Each row's keys may be split into C parts that run as independent programs; each part keeps an
online softmax (running max m, running sum l, unnormalised accumulator acc) and the parts are
merged exactly afterwards with a log-sum-exp rescale (`combine_splits`). Attention sinks (gpt-oss,
a logit per query head in the denominator only) join in that merge as one more part with max
sinks[h], sum 1 and no value, so the kernel itself is the same with or without them.

The GPU family has its own kernels: `gpu_attention` (every step kind) and the Mosaic GPU decode
kernel `decode_attention_mgpu`; dispatch.py chooses.

* TPU: Mosaic TPU with `PrefetchScalarGridSpec`: lengths and the page table sit in SMEM and the
  BlockSpec index map fetches one page per grid step (Pallas double-buffers the DMAs). Interpreted on
  CPU with `pltpu.InterpretParams()`. The pool is in `layout` (kv_layout.py): the canonical
  [2, P, page_size, K, D] (K and V pages fetched apart) or the tpu layout [P, K, page_size, 2D]
  (one [K, page_size, 2D] block a page, which tiles on TPU: XLA never relays the pool out).

Quantised pool (kv_quant.QuantizedKV: int8 / fp8 values with per-(token, kv head) scales): each
K/V block comes with the matching block of scales, fetched by the same page index. Canonical
layout: bf16 [2, P, page_size, K], keys and values dequantised in the block. Tpu layout: the
page's row block [K, 1, W] of packed bf16 pairs (kv_layout.ScaleRows, `ScaleReader`); the 1-byte values enter
the products as they are (exact in the query's dtype), the key scales multiply the score columns
and the value scales P's columns. A plain pool passes no scales and traces the kernel it always did.

This module also holds the pieces the other kernels share (mask value, online-softmax step,
split merge and sink fold, version-guarded compiler params).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import kv_layout, kv_quant, tpu_target

# Finite, so a fully masked row gives exp(0) junk that is later discarded, never inf - inf = NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
BACKENDS = ("gpu", "tpu")


# ---------------------------------------------------------------- shared helpers (jax 0.10 / 0.11)
def triton_params(num_warps: int = 4, num_stages: int = 2):
    cls = getattr(pl_triton, "CompilerParams", None) or getattr(pl_triton, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


def tpu_params(dimension_semantics: tuple[str, ...]):
    cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
    return cls(dimension_semantics=dimension_semantics)


def in_hbm(x, interpret: bool):
    """x (a layer's pool or its scales) kept in HBM for a Mosaic TPU kernel that reads blocks of
    it. Left free, XLA moves operands that fit into VMEM: a quantised pool's scales (1.5 MiB a
    layer for SmolLM2) copied whole before each call that reads a few rows of them, and an int8
    layer's values (24 MiB) scattered in VMEM by the KV write and copied back."""
    constrain = getattr(pltpu, "with_memory_space_constraint", None)
    if interpret or x is None or constrain is None:
        return x
    return constrain(x, pltpu.HBM)


def hbm_shape(x):
    """A Mosaic TPU kernel's output of x's shape and dtype, declared in HBM: an output this small
    (a quantised pool's scales, aliased to its input) XLA would otherwise place in VMEM and copy
    back to a fresh HBM buffer after the call."""
    hbm = getattr(pltpu, "HBM", None)
    return hbm(x.shape, x.dtype) if hbm is not None else jax.ShapeDtypeStruct(x.shape, x.dtype)


def interpret_arg(backend: str, interpret: bool):
    """What `pallas_call(interpret=...)` gets: the TPU interpreter simulates DMAs and SMEM."""
    if not interpret:
        return False
    if backend == "tpu":
        params = getattr(pltpu, "InterpretParams", None) or getattr(pl, "InterpretParams", None)
        return params() if params is not None else True
    return True


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend is {backend!r}; expected one of {BACKENDS}")


def check_window_and_cap(sliding_window: int | None, soft_cap: float | None) -> None:
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window is {sliding_window!r}; expected None or an int >= 1")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap is {soft_cap!r}; expected None or a float > 0")


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def scores_nt(q: jax.Array, k: jax.Array) -> jax.Array:
    """f32[R, S] = q [R, D] . k [S, D]^T. bf16 products are exact in f32; f32 asks for full precision."""
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    return lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def dequantize_rows(x: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """int8 / fp8 rows x [S, D] times their scales [S, 1] (kv_quant.SCALE_DTYPE), in `dtype`."""
    return (x.astype(jnp.float32) * scales).astype(dtype)


def cap_scores(s, soft_cap: float | None):
    """Gemma's attention-logit soft cap on scaled scores; identity (no op traced) when None."""
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def window_start(length, sliding_window: int | None):
    """First key a decode query at position length - 1 sees (0 without a window)."""
    return 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0)


def online_softmax_step(s, v, m_prev, l_prev, acc_prev, v_scale=None):
    """One block of flash attention.

    s: f32[R, S] scaled scores, masked entries already MASK_VALUE; v: [S, D] with rows of invalid
    keys zeroed (unused pages may hold NaN); m_prev, l_prev: f32[R, 1]; acc_prev: f32[R, D].
    v_scale: f32[1, S] per-key scales of quantised values (zero for invalid keys), applied to P's
    columns: P . (diag(v_scale) V) = (P diag(v_scale)) . V.
    """
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next)  # [R, S]
    l_next = correction * l_prev + jnp.sum(p, axis=1, keepdims=True)
    pv = lax.dot_general(
        p if v_scale is None else p * v_scale, v.astype(jnp.float32), (((1,), (0,)), ((), ())),
        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    )
    return m_next, l_next, correction * acc_prev + pv


def check_pool(kv_pages, layout, head_dim: int):
    """(pages, scales or None, KVLayout) of one layer's cache in `layout` (a kv_layout name);
    ValueError unless its shape is that layout's with head dim `head_dim`."""
    layout = kv_layout.get(layout)
    pages, scales = kv_quant.split(kv_pages)
    num_pages, page_size, num_kv_heads, kv_dim = layout.dims(pages.shape)
    if kv_dim != head_dim:
        raise ValueError(f"kv_pages has shape {pages.shape} ({layout.name} layout): head dim {kv_dim}, "
                         f"queries' {head_dim}")
    if scales is not None:
        want = (layout.scale_shape(num_pages, page_size, num_kv_heads), layout.scale_dtype)
        if (tuple(scales.shape), jnp.dtype(scales.dtype)) != want:
            raise ValueError(f"the scales are {scales.dtype}{list(scales.shape)}; a {layout.name}-layout pool of "
                             f"shape {pages.shape} has {want[1]}{list(want[0])}")
    return pages, scales, layout


def check_sinks(sinks, num_heads: int) -> None:
    """ValueError unless sinks is None or one f32 logit per query head."""
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks has shape {tuple(sinks.shape)}; expected ({num_heads},), one per query head")


def fold_sink(m, l, acc, sink):
    """(l, acc) of an online softmax (max m, sum l, unnormalised acc) with one more logit, the
    sink, in its denominator: the sink is a partial with max `sink`, sum 1 and no value.
    m, l, sink f32[..., 1]; acc f32[..., D]. A state that saw no key (l = 0) gets l = 1, acc = 0."""
    m_all = jnp.maximum(m, sink)
    alpha = jnp.exp(m - m_all)
    return alpha * l + jnp.exp(sink - m_all), alpha * acc


def combine_splits(acc, m, l, sink=None, *, in_order: bool = False):
    """Exact merge of C partial softmaxes along axis 1: acc f32[B, C, ..., D], m, l f32[B, C, ..., 1].
    sink: f32 logits broadcastable to m[:, 0] (gpt-oss; e.g. [K, G, 1]), one more term of each
    row's denominator with no value, added after the partials. in_order: the partials are summed
    one after another in segment order, an order no reduce can change (the batch-invariant
    merge); segments a row does not reach (m = MASK_VALUE, l = 0, acc = 0) add exact zeros, so C
    itself does not matter."""
    m_max = jnp.max(m, axis=1, keepdims=True)  # a max is exact in any order
    if sink is not None:
        sink = jnp.broadcast_to(sink, m_max.shape)
        m_max = jnp.maximum(m_max, sink)
    w = jnp.exp(m - m_max)  # empty splits have m = MASK_VALUE -> weight 0 (or 1 with l = 0)
    if in_order:
        l_sum, acc_sum = w[:, 0] * l[:, 0], w[:, 0] * acc[:, 0]
        for c in range(1, acc.shape[1]):
            l_sum = l_sum + w[:, c] * l[:, c]
            acc_sum = acc_sum + w[:, c] * acc[:, c]
    else:
        l_sum, acc_sum = jnp.sum(w * l, axis=1), jnp.sum(w * acc, axis=1)
    if sink is not None:
        l_sum = l_sum + jnp.exp(sink - m_max)[:, 0]
    return acc_sum / jnp.where(l_sum == 0.0, 1.0, l_sum)  # rows with no keys -> zeros


# ---------------------------------------------------------------- TPU (Mosaic TPU)
class PageReader:
    """Head h's keys and values [page_size, D] of the page block a TPU kernel got: two refs
    [page_size, K, D] in the canonical layout, one ref [K, page_size, 2D] in the tpu layout
    (kv_layout.py). Takes its refs off the front of `refs`."""

    def __init__(self, refs: list, fused: bool):
        self.fused = fused
        if fused:
            self.kv_ref = refs.pop(0)
            self.num_kv_heads, self.page_size, lanes = self.kv_ref.shape
            self.head_dim = lanes // 2
        else:
            self.k_ref, self.v_ref = refs.pop(0), refs.pop(0)
            self.page_size, self.num_kv_heads, self.head_dim = self.k_ref.shape

    def __call__(self, h: int):
        if self.fused:
            d = self.head_dim
            return self.kv_ref[h, :, :d], self.kv_ref[h, :, d:]
        return self.k_ref[:, h, :], self.v_ref[:, h, :]


class ScaleReader:
    """Head h's key and value scales f32[1, page_size] of the page block a TPU kernel got: one
    row block [K, 1, W] of the tpu layout's scale words (kv_layout.ScaleRows), the page's lanes
    rotated to the front and each word split into its pair. `page` is the physical page (a traced
    scalar)."""

    def __init__(self, ref, page, page_size: int):
        rows = kv_layout.ScaleRows(page_size)
        self.ref, self.page_size = ref, page_size
        width = rows.row_width
        self.shift = None  # one page a row: its lanes start at 0
        if rows.pages_per_row > 1:
            self.shift = lax.rem(width - lax.rem(page, rows.pages_per_row) * rows.lanes_per_page, width)

    def __call__(self, h: int):
        row = self.ref[h]  # i32[1, W]
        if self.shift is not None:
            row = pltpu.roll(row, self.shift, 1)
        return kv_layout.unpack_scale_pairs(row[:, :self.page_size])


def scale_specs(layout, page_size: int, num_kv_heads: int, page_index):
    """BlockSpecs of one page's scales (a quantised pool): K and V scales [page_size, K] apart
    (canonical; the scales passed twice) or the page's row block [K, 1, W] (tpu layout; once)."""
    if layout.name == "tpu":
        rows = kv_layout.ScaleRows(page_size)
        return [pl.BlockSpec((num_kv_heads, None, 1, rows.row_width),
                             lambda *a: (0, page_index(*a) // rows.pages_per_row, 0, 0))]
    block = (None, None, page_size, num_kv_heads)
    return [pl.BlockSpec(block, lambda *a: (0, page_index(*a), 0, 0)),
            pl.BlockSpec(block, lambda *a: (1, page_index(*a), 0, 0))]


def page_specs(layout, page_size: int, num_kv_heads: int, head_dim: int, page_index):
    """BlockSpecs of one page of the pool: K and V (canonical layout; the pool is passed twice) or
    the one fused block (tpu layout; passed once). page_index(*grid_and_prefetch) -> the physical page."""
    if layout.name == "tpu":
        block = (None, num_kv_heads, page_size, 2 * head_dim)
        return [pl.BlockSpec(block, lambda *a: (page_index(*a), 0, 0, 0))]
    block = (None, None, page_size, num_kv_heads, head_dim)
    return [pl.BlockSpec(block, lambda *a: (0, page_index(*a), 0, 0, 0)),
            pl.BlockSpec(block, lambda *a: (1, page_index(*a), 0, 0, 0))]


def _page_slot(b, c, p, lens_ref, *, page_size, pages_per_split, pages_per_row, sliding_window):
    """Flat page-table index fetched at grid step (b, c, p); past the row's end it repeats the
    last used page, and before its window the window's first page, so Pallas skips the DMA (same
    block index) and never reads a stray or released page."""
    used = jnp.maximum(pl.cdiv(lens_ref[b], page_size) - 1, 0)
    page = c * pages_per_split + p
    if sliding_window is not None:
        # lax.div: both operands are >= 0; a floor division would lower through lax.sign
        page = jnp.maximum(page, lax.div(window_start(lens_ref[b], sliding_window), page_size))
    return b * pages_per_row + jnp.minimum(page, used)


def _decode_kernel_tpu(
    lens_ref,  # SMEM i32[B]
    pt_ref,  # SMEM i32[B * pages_per_row]
    q_ref,  # [K, G, D]
    *refs,  # canonical layout: k_ref, v_ref [page_size, K, D] one page; tpu layout: kv_ref
    # [K, page_size, 2D] one page (K | V on lanes); quantised: the page's scales (canonical:
    # ks_ref, vs_ref [page_size, K]; tpu layout: one row block [K, 1, W], ScaleReader); then the
    # outputs: acc_ref f32[K, G, D] resident across the page axis, m_ref f32[K, G, 1], l_ref f32[K, G, 1]
    sm_scale: float, pages_per_split: int, sliding_window: int | None, soft_cap: float | None,
    quantized: bool = False, fused: bool = False, page_of=None,
):
    refs = list(refs)
    page_rows = PageReader(refs, fused)
    b, c, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page_size, num_kv_heads = page_rows.page_size, page_rows.num_kv_heads
    ks_ref = vs_ref = scale_rows = None
    if quantized and fused:
        scale_rows = ScaleReader(refs.pop(0), page_of(b, c, p, lens_ref, pt_ref), page_size)
    elif quantized:
        ks_ref, vs_ref = refs.pop(0), refs.pop(0)
    acc_ref, m_ref, l_ref = refs

    @pl.when(p == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros_like(l_ref)

    length = lens_ref[b]
    lo = window_start(length, sliding_window)
    first_key = (c * pages_per_split + p) * page_size

    @pl.when((first_key < length) & (first_key + page_size > lo))
    def _compute():
        key_row = first_key + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
        key_col = first_key + lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)
        valid_row = (key_row < length) & (key_row >= lo)
        valid_col = (key_col < length) & (key_col >= lo)
        for h in range(num_kv_heads):  # K is small and static
            k, v = page_rows(h)  # [page_size, D] each
            q = q_ref[h]
            v_scale = None
            if scale_rows is not None:  # scales on the score columns and on P's columns
                k_scale, v_scale = scale_rows(h)  # f32[1, page_size] each
                raw = scores_nt(q, k.astype(q.dtype)) * k_scale  # int8 / fp8 values are exact in q's dtype
                v_scale = jnp.where(valid_row, v_scale, 0.0)  # unused slots' scales may be NaN
            else:
                if quantized:  # dequantise the page's rows: [page_size, D] * [page_size, 1]
                    k = dequantize_rows(k, ks_ref[:, h:h + 1], q.dtype)
                    v = v.astype(jnp.float32) * vs_ref[:, h:h + 1]
                raw = scores_nt(q, k)
            s = jnp.where(valid_row, cap_scores(raw * sm_scale, soft_cap), MASK_VALUE)
            v = jnp.where(valid_col, v, jnp.zeros_like(v))
            m, l, acc = online_softmax_step(s, v, m_ref[h], l_ref[h], acc_ref[h], v_scale)
            m_ref[h] = m
            l_ref[h] = l
            acc_ref[h] = acc


def _decode_tpu(q4, kv_pages, table, lengths, scales, *, sm_scale, num_splits, interpret, sliding_window,
                soft_cap, layout):
    batch, num_kv_heads, group, head_dim = q4.shape  # [B, K, G, D]
    _, page_size, _, _ = layout.dims(kv_pages.shape)
    pages_per_row = table.shape[1]
    pages_per_split = pages_per_row // num_splits
    slot = functools.partial(
        _page_slot, page_size=page_size, pages_per_split=pages_per_split, pages_per_row=pages_per_row,
        sliding_window=sliding_window,
    )
    page_of = lambda b, c, p, lens, pt: pt[slot(b, c, p, lens)]  # noqa: E731
    pool_specs = page_specs(layout, page_size, num_kv_heads, head_dim, page_of)
    out_block = (None, None, num_kv_heads, group)
    split_out = (batch, num_splits, num_kv_heads, group)
    quantized = scales is not None
    # the page's scales, fetched by the same index as its values
    scale_block_specs = scale_specs(layout, page_size, num_kv_heads, page_of) if quantized else []
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(batch, num_splits, pages_per_split),
        in_specs=[
            pl.BlockSpec((None, num_kv_heads, group, head_dim), lambda b, c, p, lens, pt: (b, 0, 0, 0)),
            *pool_specs,
            *scale_block_specs,
        ],
        out_specs=[
            pl.BlockSpec((*out_block, head_dim), lambda b, c, p, lens, pt: (b, c, 0, 0, 0)),
            pl.BlockSpec((*out_block, 1), lambda b, c, p, lens, pt: (b, c, 0, 0, 0)),
            pl.BlockSpec((*out_block, 1), lambda b, c, p, lens, pt: (b, c, 0, 0, 0)),
        ],
    )
    kernel = functools.partial(_decode_kernel_tpu, sm_scale=sm_scale, pages_per_split=pages_per_split,
                               sliding_window=sliding_window, soft_cap=soft_cap, quantized=quantized,
                               fused=layout.name == "tpu", page_of=page_of)
    with tpu_target.pinned("tpu", interpret):  # lowered for the TPU this compiles for
        return pl.pallas_call(
            kernel,
            grid_spec=grid_spec,
            out_shape=[
                jax.ShapeDtypeStruct((*split_out, head_dim), jnp.float32),
                jax.ShapeDtypeStruct((*split_out, 1), jnp.float32),
                jax.ShapeDtypeStruct((*split_out, 1), jnp.float32),
            ],
            compiler_params=tpu_params(("parallel", "parallel", "arbitrary")),
            interpret=interpret_arg("tpu", interpret),
            name="paxpage_decode_attention_tpu",
        )(lengths, table.reshape(-1), q4, *[in_hbm(kv_pages, interpret)] * len(pool_specs),
          *[in_hbm(scales, interpret)] * len(scale_block_specs))


# ---------------------------------------------------------------- public wrapper
def default_num_splits(backend: str, batch: int, num_kv_heads: int, num_blocks: int) -> int:
    """GPU: enough programs to fill an H100/H200 (132 SMs) twice. TPU: one core walks the row."""
    if backend == "tpu":
        return 1
    return max(1, min(num_blocks, pl.cdiv(264, batch * num_kv_heads)))


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "num_splits", "backend", "interpret", "sliding_window", "soft_cap",
                              "layout")
)
def decode_attention(
    q: jax.Array,  # [B, N, D] f32 or bf16
    kv_pages,  # one layer's pool in `layout` (canonical [2, P, page_size, K, D], 0 = K, 1 = V; tpu
    # [P, K, page_size, 2D]), or a kv_quant.QuantizedKV in that layout
    page_indices: jax.Array,  # i32[B, pages_per_seq] logical -> physical page of row b
    lengths: jax.Array,  # i32[B] keys of row b (0 = padding row -> zeros)
    *,
    sm_scale: float,
    num_splits: int | None = None,  # C: parts of the key range run in parallel, merged by LSE
    backend: str = "tpu",
    interpret: bool = False,
    sliding_window: int | None = None,  # W: row b sees keys lengths[b]-W..lengths[b]-1
    soft_cap: float | None = None,  # c: scaled scores s -> c * tanh(s / c)
    sinks: jax.Array | None = None,  # f32[N] per query head: a logit in the denominator only
    layout: str = "canonical",  # the pool's kv_layout name
) -> jax.Array:  # [B, N, D] dtype of q
    check_backend(backend)
    if backend != "tpu":
        raise ValueError(f"backend is {backend!r}: the GPU family runs pallas_kernels.gpu_attention.paged_attention")
    check_window_and_cap(sliding_window, soft_cap)
    batch, num_heads, head_dim = q.shape
    kv_pages, scales, layout = check_pool(kv_pages, layout, head_dim)
    _, page_size, num_kv_heads, _ = layout.dims(kv_pages.shape)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    if page_indices.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(
            f"page_indices {page_indices.shape} / lengths {lengths.shape} do not match batch {batch}"
        )
    check_sinks(sinks, num_heads)
    group = num_heads // num_kv_heads
    pages_per_seq = page_indices.shape[1]
    num_blocks = pages_per_seq  # the TPU kernel streams one page per grid step
    if num_splits is None:
        num_splits = default_num_splits(backend, batch, num_kv_heads, num_blocks)
    num_splits = max(1, min(num_splits, num_blocks))
    pages_per_split = pl.cdiv(num_blocks, num_splits)
    # Padding entries point at page 0; they are never read past a row's length.
    table = jnp.pad(page_indices.astype(jnp.int32), ((0, 0), (0, num_splits * pages_per_split - pages_per_seq)))
    lengths = lengths.astype(jnp.int32)

    q4 = q.reshape(batch, num_kv_heads, group, head_dim)  # [B, K, G, D]
    acc, m, l = _decode_tpu(
        q4, kv_pages, table, lengths, scales, sm_scale=sm_scale, num_splits=num_splits, interpret=interpret,
        sliding_window=sliding_window, soft_cap=soft_cap, layout=layout,
    )
    # The sinks join in the merge (the kernel is the same with or without them).
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(num_kv_heads, group, 1)
    out = combine_splits(acc, m, l, sink)  # [B, K, G, D]
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)
