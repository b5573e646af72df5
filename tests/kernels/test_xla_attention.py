"""The engine's CPU fast path (XLA loop over page chunks) against the jnp reference: the while loop
that stops at the longest row (CPU, TPU) and the fixed loop over the table's width (GPU lowering,
early_exit=False), which reads the masked chunks past the rows and before their windows."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import (CONFIGS, SINK_CASES, WINDOW_CASES, assert_close, assert_sinks_matter, config_id,
                          make_case, make_sinks, reference_pool, release_outside_window, window_case_id)
from pallas_kernels.reference import paged_attention_ref
from pallas_kernels.xla_attention import paged_attention_xla, pages_per_chunk


def _finite_garbage(pool: np.ndarray) -> np.ndarray:
    """Unused slots hold stale finite K/V in the engine (the pool starts zeroed); large values
    there make any slot that escapes the mask visible in the output."""
    pool = np.asarray(jnp.asarray(pool, jnp.float32)).copy()
    pool[np.isnan(pool)] = 1e4
    return pool


@pytest.mark.parametrize("cfg", CONFIGS, ids=config_id)
@pytest.mark.parametrize("chunk_tokens", [8, 64])
@pytest.mark.parametrize(
    "kv_lens,q_lens",
    [([1, 17, 64, 0, 33], [1, 1, 1, 0, 1]), ([40, 7, 96, 0], [9, 7, 5, 0])],
    ids=["decode", "prefill"],
)
def test_xla_matches_reference(cfg, chunk_tokens, kv_lens, q_lens):
    dtype, page_size, ratio, head_dim, num_kv_heads = cfg
    rng = np.random.default_rng(3)
    case = make_case(rng, dtype=dtype, page_size=page_size, ratio=ratio, head_dim=head_dim,
                     num_kv_heads=num_kv_heads, kv_lens=kv_lens, q_lens=q_lens,
                     pages_per_seq=-(-96 // page_size) + 1)
    pool = jnp.asarray(_finite_garbage(case.kv_pages), dtype)
    got = paged_attention_xla(jnp.asarray(case.q), pool, case.page_indices, case.kv_lens,
                              case.q_lens, sm_scale=head_dim ** -0.5, chunk_tokens=chunk_tokens)
    clean = np.nan_to_num(np.asarray(jnp.asarray(case.kv_pages, jnp.float32)))
    want = paged_attention_ref(jnp.asarray(case.q), jnp.asarray(clean, dtype), case.page_indices,
                               case.kv_lens, case.q_lens, sm_scale=head_dim ** -0.5)
    assert_close(got, want, dtype)


# The decode (Tq == 1, expanded q) and prefill (Tq > 1) forms, each with lengths 0 / 1 /
# page-aligned / unaligned, permuted page tables, NaN in unused pages and slots (fed to the
# XLA path as NaN, to the reference as zeros), and chunk sizes of one page and several.
LENGTH_CASES = {
    "decode": ([0, 1, 8, 16, 24, 31, 32, 5], [0, 1, 1, 1, 1, 1, 1, 1]),
    "prefill": ([0, 1, 16, 23, 32, 9], [0, 1, 16, 7, 3, 9]),
}


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[1], CONFIGS[3]], ids=config_id)
@pytest.mark.parametrize("chunk_tokens", [pytest.param(1, marks=pytest.mark.extended), 32,
                                          pytest.param(1024, marks=pytest.mark.extended)])
@pytest.mark.parametrize("kind", sorted(LENGTH_CASES))
@pytest.mark.parametrize("early_exit", [None, False], ids=["until-longest", "whole-table"])
def test_nan_in_unused_pages_never_leaks(cfg, chunk_tokens, kind, early_exit):
    dtype, page_size, ratio, head_dim, num_kv_heads = cfg
    kv_lens, q_lens = LENGTH_CASES[kind]
    rng = np.random.default_rng(11)
    case = make_case(rng, dtype=dtype, page_size=page_size, ratio=ratio, head_dim=head_dim,
                     num_kv_heads=num_kv_heads, kv_lens=kv_lens, q_lens=q_lens,
                     pages_per_seq=-(-32 // page_size) + 2)
    got = paged_attention_xla(jnp.asarray(case.q), jnp.asarray(case.kv_pages), case.page_indices,
                              case.kv_lens, case.q_lens, sm_scale=head_dim ** -0.5,
                              chunk_tokens=chunk_tokens, early_exit=early_exit)
    want = paged_attention_ref(jnp.asarray(case.q), jnp.asarray(reference_pool(case.kv_pages)),
                               case.page_indices, case.kv_lens, case.q_lens, sm_scale=head_dim ** -0.5)
    assert_close(got, want, dtype)
    # Padding rows and padding query tokens are exact zeros.
    pad = np.arange(case.q.shape[1])[None, :] >= case.q_lens[:, None]
    assert not np.asarray(jnp.asarray(got, jnp.float32))[pad].any()


def test_all_padding_rows_give_zeros():
    # max(kv_lens) == 0: the chunk loop runs no step at all.
    rng = np.random.default_rng(5)
    case = make_case(rng, dtype=jnp.float32, page_size=8, ratio=2, head_dim=16, num_kv_heads=2,
                     kv_lens=[0, 0, 0], q_lens=[0, 0, 0], pages_per_seq=4)
    got = paged_attention_xla(jnp.asarray(case.q), jnp.asarray(case.kv_pages), case.page_indices,
                              case.kv_lens, case.q_lens, sm_scale=0.25)
    assert got.shape == case.q.shape and not np.asarray(got).any()


def test_table_entries_out_of_the_pool_are_harmless():
    # Entries past a row's pages may hold anything; they are clamped into the pool and masked.
    rng = np.random.default_rng(8)
    case = make_case(rng, dtype=jnp.float32, page_size=8, ratio=3, head_dim=16, num_kv_heads=1,
                     kv_lens=[13, 4], q_lens=[1, 1], pages_per_seq=6)
    table = case.page_indices.copy()
    table[0, 2:] = [10**6, -7, 2**31 - 1, -(2**31)]
    table[1, 1:] = 999
    got = paged_attention_xla(jnp.asarray(case.q), jnp.asarray(case.kv_pages), table,
                              case.kv_lens, case.q_lens, sm_scale=0.25, chunk_tokens=64)
    want = paged_attention_ref(jnp.asarray(case.q), jnp.asarray(reference_pool(case.kv_pages)),
                               case.page_indices, case.kv_lens, case.q_lens, sm_scale=0.25)
    assert_close(got, want, jnp.float32)


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[4]], ids=config_id)
@pytest.mark.parametrize("wc", WINDOW_CASES, ids=window_case_id)
@pytest.mark.parametrize("chunk_tokens", [8, 64])
@pytest.mark.parametrize("kind", sorted(LENGTH_CASES))
@pytest.mark.parametrize("early_exit", [None, False], ids=["until-longest", "whole-table"])
def test_sliding_window_and_soft_cap(cfg, wc, chunk_tokens, kind, early_exit):
    """Pages wholly before a row's window are NaN (released): skipped or masked, never read."""
    dtype, page_size, ratio, head_dim, num_kv_heads = cfg
    window, cap = wc
    kv_lens, q_lens = LENGTH_CASES[kind]
    kv_lens, q_lens = [n + 40 * (n > 0) for n in kv_lens], q_lens  # long enough to leave pages behind
    rng = np.random.default_rng(21)
    case = make_case(rng, dtype=dtype, page_size=page_size, ratio=ratio, head_dim=head_dim,
                     num_kv_heads=num_kv_heads, kv_lens=kv_lens, q_lens=q_lens,
                     pages_per_seq=-(-72 // page_size) + 1)
    case = release_outside_window(case, window)
    kw = dict(sm_scale=head_dim ** -0.5, sliding_window=window, soft_cap=cap)
    got = paged_attention_xla(jnp.asarray(case.q), jnp.asarray(case.kv_pages), case.page_indices,
                              case.kv_lens, case.q_lens, chunk_tokens=chunk_tokens, early_exit=early_exit, **kw)
    want = paged_attention_ref(jnp.asarray(case.q), jnp.asarray(reference_pool(case.kv_pages)),
                               case.page_indices, case.kv_lens, case.q_lens, **kw)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[3], CONFIGS[5]], ids=config_id)
