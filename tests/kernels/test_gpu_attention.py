"""Tier (b): the GPU ragged paged-attention kernel (interpret mode) against the jnp reference.

Every step kind goes through one kernel, so each case is one row-layout batch: a decode batch
(Tq == 1: lengths 1 / page-aligned / unaligned / maximal / padding row) or a mixed batch (a whole
prompt, a chunked-prefill chunk, a decode row at a page boundary, a verify-like row of 2 tokens at
maximal length, a first token, a padding row and a row with cached keys but no new token).
Pools have permuted page tables and NaN in every slot no row may read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import (CONFIGS, INTERPRET, QUANT_CASES, WINDOW_CASES, assert_close, assert_sinks_matter,
                          config_id, make_case, make_sinks, quant_case_id, quantize_case, reference_pool,
                          release_outside_window, skip_unless_runnable, window_case_id)
from pallas_kernels import gpu_attention, reference

PAGES_PER_SEQ = 4
# Interpret-mode kernels are compile-bound on CPU: XLA's lowest backend optimisation level halves
# their compile time and changes no result the tolerance table can see.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0} if INTERPRET else None


def _rows(kind, page_size):
    """(kv_lens, q_lens) of a decode or a mixed batch."""
    if kind == "decode":
        kv_lens = [1, 2 * page_size, page_size + 3, PAGES_PER_SEQ * page_size, 0]
        return kv_lens, [min(n, 1) for n in kv_lens]
    rows = [(page_size + 3, page_size + 3), (2 * page_size + 5, 4), (2 * page_size, 1),
            (PAGES_PER_SEQ * page_size, 2), (1, 1), (0, 0), (page_size, 0)]
    return [r[0] for r in rows], [r[1] for r in rows]


def _check(cfg, kind, *, seed=0, window=None, cap=None, kv_cache_dtype="auto", sinks=False, **plan):
    skip_unless_runnable("gpu")
    dtype, page_size, ratio, head_dim, num_kv_heads = cfg
    rng = np.random.default_rng(seed)
    kv_lens, q_lens = _rows(kind, page_size)
    case = make_case(
        rng, dtype=dtype, page_size=page_size, ratio=ratio, head_dim=head_dim, num_kv_heads=num_kv_heads,
        kv_lens=kv_lens, q_lens=q_lens, pages_per_seq=PAGES_PER_SEQ,
    )
    case = release_outside_window(case, window)
    pool, ref_pool = jnp.asarray(case.kv_pages), jnp.asarray(reference_pool(case.kv_pages))
    if kv_cache_dtype != "auto":  # NaN scales on unused rows
        pool, ref_pool = quantize_case(case, kv_cache_dtype)
    kw = dict(sm_scale=head_dim ** -0.5, sliding_window=window, soft_cap=cap)
    sink = jnp.asarray(make_sinks(rng, ratio * num_kv_heads)) if sinks else None
    kernel = jax.jit(functools.partial(gpu_attention.paged_attention, interpret=INTERPRET, **kw, **plan),
                     compiler_options=COMPILER_OPTIONS)
    got = kernel(jnp.asarray(case.q), pool, case.page_indices, case.kv_lens, case.q_lens, sinks=sink)
    ref = functools.partial(reference.paged_attention_ref, jnp.asarray(case.q), ref_pool, case.page_indices,
                            case.kv_lens, case.q_lens, **kw)
    want = ref(sinks=sink)
    assert got.dtype == dtype and got.shape == case.q.shape
    assert_close(got, want, dtype)
    if sinks:
        assert_sinks_matter(want, ref(), dtype)


@pytest.mark.parametrize("cfg", CONFIGS, ids=config_id)
def test_mixed_batch_matches_reference(cfg):
    _check(cfg, "mixed")


@pytest.mark.parametrize("cfg", [CONFIGS[1], CONFIGS[3], CONFIGS[4]], ids=config_id)
def test_decode_batch_matches_reference(cfg):
    _check(cfg, "decode", seed=1)


def test_decode_key_segments_combine_exactly():
    # Segments are sized from each row's real length: short rows spread over all 4 too, and a
    # segment past a row's keys contributes nothing.
    _check(CONFIGS[0], "decode", seed=3, num_splits=4)


def test_small_tiles_split_rows_pages_and_keys():
    # Key tiles of 16 inside 32-key pages, query tiles of 2 tokens (a row spans several),
    # and 2 key segments under causal masks.
    _check(CONFIGS[2], "mixed", seed=4, block_q=2, block_k=16, num_splits=2)


@pytest.mark.parametrize("wc", WINDOW_CASES, ids=window_case_id)
def test_mixed_sliding_window_and_soft_cap(wc):
    """Pages wholly before a row's window point at NaN pages (released): never read."""
    _check(CONFIGS[0], "mixed", seed=7, window=wc[0], cap=wc[1], num_splits=2 if wc[0] == 16 else None)


