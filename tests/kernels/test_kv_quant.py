"""Quantised KV cache: quantisation against hand-computed values, the reference's write and
attention on a quantised pool, and the XLA path against the reference on the same pool."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import (KV_QUANT_DTYPES, QUANT_CASES, assert_close, make_case, quant_case_id,
                          quantize_case)
from pallas_kernels import kv_layout, kv_quant, reference
from pallas_kernels.xla_attention import paged_attention_xla


def test_quantize_int8_by_hand():
    x = np.array([[1.0, -2.54, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
    values, scales = kv_quant.quantize(jnp.asarray(x), jnp.int8)
    # amax 2.54 -> scale 0.02, stored as bf16 0.02001953125 (8 significant bits); x / scale =
    # 49.95, -126.88, 24.98, 0 -> 50, -127, 25, 0. The zero row: scale 0, zeros, no NaN.
    np.testing.assert_array_equal(np.asarray(scales, np.float32), [0.02001953125, 0.0])
    np.testing.assert_array_equal(np.asarray(values), [[50, -127, 25, 0], [0, 0, 0, 0]])
    assert values.dtype == jnp.int8 and scales.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(kv_quant.dequantize(values, scales))).all()


def test_quantize_fp8_by_hand():
    x = np.array([[448.0, -224.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32) * 1e3
    values, scales = kv_quant.quantize(jnp.asarray(x), jnp.float8_e4m3fn)
    np.testing.assert_allclose(np.asarray(scales, np.float32), [1e3, 0.0])  # 1000 is exact in bf16
    # e4m3 holds 448, -224 and 1 exactly; magnitudes far past 448 are absorbed by the scale.
    np.testing.assert_array_equal(np.asarray(values, np.float32), [[448, -224, 1, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize("name", sorted(KV_QUANT_DTYPES))
def test_quantize_error_is_bounded_with_outliers(name):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 3, 64)).astype(np.float32)
    x[::7] *= 1e3  # outlier tokens: their own scales absorb the magnitude
    values, scales = kv_quant.quantize(jnp.asarray(x), KV_QUANT_DTYPES[name])
    back = np.asarray(kv_quant.dequantize(values, scales))
    assert np.isfinite(back).all()
    amax = np.abs(x).max(-1, keepdims=True)
    # int8: half a step of amax / 127; e4m3: 3 mantissa bits, half an ulp <= 1/16 relative. The
    # scale is a bf16 (8 significant bits): the step is up to 2^-8 coarser, and a value past
    # 127 steps when the scale rounded down is clipped by at most amax * 2^-9.
    bound = amax / 254 if name == "int8" else np.maximum(np.abs(x) / 16, amax / 448 * 2.0 ** -9)
    assert (np.abs(back - x) <= bound * (1 + 2.0 ** -8) + 1e-30).all()


def test_reference_write_kv_quantizes_into_slots():
    rng = np.random.default_rng(1)
    num_pages, page_size, num_kv_heads, head_dim = 4, 8, 2, 16
    pool = kv_quant.zeros((2, num_pages, page_size, num_kv_heads, head_dim), "int8", jnp.float32)
    k = rng.standard_normal((3, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((3, num_kv_heads, head_dim)).astype(np.float32)
    slots = np.array([13, -1, 30], np.int32)
    out = reference.write_kv(pool, jnp.asarray(k), jnp.asarray(v), slots)
    back = np.asarray(kv_quant.dequantize_pool(out))
    for t, slot in ((0, 13), (2, 30)):
        for half, x in ((0, k), (1, v)):
            got = back[half, slot // page_size, slot % page_size]
            # by hand: the scale rounded to bf16 as stored, values clipped to +-127 steps
            scale = (np.abs(x[t]).max(-1, keepdims=True) / 127).astype(jnp.bfloat16).astype(np.float32)
            np.testing.assert_allclose(got, np.clip(np.round(x[t] / scale), -127, 127) * scale, rtol=1e-6, atol=1e-7)
    written = np.zeros((num_pages, page_size), bool)
    written[1, 5] = written[3, 6] = True
    assert (back[:, ~written] == 0).all()  # padding token dropped, other slots untouched


@pytest.mark.parametrize("qc", QUANT_CASES, ids=quant_case_id)
def test_reference_reads_the_dequantized_pool(qc):
    name, (dtype, page_size, ratio, head_dim, num_kv_heads) = qc
    rng = np.random.default_rng(2)
    case = make_case(rng, dtype=dtype, page_size=page_size, ratio=ratio, head_dim=head_dim,
                     num_kv_heads=num_kv_heads, kv_lens=[9, 40, 0], q_lens=[9, 3, 0],
                     pages_per_seq=-(-40 // page_size) + 1)
    _, ref_pool = quantize_case(case, name)
    # Dequantised by hand in numpy: the plain f32 pool the reference already trusts.
    plain = np.asarray(ref_pool.pages, np.float32) * np.asarray(ref_pool.scales, np.float32)[..., None]
    args = (case.page_indices, case.kv_lens, case.q_lens)
    got = reference.paged_attention_ref(jnp.asarray(case.q), ref_pool, *args, sm_scale=head_dim ** -0.5)
    want = reference.paged_attention_ref(jnp.asarray(case.q), jnp.asarray(plain), *args, sm_scale=head_dim ** -0.5)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("qc", QUANT_CASES, ids=quant_case_id)
@pytest.mark.parametrize("chunk_tokens", [8, pytest.param(64, marks=pytest.mark.extended)])
@pytest.mark.parametrize("kv_lens,q_lens", [([1, 17, 64, 0, 33], [1, 1, 1, 0, 1]), ([40, 7, 64, 0], [9, 7, 5, 0])],
                         ids=["decode", "prefill"])
def test_xla_matches_reference_on_quantized_pool(qc, chunk_tokens, kv_lens, q_lens):
    name, (dtype, page_size, ratio, head_dim, num_kv_heads) = qc
    rng = np.random.default_rng(3)
    case = make_case(rng, dtype=dtype, page_size=page_size, ratio=ratio, head_dim=head_dim,
                     num_kv_heads=num_kv_heads, kv_lens=kv_lens, q_lens=q_lens,
                     pages_per_seq=-(-64 // page_size) + 1)
    pool, ref_pool = quantize_case(case, name)  # NaN scales on unused rows must never leak
    args = (case.page_indices, case.kv_lens, case.q_lens)
    got = paged_attention_xla(jnp.asarray(case.q), pool, *args, sm_scale=head_dim ** -0.5, chunk_tokens=chunk_tokens)
    want = reference.paged_attention_ref(jnp.asarray(case.q), ref_pool, *args, sm_scale=head_dim ** -0.5)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("name", sorted(KV_QUANT_DTYPES))
def test_outlier_keys_and_values_stay_finite_and_close(name):
    """K/V rows scaled by 1e3 (activations with large outliers): fp8 must not overflow (the scales
    absorb the magnitude) and the output stays near the unquantised attention's."""
    rng = np.random.default_rng(4)
    case = make_case(rng, dtype=jnp.float32, page_size=8, ratio=2, head_dim=64, num_kv_heads=2,
                     kv_lens=[20, 31], q_lens=[4, 1], pages_per_seq=4)
    pool = np.nan_to_num(case.kv_pages)
    pool[:, :, ::3] *= 1e3  # every third slot of every page, K and V
    q = case.q * 1e-3  # keep the softmax from collapsing onto one outlier key
    pool_q = kv_quant.QuantizedKV(*kv_quant.quantize(jnp.asarray(pool), KV_QUANT_DTYPES[name]))
    args = (case.page_indices, case.kv_lens, case.q_lens)
    want = np.asarray(reference.paged_attention_ref(jnp.asarray(q), jnp.asarray(pool), *args, sm_scale=0.125))
    for fn in (reference.paged_attention_ref, paged_attention_xla):
        got = np.asarray(fn(jnp.asarray(q), pool_q, *args, sm_scale=0.125))
        assert np.isfinite(got).all()
        tol = 0.02 if name == "int8" else 0.1  # of the output's largest magnitude
        assert np.abs(got - want).max() <= tol * np.abs(want).max(), np.abs(got - want).max() / np.abs(want).max()


