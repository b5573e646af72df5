"""Multi-head latent attention (DeepSeek-V3's MLA) over a latent pool: the jnp reference and its write.

A latent pool caches, per token and layer, one latent "head" of C = kv_lora_rank + qk_rope_head_dim
values: the normed compressed KV c (the first kv_lora_rank values) followed by the rotated shared
RoPE key k_rope. There is no separate V half: one layer's pool is [1, P, page_size, 1, C]
(ModelConfig.kv_pool_dims), so page ids, slots and page copies work exactly as for a K/V pool.

The attention runs in the absorbed form for every row (decode, prefill, chunked prefill alike):
the caller folds each head's q_nope into latent space through W_UK, so the query is
q = [q_nope W_UK ; q_rope] [N, C], every head's keys are the cached latents (MQA with one kv head
of width C), and the values are the cached latents' first `value_dim` (= kv_lora_rank) values.
The output stays in latent space [N, kv_lora_rank]; the caller applies W_UV and o_proj.

No Pallas kernel exists for it yet: the engine runs this reference (pallas_kernels/dispatch.py's
kernels are refused for latent attention in paxpage/attention_impl.py).

Axis legend: B rows, Tq query tokens per row, T flat tokens, S key length, N query heads,
C latent width, R value width (kv_lora_rank), P pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_latent(
    latent_pages: jax.Array,  # [1, P, page_size, 1, C] one layer's latent pool (donate it in the caller's jit)
    latent: jax.Array,  # [T, 1, C] this step's latents, flat tokens
    slot_mapping: jax.Array,  # i32[T] page_id * page_size + offset; -1 = padding, not written
) -> jax.Array:
    """Returns the pool with token t's latent stored at slot_mapping[t]."""
    if latent_pages.ndim != 5 or latent_pages.shape[0] != 1 or latent_pages.shape[3] != 1:
        raise ValueError(f"a latent pool is [1, P, page_size, 1, C]; got {latent_pages.shape}")
    if latent.shape[1:] != latent_pages.shape[3:]:
        raise ValueError(f"latents {latent.shape} do not fit the pool's rows {latent_pages.shape[3:]}")
    _, num_pages, page_size, _, _ = latent_pages.shape
    page = jnp.where(slot_mapping < 0, num_pages, slot_mapping // page_size)  # padding: out of bounds
    offset = slot_mapping % page_size
    return latent_pages.at[0, page, offset].set(latent.astype(latent_pages.dtype), mode="drop")


def latent_attention_ref(
    q: jax.Array,  # [B, Tq, N, C] absorbed queries: [q_nope W_UK ; q_rope]
    latent_pages: jax.Array,  # [1, P, page_size, 1, C] already holding this step's latents
    page_indices: jax.Array,  # i32[B, pages_per_seq]
    kv_lens: jax.Array,  # i32[B] cached tokens incl. this step's; 0 = padding row
    q_lens: jax.Array,  # i32[B] new tokens this step
    *,
    sm_scale: float,
    value_dim: int,  # R: the values are each cached latent's first R entries
) -> jax.Array:  # [B, Tq, N, R]; padding query tokens are zeros
    """Causal attention in the row layout of `reference.paged_attention_ref` (query token i of row b
    is at position kv_lens[b] - q_lens[b] + i and sees keys 0..p) against the latent pool."""
    batch, num_q, num_heads, width = q.shape
    if latent_pages.shape[0] != 1 or latent_pages.shape[3:] != (1, width):
        raise ValueError(f"queries of width {width} need a latent pool [1, P, page_size, 1, {width}]; "
                         f"got {latent_pages.shape}")
    if not 0 < value_dim <= width:
        raise ValueError(f"value_dim must be in 1..{width}, got {value_dim}")
    if page_indices.shape[0] != batch or kv_lens.shape != (batch,) or q_lens.shape != (batch,):
        raise ValueError(f"page_indices {page_indices.shape}, kv_lens {kv_lens.shape}, q_lens {q_lens.shape} "
                         f"do not match {batch} rows")
    keys = latent_pages[0][page_indices].reshape(batch, -1, width).astype(jnp.float32)  # [B, S, C]
    k_pos = jnp.arange(keys.shape[1])  # [S]
    q_pos = (kv_lens - q_lens)[:, None] + jnp.arange(num_q)[None, :]  # [B, Tq]
    visible_keys = k_pos[None, :] < kv_lens[:, None]  # [B, S]
    # Stale or NaN contents of unused slots must not reach the output through 0 * NaN.
    keys = jnp.where(visible_keys[:, :, None], keys, 0.0)
    exact = jax.lax.Precision.HIGHEST  # exact f32 on GPU too (XLA's default rounds to TF32)
    scores = jnp.einsum("BTNC,BSC->BNTS", q.astype(jnp.float32), keys, precision=exact) * sm_scale
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & visible_keys[:, None, :]  # [B, Tq, S]
    mask = mask[:, None]  # [B, 1, Tq, S]
    scores = jnp.where(mask, scores, -jnp.inf)
    scores = jnp.where(jnp.any(mask, axis=-1, keepdims=True), scores, 0.0)  # padding queries: finite
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("BNTS,BSR->BTNR", probs, keys[:, :, :value_dim], precision=exact)
    valid = jnp.arange(num_q)[None, :] < q_lens[:, None]  # [B, Tq]
    return jnp.where(valid[:, :, None, None], out, 0.0).astype(q.dtype)
