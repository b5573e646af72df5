"""Paged decode attention (one query token per row) as Pallas kernels for GPU and TPU.

Axis legend: B rows, N query heads, K kv heads, G = N // K query heads per kv head (Gp: G padded
for the GPU dot), D head dim, P pages, S key length, C splits of the key length (flash-decoding).

Semantics: `reference.paged_attention_ref` with Tq == 1 and q_lens == 1: row b attends to keys
0..lengths[b]-1 of its pages (with a sliding window W only to keys lengths[b]-W..lengths[b]-1,
and pages wholly before those are never read); a row with lengths[b] == 0 returns zeros. A soft
cap c maps scaled scores s to c * tanh(s / c).

Both backends split each row's keys into C parts that run as independent programs; each part keeps
an online softmax (running max m, running sum l, unnormalised accumulator acc) and the parts are
merged exactly afterwards with a log-sum-exp rescale (`combine_splits`).

* GPU: the Triton lowering of Pallas (`jax.experimental.pallas.triton`): it gathers pages straight
  from global memory (`k_ref[page_ids]`), as jax's own GPU paged_attention does, and runs in the
  generic interpreter (`interpret=True`) on CPU. The Mosaic GPU kernel (TMA page copies into SMEM,
  barriers) is `decode_attention_mgpu`; dispatch.py chooses between the two.
* TPU: Mosaic TPU with `PrefetchScalarGridSpec`: lengths and the page table sit in SMEM and the
  BlockSpec index map fetches one page per grid step (Pallas double-buffers the DMAs). Interpreted on
  CPU with `pltpu.InterpretParams()`.

Quantised pool (kv_quant.QuantizedKV: int8 / fp8 values, f32 scales [2, P, page_size, K]): each
K/V block comes with the matching block of scales (GPU: kv head h's scales read in place like
its pages; TPU: the page's scales fetched by the same index map). GPU keys stay in their stored
values cast to q's dtype and the scores are scaled per key; values, and on TPU keys too, are
dequantised in the block. A plain pool passes no scales and traces the kernel it always did.

This module also holds the pieces the other kernels share (mask value, online-softmax step,
version-guarded compiler params).
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

from pallas_kernels import kv_quant

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


def quantized_scores(q: jax.Array, k: jax.Array, k_scales: jax.Array) -> jax.Array:
    """f32[R, S] = q [R, D] . (k * k_scales)^T for int8 / fp8 keys k [S, D] with scales f32[1, S]:
    the dot runs on the stored values cast to q's dtype (exact: int8 and e4m3 values fit in bf16)
    and each key's column of scores is scaled after, which is the same sum."""
    return scores_nt(q, k.astype(q.dtype)) * k_scales


def dequantize_rows(x: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """int8 / fp8 rows x [S, D] times their scales f32[S, 1], in `dtype`."""
    return (x.astype(jnp.float32) * scales).astype(dtype)


def cap_scores(s, soft_cap: float | None):
    """Gemma's attention-logit soft cap on scaled scores; identity (no op traced) when None."""
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def window_start(length, sliding_window: int | None):
    """First key a decode query at position length - 1 sees (0 without a window)."""
    return 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0)


def online_softmax_step(s, v, m_prev, l_prev, acc_prev):
    """One block of flash attention.

    s: f32[R, S] scaled scores, masked entries already MASK_VALUE; v: [S, D] with rows of invalid
    keys zeroed (unused pages may hold NaN); m_prev, l_prev: f32[R, 1]; acc_prev: f32[R, D].
    """
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next)  # [R, S]
    l_next = correction * l_prev + jnp.sum(p, axis=1, keepdims=True)
    pv = lax.dot_general(
        p, v.astype(jnp.float32), (((1,), (0,)), ((), ())),
        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    )
    return m_next, l_next, correction * acc_prev + pv


def combine_splits(acc, m, l):
    """Exact merge of C partial softmaxes along axis 1: acc f32[B, C, ..., D], m, l f32[B, C, ..., 1]."""
    m_max = jnp.max(m, axis=1, keepdims=True)
    w = jnp.exp(m - m_max)  # empty splits have m = MASK_VALUE -> weight 0 (or 1 with l = 0)
    l_sum = jnp.sum(w * l, axis=1)
    acc_sum = jnp.sum(w * acc, axis=1)
    return acc_sum / jnp.where(l_sum == 0.0, 1.0, l_sum)  # rows with no keys -> zeros


