"""Paged attention in plain XLA ops: the engine's CPU path where the native kernel is not used.

The CPU default, attention_impl "native", is the C++ kernel in `native_attention.py`; this is
attention_impl "xla", and what "native" falls back to when g++ is missing or the build fails.

Same signature and semantics as `reference.paged_attention_ref` (row layout, see its
docstring), but it never materialises a row's whole page table: a loop walks the key/value
length in chunks of whole pages, gathers only that chunk's pages straight from the pool, and
folds it into an online softmax. On CPU and TPU the trip count is the longest row's length in
chunks, a traced value, so no shape depends on the context length, long and short batches
share one compiled step, and nothing is computed past the longest row; lowered for a GPU it is
the table's width in chunks, a fixed count (`fold_chunks`).

What makes it cost what it reads on XLA CPU (measured with jax 0.10.2):
- The pool is viewed as rows of whole pages, [2 * P, page_size * K * D] (a free reshape), and
  K and V pages are gathered as such rows with in-bounds indices: XLA emits that gather as a
  vectorised copy of each page. The gather of [B, pages, page_size, K, D] blocks transposed
  for a per-head dot (the previous form) was most of the attention time and ~2x slower per byte.
- Decode rows (Tq == 1) never transpose the gathered block: each query head is spread over
  all K kv heads' columns, zeros outside its own ("expanded q", [B, N, K * D]), so scores
  and values are plain batched dots on the [B, S, K * D] block as gathered. That spends K
  times the (tiny) multiply-adds of a decode step to skip a copy of the keys and values.
  The P.V product's [B, M, J] is cut to each head's own D columns right away (static slices,
  which XLA fuses into the accumulator update), so the carried accumulator is [B, M, D], not
  K times that: 3-15% less CPU time at SmolLM2's 64 x 65 decode (noisy shared machine).
  Prefill rows (Tq > 1) do enough work per key for the per-head einsum's transpose to pay.
- Pages of at most MERGED_GATHER_MAX_PAGE_BYTES per half (4 KiB: a tiny model's 16 tokens x
  4 x 16 f32) are gathered K and V in one op, then masked: 20-35% less CPU time than two
  gathers at 256 rows x 1536 there, but 12-25% more with 12 KiB pages (SmolLM2), measured on
  a 2-core AMD EPYC with jax 0.10.2; larger pages keep the two gathers, V's mask fused into its own.
- Chunks hold at most ~1 MiB of keys (and at most `chunk_tokens` tokens), so the gathered
  block is consumed from cache.
Values at keys past a row's length are zeroed before the P.V product, so stale or NaN
contents of unused slots and pages never reach the output.

Sliding window W (static): a query at position p sees keys p - W + 1..p. The loop then starts
at the first chunk any row can see, so a long row reads O(W) keys, not O(length); values below
a row's first visible key are zeroed like those past its end (released pages may hold anything).
Soft cap c (static): scores become c * tanh(scores / c). Sinks (traced f32[N], gpt-oss) join
the final normaliser once, after the loop: l + exp(sink - m) at the common max. With all three
None the traced step is the plain causal one, op for op.
Batch-invariant form (batch_invariant=True, EngineConfig.batch_invariant): every query token
runs as a decode row of its own (its keys up to its position), over chunks of a fixed
INVARIANT_CHUNK_TOKENS keys counted from key 0, with the softmax's sums over a chunk in a fixed
pairwise order. A token's scores, sums and output then come from dots and adds of shapes that do
not depend on the step (on XLA CPU a batched dot's per-row bits do not depend on the batch count;
a masked chunk past or before a row's keys adds exact zeros), so they are bitwise the same alone,
beside 255 other rows, chunked or not. A prefill token gathers its row's keys for itself, so a
prefill of T tokens over L keys gathers T x L keys where the default gathers L.
Quantised pool (kv_quant.QuantizedKV): the scales are viewed as rows of whole pages too,
[2 * P, page_size * K], gathered with the same indices, and each chunk's int8/fp8 keys and
values are dequantised (values * scales, f32) right after the gather; a plain pool traces no
scale op at all.

Where the time goes (scripts/profile_attention.py, jax 0.10.2, 2-core AMD EPYC, shared machine).
Per loop iteration at the tiny shape (256 rows x 1 page, 2 MiB of K + V): the merged gather
~240 us, the two K/V slices (mask + copy) 2 x 33 us, YNN's two dots and the max / sum
reductions 4 x 17 us, exp 15 us, the score mask 10 us, the accumulator 5 us: ~390 us, where a
read-only loop over the same pages (`--probe gather`) takes ~150 us. At SmolLM2 64 x 65 (1 page,
1.5 MiB): K gather ~70 us, V gather + mask and the score mask 2 x 35 us, YNN 4 x 17 us, exp
and accumulator ~20 us each. So the gathers are about half, the dots a fifth to a third.
What sets those costs (each measured alone in a loop like this one's):
- A gather fusion whose root keeps the gather's wide shape ([rows, page_size * J]) copies at
  ~120 us per MiB; when its root is a bitcast to the dot's [B, S, J] (what a dot consumer gets
  unless something else reads the block first) ~200-250 us per MiB. Two gathers feeding one
  elementwise output (the read-only loop) are fastest, ~75 us per MiB.
- YNN's batched dots at these skinny shapes (M = 4-9 rows) work at ~4-9 GFLOP/s, cost
  scaling with the operand's bytes, not with B (64 rows x 4 pages costs what 256 x 1 does).
  XLA's Eigen dots (YNN fusion off, measured with the XLA flag) are 1.5x slower.
- Reductions fused with elementwise work (YNN's or XLA's own emitter) cost 1-2 ns per element.
- glibc's transparent huge pages for the heap (GLIBC_TUNABLES=glibc.malloc.hugetlb=1 at
  process start, with tune_malloc's thresholds) made this step ~10% faster at both shapes.
Tried and dropped (bench_attention_ab-style A/B in one process, 2 layers tiny /
30 layers SmolLM2, CPU ms): separate K/V gathers at the tiny shape (102 vs 79 ms); row blocks as
2 / 4 / 8 independent loops with chunks sized to the 1 MiB L2 (72-92 vs 79 ms); CHUNK_BYTES from
256 KiB to 4 MiB (no change at SmolLM2); gathering chunk c + 1 in iteration c (carried:
1.15-1.9x slower); scores as elementwise k * q reduced over D (sum: 3.4x slower; a GEMV with
ones: 1.2x) and P.V as a flat [B, S * J] accumulator with the V gather fused into it (1.2-3x:
the fusion's root differs from the gather's shape); a "big-M" score dot [S * K, D] x [N, D] per
row, keeping each head's own kv head (within noise); K and V interleaved so one gather reads
two pages at once and the dots run on the combined block with zero-padded q / p (token-major
[B, S, 2, J]: 1.1x slower; 1-4 KiB blocks: 3x; complex64 K + iV: 1.7x, complex dots are slow);
page size 32 / 64 instead of 16 (no change); separate K / V gathers kept at the wide root by a
second (dummy, NaN-safe) consumer of each, V masked in the wide shape, so no slices (tiny 68.5
vs 71.6 ms, SmolLM2 44 vs 37 ms). The targets (>= 14 GB/s at 256 x 1536,
<= 15% of SmolLM2's step) are out of reach here: at 256 x 1536 the read-only loop alone reaches ~14-16
GB/s, so no formulation in XLA ops that also computes the dots can. Hence the native kernel.

Axis legend: B rows, Tq query tokens per row, S keys in a chunk, N query heads,
K kv heads, G = N // K, D head dim, M = Tq * N expanded query rows, J = K * D.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import kv_quant

# Gathered keys per chunk: small enough to stay in cache while the dots read it.
CHUNK_BYTES = 1 << 20
# Pages of at most this many bytes (one half, K or V) are gathered K and V together, in one op.
MERGED_GATHER_MAX_PAGE_BYTES = 4096
# Keys per chunk in the batch-invariant form: one chunk grid for every step, counted from key 0.
INVARIANT_CHUNK_TOKENS = 64


def pairwise_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis as a balanced tree of elementwise adds: one order for any batch
    (XLA CPU may order a reduce by the row count)."""
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = jnp.concatenate([x[..., :-2], x[..., -2:-1] + x[..., -1:]], axis=-1)
        else:
            x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def token_rows(q, page_indices, kv_lens, q_lens):
    """Every query token as a decode row of its own: (q [B * Tq, 1, N, D], tables, kv_lens, q_lens),
    a token at position p seeing keys 0..p of its row's table; padding tokens get length 0."""
    batch, num_q = q.shape[:2]
    q_lens = q_lens.astype(jnp.int32)
    q_pos = (kv_lens.astype(jnp.int32) - q_lens)[:, None] + jnp.arange(num_q)[None, :]  # [B, Tq]
    valid = jnp.arange(num_q)[None, :] < q_lens[:, None]
    return (q.reshape(batch * num_q, 1, *q.shape[2:]), jnp.repeat(page_indices, num_q, axis=0),
            jnp.where(valid, q_pos + 1, 0).reshape(-1), valid.astype(jnp.int32).reshape(-1))


