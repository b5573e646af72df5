"""Tier (b): the in-place KV write kernel against reference.write_kv, compared exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import INTERPRET, skip_unless_runnable
from pallas_kernels import kv_layout, reference
from pallas_kernels.kv_write import write_kv


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_write_kv_exact(dtype, backend):
    skip_unless_runnable(backend)
    rng = np.random.default_rng(0)
    num_pages, page_size, num_kv_heads, head_dim, num_tokens = 5, 8, 2, 64, 11
    pool = rng.standard_normal((2, num_pages, page_size, num_kv_heads, head_dim)).astype(np.float32)
    pool[:, 3] = np.nan  # untouched NaN pages must stay bit-identical
    pool = np.asarray(jnp.asarray(pool, dtype))
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    # Permuted distinct slots across pages, padding (-1) in the middle and at the end,
    # one slot inside the NaN page.
    slots = rng.permutation(np.setdiff1d(np.arange(num_pages * page_size), np.arange(24, 32)))[:num_tokens]
    slots[[2, 7, 10]] = -1
    slots[4] = 3 * page_size + 5
    slots = slots.astype(np.int32)
    want = reference.write_kv(jnp.asarray(pool), jnp.asarray(k, dtype), jnp.asarray(v, dtype), slots)
    got = write_kv(jnp.array(pool), jnp.asarray(k, dtype), jnp.asarray(v, dtype), slots, block_t=4,
                   backend=backend, interpret=INTERPRET)
    assert got.dtype == pool.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_write_kv_on_the_tpu_layout_exact(dtype):
    """The tpu layout [P, K, page_size, 2D]: the reference's write on the canonical pool, laid out."""
    skip_unless_runnable("tpu")
    rng = np.random.default_rng(1)
    num_pages, page_size, num_kv_heads, head_dim, num_tokens = 5, 8, 3, 64, 11
    pool = rng.standard_normal((2, num_pages, page_size, num_kv_heads, head_dim)).astype(np.float32)
    pool[:, 3] = np.nan  # untouched NaN pages must stay bit-identical
    pool = jnp.asarray(pool, dtype)
    k = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, head_dim)), dtype)
    slots = rng.permutation(num_pages * page_size)[:num_tokens].astype(np.int32)
    slots[[2, 10]] = -1
    slots[5] = num_pages * page_size + 3  # past the pool: dropped like padding
    want = reference.write_kv(pool, k, v, slots)
    got = write_kv(kv_layout.TPU.from_canonical(pool), k, v, slots, backend="tpu", interpret=INTERPRET, layout="tpu")
    assert got.shape == (num_pages, num_kv_heads, page_size, 2 * head_dim) and got.dtype == pool.dtype
    np.testing.assert_array_equal(np.asarray(kv_layout.TPU.to_canonical(got), np.float32),
                                  np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="TPU family"):
        write_kv(kv_layout.TPU.from_canonical(pool), k, v, slots, backend="gpu", interpret=True, layout="tpu")


def test_write_kv_donates_and_aliases_the_pool():
    backend = "gpu" if INTERPRET else jax.default_backend()
    pool = jnp.zeros((2, 4, 8, 1, 64), jnp.float32)
    k = jnp.ones((3, 1, 64), jnp.float32)
    slots = jnp.array([0, -1, 9], jnp.int32)
    lowered = write_kv.lower(pool, k, k, slots, backend=backend, interpret=INTERPRET).as_text()
    # The pool argument is donated to the output: updated in place, not copied.
    assert "tf.aliasing_output = 0" in lowered
    out = write_kv(pool, k, k, slots, backend=backend, interpret=INTERPRET)
    assert pool.is_deleted()
    assert float(out[0, 1, 1, 0, 0]) == 1.0 and float(out[0, 0, 1, 0, 0]) == 0.0