@pytest.mark.parametrize("wc", WINDOW_CASES[:2], ids=window_case_id)
def test_decode_sliding_window_and_soft_cap(wc):
    _check(CONFIGS[4], "decode", seed=5, window=wc[0], cap=wc[1], num_splits=2)


@pytest.mark.parametrize("qc", QUANT_CASES, ids=quant_case_id)
def test_quantized_pool(qc):
    """int8 / fp8 values with per-(token, kv head) scales applied inside the kernel."""
    kind = "decode" if qc[0] == "fp8" else "mixed"
    _check(qc[1], kind, seed=9, kv_cache_dtype=qc[0], num_splits=2)


def test_quantized_sliding_window():
    _check(CONFIGS[0], "mixed", seed=10, window=5, cap=2.0, kv_cache_dtype="int8")


# Attention sinks (gpt-oss) through both of the kernel's ends: folded into the program's final
# normalisation (one key segment) and into the merge of the segments (num_splits > 1). The default
# tier runs one of each end with GQA, the cap and window, a quantised pool and batch_invariant.
SINK_CHECKS = {
    "mixed-one-segment": (CONFIGS[0], "mixed", dict(), True),
    "decode-gqa-segments": (CONFIGS[3], "decode", dict(num_splits=2), True),
    "mixed-gqa3-tiles-segments": (CONFIGS[1], "mixed", dict(block_q=2, num_splits=2), False),
    "mixed-window-cap-segments": (CONFIGS[0], "mixed", dict(window=16, cap=3.0, num_splits=2), True),
    "mixed-int8-window-cap": (CONFIGS[1], "mixed", dict(kv_cache_dtype="int8", window=5, cap=2.0), False),
    "decode-fp8-segments": (CONFIGS[0], "decode", dict(kv_cache_dtype="fp8", num_splits=2), True),
    "mixed-batch-invariant": (CONFIGS[3], "mixed", dict(batch_invariant=True), False),
}


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.extended if extended else ())
                                  for name, (*_, extended) in sorted(SINK_CHECKS.items())])
def test_sinks(name):
    cfg, kind, kw, _ = SINK_CHECKS[name]
    _check(cfg, kind, seed=11, sinks=True, **kw)


def test_plan_sizes_segments_for_the_device():
    """C fills MIN_PROGRAMS and never exceeds the table's width in key tiles."""
    p = gpu_attention.plan(8, 1, 32, 8, 128, 256, 16)  # decode B=8, 4096-key table
    assert (p.block_q, p.rows, p.num_q_blocks, p.num_splits) == (1, 16, 1, 9)
    assert gpu_attention.plan(8, 1, 32, 8, 128, 2, 16).num_splits == 1  # 32 keys: one tile
    verify = gpu_attention.plan(64, 5, 32, 8, 128, 2048, 16)  # 5 tokens x 4 heads share one tile
    assert (verify.block_q, verify.rows, verify.num_q_blocks) == (8, 32, 1)


def test_rejects_bad_shapes():
    q = jnp.zeros((2, 1, 3, 64))
    kv = jnp.zeros((2, 4, 8, 2, 64))
    lens = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="not a multiple"):
        gpu_attention.paged_attention(q, kv, jnp.zeros((2, 2), jnp.int32), lens, lens, sm_scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="do not match 2 rows"):
        gpu_attention.paged_attention(jnp.zeros((2, 1, 4, 64)), kv, jnp.zeros((3, 2), jnp.int32), lens, lens,
                                      sm_scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="head_dim"):
        gpu_attention.paged_attention(jnp.zeros((2, 1, 4, 48)), jnp.zeros((2, 4, 8, 2, 48)),
                                      jnp.zeros((2, 2), jnp.int32), lens, lens, sm_scale=1.0, interpret=True)