def fold_chunks(body, init, stop, num_slots: int, early_exit: bool | None = None):
    """Folds `body` over chunks: carry[0] is the chunk index, from init's to `stop` (a traced
    bound: the longest row's chunks), every other chunk being masked inside `body`.
    early_exit True: a while loop up to `stop`, so nothing is computed past the longest row.
    False: all `num_slots` chunks from 0 (the table's width), a fixed trip count: XLA:GPU reads
    a traced loop predicate back on the host every trip, a stall per chunk that costs more than
    the masked chunks. None: False when the step lowers for CUDA / ROCm, True elsewhere
    (CPU, and TPU, whose loops run on the chip)."""

    def until_stop(carry):
        return lax.while_loop(lambda c: c[0] < stop, body, carry)

    def every_slot(carry):
        return lax.fori_loop(0, num_slots, lambda _, c: body(c), (jnp.zeros_like(carry[0]),) + tuple(carry[1:]))

    if early_exit is None:
        return lax.platform_dependent(init, cuda=every_slot, rocm=every_slot, default=until_stop)
    return until_stop(init) if early_exit else every_slot(init)


def pages_per_chunk(batch: int, page_bytes: int, page_size: int, pages_per_seq: int,
                    chunk_tokens: int) -> int:
    """Whole pages per loop step: at most chunk_tokens tokens and ~CHUNK_BYTES of keys."""
    by_tokens = max(1, chunk_tokens // page_size)
    by_bytes = max(1, CHUNK_BYTES // max(1, batch * page_bytes))
    return max(1, min(by_tokens, by_bytes, pages_per_seq))


def paged_attention_xla(
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
    chunk_tokens: int = 64,
    early_exit: bool | None = None,  # fold_chunks: None decides by platform
    batch_invariant: bool = False,  # each token alone, fixed chunks, fixed-order sums (module doc)
) -> jax.Array:  # [B, Tq, N, D]
    if batch_invariant and q.shape[1] > 1:
        tok_q, tables, tok_kv_lens, tok_q_lens = token_rows(q, page_indices, kv_lens, q_lens)
        out = paged_attention_xla(tok_q, kv_pages, tables, tok_kv_lens, tok_q_lens, sm_scale=sm_scale,
                                  sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
                                  early_exit=early_exit, batch_invariant=True)
        return out.reshape(q.shape)
    batch, num_q, num_heads, head_dim = q.shape
    kv_pages, scales = kv_quant.split(kv_pages)
    _, num_pages, page_size, num_kv_heads, _ = kv_pages.shape
    group = num_heads // num_kv_heads
    width = num_kv_heads * head_dim  # J
    pages_per_seq = page_indices.shape[1]
    # A quantised chunk is dequantised to f32 right away: size chunks by that working set.
    itemsize = kv_pages.dtype.itemsize if scales is None else 4
    if batch_invariant:  # one chunk grid whatever the batch and the table's width
        chunk_pages = max(1, INVARIANT_CHUNK_TOKENS // page_size)
    else:
        chunk_pages = pages_per_chunk(batch, page_size * width * itemsize, page_size,
                                      pages_per_seq, chunk_tokens)
    row_sum = pairwise_sum if batch_invariant else (lambda x: jnp.sum(x, axis=-1))
    chunk_len = chunk_pages * page_size  # S
    num_chunk_slots = -(-pages_per_seq // chunk_pages)
    # Pad the table to whole chunks and clamp it into the pool (entries past a row's pages
    # may hold anything): the gathers then promise in-bounds indices. Such keys are masked.
    pad = num_chunk_slots * chunk_pages - pages_per_seq
    page_indices = jnp.clip(jnp.pad(page_indices.astype(jnp.int32), ((0, 0), (0, pad))), 0, num_pages - 1)
    pool_rows = kv_pages.reshape(2 * num_pages, page_size * width)  # K pages, then V pages
    merged = scales is None and page_size * width * kv_pages.dtype.itemsize <= MERGED_GATHER_MAX_PAGE_BYTES
    if scales is not None:
        scale_rows = scales.reshape(2 * num_pages, page_size * num_kv_heads)  # same rows, per head
    kv_lens = kv_lens.astype(jnp.int32)
    q_lens = q_lens.astype(jnp.int32)
    q_pos = (kv_lens - q_lens)[:, None] + jnp.arange(num_q)[None, :]  # [B, Tq]
    q32 = q.astype(jnp.float32) * sm_scale
    expanded = num_q == 1
    if expanded:
        # Head h's queries in kv head h // G's columns: static slices and pads.
        qx = jnp.concatenate([
            jnp.pad(q32[:, :, h * group:(h + 1) * group],
                    ((0, 0), (0, 0), (0, 0), (h * head_dim, width - (h + 1) * head_dim)))
            for h in range(num_kv_heads)], axis=2).reshape(batch, num_q * num_heads, width)  # [B, M, J]
        stat_shape = (batch, num_q * num_heads)  # [B, M]
        acc_shape = (batch, num_q * num_heads, head_dim)  # [B, M, D]: each head's own columns
        q_pos_s = jnp.repeat(q_pos, num_heads, axis=1)[:, :, None]  # [B, M, 1]
    else:
        qx = q32.reshape(batch, num_q, num_kv_heads, group, head_dim)  # [B, Tq, K, G, D]
        stat_shape = (batch, num_kv_heads, group, num_q)  # [B, K, G, Tq]
        acc_shape = (batch, num_kv_heads, group, num_q, head_dim)  # [B, K, G, Tq, D]
        q_pos_s = q_pos[:, None, None, :, None]  # [B, 1, 1, Tq, 1]
    kv_lens_s = kv_lens.reshape((batch,) + (1,) * len(stat_shape))  # broadcasts like the scores
    num_chunks = (jnp.max(kv_lens) + chunk_len - 1) // chunk_len
    first_chunk = jnp.int32(0)
    if sliding_window is not None:
        first_key = jnp.maximum(kv_lens - q_lens - sliding_window + 1, 0)  # [B] of its first query
        first_chunk = jnp.min(jnp.where(kv_lens > 0, first_key, jnp.iinfo(jnp.int32).max)) // chunk_len
        first_chunk = jnp.minimum(first_chunk, num_chunks).astype(jnp.int32)

    def own_columns(x):  # [B, M, J] -> [B, M, D]: head h's kv head's columns, by static slices
        x = x.reshape(batch, num_q, num_heads, width)
        x = jnp.concatenate([x[:, :, h * group:(h + 1) * group, h * head_dim:(h + 1) * head_dim]
                             for h in range(num_kv_heads)], axis=2)
        return x.reshape(batch, num_q * num_heads, head_dim)

    def body(carry):
        c, m, l, acc = carry
        idx = lax.dynamic_slice_in_dim(page_indices, c * chunk_pages, chunk_pages, axis=1)
        k_pos = c * chunk_len + jnp.arange(chunk_len)  # [S]
        live = k_pos[None, :] < kv_lens[:, None]  # [B, S]
        if sliding_window is not None:
            live &= k_pos[None, :] >= first_key[:, None]
        if merged:
            # Small pages: one gather of K and V pages, [2, B, chunk_pages, page_size * J], with
            # the keys past each row's length zeroed in both halves (masked scores ignore K's).
            kv = pool_rows.at[jnp.stack([idx, idx + num_pages])].get(mode="promise_in_bounds")
            kv = jnp.where(live.reshape(1, batch, chunk_pages, page_size, 1),
                           kv.reshape(2, batch, chunk_pages, page_size, width), 0.0)
            k = kv[0].reshape(batch, chunk_len, width).astype(jnp.float32)  # [B, S, J]
            v = kv[1].reshape(batch, chunk_len, width).astype(jnp.float32)
        else:
            k = pool_rows.at[idx].get(mode="promise_in_bounds")  # [B, chunk_pages, page_size * J]
            v = pool_rows.at[idx + num_pages].get(mode="promise_in_bounds")
            if scales is not None:  # dequantise: [B, S, K, D] * [B, S, K, 1], back to [B, S, J]
                def deq(x, rows):
                    s_kv = scale_rows.at[rows].get(mode="promise_in_bounds").reshape(batch, chunk_len, num_kv_heads)
                    x = x.reshape(batch, chunk_len, num_kv_heads, head_dim)
                    return kv_quant.dequantize(x, s_kv).reshape(batch, chunk_len, width)
                k, v = deq(k, idx), deq(v, idx + num_pages)
            k = k.reshape(batch, chunk_len, width).astype(jnp.float32)  # [B, S, J]
            v = jnp.where(live[:, :, None], v.reshape(batch, chunk_len, width).astype(jnp.float32), 0.0)
        if expanded:
            s = jnp.einsum("BMJ,BSJ->BMS", qx, k)
        else:
            s = jnp.einsum("BTKGD,BSKD->BKGTS", qx, k.reshape(batch, chunk_len, num_kv_heads, head_dim))
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        visible = (k_pos <= q_pos_s) & (k_pos < kv_lens_s)
        if sliding_window is not None:
            visible &= k_pos > q_pos_s - sliding_window
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        # Rows that have seen no key yet keep m = -inf; shift by 0 there to avoid inf - inf.
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        l = alpha * l + row_sum(p)
        if expanded:
            pv = own_columns(jnp.einsum("BMS,BSJ->BMJ", p, v))  # [B, M, D]
        else:
            pv = jnp.einsum("BKGTS,BSKD->BKGTD", p, v.reshape(batch, chunk_len, num_kv_heads, head_dim))
        return c + 1, m_new, l, alpha[..., None] * acc + pv

    init = (
        first_chunk,
        jnp.full(stat_shape, -jnp.inf, jnp.float32),
        jnp.zeros(stat_shape, jnp.float32),
        jnp.zeros(acc_shape, jnp.float32),
    )
    _, m, l, acc = fold_chunks(body, init, num_chunks, num_chunk_slots, early_exit)
    if sinks is not None:
        sinks = sinks.astype(jnp.float32)
        sink = (jnp.tile(sinks, num_q)[None, :] if expanded  # [1, M], m = t * N + h
                else sinks.reshape(1, num_kv_heads, group, 1))  # [1, K, G, 1]
        m_all = jnp.maximum(m, sink)  # finite: rows that saw no key take the sink's
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - m_all, -jnp.inf))
        l = alpha * l + jnp.exp(sink - m_all)
        acc = alpha[..., None] * acc
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    if expanded:
        out = out.reshape(batch, num_q, num_heads, head_dim)
    else:
        out = out.transpose(0, 3, 1, 2, 4).reshape(batch, num_q, num_heads, head_dim)
    valid = jnp.arange(num_q)[None, :] < q_lens[:, None]
    return jnp.where(valid[:, :, None, None], out, 0.0).astype(q.dtype)
