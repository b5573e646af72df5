"""The KV pool layouts (pallas_kernels/kv_layout.py): shapes, axes, the canonical round trip, which
backend's pool gets which, and the engine's pieces that read them (page copy, sharding, dispatch)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pallas_kernels import dispatch, kv_layout, kv_quant
from paxpage.kv_pool import copy_pages
from paxpage.sharding import ShardingPlan, kv_pool_axes, kv_scale_axes


def _pool(rng, num_pages=6, page_size=8, num_kv_heads=3, head_dim=64):
    return jnp.asarray(rng.standard_normal((2, num_pages, page_size, num_kv_heads, head_dim)), jnp.float32)


def test_shapes_and_axes():
    assert kv_layout.CANONICAL.shape(10, 16, 3, 64) == (2, 10, 16, 3, 64)
    assert kv_layout.TPU.shape(10, 16, 3, 64) == (10, 3, 16, 128)
    for layout in (kv_layout.CANONICAL, kv_layout.TPU):
        shape = layout.shape(10, 16, 3, 64)
        assert shape[layout.page_axis] == 10 and shape[layout.head_axis] == 3
        assert layout.dims(shape) == (10, 16, 3, 64)
    with pytest.raises(ValueError, match="canonical layout"):
        kv_layout.CANONICAL.dims((10, 3, 16, 128))
    with pytest.raises(ValueError, match="tpu layout"):
        kv_layout.TPU.dims((2, 10, 16, 3, 64))
    with pytest.raises(ValueError, match="expected one of"):
        kv_layout.get("rows")


def test_round_trip_puts_k_and_v_side_by_side():
    pool = _pool(np.random.default_rng(0))
    tpu = kv_layout.TPU.from_canonical(pool)
    assert tpu.shape == (6, 3, 8, 128)
    # page 4, head 2, slot 5: lanes 0..63 the key, 64..127 the value
    np.testing.assert_array_equal(tpu[4, 2, 5, :64], pool[0, 4, 5, 2])
    np.testing.assert_array_equal(tpu[4, 2, 5, 64:], pool[1, 4, 5, 2])
    np.testing.assert_array_equal(kv_layout.TPU.to_canonical(tpu), pool)
    assert kv_layout.CANONICAL.from_canonical(pool) is pool


def test_each_backend_gets_its_layout():
    assert kv_layout.for_backend("tpu") is kv_layout.TPU
    for backend in ("gpu", "cpu", None):
        assert kv_layout.for_backend(backend) is kv_layout.CANONICAL
    # a latent pool stays canonical everywhere (a quantised one is the TPU's on TPU)
    assert kv_layout.for_backend("tpu", latent=True) is kv_layout.CANONICAL


def test_page_copy_on_the_tpu_layout_matches_the_canonical_one():
    pool = _pool(np.random.default_rng(1))
    src, dst = jnp.array([1, 4], jnp.int32), jnp.array([5, 6], jnp.int32)  # 6: past the pool, dropped
    want = copy_pages(pool, src, dst, page_axis=kv_layout.CANONICAL.page_axis)
    got = copy_pages(kv_layout.TPU.from_canonical(pool), src, dst, page_axis=kv_layout.TPU.page_axis)
    np.testing.assert_array_equal(kv_layout.TPU.to_canonical(got), want)


def _quantized_pool(rng, num_pages, page_size, num_kv_heads=3, head_dim=16):
    values, scales = kv_quant.quantize(_pool(rng, num_pages, page_size, num_kv_heads, head_dim), jnp.int8)
    return kv_quant.QuantizedKV(values, scales)


@pytest.mark.parametrize("page_size", [3, 8, 16, 80, 200])  # 32, 16, 8 and 1 page(s) per scale row; 200: 256 lanes
def test_quantized_round_trip_places_each_scale_in_its_row_and_lane(page_size):
    num_pages = 19
    pool = _quantized_pool(np.random.default_rng(3), num_pages, page_size)
    tpu = kv_layout.TPU.from_canonical(pool)
    assert tpu.pages.shape == (num_pages, 3, page_size, 32) and tpu.scales.dtype == jnp.int32
    lanes = 1 << (page_size - 1).bit_length() if page_size <= 128 else 256
    per_row = max(1, 128 // lanes)
    assert tpu.scales.shape == (3, -(-num_pages // per_row), 1, max(128, lanes))
    bits, got = np.asarray(pool.scales).view(np.uint16).astype(np.int64), np.asarray(tpu.scales).view(np.uint32)
    for page, slot, head in [(0, 0, 0), (18, page_size - 1, 2), (num_pages // 2, 1, 1)]:
        lane = (page % per_row) * lanes + slot
        assert got[head, page // per_row, 0, lane] == bits[0, page, slot, head] << 16 | bits[1, page, slot, head]
    back = kv_layout.TPU.to_canonical(tpu)
    np.testing.assert_array_equal(np.asarray(back.pages), np.asarray(pool.pages))
    np.testing.assert_array_equal(np.asarray(back.scales).view(np.uint16), np.asarray(pool.scales).view(np.uint16))
    assert back.scales.dtype == pool.scales.dtype


@pytest.mark.parametrize("page_size", [3, 16, 80])
def test_quantized_page_copy_and_scale_write_on_the_tpu_layout_match_the_canonical_ones(page_size):
    pool = _quantized_pool(np.random.default_rng(4), 19, page_size)
    src, dst = jnp.array([1, 17, 4], jnp.int32), jnp.array([16, 2, 19], jnp.int32)  # 19: past the pool, dropped
    want = copy_pages(pool, src, dst, page_axis=kv_layout.CANONICAL.page_axis)
    got = copy_pages([kv_layout.TPU.from_canonical(pool)], src, dst, kv_layout.TPU.page_axis, "tpu")[0]
    got = kv_layout.TPU.to_canonical(got)
    np.testing.assert_array_equal(np.asarray(got.pages), np.asarray(want.pages))
    np.testing.assert_array_equal(np.asarray(got.scales, np.float32), np.asarray(want.scales, np.float32))
    slots = jnp.array([0, page_size * 18 + page_size - 1, -1, page_size * 19, page_size * 7 + 1], jnp.int32)
    new = jnp.asarray(np.random.default_rng(5).standard_normal((2, 5, 3)), jnp.bfloat16)
    want = kv_quant.write_scales(pool.scales, slots, new)
    got = kv_layout.TPU.write_scales(kv_layout.TPU.scales_from_canonical(pool.scales), page_size, slots, new)
    got = kv_layout.TPU.scales_to_canonical(got, 19, page_size)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_page_copy_on_a_scanned_tpu_pool_copies_every_layers_page():
    """Scanned layers' tpu-layout pool is one pool of L * P pages (models/layer_stack.py); a copy
    of a layer's pages moves them in every layer, as the per-layer copies of the canonical pools."""
    from models import layer_stack
    from models.config import ModelConfig
    from paxpage.kv_pool import KVPoolSpec

    num_layers, num_pages, page_size = 3, 13, 8
    rng = np.random.default_rng(7)
    layers = [_quantized_pool(rng, num_pages, page_size) for _ in range(num_layers)]
    src, dst = jnp.array([1, 12, 4], jnp.int32), jnp.array([11, 2, 13], jnp.int32)  # 13: padding, dropped
    want = [copy_pages(layer, src, dst, kv_layout.CANONICAL.page_axis) for layer in layers]
    tpu = [kv_layout.TPU.from_canonical(layer) for layer in layers]
    merged = kv_quant.QuantizedKV(jnp.concatenate([t.pages for t in tpu]),
                                  kv_layout.TPU.scales_from_canonical(jnp.concatenate([l.scales for l in layers], axis=1)))
    assert layer_stack.is_merged(merged) and layer_stack.pool_geometry(merged, num_layers) == (num_pages, page_size)
    model = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=num_layers, num_heads=3,
                        num_kv_heads=3, head_dim=16)
    spec = KVPoolSpec(model, page_size, "int8", jnp.bfloat16, kv_layout.TPU, scanned=True)
    assert spec.merged and spec.page_axis == 0
    assert jax.tree.map(lambda a: a.shape, spec.abstract(num_pages)) == jax.tree.map(lambda a: a.shape, merged)
    got = kv_layout.TPU.to_canonical(spec.copy(merged, src, dst))
    for i, layer in enumerate(want):
        np.testing.assert_array_equal(np.asarray(got.pages[:, i * num_pages:(i + 1) * num_pages]),
                                      np.asarray(layer.pages))
        np.testing.assert_array_equal(np.asarray(got.scales[:, i * num_pages:(i + 1) * num_pages], np.float32),
                                      np.asarray(layer.scales, np.float32))
    plan = ShardingPlan(2, split_heads=True, split_mlp=True, split_vocab=True)
    assert plan.kv_cache_spec("int8", stacked=True, layout="tpu") == plan.kv_cache_spec("int8", layout="tpu")
    assert plan.kv_cache_spec("auto", stacked=True) == P(None, None, None, None, "model", None)


