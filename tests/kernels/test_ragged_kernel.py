"""Tier (b): the TPU ragged (mixed prefill + decode) kernel against the jnp reference, flat layout
(the GPU family's kernel: test_gpu_attention.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import (CONFIGS, INTERPRET, QUANT_CASES, WINDOW_CASES, assert_close, assert_sinks_matter,
                          config_id, make_case, make_sinks, quant_case_id, quantize_case, reference_pool,
                          release_outside_window, skip_unless_runnable, window_case_id)
from pallas_kernels import kv_layout, reference
from pallas_kernels.ragged_attention import ragged_paged_attention

PAGES_PER_SEQ = 4
SPARE_SLOTS = 2  # sequence slots past num_seqs, filled with garbage metadata
TRAILING_TOKENS = 3  # flat tokens past the last sequence: must come back as zeros


def _seqs(page_size):
    # (kv_len, q_len): whole prompt, chunked prefill (unaligned), decode at a page boundary,
    # maximal length with 2 new tokens, first token of a sequence.
    return [(page_size + 3, page_size + 3), (2 * page_size + 5, 4), (2 * page_size, 1),
            (PAGES_PER_SEQ * page_size, 2), (1, 1)]


def _check(cfg, backend, *, block_q=None, seed=0, window=None, cap=None, kv_cache_dtype="auto", sinks=False,
           layout="canonical"):
    skip_unless_runnable(backend)
    dtype, page_size, ratio, head_dim, num_kv_heads = cfg
    rng = np.random.default_rng(seed)
    kv_lens, q_lens = (list(x) for x in zip(*_seqs(page_size)))
    case = make_case(
        rng, dtype=dtype, page_size=page_size, ratio=ratio, head_dim=head_dim, num_kv_heads=num_kv_heads,
        kv_lens=kv_lens, q_lens=q_lens, pages_per_seq=PAGES_PER_SEQ,
    )
    case = release_outside_window(case, window)
    scale = head_dim ** -0.5
    num_seqs = len(kv_lens)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    flat_q = np.concatenate([case.q[b, :q_lens[b]] for b in range(num_seqs)])
    flat_q = np.concatenate([flat_q, rng.standard_normal((TRAILING_TOKENS, *flat_q.shape[1:])).astype(flat_q.dtype)])
    num_pages = case.kv_pages.shape[1]
    table = np.concatenate([case.page_indices, rng.integers(0, num_pages, (SPARE_SLOTS, PAGES_PER_SEQ))])
    cu_slots = np.concatenate([cu, rng.integers(0, 50, SPARE_SLOTS)]).astype(np.int32)
    kv_slots = np.concatenate([kv_lens, rng.integers(1, 50, SPARE_SLOTS)]).astype(np.int32)

    pool, ref_pool = jnp.asarray(case.kv_pages), jnp.asarray(reference_pool(case.kv_pages))
    if kv_cache_dtype != "auto":  # NaN scales on unused rows
        pool, ref_pool = quantize_case(case, kv_cache_dtype)
    pool = kv_layout.get(layout).from_canonical(pool)  # the same keys and values (NaN pages too)
    sink = jnp.asarray(make_sinks(rng, ratio * num_kv_heads)) if sinks else None
    got = ragged_paged_attention(
        jnp.asarray(flat_q), pool, table.astype(np.int32), cu_slots, kv_slots,
        np.array([num_seqs], np.int32), sm_scale=scale, block_q=block_q, backend=backend, interpret=INTERPRET,
        sliding_window=window, soft_cap=cap, sinks=sink, layout=layout,
    )

    def want(sinks):
        rows = reference.paged_attention_ref(
            jnp.asarray(case.q), ref_pool, case.page_indices,
            case.kv_lens, case.q_lens, sm_scale=scale, sliding_window=window, soft_cap=cap, sinks=sinks,
        )
        flat = np.concatenate([np.asarray(rows[b, :q_lens[b]]) for b in range(num_seqs)])
        return np.concatenate([flat, np.zeros((TRAILING_TOKENS, *flat.shape[1:]), flat.dtype)])

    assert got.dtype == dtype and got.shape == flat_q.shape
    assert_close(got, want(sink), dtype)
    if sinks:
        assert_sinks_matter(want(sink), want(None), dtype)


@pytest.mark.parametrize("cfg", CONFIGS, ids=config_id)
@pytest.mark.parametrize("backend", ["tpu"])
def test_ragged_matches_reference(cfg, backend):
    _check(cfg, backend)


@pytest.mark.parametrize("backend,block_q", [("tpu", 4)])
def test_ragged_query_blocks_spanning_sequences(backend, block_q):
    # Other block sizes move sequence boundaries inside query blocks.
    _check(CONFIGS[1], backend, block_q=block_q, seed=5)


@pytest.mark.parametrize("wc", WINDOW_CASES, ids=window_case_id)
@pytest.mark.parametrize("backend,block_q", [("tpu", None), ("tpu", 4)])
def test_ragged_sliding_window_and_soft_cap(wc, backend, block_q):
    """Pages wholly before a sequence's window point at NaN pages (released): never read."""
    _check(CONFIGS[0], backend, block_q=block_q, seed=7, window=wc[0], cap=wc[1])


