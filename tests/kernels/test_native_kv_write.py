"""The native CPU KV write (pallas_kernels/native_kv_write.py) against the reference's scatter,
bitwise: plain f32 / bf16 pools and int8 / fp8 quantised ones, padding and out-of-range slots,
one token and many, per-layer and stacked pools, in place when the pool is donated."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_quant, native_kv_write, reference

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the native kernel"),
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel; the default backend is not CPU"),
]

PAGES, PAGE_SIZE, HEADS, HEAD_DIM = 6, 4, 2, 8


@pytest.fixture(scope="module", autouse=True)
def native():
    from models.cache import NATIVE_DIR, cache_dir

    assert native_kv_write.load(os.path.join(cache_dir(), NATIVE_DIR)), native_kv_write.LIBRARY.error


def _pool(kv_dtype: str, rng, lead=()):
    shape = (2, *lead, PAGES, PAGE_SIZE, HEADS, HEAD_DIM)
    values = rng.standard_normal(shape).astype(np.float32)
    if kv_dtype in ("float32", "bfloat16"):
        return jnp.asarray(values, kv_dtype)
    pages, scales = kv_quant.quantize(jnp.asarray(values), kv_quant.KV_CACHE_DTYPES[kv_dtype])
    return kv_quant.QuantizedKV(pages, scales.astype(jnp.float32))  # scales as a CPU pool holds them


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("slots", [[5], [-1], [0, 23, -1, 9, 24, 1000, 7]], ids=["one", "padding", "many"])
def test_native_write_equals_the_reference(kv_dtype, slots):
    rng = np.random.default_rng(len(slots))
    pool = _pool(kv_dtype, rng)
    k = jnp.asarray(rng.standard_normal((len(slots), HEADS, HEAD_DIM)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((len(slots), HEADS, HEAD_DIM)), jnp.float32)
    slot_mapping = jnp.asarray(slots, jnp.int32)  # 24 and 1000 are past the 6 x 4 slots: dropped
    want = jax.jit(reference.write_kv)(pool, k, v, slot_mapping)
    got = jax.jit(native_kv_write.write_kv)(pool, k, v, slot_mapping)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    if slots != [-1]:  # something was written
        assert any(not np.array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
                   for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(pool)))


def test_native_write_on_a_stacked_pool_and_in_place():
    """A scanned model's layer l writes pages l * P.. of the stacked pool [2, L, P, ...] viewed as
    [2, L * P, ...]; donated, the result is the pool's own buffer."""
    rng = np.random.default_rng(0)
    stacked = _pool("bfloat16", rng, lead=(3,))
    layer = stacked.reshape(2, 3 * PAGES, PAGE_SIZE, HEADS, HEAD_DIM)
    k = jnp.asarray(rng.standard_normal((2, HEADS, HEAD_DIM)), jnp.float32)
    slot_mapping = jnp.asarray([PAGES * PAGE_SIZE + 3, 2 * PAGES * PAGE_SIZE], jnp.int32)  # layers 1 and 2
    want = np.asarray(reference.write_kv(layer, k, -k, slot_mapping).astype(jnp.float32))
    pointer = layer.unsafe_buffer_pointer()
    got = jax.jit(native_kv_write.write_kv, donate_argnums=0)(layer, k, -k, slot_mapping)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)
    assert got.unsafe_buffer_pointer() == pointer