# ---------------------------------------------------------------- GPU (Triton lowering)
def _decode_kernel_gpu(
    lens_ref,  # i32[1] this row's length
    pt_ref,  # i32[pages_per_split] this split's slice of the page table
    q_ref,  # [Gp, D]
    k_ref,  # [P, page_size, D] kv head h of the pool, read in place
    v_ref,  # [P, page_size, D]
    *refs,  # quantised: ks_ref, vs_ref f32[P, page_size] (kv head h's scales); then the outputs:
    # acc_ref f32[Gp, D], m_ref f32[Gp, 1], l_ref f32[Gp, 1]
    sm_scale: float, pages_per_block: int, sliding_window: int | None, soft_cap: float | None,
    quantized: bool = False,
):
    ks_ref, vs_ref, acc_ref, m_ref, l_ref = refs if quantized else (None, None, *refs)
    split = pl.program_id(2)
    page_size, head_dim = k_ref.shape[1], k_ref.shape[2]
    pages_per_split = pt_ref.shape[0]
    block_len = pages_per_block * page_size
    length = lens_ref[0]
    start = split * pages_per_split * page_size
    end = jnp.minimum(length, start + pages_per_split * page_size)
    num_blocks = jnp.where(end > start, pl.cdiv(end - start, block_len), 0)
    lo = window_start(length, sliding_window)
    # Blocks wholly before the window are skipped: they may be released pages.
    first_block = jnp.clip((lo - start) // block_len, 0, num_blocks) if sliding_window else 0
    q = q_ref[...]
    rows = q.shape[0]

    def body(i, carry):
        ids = pt_ref[pl.ds(i * pages_per_block, pages_per_block)]
        k = k_ref[ids].reshape(block_len, head_dim)
        v = v_ref[ids].reshape(block_len, head_dim)
        pos = start + i * block_len + jnp.arange(block_len, dtype=jnp.int32)
        valid = pos < length  # [S]
        if sliding_window is not None:
            valid &= pos >= lo
        if quantized:
            s = quantized_scores(q, k, ks_ref[ids].reshape(1, block_len))
            v = v.astype(jnp.float32) * vs_ref[ids].reshape(block_len, 1)
        else:
            s = scores_nt(q, k)
        s = jnp.where(valid[None, :], cap_scores(s * sm_scale, soft_cap), MASK_VALUE)
        v = jnp.where(valid[:, None], v, jnp.zeros_like(v))
        return online_softmax_step(s, v, *carry)

    init = (
        jnp.full((rows, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    m, l, acc = lax.fori_loop(first_block, num_blocks, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _decode_gpu(q4, kv_pages, table, lengths, scales, *, sm_scale, pages_per_block, num_splits, interpret,
                sliding_window, soft_cap):
    batch, num_kv_heads, rows, head_dim = q4.shape  # [B, K, Gp, D]
    _, num_pages, page_size, _, _ = kv_pages.shape
    pages_per_split = table.shape[1] // num_splits
    table = table.reshape(batch, num_splits, pages_per_split)
    quantized = scales is not None
    kernel = functools.partial(_decode_kernel_gpu, sm_scale=sm_scale, pages_per_block=pages_per_block,
                               sliding_window=sliding_window, soft_cap=soft_cap, quantized=quantized)
    pool_block = (None, num_pages, page_size, None, head_dim)
    split_out = (batch, num_splits, num_kv_heads, rows)
    scale_specs, scale_args = [], []
    if quantized:  # kv head h's scales, read in place like its pages
        scale_block = (None, num_pages, page_size, None)
        scale_specs = [pl.BlockSpec(scale_block, lambda b, h, c: (0, 0, 0, h)),
                       pl.BlockSpec(scale_block, lambda b, h, c: (1, 0, 0, h))]
        scale_args = [scales, scales]
    return pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, c: (b,)),
            pl.BlockSpec((None, None, pages_per_split), lambda b, h, c: (b, c, 0)),
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, c: (b, h, 0, 0)),
            pl.BlockSpec(pool_block, lambda b, h, c: (0, 0, 0, h, 0)),  # K half
            pl.BlockSpec(pool_block, lambda b, h, c: (1, 0, 0, h, 0)),  # V half
            *scale_specs,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, c: (b, c, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows, 1), lambda b, h, c: (b, c, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows, 1), lambda b, h, c: (b, c, h, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*split_out, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((*split_out, 1), jnp.float32),
            jax.ShapeDtypeStruct((*split_out, 1), jnp.float32),
        ],
        compiler_params=triton_params(),
        interpret=interpret_arg("gpu", interpret),
        name="paxpage_decode_attention_gpu",
    )(lengths, table, q4, kv_pages, kv_pages, *scale_args)


# ---------------------------------------------------------------- TPU (Mosaic TPU)
def _page_slot(b, c, p, lens_ref, *, page_size, pages_per_split, pages_per_row, sliding_window):
    """Flat page-table index fetched at grid step (b, c, p); past the row's end it repeats the
    last used page, and before its window the window's first page, so Pallas skips the DMA (same
    block index) and never reads a stray or released page."""
    used = jnp.maximum(pl.cdiv(lens_ref[b], page_size) - 1, 0)
    page = c * pages_per_split + p
    if sliding_window is not None:
        page = jnp.maximum(page, window_start(lens_ref[b], sliding_window) // page_size)
    return b * pages_per_row + jnp.minimum(page, used)


def _decode_kernel_tpu(
    lens_ref,  # SMEM i32[B]
    pt_ref,  # SMEM i32[B * pages_per_row]
    q_ref,  # [K, G, D]
    k_ref,  # [page_size, K, D] one page
    v_ref,  # [page_size, K, D]
    *refs,  # quantised: ks_ref, vs_ref f32[page_size, K] the page's scales; then the outputs:
    # acc_ref f32[K, G, D] resident across the page axis, m_ref f32[K, G, 1], l_ref f32[K, G, 1]
    sm_scale: float, pages_per_split: int, sliding_window: int | None, soft_cap: float | None,
    quantized: bool = False,
):
    ks_ref, vs_ref, acc_ref, m_ref, l_ref = refs if quantized else (None, None, *refs)
    b, c, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page_size = k_ref.shape[0]

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
        for h in range(k_ref.shape[1]):  # K is small and static
            k = k_ref[:, h, :]  # [page_size, D]
            v = v_ref[:, h, :]
            q = q_ref[h]
            if quantized:  # dequantise the page's rows: [page_size, D] * [page_size, 1]
                k = dequantize_rows(k, ks_ref[:, h:h + 1], q.dtype)
                v = v.astype(jnp.float32) * vs_ref[:, h:h + 1]
            s = jnp.where(valid_row, cap_scores(scores_nt(q, k) * sm_scale, soft_cap), MASK_VALUE)
            v = jnp.where(valid_col, v, jnp.zeros_like(v))
            m, l, acc = online_softmax_step(s, v, m_ref[h], l_ref[h], acc_ref[h])
            m_ref[h] = m
            l_ref[h] = l
            acc_ref[h] = acc


def _decode_tpu(q4, kv_pages, table, lengths, scales, *, sm_scale, num_splits, interpret, sliding_window,
                soft_cap):
    batch, num_kv_heads, group, head_dim = q4.shape  # [B, K, G, D]
    _, _, page_size, _, _ = kv_pages.shape
    pages_per_row = table.shape[1]
    pages_per_split = pages_per_row // num_splits
    slot = functools.partial(
        _page_slot, page_size=page_size, pages_per_split=pages_per_split, pages_per_row=pages_per_row,
        sliding_window=sliding_window,
    )
    page_block = (None, None, page_size, num_kv_heads, head_dim)
    out_block = (None, None, num_kv_heads, group)
    split_out = (batch, num_splits, num_kv_heads, group)
    quantized = scales is not None
    scale_specs, scale_args = [], []
    if quantized:  # the page's scales, fetched by the same index as its values
        scale_block = (None, None, page_size, num_kv_heads)
        scale_specs = [pl.BlockSpec(scale_block, lambda b, c, p, lens, pt: (0, pt[slot(b, c, p, lens)], 0, 0)),
                       pl.BlockSpec(scale_block, lambda b, c, p, lens, pt: (1, pt[slot(b, c, p, lens)], 0, 0))]
        scale_args = [scales, scales]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(batch, num_splits, pages_per_split),
        in_specs=[
            pl.BlockSpec((None, num_kv_heads, group, head_dim), lambda b, c, p, lens, pt: (b, 0, 0, 0)),
            pl.BlockSpec(page_block, lambda b, c, p, lens, pt: (0, pt[slot(b, c, p, lens)], 0, 0, 0)),
            pl.BlockSpec(page_block, lambda b, c, p, lens, pt: (1, pt[slot(b, c, p, lens)], 0, 0, 0)),
            *scale_specs,
        ],
        out_specs=[
            pl.BlockSpec((*out_block, head_dim), lambda b, c, p, lens, pt: (b, c, 0, 0, 0)),
            pl.BlockSpec((*out_block, 1), lambda b, c, p, lens, pt: (b, c, 0, 0, 0)),
            pl.BlockSpec((*out_block, 1), lambda b, c, p, lens, pt: (b, c, 0, 0, 0)),
        ],
    )
    kernel = functools.partial(_decode_kernel_tpu, sm_scale=sm_scale, pages_per_split=pages_per_split,
                               sliding_window=sliding_window, soft_cap=soft_cap, quantized=quantized)
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
    )(lengths, table.reshape(-1), q4, kv_pages, kv_pages, *scale_args)


# ---------------------------------------------------------------- public wrapper
def default_num_splits(backend: str, batch: int, num_kv_heads: int, num_blocks: int) -> int:
    """GPU: enough programs to fill an H100/H200 (132 SMs) twice. TPU: one core walks the row."""
    if backend == "tpu":
        return 1
    return max(1, min(num_blocks, pl.cdiv(264, batch * num_kv_heads)))


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "pages_per_block", "num_splits", "backend", "interpret",
                              "sliding_window", "soft_cap")
)
def decode_attention(
    q: jax.Array,  # [B, N, D] f32 or bf16
    kv_pages,  # [2, P, page_size, K, D] one layer's pool (0 = K, 1 = V), or a kv_quant.QuantizedKV
    page_indices: jax.Array,  # i32[B, pages_per_seq] logical -> physical page of row b
    lengths: jax.Array,  # i32[B] keys of row b (0 = padding row -> zeros)
    *,
    sm_scale: float,
    pages_per_block: int | None = None,  # GPU: pages per inner block (block = pages * page_size keys)
    num_splits: int | None = None,  # C: parts of the key range run in parallel, merged by LSE
    backend: str = "gpu",
    interpret: bool = False,
    sliding_window: int | None = None,  # W: row b sees keys lengths[b]-W..lengths[b]-1
    soft_cap: float | None = None,  # c: scaled scores s -> c * tanh(s / c)
) -> jax.Array:  # [B, N, D] dtype of q
    check_backend(backend)
    check_window_and_cap(sliding_window, soft_cap)
    batch, num_heads, head_dim = q.shape
    kv_pages, scales = kv_quant.split(kv_pages)
    two, _, page_size, num_kv_heads, kv_dim = kv_pages.shape
    if two != 2 or kv_dim != head_dim:
        raise ValueError(f"kv_pages has shape {kv_pages.shape}; expected [2, P, page_size, K, {head_dim}]")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    if page_indices.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(
            f"page_indices {page_indices.shape} / lengths {lengths.shape} do not match batch {batch}"
        )
    group = num_heads // num_kv_heads
    pages_per_seq = page_indices.shape[1]
    if backend == "gpu":
        # Triton wants power-of-two tiles and dots of at least 16 x 16 x 16.
        if page_size & (page_size - 1) or head_dim & (head_dim - 1) or head_dim < 16:
            raise ValueError(
                f"GPU kernel needs power-of-two page_size and head_dim >= 16; got {page_size}, {head_dim}"
            )
        if pages_per_block is None:
            pages_per_block = max(1, 64 // page_size)
        pages_per_block = max(pages_per_block, pl.cdiv(16, page_size))
        rows = max(16, next_pow2(group))
    else:
        pages_per_block = 1  # the TPU kernel streams one page per grid step
        rows = group
    num_blocks = pl.cdiv(pages_per_seq, pages_per_block)
    if num_splits is None:
        num_splits = default_num_splits(backend, batch, num_kv_heads, num_blocks)
    num_splits = max(1, min(num_splits, num_blocks))
    pages_per_split = pl.cdiv(num_blocks, num_splits) * pages_per_block
    # Padding entries point at page 0; they are never read past a row's length.
    table = jnp.pad(page_indices.astype(jnp.int32), ((0, 0), (0, num_splits * pages_per_split - pages_per_seq)))
    lengths = lengths.astype(jnp.int32)

    q4 = q.reshape(batch, num_kv_heads, group, head_dim)
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, rows - group), (0, 0)))  # [B, K, Gp, D]
    if backend == "gpu":
        acc, m, l = _decode_gpu(
            q4, kv_pages, table, lengths, scales, sm_scale=sm_scale, pages_per_block=pages_per_block,
            num_splits=num_splits, interpret=interpret, sliding_window=sliding_window, soft_cap=soft_cap,
        )
    else:
        acc, m, l = _decode_tpu(
            q4, kv_pages, table, lengths, scales, sm_scale=sm_scale, num_splits=num_splits, interpret=interpret,
            sliding_window=sliding_window, soft_cap=soft_cap,
        )
    out = combine_splits(acc, m, l)[:, :, :group]  # [B, K, G, D]
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)