@pytest.mark.parametrize("wc", SINK_CASES, ids=window_case_id)
@pytest.mark.parametrize("kind", sorted(LENGTH_CASES))
@pytest.mark.parametrize("early_exit", [None, False], ids=["until-longest", "whole-table"])
def test_sinks(cfg, wc, kind, early_exit):
    """Per-head sinks (GQA) with and without a window / cap, chunks of one page so the sink meets
    a carry folded over several; pages behind the window are NaN."""
    dtype, page_size, ratio, head_dim, num_kv_heads = cfg
    window, cap = wc
    kv_lens, q_lens = LENGTH_CASES[kind]
    kv_lens = [n + 20 * (n > 0) for n in kv_lens]
    rng = np.random.default_rng(23)
    case = make_case(rng, dtype=dtype, page_size=page_size, ratio=ratio, head_dim=head_dim,
                     num_kv_heads=num_kv_heads, kv_lens=kv_lens, q_lens=q_lens,
                     pages_per_seq=-(-52 // page_size) + 1)
    case = release_outside_window(case, window)
    sinks = jnp.asarray(make_sinks(rng, ratio * num_kv_heads))
    kw = dict(sm_scale=head_dim ** -0.5, sliding_window=window, soft_cap=cap)
    args = (jnp.asarray(case.q), jnp.asarray(case.kv_pages), case.page_indices, case.kv_lens, case.q_lens)
    got = paged_attention_xla(*args, chunk_tokens=page_size, early_exit=early_exit, sinks=sinks, **kw)
    want = paged_attention_ref(jnp.asarray(case.q), jnp.asarray(reference_pool(case.kv_pages)),
                               case.page_indices, case.kv_lens, case.q_lens, sinks=sinks, **kw)
    assert_close(got, want, dtype)
    assert_sinks_matter(got, paged_attention_xla(*args, chunk_tokens=page_size, early_exit=early_exit, **kw),
                        dtype)
    pad = np.arange(case.q.shape[1])[None, :] >= case.q_lens[:, None]
    assert not np.asarray(jnp.asarray(got, jnp.float32))[pad].any()


@pytest.mark.parametrize("batch,page_bytes,page_size,pages_per_seq,chunk_tokens,want", [
    (1, 4096, 16, 128, 64, 4),  # small batch: the token cap
    (256, 4096, 16, 128, 64, 1),  # 256 rows x 4 KiB pages: one page per chunk fits 1 MiB
    (64, 4096, 16, 128, 64, 4),  # 64 x 4 pages x 4 KiB = 1 MiB
    (2, 4096, 16, 3, 1024, 3),  # never past the table
    (4, 1 << 21, 8, 16, 64, 1),  # pages over the budget: still one page
])
def test_pages_per_chunk(batch, page_bytes, page_size, pages_per_seq, chunk_tokens, want):
    assert pages_per_chunk(batch, page_bytes, page_size, pages_per_seq, chunk_tokens) == want


def _token_alone_and_batched(batch_invariant: bool, **masking):
    """Token 4 of row 0's 9-token prefill (position 40 + 4 over a 49-key row) in a mixed batch over
    an 80-page table, the same token as a decode row alone over a 12-page table, and the reference
    for it: (batched, alone, want), each [N, D]."""
    rng = np.random.default_rng(12)
    kv_lens, q_lens = [49, 37, 700, 5, 64], [9, 1, 1, 5, 3]
    case = make_case(rng, dtype=jnp.float32, page_size=8, ratio=3, head_dim=64, num_kv_heads=2,
                     kv_lens=kv_lens, q_lens=q_lens, pages_per_seq=90)
    attend = functools.partial(paged_attention_xla, sm_scale=0.125, batch_invariant=batch_invariant, **masking)
    pool, q = jnp.asarray(case.kv_pages), jnp.asarray(case.q)
    batched = jax.jit(attend)(q, pool, case.page_indices, case.kv_lens, case.q_lens)[0, 4]
    alone_lens = jnp.asarray([45], jnp.int32)  # the token's own keys: 40 cached + 5 of the prefill
    alone = jax.jit(attend)(q[:1, 4:5], pool, case.page_indices[:1, :12], alone_lens, jnp.ones(1, jnp.int32))[0, 0]
    want = paged_attention_ref(q[:1, 4:5], jnp.asarray(reference_pool(case.kv_pages)), case.page_indices[:1],
                               alone_lens, jnp.ones(1, jnp.int32), sm_scale=0.125, **masking)[0, 0]
    return np.asarray(batched), np.asarray(alone), want


@pytest.mark.parametrize("masking", [{}, dict(sliding_window=20, soft_cap=30.0)], ids=["causal", "window-cap"])
def test_batch_invariant_token_alone_equals_batched(masking):
    """Each token as a row of its own over fixed 64-key chunks: a prefill token's output is bitwise
    the one it gets as a lone decode row (another Tq, batch and table width)."""
    batched, alone, want = _token_alone_and_batched(True, **masking)
    np.testing.assert_array_equal(batched, alone)
    assert_close(batched, want, jnp.float32)


def test_default_form_moves_with_the_batch():
    """What the invariant form removes: the default's prefill form and its batch-sized chunks give the
    same token other bits."""
    batched, alone, want = _token_alone_and_batched(False)
    assert not np.array_equal(batched, alone)
    assert_close(batched, want, jnp.float32)


@pytest.mark.parametrize("kind", sorted(LENGTH_CASES))
def test_batch_invariant_form_matches_reference(kind):
    """NaN in unused pages and slots, padding rows and tokens: as the default form, exact zeros."""
    kv_lens, q_lens = LENGTH_CASES[kind]
    rng = np.random.default_rng(11)
    dtype, page_size, ratio, head_dim, num_kv_heads = CONFIGS[1]
    case = make_case(rng, dtype=dtype, page_size=page_size, ratio=ratio, head_dim=head_dim,
                     num_kv_heads=num_kv_heads, kv_lens=kv_lens, q_lens=q_lens, pages_per_seq=6)
    sinks = jnp.asarray(make_sinks(rng, ratio * num_kv_heads))
    got = paged_attention_xla(jnp.asarray(case.q), jnp.asarray(case.kv_pages), case.page_indices, case.kv_lens,
                              case.q_lens, sm_scale=head_dim ** -0.5, sinks=sinks, batch_invariant=True)
    want = paged_attention_ref(jnp.asarray(case.q), jnp.asarray(reference_pool(case.kv_pages)), case.page_indices,
                               case.kv_lens, case.q_lens, sm_scale=head_dim ** -0.5, sinks=sinks)
    assert_close(got, want, dtype)
    pad = np.arange(case.q.shape[1])[None, :] >= case.q_lens[:, None]
    assert not np.asarray(got)[pad].any()
