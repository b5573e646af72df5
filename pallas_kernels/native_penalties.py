"""The sampler's penalties as a native CPU kernel (native/penalties_cpu.cc, an XLA FFI custom call
updating the logits in place), beside `apply_penalties_ref`, the sampler's own XLA version with the
same signature.

Repetition, frequency and presence penalties and banned ids touch a few thousand of a row's
logits: the XLA version gathers them, penalises and scatters them back, and XLA CPU runs that
scatter one index at a time (~40 ms a step at 256 rows x 2,048 listed tokens, more than the
model's forward on the tiny bench model; 2-core EPYC, jax 0.10.2). The kernel reads and writes
just those logits, rows spread over XLA's intra-op threads: the same logits up to f32 rounding
(XLA fuses some of its products into FMAs and divides by multiplying with a reciprocal).

Built with g++ on first use into the directory the caller names (paxpage: its cache dir +
/native) and registered for the CPU platform; `load` says whether that worked (one warning per
process when not: the caller keeps the XLA path).

Axis legend: R rows, V vocabulary, S listed tokens per row, E banned tokens per row.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels.native import build as native_build

TARGET = "paxpage_penalties_cpu"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "penalties_cpu.cc")
LIBRARY = native_build.NativeLibrary(SOURCE, {TARGET: "PaxpagePenaltiesCpu"}, "the native CPU penalties")


def load(build_dir: str, compiler: str = "g++") -> bool:
    """Builds (cached in build_dir), loads and registers the kernel once per process."""
    return LIBRARY.load(build_dir, compiler)


def loaded() -> bool:
    return LIBRARY.loaded()


def apply_penalties_native(logits: jax.Array, t, pending: jax.Array | None = None) -> jax.Array:
    """`apply_penalties_ref` as the native kernel: logits f32[R, V], t the step's
    SamplingTensors (token_ids / token_counts [R, S], banned_ids [R, E], the penalty fields [R]),
    pending None or i32[R] (one more output token per penalised row, -1 none)."""
    from paxpage.sampling.sampler import counted_pending

    if not loaded():
        raise RuntimeError("apply_penalties_native: call native_penalties.load(build_dir) first")
    num_rows = logits.shape[0]
    pending = jnp.full((num_rows,), -1, jnp.int32) if pending is None else counted_pending(t, pending)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(logits.shape, jnp.float32), input_output_aliases={0: 0})
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return call(f32(logits), i32(t.token_ids), i32(t.token_counts), i32(t.banned_ids), f32(t.repetition_penalty),
                f32(t.frequency_penalty), f32(t.presence_penalty), pending)


def apply_penalties_ref(logits: jax.Array, t, pending: jax.Array | None = None) -> jax.Array:
    """The sampler's XLA version (paxpage/sampling/sampler.py apply_penalties)."""
    from paxpage.sampling.sampler import apply_penalties

    return apply_penalties(logits, t, pending)
