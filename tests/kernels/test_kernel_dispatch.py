"""dispatch.paged_attention / write_kv: row-layout semantics of the reference, impl selection."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import (IMPL, assert_close, assert_sinks_matter, make_case, make_sinks, quantize_case,
                          reference_pool, release_outside_window, skip_unless_runnable)
from pallas_kernels import dispatch, reference


@pytest.mark.parametrize("backend,gpu_decode", [("gpu", "auto"), ("gpu", "triton"), ("tpu", "auto")])
@pytest.mark.parametrize(
    "kv_lens,q_lens",
    [
        ([9, 16, 1, 0], [1, 1, 1, 0]),  # decode step (Tq == 1) with a padding row
        ([9, 30, 3, 0, 12], [6, 2, 3, 0, 0]),  # prefill chunks, padding row, row with no new tokens
    ],
    ids=["decode", "mixed"],
)
def test_paged_attention_row_layout(backend, gpu_decode, kv_lens, q_lens):
    skip_unless_runnable(backend)
    rng = np.random.default_rng(7)
    case = make_case(
        rng, dtype=jnp.float32, page_size=8, ratio=2, head_dim=64, num_kv_heads=2,
        kv_lens=kv_lens, q_lens=q_lens, pages_per_seq=4,
    )
    step = jax.jit(lambda q, kv, pt, kvl, ql: dispatch.paged_attention(
        q, kv, pt, kvl, ql, sm_scale=0.125, impl=IMPL, backend=backend, gpu_decode=gpu_decode))
    got = step(jnp.asarray(case.q), jnp.asarray(case.kv_pages), case.page_indices, case.kv_lens, case.q_lens)
    want = reference.paged_attention_ref(
        jnp.asarray(case.q), jnp.asarray(reference_pool(case.kv_pages)), case.page_indices,
        case.kv_lens, case.q_lens, sm_scale=0.125,
    )
    assert got.shape == case.q.shape
    assert_close(got, want, jnp.float32)


@pytest.mark.parametrize("backend,gpu_decode", [("gpu", "mosaic"), ("gpu", "triton"), ("tpu", "auto")])
@pytest.mark.parametrize(
    "kv_lens,q_lens",
    [([9, 30, 1, 0], [1, 1, 1, 0]), ([9, 30, 3, 0, 12], [6, 2, 3, 0, 0])],
    ids=["decode", "mixed"],
)
def test_paged_attention_window_and_cap_reach_every_kernel(backend, gpu_decode, kv_lens, q_lens):
    skip_unless_runnable(backend)
    if gpu_decode == "mosaic" and dispatch.decode_attention_mgpu.unsupported_reason(
            jnp.float32, jnp.float32, 16, 4, 2, 64, interpret=IMPL == "pallas-interpret"):
        pytest.skip("no Mosaic GPU here")
    rng = np.random.default_rng(8)
    case = make_case(
        rng, dtype=jnp.float32, page_size=16, ratio=2, head_dim=64, num_kv_heads=2,
        kv_lens=kv_lens, q_lens=q_lens, pages_per_seq=2,
    )
    case = release_outside_window(case, 6)
    kw = dict(sm_scale=0.125, sliding_window=6, soft_cap=1.5)
    step = jax.jit(lambda q, kv, pt, kvl, ql: dispatch.paged_attention(
        q, kv, pt, kvl, ql, impl=IMPL, backend=backend, gpu_decode=gpu_decode, **kw))
    got = step(jnp.asarray(case.q), jnp.asarray(case.kv_pages), case.page_indices, case.kv_lens, case.q_lens)
    want = reference.paged_attention_ref(
        jnp.asarray(case.q), jnp.asarray(reference_pool(case.kv_pages)), case.page_indices,
        case.kv_lens, case.q_lens, **kw,
    )
    assert_close(got, want, jnp.float32)


@pytest.mark.parametrize("backend,gpu_decode,kv_lens,q_lens", [
    ("gpu", "mosaic", [9, 30, 1, 0], [1, 1, 1, 0]),  # the Mosaic GPU decode kernel
    ("tpu", "auto", [9, 30, 3, 0, 12], [6, 2, 3, 0, 0]),  # the TPU ragged kernel on packed tokens
], ids=["gpu-mosaic-decode", "tpu-mixed"])
def test_sinks_reach_the_kernels(backend, gpu_decode, kv_lens, q_lens):
    """gpt-oss's sinks through the row-layout entry point (the GPU ragged kernel takes them in
    test_gpu_attention.py and in the gpt-oss engine test), with a window and GQA."""
    skip_unless_runnable(backend)
    if gpu_decode == "mosaic" and dispatch.decode_attention_mgpu.unsupported_reason(
            jnp.float32, jnp.float32, 16, 4, 2, 64, interpret=IMPL == "pallas-interpret"):
        pytest.skip("no Mosaic GPU here")
    rng = np.random.default_rng(10)
    case = make_case(rng, dtype=jnp.float32, page_size=16, ratio=2, head_dim=64, num_kv_heads=2,
                     kv_lens=kv_lens, q_lens=q_lens, pages_per_seq=2)
    case = release_outside_window(case, 20)
    sinks = jnp.asarray(make_sinks(rng, 4))
    kw = dict(sm_scale=0.125, sliding_window=20)
    got = dispatch.paged_attention(jnp.asarray(case.q), jnp.asarray(case.kv_pages), case.page_indices, case.kv_lens,
                                   case.q_lens, impl=IMPL, backend=backend, gpu_decode=gpu_decode, sinks=sinks, **kw)
    want = lambda sinks: reference.paged_attention_ref(  # noqa: E731
        jnp.asarray(case.q), jnp.asarray(reference_pool(case.kv_pages)), case.page_indices, case.kv_lens,
        case.q_lens, sinks=sinks, **kw)
    assert_close(got, want(sinks), jnp.float32)
    assert_sinks_matter(want(sinks), want(None), jnp.float32)


def test_sinks_must_be_one_per_query_head():
    q = jnp.zeros((1, 1, 4, 64))
    lens = jnp.ones((1,), jnp.int32)
    for backend in ("gpu", "tpu"):
        with pytest.raises(ValueError, match=r"sinks has shape \(2,\); expected \(4,\), one per query head"):
            dispatch.paged_attention(q, jnp.zeros((2, 2, 8, 2, 64)), jnp.zeros((1, 1), jnp.int32), lens, lens,
                                     sm_scale=1.0, impl="pallas-interpret", backend=backend,
                                     sinks=jnp.zeros((2,), jnp.float32))


def test_write_kv_matches_reference():
    rng = np.random.default_rng(0)
    pool = rng.standard_normal((2, 3, 8, 1, 64)).astype(np.float32)
    k = rng.standard_normal((4, 1, 64)).astype(np.float32)
    slots = np.array([5, -1, 17, 0], np.int32)
    want = reference.write_kv(jnp.asarray(pool), k, -k, slots)
    got = dispatch.write_kv(jnp.array(pool), k, -k, slots, impl=IMPL)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_impl_selection():
    assert dispatch.resolve_impl("pallas-interpret", "tpu") == ("tpu", True)
    with pytest.raises(ValueError, match="impl"):
        dispatch.resolve_impl("triton")
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="pallas-interpret"):
            dispatch.resolve_impl("pallas")
        assert dispatch.resolve_impl("pallas-interpret") == ("gpu", True)
    else:
        assert dispatch.resolve_impl("pallas") == (jax.default_backend(), False)


def test_gpu_decode_selection():
    kv = (2, 4, 16, 2, 64)  # [2, P, page_size, K, D]
    assert dispatch.select_gpu_decode("triton", jnp.bfloat16, kv, jnp.bfloat16, 4, interpret=True) == "triton"
    # "auto" is Triton (Mosaic GPU measured 14x slower natively); shapes Mosaic cannot take raise.
    odd = (2, 4, 16, 2, 96)
    assert dispatch.select_gpu_decode("auto", jnp.bfloat16, odd, jnp.bfloat16, 4, interpret=True) == "triton"
    with pytest.raises(ValueError, match="head_dim 96"):
        dispatch.select_gpu_decode("mosaic", jnp.bfloat16, odd, jnp.bfloat16, 4, interpret=True)
    with pytest.raises(ValueError, match="gpu_decode"):
        dispatch.select_gpu_decode("pallas", jnp.bfloat16, kv, jnp.bfloat16, 4, interpret=True)
    assert dispatch.select_gpu_decode("auto", jnp.bfloat16, kv, jnp.bfloat16, 4, interpret=True) == "triton"
    if dispatch.decode_attention_mgpu.unsupported_reason(jnp.bfloat16, jnp.bfloat16, 16, 4, 2, 64, interpret=True) is None:
        assert dispatch.select_gpu_decode("mosaic", jnp.bfloat16, kv, jnp.bfloat16, 4, interpret=True) == "mosaic"


def test_quantized_pool_routes_gpu_decode_to_triton():
    """Mosaic GPU takes no quantised pool (decode_attention_mgpu.QUANTIZED_REASON): "auto" picks
    Triton, "mosaic" says why, and the row-layout step on an int8 pool matches the reference."""
    kv = (2, 4, 16, 2, 64)
    for dtype in (jnp.int8, jnp.float8_e4m3fn):
        assert dispatch.select_gpu_decode("auto", jnp.bfloat16, kv, dtype, 4, interpret=True) == "triton"
        with pytest.raises(ValueError, match="TMA copy needs a contiguous innermost dimension"):
            dispatch.select_gpu_decode("mosaic", jnp.bfloat16, kv, dtype, 4, interpret=True)
    skip_unless_runnable("gpu")
    rng = np.random.default_rng(9)
    case = make_case(rng, dtype=jnp.float32, page_size=16, ratio=2, head_dim=64, num_kv_heads=2,
                     kv_lens=[9, 30, 1, 0], q_lens=[1, 1, 1, 0], pages_per_seq=2)
    pool, ref_pool = quantize_case(case, "int8")
    got = dispatch.paged_attention(jnp.asarray(case.q), pool, case.page_indices, case.kv_lens, case.q_lens,
                                   sm_scale=0.125, impl=IMPL, backend="gpu", gpu_decode="auto")
    want = reference.paged_attention_ref(jnp.asarray(case.q), ref_pool, case.page_indices, case.kv_lens,
                                         case.q_lens, sm_scale=0.125)
    assert_close(got, want, jnp.float32)
