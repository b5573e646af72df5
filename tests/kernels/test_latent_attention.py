"""Latent attention (DeepSeek-V3's MLA over a latent pool): the jnp reference against hand-computed
values, and the engine's chunked XLA form against the reference over page sizes, dtypes and lengths
0 / 1 / page-aligned / unaligned, with permuted page tables and every unused slot NaN. The expanded
form of prefill rows and the absorbed form (with its W_UK / W_UV products) against a float64 numpy
computation of HF's expanded attention, including rows whose earlier keys are already in the pool;
and which row widths choose the expanded form."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.latent_attention import (latent_attention_expanded, latent_attention_ref, latent_attention_xla,
                                             prefill_uses_expanded, write_latent)

TOLERANCE = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _pool(rng, kv_lens, page_size, width, dtype, num_heads=4, num_q=1):
    """(q, pool, page_indices): each row's latents at its own permuted pages, the rest NaN."""
    pages_per_seq = max(1, -(-max(kv_lens) // page_size)) + 1
    num_pages = len(kv_lens) * pages_per_seq + 1
    order = rng.permutation(num_pages)
    tables = order[:len(kv_lens) * pages_per_seq].reshape(len(kv_lens), pages_per_seq).astype(np.int32)
    pool = np.full((1, num_pages, page_size, 1, width), np.nan, np.float32)
    for row, n in enumerate(kv_lens):
        for t in range(n):
            pool[0, tables[row, t // page_size], t % page_size, 0] = rng.standard_normal(width)
    q = jnp.asarray(rng.standard_normal((len(kv_lens), num_q, num_heads, width)), dtype)
    return q, jnp.asarray(pool, dtype), jnp.asarray(tables)


def test_reference_against_hand_computed():
    """Two rows over a permuted page table, unused slots NaN: row 0 decodes its 6th token, row 1
    prefills 3 tokens of 3; each query sees exactly its causal keys, values the latents' first R."""
    rng = np.random.default_rng(0)
    page_size, width, value_dim, heads = 4, 6, 4, 2
    pool = jnp.full((1, 6, page_size, 1, width), jnp.nan, jnp.float32)
    tables = np.array([[4, 1], [2, 5]], np.int32)
    lens = [6, 3]
    latents = [rng.standard_normal((n, width)).astype(np.float32) for n in lens]
    for row, n in enumerate(lens):
        slots = np.array([tables[row, t // page_size] * page_size + t % page_size for t in range(n)], np.int32)
        pool = write_latent(pool, jnp.asarray(latents[row][:, None, :]), jnp.asarray(slots))
    q = rng.standard_normal((2, 3, heads, width)).astype(np.float32)
    q_lens = np.array([1, 3], np.int32)
    out = np.asarray(latent_attention_ref(jnp.asarray(q), pool, jnp.asarray(tables), jnp.asarray(lens, jnp.int32),
                                          jnp.asarray(q_lens), sm_scale=0.5, value_dim=value_dim))
    for row in range(2):
        for i in range(3):
            if i >= q_lens[row]:
                assert not out[row, i].any()
                continue
            pos = lens[row] - q_lens[row] + i
            keys = latents[row][:pos + 1]
            for h in range(heads):
                s = keys @ q[row, i, h] * 0.5
                p = np.exp(s - s.max())
                p /= p.sum()
                np.testing.assert_allclose(out[row, i, h], p @ keys[:, :value_dim], rtol=1e-5, atol=1e-6)


# (dtype, page_size, chunk_tokens): the default tier runs several chunks per row in f32 and one
# chunk per row in bf16; the rest of the product is the extended tier.
CASES = [(dtype, page_size, chunk) for dtype in (jnp.float32, jnp.bfloat16) for page_size in (4, 16)
         for chunk in (8, 256)]
CORE = {(jnp.float32, 4, 8), (jnp.bfloat16, 16, 256)}


@pytest.mark.parametrize("dtype,page_size,chunk_tokens", [
    pytest.param(*case, marks=() if case in CORE else pytest.mark.extended,
                 id=f"{jnp.dtype(case[0]).name}-page{case[1]}-chunk{case[2]}") for case in CASES])
@pytest.mark.parametrize("kv_lens,q_lens,num_q", [
    ([1, 17, 32, 0, 33], [1, 1, 1, 0, 1], 1),  # decode rows: lengths 1, unaligned, aligned, padding
    ([40, 7, 48, 0], [9, 7, 5, 0], 9),  # prefill and chunked prefill rows
], ids=["decode", "prefill"])
@pytest.mark.parametrize("early_exit", [None, False], ids=["until-longest", "whole-table"])
def test_xla_matches_reference(dtype, page_size, chunk_tokens, kv_lens, q_lens, num_q, early_exit):
    rng = np.random.default_rng(1)
    width, value_dim = 40, 32
    q, pool, tables = _pool(rng, kv_lens, page_size, width, dtype, num_q=num_q)
    args = (q, pool, tables, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(q_lens, jnp.int32))
    want = latent_attention_ref(*args, sm_scale=0.2, value_dim=value_dim)
    got = latent_attention_xla(*args, sm_scale=0.2, value_dim=value_dim, chunk_tokens=chunk_tokens,
                               early_exit=early_exit)
    assert got.shape == (len(kv_lens), num_q, 4, value_dim) and got.dtype == dtype
    assert np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **TOLERANCE[dtype])


def test_shapes_are_checked():
    q = jnp.zeros((2, 1, 4, 40))
    pool = jnp.zeros((2, 8, 4, 1, 40))  # a K/V pool, not a latent one
    with pytest.raises(ValueError, match=r"need a latent pool \[1, P, page_size, 1, 40\]"):
        latent_attention_xla(q, pool, jnp.zeros((2, 3), jnp.int32), jnp.ones(2, jnp.int32), jnp.ones(2, jnp.int32),
                             sm_scale=1.0, value_dim=32)
    with pytest.raises(ValueError, match="value_dim must be in 1..40"):
        latent_attention_ref(q, pool[:1], jnp.zeros((2, 3), jnp.int32), jnp.ones(2, jnp.int32),
                             jnp.ones(2, jnp.int32), sm_scale=1.0, value_dim=41)


def _expanded_f64(q, pool, tables, kv_lens, q_lens, w_uk, w_uv, sm_scale):
    """HF's MLA in float64: per-head keys [c W_UK ; k_rope], values c W_UV, causal softmax by position."""
    rank, dn = w_uk.shape[0], w_uk.shape[2]
    batch, num_q, num_heads, _ = q.shape
    page_size = pool.shape[2]
    out = np.zeros((batch, num_q, num_heads, w_uv.shape[2]))
    for b in range(batch):
        for i in range(q_lens[b]):
            pos = kv_lens[b] - q_lens[b] + i
            lat = np.stack([pool[0, tables[b, t // page_size], t % page_size, 0] for t in range(pos + 1)])
            k = np.concatenate([np.einsum("SR,RND->SND", lat[:, :rank], w_uk),
                                np.broadcast_to(lat[:, None, rank:], (pos + 1, num_heads, lat.shape[1] - rank))], -1)
            v = np.einsum("SR,RNV->SNV", lat[:, :rank], w_uv)
            s = np.einsum("ND,SND->NS", q[b, i], k) * sm_scale
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, i] = np.einsum("NS,SNV->NV", p / p.sum(-1, keepdims=True), v)
    return out


@pytest.mark.parametrize("page_size,chunk_tokens", [(4, 4), (4, 256), (16, 8)],
                         ids=["page4-chunk4", "page4-chunk256", "page16-chunk8"])
def test_expanded_and_absorbed_match_float64(page_size, chunk_tokens):
    """Prefill rows: a fresh prompt, chunks whose earlier keys sit in the pool (a previous chunk or a
    prefix-cache hit: kv_lens well past q_lens), a one-token row and a padding row; unused slots NaN."""
    rng = np.random.default_rng(3)
    rank, rope, dn, dv, heads, sm_scale = 24, 8, 16, 12, 3, 0.3
    kv_lens, q_lens, num_q = [6, 21, 33, 9, 0], [6, 6, 3, 1, 0], 6
    _, pool, tables = _pool(rng, kv_lens, page_size, rank + rope, jnp.float32)
    q = rng.standard_normal((len(kv_lens), num_q, heads, dn + rope)).astype(np.float32)
    w_uk = rng.standard_normal((rank, heads, dn)).astype(np.float32) / 4
    w_uv = rng.standard_normal((rank, heads, dv)).astype(np.float32) / 4
    lens = (jnp.asarray(kv_lens, jnp.int32), jnp.asarray(q_lens, jnp.int32))
    want = _expanded_f64(q.astype(np.float64), np.asarray(pool, np.float64), np.asarray(tables), kv_lens, q_lens,
                         w_uk.astype(np.float64), w_uv.astype(np.float64), sm_scale)
    expanded = latent_attention_expanded(jnp.asarray(q), pool, tables, *lens, jnp.asarray(w_uk), jnp.asarray(w_uv),
                                         sm_scale=sm_scale, chunk_tokens=chunk_tokens)
    q_abs = jnp.concatenate([jnp.einsum("BTND,RND->BTNR", q[..., :dn], w_uk, precision="highest"),
                             jnp.asarray(q[..., dn:])], axis=-1)
    latent_out = latent_attention_xla(q_abs, pool, tables, *lens, sm_scale=sm_scale, value_dim=rank,
                                      chunk_tokens=chunk_tokens)
    absorbed = jnp.einsum("BTNR,RNV->BTNV", latent_out, w_uv, precision="highest")
    assert expanded.shape == want.shape and np.isfinite(np.asarray(expanded)).all()
    np.testing.assert_allclose(np.asarray(expanded), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(absorbed), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(expanded), np.asarray(absorbed), rtol=1e-5, atol=1e-5)


def test_expanded_form_is_chosen_for_rows_it_makes_cheaper():
    """At DeepSeek-V3's widths the expanded form costs fewer FLOPs from rows of 171 tokens on: the
    GPU / TPU default rows of 64 stay absorbed."""
    v3 = dict(latent_width=576, value_dim=512, qk_head_dim=192, v_head_dim=128, nope_head_dim=128)
    assert [prefill_uses_expanded(n, **v3) for n in (1, 64, 170, 171, 512)] == [False, False, False, True, True]
    # the latent no wider than the per-head dims: never expanded
    assert not prefill_uses_expanded(4096, latent_width=40, value_dim=32, qk_head_dim=48, v_head_dim=32,
                                     nope_head_dim=40)


def test_expanded_shapes_are_checked():
    pool = jnp.zeros((1, 8, 4, 1, 40))
    lens = (jnp.zeros((2, 3), jnp.int32), jnp.ones(2, jnp.int32), jnp.ones(2, jnp.int32))
    with pytest.raises(ValueError, match="do not fit latents of width 40"):
        latent_attention_expanded(jnp.zeros((2, 4, 3, 30)), pool, *lens, jnp.zeros((32, 3, 16)),
                                  jnp.zeros((32, 3, 16)), sm_scale=1.0)
    with pytest.raises(ValueError, match=r"must be \[R, 3, ...\]"):
        latent_attention_expanded(jnp.zeros((2, 4, 3, 24)), pool, *lens, jnp.zeros((32, 4, 16)),
                                  jnp.zeros((32, 4, 16)), sm_scale=1.0)


def test_batch_invariant_token_alone_equals_batched():
    """The batch-invariant form (each token a row of its own, fixed 64-key chunks): token 5 of a
    9-token prefill over 150 keys is bitwise the lone decode row at its position, beside other rows
    and over a wider table; it equals the reference."""
    rng = np.random.default_rng(7)
    kv_lens, q_lens = [150, 40, 3], [9, 1, 3]
    q, pool, tables = _pool(rng, kv_lens, 8, 48, jnp.float32, num_q=9)
    attend = functools.partial(latent_attention_xla, sm_scale=0.3, value_dim=32, batch_invariant=True)
    lens, qs = jnp.asarray(kv_lens, jnp.int32), jnp.asarray(q_lens, jnp.int32)
    batched = np.asarray(jax.jit(attend)(q, pool, tables, lens, qs))[0, 5]
    own = jnp.asarray([150 - 9 + 6], jnp.int32)  # the token's keys: through its own position
    one = jnp.ones(1, jnp.int32)
    alone = np.asarray(jax.jit(attend)(q[:1, 5:6], pool, tables[:1, :19], own, one))[0, 0]
    np.testing.assert_array_equal(batched, alone)
    want = latent_attention_ref(q[:1, 5:6], jnp.nan_to_num(pool), tables[:1], own, one, sm_scale=0.3, value_dim=32)
    np.testing.assert_allclose(batched, np.asarray(want)[0, 0], **TOLERANCE[jnp.float32])
    default = np.asarray(jax.jit(functools.partial(attend, batch_invariant=False))(q, pool, tables, lens, qs))[0, 5]
    np.testing.assert_allclose(default, batched, **TOLERANCE[jnp.float32])
