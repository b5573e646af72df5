"""Tier (b): the TPU decode kernel (interpret mode) against the jnp reference (the GPU family's
kernel: test_gpu_attention.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import (CONFIGS, INTERPRET, QUANT_CASES, WINDOW_CASES, assert_close, assert_sinks_matter,
                          config_id, make_case, make_sinks, quant_case_id, quantize_case, reference_pool,
                          release_outside_window, skip_unless_runnable, window_case_id)
from pallas_kernels import kv_layout, reference
from pallas_kernels.decode_attention import decode_attention

PAGES_PER_SEQ = 4


def _lengths(page_size):
    # 1 / page-aligned / unaligned / maximal / padding row (0).
    return [1, 2 * page_size, page_size + 3, PAGES_PER_SEQ * page_size, 0]


def _check(cfg, backend, num_splits, seed=0, window=None, cap=None, kv_cache_dtype="auto", sinks=False,
           layout="canonical"):
    skip_unless_runnable(backend)
    dtype, page_size, ratio, head_dim, num_kv_heads = cfg
    rng = np.random.default_rng(seed)
    kv_lens = _lengths(page_size)
    case = make_case(
        rng, dtype=dtype, page_size=page_size, ratio=ratio, head_dim=head_dim, num_kv_heads=num_kv_heads,
        kv_lens=kv_lens, q_lens=[1] * len(kv_lens), pages_per_seq=PAGES_PER_SEQ,
    )
    case = release_outside_window(case, window)
    scale = head_dim ** -0.5
    pool, ref_pool = jnp.asarray(case.kv_pages), jnp.asarray(reference_pool(case.kv_pages))
    if kv_cache_dtype != "auto":  # NaN scales on unused rows
        pool, ref_pool = quantize_case(case, kv_cache_dtype)
    pool = kv_layout.get(layout).from_canonical(pool)  # the same keys and values (NaN pages too)
    sink = jnp.asarray(make_sinks(rng, ratio * num_kv_heads)) if sinks else None
    got = decode_attention(
        jnp.asarray(case.q[:, 0]), pool, case.page_indices, case.kv_lens,
        sm_scale=scale, num_splits=num_splits, backend=backend, interpret=INTERPRET,
        sliding_window=window, soft_cap=cap, sinks=sink, layout=layout,
    )
    q_lens = (case.kv_lens > 0).astype(np.int32)

    def want(sinks):
        return reference.paged_attention_ref(
            jnp.asarray(case.q), ref_pool, case.page_indices,
            case.kv_lens, q_lens, sm_scale=scale, sliding_window=window, soft_cap=cap, sinks=sinks,
        )[:, 0]

    assert got.dtype == dtype
    assert_close(got, want(sink), dtype)
    if sinks:
        assert_sinks_matter(want(sink), want(None), dtype)


@pytest.mark.parametrize("cfg", CONFIGS, ids=config_id)
@pytest.mark.parametrize("backend", ["tpu"])
def test_decode_matches_reference(cfg, backend):
    _check(cfg, backend, num_splits=1)


@pytest.mark.parametrize("backend,num_splits", [("tpu", 2)])
def test_decode_split_keys_combine_exactly(backend, num_splits):
    # Splits whose whole range lies past a row's length must contribute nothing.
    _check(CONFIGS[0], backend, num_splits=num_splits, seed=3)


@pytest.mark.parametrize("wc", WINDOW_CASES, ids=window_case_id)
@pytest.mark.parametrize("backend,num_splits", [("tpu", 1), ("tpu", 2)])
def test_decode_sliding_window_and_soft_cap(wc, backend, num_splits):
    """Pages wholly before a row's window point at NaN pages (released): never read."""
    _check(CONFIGS[4], backend, num_splits=num_splits, seed=5, window=wc[0], cap=wc[1])


