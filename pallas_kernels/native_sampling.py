"""The sampler's proposal draw as a native CPU kernel (native/proposal_draw_cpu.cc, an XLA FFI
custom call), beside `proposal_draw_ref`, the same draw in jnp with the same signature.

The proposal draw is the costly step of a sampled row without top-k (paxpage/sampling_draw.py):
one inverse-CDF draw from the whole temperature-scaled distribution, then the check that the
drawn token is kept by min-p and top-p. In XLA on CPU it costs two fused passes over the [R, V]
logits, each with an exp per logit (~4 ms each at 256 x 49152 on the 2-core EPYC, and ~22 ms
in some processes, where XLA's library fusion of the reduction goes slow); the kernel reads each
row once, keeps its weights in cache for the top-p check, and spreads rows over XLA's intra-op
threads.

Built with g++ on first use into the directory the caller names (paxpage: its cache dir +
/native) and registered for the CPU platform; `load` says whether that worked (one warning per
process when not: the caller keeps the XLA path).

Axis legend: R rows, V vocabulary.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels.native import build as native_build

TARGET = "paxpage_proposal_draw_cpu"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "proposal_draw_cpu.cc")
LIBRARY = native_build.NativeLibrary(SOURCE, {TARGET: "PaxpageProposalDrawCpu"}, "the native CPU proposal draw")
BLOCK = 256  # tokens per block of the inverse-CDF draw (the kernel's kBlock)


def load(build_dir: str, compiler: str = "g++") -> bool:
    """Builds (cached in build_dir), loads and registers the kernel once per process."""
    return LIBRARY.load(build_dir, compiler)


def loaded() -> bool:
    return LIBRARY.loaded()


def proposal_draw_native(
    logits: jax.Array,  # f32[R, V]
    temperature: jax.Array,  # f32[R] > 0
    best: jax.Array,  # f32[R]: max(logits) / temperature
    l_min: jax.Array,  # f32[R]: min-p's logit floor (-inf: off)
    top_p: jax.Array,  # f32[R]: 1 = off
    u: jax.Array,  # f32[R] uniforms in [0, 1)
    active: jax.Array,  # bool[R]: rows to draw (others give token 0, not accepted)
) -> tuple[jax.Array, jax.Array]:  # (token i32[R], accepted bool[R])
    if not loaded():
        raise RuntimeError("proposal_draw_native: call native_sampling.load(build_dir) first")
    num_rows = logits.shape[0]
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct((num_rows,), jnp.int32),
                                     jax.ShapeDtypeStruct((num_rows,), jnp.int32)))
    f32 = [jnp.asarray(a, jnp.float32) for a in (logits, temperature, best, l_min, top_p, u)]
    token, accepted = call(*f32, jnp.asarray(active, jnp.int32))
    return token, accepted != 0


def _pick(cum: jax.Array, target: jax.Array) -> jax.Array:
    """First index whose prefix sum exceeds target, capped at the last entry of positive weight."""
    below = jnp.sum(cum <= target[..., None], axis=-1)
    last_positive = jnp.sum(cum < cum[..., -1:], axis=-1)
    return jnp.minimum(below, last_positive).astype(jnp.int32)


def proposal_draw_ref(
    logits: jax.Array,  # f32[R, V]
    temperature: jax.Array,  # f32[R] > 0
    best: jax.Array,  # f32[R]: max(logits) / temperature
    l_min: jax.Array,  # f32[R]: min-p's logit floor (-inf: off)
    top_p: jax.Array,  # f32[R]: 1 = off
    u: jax.Array,  # f32[R] uniforms in [0, 1)
    active: jax.Array,  # bool[R]: rows to draw (others give token 0, not accepted)
) -> tuple[jax.Array, jax.Array]:  # (token i32[R], accepted bool[R])
    """Weights w = exp(logits / T - best) where logits > -inf (else 0); block sums over BLOCK
    tokens, a block by inverse CDF of u * total, then a token inside it; accepted when its logit
    is >= l_min and (top_p >= 1 or the weight of strictly better tokens < top_p * total)."""
    num_rows, vocab = logits.shape
    w = jnp.where(logits > -jnp.inf, jnp.exp(logits / temperature[:, None] - best[:, None]), 0.0)
    num_blocks = -(-vocab // BLOCK)
    wb = jnp.pad(w, [(0, 0), (0, num_blocks * BLOCK - vocab)]).reshape(num_rows, num_blocks, BLOCK)
    cum = jnp.cumsum(jnp.sum(wb, axis=-1), axis=-1)  # [R, N]
    total = cum[:, -1]
    target = u * total
    block = _pick(cum, target)
    before = jnp.where(block > 0, jnp.take_along_axis(cum, jnp.maximum(block - 1, 0)[:, None], -1)[:, 0], 0.0)
    inner_cum = jnp.cumsum(jnp.take_along_axis(wb, block[:, None, None], axis=1)[:, 0], axis=-1)  # [R, B]
    token = jnp.minimum(block * BLOCK + _pick(inner_cum, target - before), vocab - 1)
    value = jnp.take_along_axis(logits, token[:, None], -1)[:, 0]
    mass_above = jnp.sum(jnp.where(logits > value[:, None], w, 0.0), axis=-1)
    accepted = (value >= l_min) & ((top_p >= 1.0) | (mass_above < top_p * total))
    return jnp.where(active, token, 0), active & accepted