def test_int8_pool_holds_1_9x_bf16_tokens_at_head_dim_64():
    # a row of 64 bf16 values = 128 bytes against 64 int8 values + one bf16 scale = 66 bytes, in
    # the canonical layout and in the tpu one (a slot's two bf16 scales packed in one 4-byte
    # word: page_size 16 fills a page's 16 lanes exactly)
    auto, int8 = (kv_quant.head_page_bytes(name, 2, 64, 16) for name in ("auto", "int8"))
    assert (auto, int8) == (2 * 16 * 128, 2 * 16 * 66) and auto / int8 >= 1.9
    pool = kv_quant.zeros((2, 4, 16, 2, 64), "int8", jnp.bfloat16)
    assert pool.pages.nbytes + pool.scales.nbytes == 4 * 2 * int8
    tpu = kv_quant.head_page_bytes("int8", 2, 64, 16, "tpu")
    assert tpu == 2 * 16 * 66 and auto / tpu >= 1.9
    pool = kv_quant.zeros(kv_layout.TPU.shape(16, 16, 2, 64), "int8", jnp.bfloat16, "tpu")  # 16 pages: 2 whole rows
    assert pool.pages.nbytes + pool.scales.nbytes == 16 * 2 * tpu


def test_tpu_layout_pads_page_scales_to_a_power_of_two_lanes():
    # one 4-byte word a slot: page_size 3 takes 4 lanes, 32 pages a row; page_size 80 takes 128 lanes
    assert [kv_layout.TPU.scale_bytes_per_page(ps) for ps in (3, 16, 80)] == [4 * 4, 16 * 4, 128 * 4]
    assert [kv_layout.CANONICAL.scale_bytes_per_page(ps) for ps in (3, 16, 80)] == [6 * 2, 32 * 2, 160 * 2]
    assert kv_layout.TPU.scale_shape(33, 3, 2) == (2, 2, 1, 128)  # 33 pages at 32 per row
    assert kv_layout.TPU.scale_shape(5, 80, 2) == (2, 5, 1, 128)
    assert kv_layout.TPU.scale_shape(5, 200, 2) == (2, 5, 1, 256)


def test_packed_scale_pairs_hold_both_bf16_scales_exactly():
    """Every bf16 pattern a scale can be (zero, subnormal, the largest finite, NaN) survives a
    pack and unpack bit for bit, key and value apart, whichever half the other takes."""
    pattern = np.array([0x0000, 0x0001, 0x007F, 0x0080, 0x3F80, 0x7F7F, 0x7FC0, 0x1234], np.uint16)
    k, v = (jnp.asarray(np.repeat(pattern, 8) if i else np.tile(pattern, 8)).view(jnp.bfloat16) for i in range(2))
    words = kv_layout.pack_scale_pairs(k, v)
    assert words.dtype == jnp.int32 and not (np.asarray(words) == kv_layout.NO_PAIR).any()
    got_k, got_v = kv_layout.unpack_scale_pairs(words)
    for got, want in ((got_k, k), (got_v, v)):
        assert got.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.bfloat16)).view(np.uint16),
                                      np.asarray(want).view(np.uint16))
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32) & 0xFFFF, 0)  # exactly the bf16 value