def test_write_kv_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="do not fit"):
        write_kv(jnp.zeros((2, 4, 8, 1, 64)), jnp.zeros((3, 2, 64)), jnp.zeros((3, 2, 64)),
                 jnp.zeros((3,), jnp.int32), interpret=True)


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_write_kv_quantized_exact(name, backend):
    """Values and scales land where reference.write_kv puts them, bit for bit; untouched rows
    (NaN scales here) stay as they were."""
    from kernel_cases import KV_QUANT_DTYPES
    from pallas_kernels import kv_quant

    skip_unless_runnable(backend)
    rng = np.random.default_rng(1)
    num_pages, page_size, num_kv_heads, head_dim, num_tokens = 4, 8, 3, 32, 9
    values, scales = kv_quant.quantize(jnp.asarray(rng.standard_normal(
        (2, num_pages, page_size, num_kv_heads, head_dim)), jnp.float32), KV_QUANT_DTYPES[name])
    scales = scales.at[:, 2].set(jnp.nan)
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    k[3] = 0.0  # a zero row: scale 0, no NaN
    slots = rng.permutation(np.setdiff1d(np.arange(num_pages * page_size), np.arange(16, 24)))[:num_tokens]
    slots[[1, 8]] = -1
    slots = slots.astype(np.int32)
    want = reference.write_kv(kv_quant.QuantizedKV(values, scales), jnp.asarray(k), jnp.asarray(v), slots)
    got = write_kv(kv_quant.QuantizedKV(jnp.array(values), jnp.array(scales)), jnp.asarray(k), jnp.asarray(v),
                   slots, block_t=4, backend=backend, interpret=INTERPRET)
    assert isinstance(got, kv_quant.QuantizedKV) and got.pages.dtype == values.dtype
    np.testing.assert_array_equal(np.asarray(got.pages, np.float32), np.asarray(want.pages, np.float32))
    np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales))
    assert np.isnan(np.asarray(got.scales)[:, 2]).all()
    if backend == "tpu":  # the same write on the TPU kernels' layout (f32 scale rows)
        from pallas_kernels import kv_layout

        tpu = kv_layout.TPU.from_canonical(kv_quant.QuantizedKV(values, scales))
        got = write_kv(tpu, jnp.asarray(k), jnp.asarray(v), slots, block_t=4, backend=backend,
                       interpret=INTERPRET, layout="tpu")
        got = kv_layout.TPU.to_canonical(got)
        np.testing.assert_array_equal(np.asarray(got.pages, np.float32), np.asarray(want.pages, np.float32))
        np.testing.assert_array_equal(np.asarray(got.scales, np.float32), np.asarray(want.scales, np.float32))


@pytest.mark.parametrize("num_tokens", [1, 100])
def test_write_kv_quantized_tpu_layout_many_rows(num_tokens):
    """On the tpu layout the scales' rows a step touches are read, updated and written back by
    DMA, in blocks of rows: tokens spread over more rows than one block holds, several tokens in
    one row, padding and slots past the pool. Values equal reference.write_kv's; the whole scale
    array (untouched rows and lanes, NaN ones included) equals the jnp scatter's."""
    from kernel_cases import KV_QUANT_DTYPES
    from pallas_kernels import kv_quant

    skip_unless_runnable("tpu")
    rng = np.random.default_rng(7)
    num_pages, page_size, num_kv_heads, head_dim = 320, 16, 2, 32  # 8 pages a row: 40 rows
    values, scales = kv_quant.quantize(jnp.asarray(rng.standard_normal(
        (2, num_pages, page_size, num_kv_heads, head_dim)), jnp.float32), KV_QUANT_DTYPES["int8"])
    scales = scales.at[:, 9].set(jnp.nan)
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    slots = rng.permutation(num_pages * page_size)[:num_tokens].astype(np.int32)
    if num_tokens > 1:
        slots[:6] = 40 * page_size + np.arange(6)  # six tokens in one page's row
        slots[[10, 30]] = -1
        slots[20] = num_pages * page_size + 3  # past the pool: dropped
    rows = kv_layout.ScaleRows(page_size)
    if num_tokens > 1:
        real = slots[(slots >= 0) & (slots < num_pages * page_size)]
        assert len(set(real // page_size // rows.pages_per_row)) > 32
    want = reference.write_kv(kv_quant.QuantizedKV(values, scales), jnp.asarray(k), jnp.asarray(v), slots)
    tpu = kv_layout.TPU.from_canonical(kv_quant.QuantizedKV(values, scales))
    kept = np.asarray(slots < num_pages * page_size)
    want_rows = kv_layout.TPU.write_scales(tpu.scales, page_size, jnp.asarray(np.where(kept, slots, -1)),
                                           kv_quant.quantize(jnp.stack([jnp.asarray(k), jnp.asarray(v)]),
                                                             KV_QUANT_DTYPES["int8"])[1])
    got = write_kv(tpu, jnp.asarray(k), jnp.asarray(v), slots, backend="tpu", interpret=INTERPRET, layout="tpu")
    np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want_rows))
    got = kv_layout.TPU.to_canonical(got)
    np.testing.assert_array_equal(np.asarray(got.pages, np.float32), np.asarray(want.pages, np.float32))
    np.testing.assert_array_equal(np.asarray(got.scales, np.float32), np.asarray(want.scales, np.float32))
