"""The sampler's proposal draw as a native CPU kernel (native/proposal_draw_cpu.cc, an XLA FFI
custom call), beside `proposal_draw_ref`, the same draw in jnp with the same signature.

The proposal draw is the costly step of a sampled row without top-k (paxpage/sampling/draw.py):
one two-level Gumbel-max draw from the whole temperature-scaled distribution (a block by its log
mass, then a token inside it, the noise a hash of the row key and the index), then the check that
the drawn token is kept by min-p and top-p. In XLA on CPU it costs two fused passes over the [R, V]
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
BLOCK = 256  # tokens per block of the two-level draw (the kernel's kBlock, paxpage/sampling/draw.py _BLOCK)


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
    keys: jax.Array,  # u32[R, 2]: the row keys (paxpage/sampling/tensors.py row_keys)
    active: jax.Array,  # bool[R]: rows to draw (others give token 0, not accepted)
) -> tuple[jax.Array, jax.Array]:  # (token i32[R], accepted bool[R])
    if not loaded():
        raise RuntimeError("proposal_draw_native: call native_sampling.load(build_dir) first")
    num_rows = logits.shape[0]
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct((num_rows,), jnp.int32),
                                     jax.ShapeDtypeStruct((num_rows,), jnp.int32)))
    f32 = [jnp.asarray(a, jnp.float32) for a in (logits, temperature, best, l_min, top_p)]
    token, accepted = call(*f32, jnp.asarray(keys, jnp.uint32), jnp.asarray(active, jnp.int32))
    return token, accepted != 0


def proposal_draw_ref(
    logits: jax.Array,  # f32[R, V]
    temperature: jax.Array,  # f32[R] > 0
    best: jax.Array,  # f32[R]: max(logits) / temperature
    l_min: jax.Array,  # f32[R]: min-p's logit floor (-inf: off)
    top_p: jax.Array,  # f32[R]: 1 = off
    keys: jax.Array,  # u32[R, 2]: the row keys (paxpage/sampling/tensors.py row_keys)
    active: jax.Array,  # bool[R]: rows to draw (others give token 0, not accepted)
) -> tuple[jax.Array, jax.Array]:  # (token i32[R], accepted bool[R])
    """The sampler's own proposal draw in XLA ops (paxpage/sampling/draw.py two_level_draw, round
    0): weights w = exp(logits / T - best) where logits > -inf (else 0); a block of BLOCK tokens by
    Gumbel-max over log block sums, a token in it by Gumbel-max over logits / T - best; accepted
    when its logit is >= l_min and (top_p >= 1 or the weight of strictly better tokens < top_p *
    total)."""
    from paxpage.sampling.draw import two_level_draw

    no_floor = jnp.full(temperature.shape, -jnp.inf, jnp.float32)
    token, value, total = two_level_draw(logits, (temperature, best, no_floor, no_floor), keys, 0)
    w = jnp.where(logits > -jnp.inf, jnp.exp(logits / temperature[:, None] - best[:, None]), 0.0)
    mass_above = jnp.sum(jnp.where(logits > value[:, None], w, 0.0), axis=-1)
    accepted = (value >= l_min) & ((top_p >= 1.0) | (mass_above < top_p * total))
    return jnp.where(active, token, 0), active & accepted
