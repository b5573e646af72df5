"""models/invariant_ops.py: a row's result does not depend on the rows beside it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.invariant_ops import norm_mean_square, stable_rows
from models.quant import quantize_int8, quantized_matmul


def _data(rows, seed=0, width=(576, 1536)):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((rows, width[0])), jnp.float32), jnp.asarray(
        rng.standard_normal(width), jnp.float32)


ROW_COUNTS = (1, 2, 5, 17, 32, 33, 40, 51, 64, 70, 100, 130)


@pytest.mark.parametrize("width, dtype", [((576, 1536), jnp.float32), ((576, 1536), jnp.bfloat16),
                                          ((64, 32), jnp.float32), ((64, 576), jnp.float32)])
def test_every_row_is_the_same_at_any_row_count(width, dtype):
    """Each row of the step alone or among up to 130 rows: the same bits (x @ W, and the
    per-channel int8 kernel's product), and equal to a float64 product within rounding. [64, 32]
    and [64, 576] are widths whose plain product keeps moving up to 50 rows."""
    x, w = (a.astype(dtype) for a in _data(130, width=width))
    q, scale = quantize_int8(np.asarray(w, np.float32), axis=0)
    maps = {"float": lambda r: jnp.dot(r, w),
            "int8": lambda r: quantized_matmul(r, jnp.asarray(q), jnp.asarray(scale))}
    for name, fn in maps.items():
        # jitted, as in a step: XLA's simplifier must not cut the padding back out of the product
        fn = jax.jit(functools.partial(stable_rows, fn))
        full = np.asarray(fn(x).astype(jnp.float32))
        ref = np.asarray(x[:1], np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
        loose = dtype == jnp.bfloat16 or name == "int8"
        np.testing.assert_allclose(full[:1], ref, rtol=0.05 if loose else 1e-4, atol=1.0 if loose else 1e-3)
        for rows in ROW_COUNTS:
            got = np.asarray(fn(x[:rows]).astype(jnp.float32))
            np.testing.assert_array_equal(got, full[:rows], err_msg=f"{name}, {rows} rows")


@pytest.mark.extended
def test_norm_mean_square_is_the_same_at_any_row_count():
    x, _ = _data(40, seed=1)
    alone = norm_mean_square(x[:1])
    ref = np.mean(np.asarray(x[:1], np.float64) ** 2, axis=-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(alone), ref, rtol=1e-6)
    for rows in (2, 7, 8, 40):
        np.testing.assert_array_equal(np.asarray(norm_mean_square(x[:rows])[0]), np.asarray(alone[0]))
