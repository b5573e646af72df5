"""models/invariant_ops.py: a row's result does not depend on the rows beside it."""

import numpy as np
import pytest
import jax.numpy as jnp

from models.invariant_ops import norm_mean_square, tiled_rows


def _data(rows, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((rows, 576)), jnp.float32), jnp.asarray(
        rng.standard_normal((576, 1536)), jnp.float32)


def test_tiled_matmul_row_is_the_same_at_any_batch_size():
    x, w = _data(70)
    alone = tiled_rows(lambda r: jnp.dot(r, w), x[:1])
    ref = np.asarray(x[:1], np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(alone), ref, rtol=1e-4, atol=1e-4)
    for rows in (2, 5, 17, 64, 70):
        got = tiled_rows(lambda r: jnp.dot(r, w), x[:rows])
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(alone[0]))


@pytest.mark.extended
def test_norm_mean_square_is_the_same_at_any_row_count():
    x, _ = _data(40, seed=1)
    alone = norm_mean_square(x[:1])
    ref = np.mean(np.asarray(x[:1], np.float64) ** 2, axis=-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(alone), ref, rtol=1e-6)
    for rows in (2, 7, 8, 40):
        np.testing.assert_array_equal(np.asarray(norm_mean_square(x[:rows])[0]), np.asarray(alone[0]))