def _one_row_alone_and_batched(batch_invariant: bool, sinks: bool = False):
    """Row 2 (a 700-key decode row) of a mixed batch over an 80-page table, and the same row
    alone over a 44-page table: (batched row, alone row, reference row)."""
    skip_unless_runnable("gpu")
    rng = np.random.default_rng(12)
    kv_lens, q_lens = [8, 37, 700, 5, 64], [8, 1, 1, 5, 3]
    case = make_case(rng, dtype=jnp.float32, page_size=16, ratio=4, head_dim=16, num_kv_heads=1,
                     kv_lens=kv_lens, q_lens=q_lens, pages_per_seq=80)
    sink = jnp.asarray(make_sinks(rng, 4)) if sinks else None
    kernel = jax.jit(functools.partial(gpu_attention.paged_attention, sm_scale=0.25, interpret=INTERPRET,
                                       batch_invariant=batch_invariant, sinks=sink),
                     compiler_options=COMPILER_OPTIONS)
    pool, q = jnp.asarray(case.kv_pages), jnp.asarray(case.q)
    batched = kernel(q, pool, case.page_indices, case.kv_lens, case.q_lens)[2, 0]
    alone = kernel(q[2:3, :1], pool, case.page_indices[2:3, :44], case.kv_lens[2:3], case.q_lens[2:3])[0, 0]
    ref = functools.partial(reference.paged_attention_ref, q[2:3, :1], jnp.asarray(reference_pool(case.kv_pages)),
                            case.page_indices[2:3], case.kv_lens[2:3], case.q_lens[2:3], sm_scale=0.25)
    want = ref(sinks=sink)[0, 0]
    if sinks:
        assert_sinks_matter(want, ref()[0, 0], jnp.float32)
    return np.asarray(batched), np.asarray(alone), want


def test_batch_invariant_row_alone_equals_batched():
    """Fixed 512-key segments and query tiles: a row's output, bitwise, whatever the launch holds
    (other rows, a larger Tq, a wider table); the default plan's segments follow the batch and move it."""
    batched, alone, want = _one_row_alone_and_batched(True)
    np.testing.assert_array_equal(batched, alone)
    assert_close(batched, want, jnp.float32)
    batched, alone, _ = _one_row_alone_and_batched(False)
    assert not np.array_equal(batched, alone)


def test_batch_invariant_sinks_merge_after_the_last_segment():
    """The sinks join the in-order merge of the fixed segments (3 here): still bitwise."""
    batched, alone, want = _one_row_alone_and_batched(True, sinks=True)
    np.testing.assert_array_equal(batched, alone)
    assert_close(batched, want, jnp.float32)


def test_sinks_of_the_wrong_shape_raise():
    q = jnp.zeros((2, 1, 4, 64))
    kv = jnp.zeros((2, 4, 8, 2, 64))
    lens = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match=r"sinks has shape \(2,\); expected \(4,\)"):
        gpu_attention.paged_attention(q, kv, jnp.zeros((2, 2), jnp.int32), lens, lens, sm_scale=1.0, interpret=True,
                                      sinks=jnp.zeros((2,), jnp.float32))


def test_batch_invariant_plan_is_fixed():
    """Segments of SPLIT_TILES tiles cover the table; block_q ignores Tq; fixed fields refused."""
    for batch, num_q in ((1, 1), (64, 1), (3, 40)):
        p = gpu_attention.plan(batch, num_q, 32, 8, 128, 256, 16, batch_invariant=True)  # 4096 keys: 64 tiles
        assert (p.block_q, p.num_splits, p.split_tiles) == (16, 8, gpu_attention.SPLIT_TILES)
    with pytest.raises(ValueError, match="batch_invariant"):
        gpu_attention.plan(1, 1, 32, 8, 128, 256, 16, batch_invariant=True, num_splits=2)
