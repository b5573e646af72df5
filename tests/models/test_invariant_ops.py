"""models/invariant_ops.py: a row's result does not depend on the rows beside it."""

import numpy as np
import pytest
import jax.numpy as jnp

from models.invariant_ops import norm_mean_square, stable_rows
from models.quant import quantize_int8, quantized_matmul


def _data(rows, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((rows, 576)), jnp.float32), jnp.asarray(
        rng.standard_normal((576, 1536)), jnp.float32)


ROW_COUNTS = (1, 2, 5, 17, 32, 33, 40, 64, 70, 130)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_row_is_the_same_at_any_row_count(dtype):
    """Each row of the step alone or among up to 130 rows: the same bits (x @ W in f32 / bf16, and
    the per-channel int8 kernel's product), and equal to a float64 product within rounding."""
    x, w = (a.astype(dtype) for a in _data(130))
    q, scale = quantize_int8(np.asarray(w, np.float32), axis=0)
    maps = {"float": lambda r: jnp.dot(r, w),
            "int8": lambda r: quantized_matmul(r, jnp.asarray(q), jnp.asarray(scale))}
    for name, fn in maps.items():
        full = np.asarray(stable_rows(fn, x).astype(jnp.float32))
        ref = np.asarray(x[:1], np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
        np.testing.assert_allclose(full[:1], ref, rtol=0.05 if dtype == jnp.bfloat16 or name == "int8" else 1e-4,
                                   atol=1.0 if dtype == jnp.bfloat16 or name == "int8" else 1e-3)
        for rows in ROW_COUNTS:
            got = np.asarray(stable_rows(fn, x[:rows]).astype(jnp.float32))
            np.testing.assert_array_equal(got, full[:rows], err_msg=f"{name}, {rows} rows")


@pytest.mark.extended
def test_norm_mean_square_is_the_same_at_any_row_count():
    x, _ = _data(40, seed=1)
    alone = norm_mean_square(x[:1])
    ref = np.mean(np.asarray(x[:1], np.float64) ** 2, axis=-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(alone), ref, rtol=1e-6)
    for rows in (2, 7, 8, 40):
        np.testing.assert_array_equal(np.asarray(norm_mean_square(x[:rows])[0]), np.asarray(alone[0]))