@pytest.mark.parametrize("qc", QUANT_CASES, ids=quant_case_id)
@pytest.mark.parametrize("backend,num_splits", [("tpu", 1)])
def test_decode_quantized_pool(qc, backend, num_splits):
    """int8 / fp8 values with per-(token, kv head) scales, read with the matching scale blocks."""
    _check(qc[1], backend, num_splits=num_splits, seed=9, kv_cache_dtype=qc[0])


def test_decode_quantized_sliding_window():
    _check(CONFIGS[4], "tpu", num_splits=2, seed=10, window=16, cap=3.0, kv_cache_dtype="fp8")


@pytest.mark.parametrize("cfg,num_splits,window,cap,kv_cache_dtype", [
    (CONFIGS[3], 2, 5, None, "auto"),  # GQA 8:1 bf16, a window under a page, 2 splits
    (CONFIGS[1], 1, 16, 3.0, "int8"),  # GQA 3:1, a window and a cap on an int8 pool (extended tier)
], ids=["gqa-window-splits", "int8-window-cap"])
def test_decode_sinks(cfg, num_splits, window, cap, kv_cache_dtype):
    """Attention sinks (gpt-oss) join the merge of the splits."""
    _check(cfg, "tpu", num_splits=num_splits, seed=11, window=window, cap=cap, kv_cache_dtype=kv_cache_dtype,
           sinks=True)


@pytest.mark.parametrize("cfg", CONFIGS, ids=config_id)
def test_decode_on_the_tpu_layout(cfg):
    """The pool in the tpu layout [P, K, page_size, 2D] gives the reference's result on the same
    keys and values in the canonical layout."""
    _check(cfg, "tpu", num_splits=1, seed=12, layout="tpu")


@pytest.mark.parametrize("wc", WINDOW_CASES[:1], ids=window_case_id)
def test_decode_on_the_tpu_layout_window_splits_sinks(wc):
    _check(CONFIGS[4], "tpu", num_splits=2, seed=13, window=wc[0], cap=wc[1], sinks=True, layout="tpu")


@pytest.mark.parametrize("qc", QUANT_CASES, ids=quant_case_id)
def test_decode_quantized_pool_on_the_tpu_layout(qc):
    """int8 / fp8 values in the tpu layout with their scales packed in pairs in its rows
    (kv_layout.ScaleRows; page sizes 8 and 16 put 16 and 8 pages in a row): NaN scales of unused
    slots stay unread."""
    _check(qc[1], "tpu", num_splits=1, seed=16, kv_cache_dtype=qc[0], layout="tpu")


def test_decode_quantized_tpu_layout_window_cap_splits_sinks():
    _check(CONFIGS[5], "tpu", num_splits=2, seed=17, window=16, cap=3.0, kv_cache_dtype="int8", sinks=True,
           layout="tpu")


def test_decode_rejects_bad_shapes():
    q = jnp.zeros((2, 3, 64))
    kv = jnp.zeros((2, 4, 8, 2, 64))
    with pytest.raises(ValueError, match="not a multiple"):
        decode_attention(q, kv, jnp.zeros((2, 2), jnp.int32), jnp.zeros((2,), jnp.int32), sm_scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="backend"):
        decode_attention(q, kv, jnp.zeros((2, 2), jnp.int32), jnp.zeros((2,), jnp.int32), sm_scale=1.0, backend="cpu")
    with pytest.raises(ValueError, match="gpu_attention"):
        decode_attention(q, kv, jnp.zeros((2, 2), jnp.int32), jnp.zeros((2,), jnp.int32), sm_scale=1.0, backend="gpu")
    with pytest.raises(ValueError, match="tpu layout"):
        decode_attention(q, kv, jnp.zeros((2, 2), jnp.int32), jnp.zeros((2,), jnp.int32), sm_scale=1.0,
                         interpret=True, layout="tpu")
    with pytest.raises(ValueError, match="one per query head"):
        decode_attention(jnp.zeros((2, 4, 64)), kv, jnp.zeros((2, 2), jnp.int32), jnp.zeros((2,), jnp.int32),
                         sm_scale=1.0, interpret=True, sinks=jnp.zeros((4, 1), jnp.float32))