@pytest.mark.parametrize("qc", QUANT_CASES, ids=quant_case_id)
@pytest.mark.parametrize("backend", ["tpu"])
def test_ragged_quantized_pool(qc, backend):
    """int8 / fp8 values with per-(token, kv head) scales, read with the matching scale blocks."""
    _check(qc[1], backend, seed=9, kv_cache_dtype=qc[0])


@pytest.mark.parametrize("cfg", CONFIGS, ids=config_id)
def test_ragged_on_the_tpu_layout(cfg):
    """The pool in the tpu layout [P, K, page_size, 2D] gives the reference's result on the same
    keys and values in the canonical layout."""
    _check(cfg, "tpu", seed=14, layout="tpu")


@pytest.mark.parametrize("wc", WINDOW_CASES[:1], ids=window_case_id)
def test_ragged_on_the_tpu_layout_window_blocks_sinks(wc):
    _check(CONFIGS[1], "tpu", block_q=4, seed=15, window=wc[0], cap=wc[1], sinks=True, layout="tpu")


@pytest.mark.parametrize("qc", QUANT_CASES, ids=quant_case_id)
def test_ragged_quantized_pool_on_the_tpu_layout(qc):
    """int8 / fp8 values in the tpu layout with their scales packed in pairs in its rows (kv_layout.ScaleRows)."""
    _check(qc[1], "tpu", seed=18, kv_cache_dtype=qc[0], layout="tpu")


def test_ragged_quantized_tpu_layout_window_cap_blocks_sinks():
    _check(CONFIGS[3], "tpu", block_q=4, seed=19, window=16, cap=3.0, kv_cache_dtype="int8", sinks=True,
           layout="tpu")


def test_ragged_quantized_sliding_window():
    _check(CONFIGS[0], "tpu", block_q=4, seed=10, window=5, cap=2.0, kv_cache_dtype="int8")


@pytest.mark.parametrize("cfg,block_q,window,cap,kv_cache_dtype", [
    (CONFIGS[3], None, 16, 3.0, "int8"),  # GQA 8:1, a window and a cap on an int8 pool
    (CONFIGS[1], 4, None, None, "auto"),  # GQA 3:1, query blocks spanning sequences (extended tier)
], ids=["gqa8-int8-window-cap", "gqa3-blocks"])
def test_ragged_sinks(cfg, block_q, window, cap, kv_cache_dtype):
    """Attention sinks (gpt-oss) in each sequence's final normalisation."""
    _check(cfg, "tpu", block_q=block_q, seed=11, window=window, cap=cap, kv_cache_dtype=kv_cache_dtype,
           sinks=True)


def test_ragged_rejects_mismatched_metadata():
    with pytest.raises(ValueError, match="sequence slots"):
        ragged_paged_attention(
            jnp.zeros((4, 2, 64)), jnp.zeros((2, 4, 8, 1, 64)), jnp.zeros((3, 2), jnp.int32),
            jnp.zeros((3,), jnp.int32), jnp.zeros((3,), jnp.int32), jnp.ones((1,), jnp.int32),
            sm_scale=1.0, interpret=True,
        )
    with pytest.raises(ValueError, match="gpu_attention"):
        ragged_paged_attention(
            jnp.zeros((4, 2, 64)), jnp.zeros((2, 4, 8, 1, 64)), jnp.zeros((2, 2), jnp.int32),
            jnp.zeros((3,), jnp.int32), jnp.zeros((2,), jnp.int32), jnp.ones((1,), jnp.int32),
            sm_scale=1.0, backend="gpu", interpret=True,
        )
