"""Batch-invariant forms of the model's row-wise reductions (EngineConfig.batch_invariant).

XLA picks a matmul's blocking, and so its summation order, from the number of rows: on XLA CPU a
row of [T, I] @ [I, O] changes in its last bits as T grows, until a row count from which every
row keeps the same bits at any T. That count depends on the shape: measured on this project's
CPU (every row of T = 2..139 against T = 140, f32), 2 for most widths, 33 for SmolLM2's q / k / v
/ gate / up and LM-head products, 51 for [I, 32], [I, 96] and [64, 576]. `stable_rows` pads a
step's rows up to MIN_ROWS and runs the matmul once, so a row's result does not depend on how many
rows share the step or where it sits; a step of MIN_ROWS rows or more is not padded. Likewise
jnp.mean's reduction order over H depends on the row count; norm_mean_square sums in a fixed
order per row.

tests/models/test_invariant_ops.py checks the row-count property on the machine it runs on.

Axis legend: T rows (tokens), I input features, O output features, H hidden.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.xla_attention import pairwise_sum

MIN_ROWS = 64  # at or past every measured row count of XLA CPU's row-stable blocking (module doc)


def stable_tokens(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """fn (a map over axis 0, such as x @ W or a per-head einsum of x [T, ...]) run on
    max(T, MIN_ROWS) tokens, padded with zeros, as one product."""
    num_tokens = x.shape[0]
    if num_tokens >= MIN_ROWS:
        return fn(x)
    return fn(jnp.pad(x, ((0, MIN_ROWS - num_tokens),) + ((0, 0),) * (x.ndim - 1)))[:num_tokens]


def stable_rows(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """fn (a per-row map such as x @ W) applied to x [..., T, I] as one [max(T, MIN_ROWS), I] matmul."""
    y = stable_tokens(fn, x.reshape(-1, x.shape[-1]))  # [T, O]
    return y.reshape(*x.shape[:-1], y.shape[-1])


def norm_mean_square(x32: jax.Array) -> jax.Array:
    """mean(x * x) over the last axis of f32 x [..., H] in an order that does not depend on the rows: [..., 1]."""
    h = x32.shape[-1]
    # Elementwise adds only: XLA cannot reorder them by the row count as it may a reduce.
    return (pairwise_sum(x32 * x32) / h)[..., None]
