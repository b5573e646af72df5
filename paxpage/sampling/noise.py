"""Gumbel noise as a pure function of (row key, stream, index): the randomness of every draw.

A row's draw (paxpage/sampling/draw.py) takes the argmax of log-weights plus Gumbel noise, so its
token moves only when two noisy scores nearly tie; the noise itself must then depend on nothing
but the row's key and the index it is added to (a block, a token id), never on the batch, the
vocabulary's padding or the device. It is a small counter hash that the native CPU draw
(pallas_kernels/native/proposal_draw_cpu.cc) computes with the same integer operations:

  a = fmix32(k0 ^ fmix32(stream + 0x632BE5AB)),  b = fmix32(k1 + a)
  bits(index) = fmix32(fmix32(index * 0x9E3779B9 + a) ^ b)       (a bijection of index)
  v = min((f32(bits) + 0.5) * 2^-32, 1 - 2^-24)                 (v in (0, 1))
  gumbel = -log(-log1p(-v))

fmix32 is MurmurHash3's finaliser. Writing the uniform as 1 - v keeps 2^-32 resolution where a
small exponential -log1p(-v) decides a tail token's win; the noise lies in about [-2.82, 22.88].
Streams: 2 * round + 0 for blocks, 2 * round + 1 for tokens (round 0 is a row's first draw,
later rounds are the exact path's rejection rounds).

Axis legend: R rows, M indices per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK_STREAM = 0  # + 2 * round: the noise of a round's block choice
TOKEN_STREAM = 1  # + 2 * round: the noise of a round's token choice (indexed by token id)

_GOLDEN = 0x9E3779B9
_STREAM_SALT = 0x632BE5AB


def fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser (a bijection on u32)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def row_words(keys: jax.Array, stream: jax.Array | int) -> tuple[jax.Array, jax.Array]:
    """keys u32[..., 2] raw key data, stream int -> the two per-row words (a, b), u32[...]."""
    keys = keys.astype(jnp.uint32)
    s = jnp.asarray(stream).astype(jnp.uint32)
    a = fmix32(keys[..., 0] ^ fmix32(s + jnp.uint32(_STREAM_SALT)))
    return a, fmix32(keys[..., 1] + a)


def gumbel(keys: jax.Array, stream: jax.Array | int, index: jax.Array) -> jax.Array:
    """Gumbel noise f32[..., M] for keys u32[..., 2] (one key per leading index), a stream, and
    non-negative indices i32[..., M] (broadcast against the keys' leading shape)."""
    a, b = row_words(keys, stream)
    h = index.astype(jnp.uint32) * jnp.uint32(_GOLDEN) + a[..., None]
    h = fmix32(fmix32(h) ^ b[..., None])
    v = jnp.minimum((h.astype(jnp.float32) + 0.5) * jnp.float32(2.0 ** -32), jnp.float32(1.0 - 2.0 ** -24))
    return -jnp.log(-jnp.log1p(-v))
