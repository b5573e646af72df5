"""Latent attention (DeepSeek-V3's MLA over a latent pool): the jnp reference against hand-computed
values, and the engine's chunked XLA form against the reference over page sizes, dtypes and lengths
0 / 1 / page-aligned / unaligned, with permuted page tables and every unused slot NaN."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.latent_attention import latent_attention_ref, latent_attention_xla, write_latent

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
