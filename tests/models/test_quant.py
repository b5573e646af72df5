"""The quantised-weight form (models/quant.py) and GGUF block decoding (models/gguf_quants.py).

References: `gguf.quants.dequantize` (the gguf package's own numpy decoder, which transformers
also uses) for every block format, and plain numpy matmuls of the dequantised weights for the
in-step matmuls."""

from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants

from models import gguf_quants, quant

ROWS, COLS = 6, 512


def _blocks(type_name: str, rng) -> np.ndarray:
    """Raw bytes of ROWS rows in `type_name`: quantised by gguf where it can; K-quants written as
    random blocks whose f16 super-scales are set to small finite values."""
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in ("Q8_0", "Q4_0", "Q4_1"):
        return quants.quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32), qtype)
    block_bytes = gguf_quants.BLOCKS[type_name][0]
    raw = rng.integers(0, 256, (ROWS, COLS // 256, block_bytes), dtype=np.uint8)
    halves = lambda: (rng.standard_normal((ROWS, COLS // 256)) * 0.01).astype(np.float16).view(np.uint8)
    if type_name == "Q4_K":  # d, dmin lead the block
        raw[..., 0:2] = halves().reshape(ROWS, -1, 2)
        raw[..., 2:4] = halves().reshape(ROWS, -1, 2)
    else:  # Q6_K: d ends it
        raw[..., 208:210] = halves().reshape(ROWS, -1, 2)
    return raw.reshape(ROWS, -1)


@pytest.mark.parametrize("type_name", gguf_quants.FORMATS)
def test_decode_matches_gguf_dequantize(type_name):
    raw = _blocks(type_name, np.random.default_rng(0))
    ref = quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    q, scale, offset = gguf_quants.decode(raw, type_name)
    group = gguf_quants.BLOCKS[type_name][2]
    assert q.dtype == np.int8 and q.shape == (ROWS, COLS)
    assert scale.dtype == np.float32 and scale.shape == (ROWS, COLS // group)
    assert (offset is not None) == (type_name in ("Q4_1", "Q4_K"))
    np.testing.assert_array_equal(gguf_quants.dequantize(q, scale, offset), ref)  # exact, not close
    # And the in-step dequantisation (kernel layout: groups along axis 0) gives the same values.
    w = quant.dequantize_kernel(jnp.asarray(q.T), jnp.asarray(scale.T),
                                None if offset is None else jnp.asarray(offset.T), jnp.float32)
    np.testing.assert_allclose(np.asarray(w), ref.T, rtol=1e-6, atol=1e-7)


def test_decode_rejects_unknown_type_and_partial_blocks():
    with pytest.raises(ValueError, match="Q5_K"):
        gguf_quants.decode(np.zeros((1, 176), np.uint8), "Q5_K")
    with pytest.raises(ValueError, match="34-byte"):
        gguf_quants.decode(np.zeros((1, 35), np.uint8), "Q8_0")


def _grouped(rng, num_in, num_out, group, affine):
    q = rng.integers(-8, 8, (num_in, num_out)).astype(np.int8)
    scale = rng.uniform(0.01, 0.1, (num_in // group, num_out)).astype(np.float32)
    offset = rng.uniform(-0.1, 0.1, scale.shape).astype(np.float32) if affine else None
    w = np.repeat(scale, group, axis=0) * q + (np.repeat(offset, group, axis=0) if affine else 0)
    return q, scale, offset, w.astype(np.float32)


@pytest.mark.parametrize("group,affine", [(64, False), (32, False), (32, True), (16, False)])
def test_quantized_matmul_matches_dequantised_reference(group, affine):
    rng = np.random.default_rng(1)
    q, scale, offset, w = _grouped(rng, 64, 24, group, affine)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    y = quant.quantized_matmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale),
                               None if offset is None else jnp.asarray(offset))
    np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)


def test_quantized_embedding_rows_and_tied_head():
    rng = np.random.default_rng(2)
    q, scale, offset, w = _grouped(rng, 64, 10, 32, True)  # build [H, V] groups along H, then view as [V, H]
    table, tq, tscale, toffset = w.T, q.T, scale.T, offset.T
    ids = jnp.asarray([3, 0, 9, 3])
    rows = quant.dequantize_rows(jnp.asarray(tq)[ids], jnp.asarray(tscale)[ids], jnp.asarray(toffset)[ids],
                                 jnp.float32)
    np.testing.assert_allclose(np.asarray(rows), table[np.asarray(ids)], rtol=1e-6, atol=1e-7)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    logits = quant.quantized_attend(jnp.asarray(x), jnp.asarray(tq), jnp.asarray(tscale), jnp.asarray(toffset))
    np.testing.assert_allclose(np.asarray(logits), x.astype(np.float64) @ table.T, rtol=1e-5, atol=1e-5)


def test_int8_per_channel_error_bound():
    """Round-to-nearest with scale = amax / 127 errs by at most scale / 2 per weight."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((48, 16)).astype(np.float32) * rng.uniform(0.1, 3.0, (1, 16)).astype(np.float32)
    flat = quant.quantize_flat_int8({"l/kernel": w, "embed_tokens/embedding": w.T, "norm/scale": w[0]})
    assert flat["l/kernel_q"].dtype == np.int8 and flat["l/kernel_scale"].shape == (1, 16)
    assert flat["embed_tokens/embedding_scale"].shape == (16, 1)
    np.testing.assert_array_equal(flat["norm/scale"], w[0])
    step = np.abs(w).max(axis=0) / 127
    back = quant.dequantize_flat(flat)
    assert np.all(np.abs(back["l/kernel"] - w) <= step / 2 + 1e-7)
    assert np.all(np.abs(back["embed_tokens/embedding"] - w.T) <= step[:, None] / 2 + 1e-7)
    x = rng.standard_normal((3, 48)).astype(np.float32)
    y = quant.quantized_matmul(jnp.asarray(x), jnp.asarray(flat["l/kernel_q"]), jnp.asarray(flat["l/kernel_scale"]))
    np.testing.assert_allclose(np.asarray(y), x @ back["l/kernel"], rtol=1e-4, atol=1e-4)
