"""Pure-jnp reference paged attention and KV write: the semantics every kernel must match.

Axis legend: B rows (sequences), Tq query tokens per row, T flat tokens, S key/value length,
N query heads, K kv heads, D head dim, P pages, G = N // K query heads per kv head.

These are written for clarity, not speed: they gather each row's whole page table.
The engine's fast CPU path is `pallas_kernels.xla_attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import kv_layout, kv_quant


def write_kv(
    kv_pages,  # [2, P, page_size, K, D] one layer's pool, or a kv_quant.QuantizedKV
    k: jax.Array,  # [T, K, D] this step's keys, flat tokens
    v: jax.Array,  # [T, K, D]
    slot_mapping: jax.Array,  # i32[T] page_id * page_size + offset; -1 = padding, not written
) -> jax.Array:
    """Returns the pool with token t's K/V stored at slot_mapping[t] (quantised per (token, kv
    head) when the pool is a QuantizedKV)."""
    pages, scales = kv_quant.split(kv_pages)
    _, num_pages, page_size, _, _ = pages.shape
    slot_mapping, k, v = kv_layout.two_token_scatter(slot_mapping, k, v)
    # Index (page, offset) directly: reshaping the pool to flat slots first makes XLA copy
    # the whole pool when the update degenerates to one slot (measured: ~1 s per step).
    page = jnp.where(slot_mapping < 0, num_pages, slot_mapping // page_size)  # padding: out of bounds
    offset = slot_mapping % page_size
    if scales is None:
        kv = jnp.stack([k, v]).astype(kv_pages.dtype)  # [2, T, K, D]
        return kv_pages.at[:, page, offset].set(kv, mode="drop")
    kv, kv_scales = kv_quant.quantize(jnp.stack([k, v]), pages.dtype)  # [2, T, K, D], f32[2, T, K]
    return kv_quant.QuantizedKV(pages.at[:, page, offset].set(kv, mode="drop"),
                                kv_quant.write_scales(scales, slot_mapping, kv_scales))


def paged_attention_ref(
    q: jax.Array,  # [B, Tq, N, D]
    kv_pages,  # [2, P, page_size, K, D] already holding this step's K/V (or a QuantizedKV)
    page_indices: jax.Array,  # i32[B, pages_per_seq]
    kv_lens: jax.Array,  # i32[B] cached tokens incl. this step's; 0 = padding row
    q_lens: jax.Array,  # i32[B] new tokens this step
    *,
    sm_scale: float,
    sliding_window: int | None = None,  # W: a query sees only its last W keys (itself included)
    soft_cap: float | None = None,  # c: scores become c * tanh(scores / c) before the mask
    sinks: jax.Array | None = None,  # f32[N] per query head: a logit in the softmax's denominator only
) -> jax.Array:  # [B, Tq, N, D]
    """Causal paged attention in the row layout: row b holds the q_lens[b] new query tokens of
    one sequence (a decode row 1, a prefill row up to Tq; docs/architecture.md, "How a step flows").

    Query token i of row b is at position p = kv_lens[b] - q_lens[b] + i and sees keys
    0..p, or with a sliding window W only keys p - W + 1..p (HF transformers' convention:
    `kv_idx > q_idx - sliding_window`). Padding query tokens (i >= q_lens[b]) return zeros.
    A QuantizedKV pool is dequantised (values * scales, f32) as it is gathered.

    Sinks (gpt-oss): head h's probabilities are exp(s_j) / (sum_j exp(s_j) + exp(sinks[h])) over
    its scaled (and capped) scores s_j; the sink is not scaled or capped and carries no value, so
    the weights sum to less than one.
    """
    batch, num_q, num_heads, head_dim = q.shape
    pages, scales = kv_quant.split(kv_pages)
    _, _, page_size, num_kv_heads, _ = pages.shape
    group = num_heads // num_kv_heads
    k = pages[0][page_indices]  # [B, pages_per_seq, page_size, K, D]
    v = pages[1][page_indices]
    if scales is not None:
        k = kv_quant.dequantize(k, scales[0][page_indices])
        v = kv_quant.dequantize(v, scales[1][page_indices])
    k = k.reshape(batch, -1, num_kv_heads, head_dim).astype(jnp.float32)  # [B, S, K, D]
    v = v.reshape(batch, -1, num_kv_heads, head_dim).astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(batch, num_q, num_kv_heads, group, head_dim)
    # HIGHEST: on GPU, XLA's default f32 dot rounds its inputs to TF32 (10-bit mantissa), which
    # the first native run measured at ~2e-4 off the kernels; the oracle must be exact f32.
    exact = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("BTKGD,BSKD->BKGTS", qg, k, precision=exact) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    q_pos = (kv_lens - q_lens)[:, None] + jnp.arange(num_q)[None, :]  # [B, Tq]
    k_pos = jnp.arange(k.shape[1])  # [S]
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < kv_lens[:, None, None])
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    mask = mask[:, None, None, :, :]  # [B, 1, 1, Tq, S]
    scores = jnp.where(mask, scores, -jnp.inf)
    # Padding queries have no visible key: give them a harmless finite row, zero them below.
    any_visible = jnp.any(mask, axis=-1, keepdims=True)
    scores = jnp.where(any_visible, scores, 0.0)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:  # the sink as one more key, dropped after the softmax
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, num_kv_heads, group, 1, 1),
                                scores.shape[:-1] + (1,))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    out = jnp.einsum("BKGTS,BSKD->BTKGD", probs, v, precision=exact).reshape(batch, num_q, num_heads, head_dim)
    valid = jnp.arange(num_q)[None, :] < q_lens[:, None]  # [B, Tq]
    return jnp.where(valid[:, :, None, None], out, 0.0).astype(q.dtype)
