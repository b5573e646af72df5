"""Multi-head latent attention (DeepSeek-V3's MLA) over a latent pool: the jnp reference and its write.

A latent pool caches, per token and layer, one latent "head" of C = kv_lora_rank + qk_rope_head_dim
values: the normed compressed KV c (the first kv_lora_rank values) followed by the rotated shared
RoPE key k_rope. There is no separate V half: one layer's pool is [1, P, page_size, 1, C]
(ModelConfig.kv_pool_dims), so page ids, slots and page copies work exactly as for a K/V pool.

Two forms of the attention. The absorbed form (decode rows, and prefill rows too narrow for the
other to pay): the caller folds each head's q_nope into latent space through W_UK, so the query is
q = [q_nope W_UK ; q_rope] [N, C], every head's keys are the cached latents (MQA with one kv head
of width C), and the values are the cached latents' first `value_dim` (= kv_lora_rank) values.
The output stays in latent space [N, kv_lora_rank]; the caller applies W_UV and o_proj.
The expanded form (`latent_attention_expanded`, prefill rows of at least `prefill_uses_expanded`'s
width): each row's cached latents are expanded through kv_b_proj to per-head keys [c W_UK ; k_rope]
[N, Dn + Dr] and values c W_UV [N, Dv], and ordinary causal attention runs on them, as HF and vLLM
compute prefill: head dims Dn + Dr and Dv instead of C, far fewer FLOPs per query-key pair.
Memory bound of the expanded form: one loop step expands at most max(Tq, page_size) keys of each
row (whole pages), so its expanded keys and values are at most N (Dn + Dv) values per query token
of the step (one page per row where rows are narrower than a page), never the row's whole context.

The absorbed form, one signature: `latent_attention_ref` gathers each row's whole page table (the oracle);
`latent_attention_xla`, what the engine runs on every backend, walks the key length in chunks of
whole pages under a while loop with an online softmax (as pallas_kernels/xla_attention.py does for
K/V pools), so a step reads only up to its longest row's keys, never the whole table. No Pallas
kernel exists for it yet (pallas_kernels/dispatch.py's kernels are refused for latent attention in
paxpage/attention_impl.py).

Axis legend: B rows, Tq query tokens per row, T flat tokens, S key length, N query heads,
C latent width, R value width (kv_lora_rank), P pages, Dn / Dr / Dv the per-head no-RoPE key,
RoPE key and value widths (expanded form).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.kv_layout import two_token_scatter
from pallas_kernels.xla_attention import INVARIANT_CHUNK_TOKENS, fold_chunks, pages_per_chunk, pairwise_sum, token_rows


def check_latent_rows(latent_pages: jax.Array, latent: jax.Array) -> None:
    """ValueError unless latent_pages is a latent pool [1, P, page_size, 1, C] and latent [T, 1, C] its rows."""
    if latent_pages.ndim != 5 or latent_pages.shape[0] != 1 or latent_pages.shape[3] != 1:
        raise ValueError(f"a latent pool is [1, P, page_size, 1, C]; got {latent_pages.shape}")
    if latent.shape[1:] != latent_pages.shape[3:]:
        raise ValueError(f"latents {latent.shape} do not fit the pool's rows {latent_pages.shape[3:]}")


def write_latent(
    latent_pages: jax.Array,  # [1, P, page_size, 1, C] one layer's latent pool (donate it in the caller's jit)
    latent: jax.Array,  # [T, 1, C] this step's latents, flat tokens
    slot_mapping: jax.Array,  # i32[T] page_id * page_size + offset; -1 = padding, not written
) -> jax.Array:
    """Returns the pool with token t's latent stored at slot_mapping[t]."""
    check_latent_rows(latent_pages, latent)
    _, num_pages, page_size, _, _ = latent_pages.shape
    slot_mapping, latent = two_token_scatter(slot_mapping, latent)
    page = jnp.where(slot_mapping < 0, num_pages, slot_mapping // page_size)  # padding: out of bounds
    offset = slot_mapping % page_size
    return latent_pages.at[0, page, offset].set(latent.astype(latent_pages.dtype), mode="drop")


def _check(q, latent_pages, page_indices, kv_lens, q_lens, value_dim):
    batch, _, _, width = q.shape
    if latent_pages.ndim != 5 or latent_pages.shape[0] != 1 or latent_pages.shape[3:] != (1, width):
        raise ValueError(f"queries of width {width} need a latent pool [1, P, page_size, 1, {width}]; "
                         f"got {latent_pages.shape}")
    if not 0 < value_dim <= width:
        raise ValueError(f"value_dim must be in 1..{width}, got {value_dim}")
    if page_indices.shape[0] != batch or kv_lens.shape != (batch,) or q_lens.shape != (batch,):
        raise ValueError(f"page_indices {page_indices.shape}, kv_lens {kv_lens.shape}, q_lens {q_lens.shape} "
                         f"do not match {batch} rows")


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
    _check(q, latent_pages, page_indices, kv_lens, q_lens, value_dim)
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


def latent_attention_xla(
    q: jax.Array,  # [B, Tq, N, C]
    latent_pages: jax.Array,  # [1, P, page_size, 1, C]
    page_indices: jax.Array,  # i32[B, pages_per_seq]
    kv_lens: jax.Array,  # i32[B]
    q_lens: jax.Array,  # i32[B]
    *,
    sm_scale: float,
    value_dim: int,
    chunk_tokens: int = 256,  # keys per loop step, at most (whole pages, ~1 MiB of latents)
    early_exit: bool | None = None,  # xla_attention.fold_chunks: None decides by platform
    batch_invariant: bool = False,  # xla_attention's batch-invariant form: each token alone, fixed chunks
) -> jax.Array:  # [B, Tq, N, R]
    """`latent_attention_ref` in chunks: the loop's trip count is the longest row's length in chunks
    (a traced value; lowered for a GPU, the table's width: xla_attention.fold_chunks), each step
    gathers one chunk of pages of every row and folds it into a running max / sum / output. Keys
    past a row's length or after a query are masked, and zeroed before the products, so stale or
    NaN slots never reach the output.
    batch_invariant: every query token a row of its own over chunks of xla_attention's
    INVARIANT_CHUNK_TOKENS keys from key 0, sums in a fixed order (as paged_attention_xla's form)."""
    _check(q, latent_pages, page_indices, kv_lens, q_lens, value_dim)
    if batch_invariant and q.shape[1] > 1:
        tok_q, tables, tok_kv_lens, tok_q_lens = token_rows(q, page_indices, kv_lens, q_lens)
        out = latent_attention_xla(tok_q, latent_pages, tables, tok_kv_lens, tok_q_lens, sm_scale=sm_scale,
                                   value_dim=value_dim, early_exit=early_exit, batch_invariant=True)
        return out.reshape(*q.shape[:3], value_dim)
    batch, num_q, num_heads, width = q.shape
    page_size = latent_pages.shape[2]
    pages_per_seq = page_indices.shape[1]
    if batch_invariant:
        chunk_pages = max(1, INVARIANT_CHUNK_TOKENS // page_size)
    else:
        chunk_pages = pages_per_chunk(batch, page_size * width * latent_pages.dtype.itemsize, page_size,
                                      pages_per_seq, chunk_tokens)
    q32 = q.astype(jnp.float32) * sm_scale
    exact = lax.Precision.HIGHEST

    def scores_and_values(keys):  # the latents are the keys, and their first R entries the values
        scores = jnp.einsum("BTNC,BSC->BTNS", q32, keys, precision=exact)
        return scores, lambda p: jnp.einsum("BTNS,BSR->BTNR", p, keys[:, :, :value_dim], precision=exact)

    return _attend_in_chunks(latent_pages, page_indices, kv_lens, q_lens, num_q, num_heads, value_dim,
                             chunk_pages, early_exit, scores_and_values, q.dtype, in_order=batch_invariant)


def prefill_uses_expanded(num_q: int, *, latent_width: int, value_dim: int, qk_head_dim: int,
                          v_head_dim: int, nope_head_dim: int) -> bool:
    """Whether rows of `num_q` query tokens cost fewer FLOPs in the expanded form than the absorbed
    one, for any key length S (a static choice, made when the step is traced).

    Per head, the absorbed form spends S Tq (C + R) on scores and values plus Tq R (Dn + Dv) on
    folding the queries in and the output out; the expanded one S R (Dn + Dv) on expanding the
    row's keys and values plus S Tq (Dn + Dr + Dv) on attention. With S >= Tq the expanded form
    is the cheaper one whenever Tq (C + R - Dn - Dr - Dv) >= R (Dn + Dv): at DeepSeek-V3's widths
    (C 576, R 512, Dn 128, Dr 64, Dv 128) rows of at least 171 tokens. Narrower rows expand the
    same keys again for every row of a chunk, which costs more than absorbing."""
    saved = latent_width + value_dim - qk_head_dim - v_head_dim
    return saved > 0 and num_q * saved >= value_dim * (nope_head_dim + v_head_dim)


def latent_attention_expanded(
    q: jax.Array,  # [B, Tq, N, Dn + Dr] per-head queries [q_nope ; q_rope]
    latent_pages: jax.Array,  # [1, P, page_size, 1, C] already holding this step's latents
    page_indices: jax.Array,  # i32[B, pages_per_seq]
    kv_lens: jax.Array,  # i32[B] cached tokens incl. this step's; 0 = padding row
    q_lens: jax.Array,  # i32[B] new tokens this step
    w_uk: jax.Array,  # [R, N, Dn] kv_b_proj's key half
    w_uv: jax.Array,  # [R, N, Dv] kv_b_proj's value half
    *,
    sm_scale: float,
    chunk_tokens: int = 256,  # keys per loop step, at most (whole pages; see the bound below)
    early_exit: bool | None = None,  # xla_attention.fold_chunks: None decides by platform
) -> jax.Array:  # [B, Tq, N, Dv]; padding query tokens are zeros
    """HF's attention itself: each row's cached latents expanded to per-head keys
    [c W_UK ; k_rope] and values c W_UV, then ordinary causal attention (row layout and masking of
    `latent_attention_ref`). The output is per head [N, Dv], already through W_UV.

    The keys are walked in chunks of whole pages under a loop with an online softmax, as
    `latent_attention_xla` does, and only one chunk is expanded at a time: a chunk holds at most
    max(Tq, page_size) keys, so the expanded keys and values of a loop step, B x chunk x N x
    (Dn + Dv) values, are at most N (Dn + Dv) per query token of the step (one page per row where
    rows are narrower than a page), however long the rows' contexts are."""
    batch, num_q, num_heads, qk_dim = q.shape
    _, _, page_size, _, width = latent_pages.shape
    rank, nope_dim, v_dim = w_uk.shape[0], w_uk.shape[2], w_uv.shape[2]
    if w_uk.shape[:2] != (rank, num_heads) or w_uv.shape[:2] != (rank, num_heads):
        raise ValueError(f"w_uk {w_uk.shape} and w_uv {w_uv.shape} must be [R, {num_heads}, ...]")
    if qk_dim - nope_dim != width - rank or not 0 < rank < width:
        raise ValueError(f"queries of width {qk_dim} = Dn {nope_dim} + Dr do not fit latents of width {width} "
                         f"= R {rank} + Dr")
    _check(jax.ShapeDtypeStruct((batch, num_q, num_heads, width), q.dtype), latent_pages, page_indices, kv_lens,
           q_lens, rank)
    pages_per_seq = page_indices.shape[1]
    expanded_page_bytes = page_size * num_heads * (nope_dim + v_dim) * 4
    chunk_pages = pages_per_chunk(batch, expanded_page_bytes, page_size, pages_per_seq,
                                  min(chunk_tokens, max(num_q, page_size)))
    q32 = q.astype(jnp.float32) * sm_scale
    q_nope, q_rope = q32[..., :nope_dim], q32[..., nope_dim:]  # [B, Tq, N, Dn], [B, Tq, N, Dr]
    w_uk32, w_uv32 = w_uk.astype(jnp.float32), w_uv.astype(jnp.float32)
    exact = lax.Precision.HIGHEST

    def scores_and_values(latents):  # this chunk's latents expanded to per-head keys and values
        compressed, k_rope = latents[..., :rank], latents[..., rank:]  # [B, S, R], [B, S, Dr]
        k_nope = jnp.einsum("BSR,RND->BSND", compressed, w_uk32, precision=exact)
        values = jnp.einsum("BSR,RNV->BSNV", compressed, w_uv32, precision=exact)
        scores = (jnp.einsum("BTND,BSND->BTNS", q_nope, k_nope, precision=exact)
                  + jnp.einsum("BTND,BSD->BTNS", q_rope, k_rope, precision=exact))
        return scores, lambda p: jnp.einsum("BTNS,BSNV->BTNV", p, values, precision=exact)

    return _attend_in_chunks(latent_pages, page_indices, kv_lens, q_lens, num_q, num_heads, v_dim,
                             chunk_pages, early_exit, scores_and_values, q.dtype)


def _attend_in_chunks(latent_pages, page_indices, kv_lens, q_lens, num_q: int, num_heads: int, out_dim: int,
                      chunk_pages: int, early_exit, scores_and_values, out_dtype,
                      in_order: bool = False) -> jax.Array:
    """Causal attention of every row's queries over its cached latents, `chunk_pages` pages of
    each row per loop step, with a running max / sum / output (xla_attention.fold_chunks).
    `scores_and_values(latents f32[B, S, C])` gives the chunk's scaled scores f32[B, Tq, N, S]
    and a function of the probabilities p f32[B, Tq, N, S] to their values' sum f32[B, Tq, N,
    out_dim]. Keys past a row's length or after a query are masked, and their latents zeroed
    before any product, so stale or NaN slots never reach the output. -> [B, Tq, N, out_dim].
    in_order: the sums over a chunk's keys in a fixed pairwise order (the batch-invariant form)."""
    batch, pages_per_seq = page_indices.shape
    _, num_pages, page_size, _, width = latent_pages.shape
    chunk_len = chunk_pages * page_size  # S
    num_chunk_slots = -(-pages_per_seq // chunk_pages)
    # Whole chunks, clamped into the pool: entries past a row's pages may hold anything (masked).
    pad = num_chunk_slots * chunk_pages - pages_per_seq
    page_indices = jnp.clip(jnp.pad(page_indices.astype(jnp.int32), ((0, 0), (0, pad))), 0, num_pages - 1)
    pool_rows = latent_pages.reshape(num_pages, page_size * width)
    kv_lens, q_lens = kv_lens.astype(jnp.int32), q_lens.astype(jnp.int32)
    q_pos = (kv_lens - q_lens)[:, None] + jnp.arange(num_q)[None, :]  # [B, Tq]
    num_chunks = jnp.minimum((jnp.max(kv_lens) + chunk_len - 1) // chunk_len, num_chunk_slots)

    def body(carry):
        c, m, l, acc = carry
        ids = lax.dynamic_slice_in_dim(page_indices, c * chunk_pages, chunk_pages, axis=1)  # [B, pages]
        latents = pool_rows[ids].reshape(batch, chunk_len, width).astype(jnp.float32)  # [B, S, C]
        k_pos = c * chunk_len + jnp.arange(chunk_len)  # [S]
        in_row = k_pos[None, :] < kv_lens[:, None]  # [B, S]
        scores, weigh = scores_and_values(jnp.where(in_row[:, :, None], latents, 0.0))
        visible = in_row[:, None, :] & (k_pos[None, None, :] <= q_pos[:, :, None])  # [B, Tq, S]
        scores = jnp.where(visible[:, :, None, :], scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))  # [B, Tq, N]
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(scores - m_safe[..., None])  # masked keys: exp(-inf) = 0
        rescale = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
        l = l * rescale + (pairwise_sum(p) if in_order else jnp.sum(p, axis=-1))
        acc = acc * rescale[..., None] + weigh(p)
        return c + 1, m_new, l, acc

    init = (jnp.int32(0), jnp.full((batch, num_q, num_heads), -jnp.inf, jnp.float32),
            jnp.zeros((batch, num_q, num_heads), jnp.float32),
            jnp.zeros((batch, num_q, num_heads, out_dim), jnp.float32))
    _, _, l, acc = fold_chunks(body, init, num_chunks, num_chunk_slots, early_exit)
    valid = (jnp.arange(num_q)[None, :] < q_lens[:, None])[:, :, None]  # [B, Tq, 1]
    out = acc / jnp.where(valid & (l > 0), l, 1.0)[..., None]
    return jnp.where(valid[..., None], out, 0.0).astype(out_dtype)