def test_tensor_parallel_splits_each_layout_on_its_head_axis():
    assert kv_pool_axes("canonical") == (None, None, None, "kv_heads", None)
    assert kv_pool_axes("tpu") == (None, "kv_heads", None, None)
    plan = ShardingPlan(2, split_heads=True, split_mlp=True, split_vocab=True)
    assert plan.layout_pool_spec("tpu") == P(None, "model", None, None)
    assert plan.kv_cache_spec("auto", layout="tpu") == P(None, "model", None, None)
    assert plan.kv_pool_spec == plan.layout_pool_spec(None) == P(None, None, None, "model", None)
    assert kv_scale_axes("canonical") == (None, None, None, "kv_heads")
    assert kv_scale_axes("tpu") == ("kv_heads", None, None, None)
    assert plan.kv_cache_spec("int8", layout="tpu") == kv_quant.QuantizedKV(P(None, "model", None, None),
                                                                           P("model", None, None, None))
    assert plan.kv_cache_spec("int8").scales == P(None, None, None, "model")


def test_dispatch_keeps_the_tpu_layout_off_the_gpu_family():
    pool = kv_layout.TPU.from_canonical(_pool(np.random.default_rng(2)))
    q = jnp.zeros((2, 1, 3, 64), jnp.float32)
    with pytest.raises(ValueError, match="TPU kernels only"):
        dispatch.paged_attention(q, pool, jnp.zeros((2, 2), jnp.int32), jnp.ones(2, jnp.int32),
                                 jnp.ones(2, jnp.int32), sm_scale=1.0, impl="pallas-interpret", backend="gpu",
                                 layout="tpu")
