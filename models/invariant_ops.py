"""Batch-invariant forms of the model's row-wise reductions (EngineConfig.batch_invariant).

XLA picks a matmul's blocking, and so its summation order, from the number of rows: on CPU a
row of [T, I] @ [I, O] changes in its last bits between T = 1, T = 2..32 and T >= 64. Cutting
the rows into fixed tiles of TILE_ROWS makes every tile the same matmul, so a row's result no
longer depends on how many rows share the step or where it sits. Likewise jnp.mean's reduction
order over H depends on the row count; norm_mean_square sums in a fixed order per row.

Axis legend: T rows (tokens), I input features, O output features, H hidden.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

TILE_ROWS = 64  # rows per matmul tile; B >= 64 was measured to take XLA CPU's row-stable blocking


def tiled_rows(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """fn (a per-row map such as x @ W) applied to x [..., T, I] in fixed tiles of TILE_ROWS rows."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])  # [T, I]
    num_rows = flat.shape[0]
    padded = -(-num_rows // TILE_ROWS) * TILE_ROWS
    flat = jnp.pad(flat, ((0, padded - num_rows), (0, 0)))
    y = fn(flat.reshape(padded // TILE_ROWS, TILE_ROWS, flat.shape[-1]))  # [n, TILE_ROWS, O]
    return y.reshape(padded, y.shape[-1])[:num_rows].reshape(*lead, y.shape[-1])


def _pairwise_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis as a balanced tree of elementwise adds: one order for any batch."""
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = jnp.concatenate([x[..., :-2], x[..., -2:-1] + x[..., -1:]], axis=-1)
        else:
            x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def norm_mean_square(x32: jax.Array) -> jax.Array:
    """mean(x * x) over the last axis of f32 x [..., H] in an order that does not depend on the rows: [..., 1]."""
    h = x32.shape[-1]
    # Elementwise adds only: XLA cannot reorder them by the row count as it may a reduce.
    return (_pairwise_sum(x32 * x32) / h)[..., None]
