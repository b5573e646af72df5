"""A dense layer's matmul as a native CPU kernel (native/linear_cpu.cc, an XLA FFI custom call),
beside `linear_ref`, the same product in jnp with the same signature.

The weight comes in column panels (models/panel_layout.py: f32 or bf16 [P, I, 64], panel p holding
columns [64p, 64p + 64) of the [I, O] weight), each one contiguous block; bf16 panels are widened to
f32 as the kernel loads them (XLA CPU runs a bf16 dot by converting both operands, the whole
weight included, to f32 on every call; jax 0.10.2). XLA's CPU dot repacks a
row-major weight on every call and runs a decode step's skinny matmuls (a few to 64 rows) at
about half the machine's f32 rate; the kernel streams each panel once, front to back, while
register tiles of 6 rows x 64 columns pass over it, and splits (panel, row group) items over
XLA's intra-op threads. On a 2-core AMD EPYC a SmolLM2 layer stack's matmuls run ~1.5x faster at
4-16 rows and ~1.1-1.3x at 64-512 (`scripts/bench_matmul.py`, the layer-stack lines). Every output is a sum
over the input width in order, so a row's result does not depend on the other rows of the step.

A quantised weight (models/quant.py: int8 values with an f32 scale, and for the affine GGUF
formats an f32 offset, per group of Q inputs of a column) comes in the same panels, q i8[P, I, 64]
with scale / offset f32[P, I / Q, 64]; the kernel dequantises each weight as it loads it
(a quarter of f32's bytes to stream), where XLA's dot on CPU expands the whole weight to f32 in
every call.

Built with g++ on first use into the directory the caller names (paxpage: its cache dir +
/native) and registered for the CPU platform; `load` says whether that worked (one warning per
process when not: the caller keeps XLA's dot).

Axis legend: T tokens, I input width, O output width, P panels (O / 64), Q inputs per scale.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels.native import build as native_build

TARGET = "paxpage_linear_cpu"
TARGET_Q = "paxpage_linear_q_cpu"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "linear_cpu.cc")
LIBRARY = native_build.NativeLibrary(SOURCE, {TARGET: "PaxpageLinearCpu", TARGET_Q: "PaxpageLinearQCpu"},
                                     "the native CPU matmul")
PANEL = 64  # columns per panel (the kernel's kPanel)
# What the kernel reads as stored: a bf16 model's panels too (XLA CPU runs a bf16 dot by converting
# both operands, the whole weight included, to f32 on every call; jax 0.10.2).
PANEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def load(build_dir: str, compiler: str = "g++") -> bool:
    """Builds (cached in build_dir), loads and registers the kernel once per process."""
    return LIBRARY.load(build_dir, compiler)


def loaded() -> bool:
    return LIBRARY.loaded()


def _check(x, panels, live, group, scale=None, offset=None) -> None:
    stacked = panels.ndim == 4
    if x.ndim != 2 or panels.ndim not in (3, 4) or panels.shape[-2] != x.shape[1] or panels.shape[-1] != PANEL:
        raise ValueError(f"linear: x {x.shape} and panels {panels.shape}; expected [T, I] and [(G,) P, I, {PANEL}]")
    if stacked != (group is not None):
        raise ValueError(f"linear: panels {panels.shape} with group {group}; a group goes with [G, P, I, "
                         f"{PANEL}] panels and only with them")
    if live is not None and tuple(live.shape) != (x.shape[0],):
        raise ValueError(f"linear: live {tuple(live.shape)} for x {x.shape}; expected [{x.shape[0]}]")
    quantised = jnp.dtype(panels.dtype) == jnp.int8
    if quantised != (scale is not None) or (offset is not None and scale is None):
        raise ValueError(f"linear: {panels.dtype} panels with scale {scale is not None} and offset "
                         f"{offset is not None}; int8 panels take a scale (and maybe an offset), float ones neither")
    if quantised:
        *lead, p, i, _ = panels.shape
        blocks = scale.shape[-2] if scale.ndim == panels.ndim else 0
        if scale.shape != (*lead, p, blocks, PANEL) or not blocks or i % blocks \
                or (offset is not None and offset.shape != scale.shape):
            raise ValueError(f"linear: scale {scale.shape} (offset {None if offset is None else offset.shape}) "
                             f"for panels {panels.shape}; expected [(G,) P, I / Q, {PANEL}] with Q dividing I")


def linear_native(
    x: jax.Array,  # f32[T, I] (another float dtype is cast to f32)
    panels: jax.Array,  # f32 / bf16 / i8 [P, I, 64]: the [I, O] weight in column panels; or [G, P, I, 64]: G of them
    live: jax.Array | None = None,  # bool / i32[T]: the rows to compute (None: all); the others are 0
    group: jax.Array | None = None,  # i32[]: which of G stacked weights (a scanned stack's group)
    scale: jax.Array | None = None,  # f32[(G,) P, I / Q, 64]: int8 panels' scales, one per Q inputs of a column
    offset: jax.Array | None = None,  # f32, as scale: an affine format's offsets (w = q * scale + offset)
) -> jax.Array:  # f32[T, O = 64 P]: x @ weight, each element summed over I in order in f32
    """A scanned layer stack passes every group's panels and the group: slicing them out in the
    scan would copy the group's weights before every call."""
    if not loaded():
        raise RuntimeError("linear_native: call native_linear.load(build_dir) first")
    _check(x, panels, live, group, scale, offset)
    live = jnp.ones(x.shape[0], jnp.int32) if live is None else jnp.asarray(live).astype(jnp.int32)
    group = jnp.zeros((), jnp.int32) if group is None else jnp.asarray(group, jnp.int32).reshape(())
    out = jax.ShapeDtypeStruct((x.shape[0], panels.shape[-3] * PANEL), jnp.float32)
    x = jnp.asarray(x, jnp.float32)
    if scale is not None:
        offset = jnp.zeros((0,), jnp.float32) if offset is None else jnp.asarray(offset, jnp.float32)
        return jax.ffi.ffi_call(TARGET_Q, out)(x, panels, jnp.asarray(scale, jnp.float32), offset, group, live)
    if jnp.dtype(panels.dtype) not in PANEL_DTYPES:
        panels = jnp.asarray(panels, jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x, panels, group, live)


def linear_ref(
    x: jax.Array,  # f32[T, I]
    panels: jax.Array,  # f32 / bf16 / i8 [P, I, 64]: the [I, O] weight in column panels; or [G, P, I, 64]: G of them
    live: jax.Array | None = None,  # bool / i32[T]: the rows to compute (None: all); the others are 0
    group: jax.Array | None = None,  # i32[]: which of G stacked weights
    scale: jax.Array | None = None,  # f32[(G,) P, I / Q, 64]: int8 panels' scales
    offset: jax.Array | None = None,  # f32, as scale: an affine format's offsets
) -> jax.Array:  # f32[T, O = 64 P]: x @ weight
    """The same product in jnp at full f32 precision, panel by panel (int8 panels dequantised
    first, as models/quant.py does)."""
    _check(x, panels, live, group, scale, offset)
    if group is not None:
        panels, scale, offset = (None if a is None else a[group] for a in (panels, scale, offset))
    if scale is not None:  # each panel is an [I, 64] kernel with its [I / Q, 64] scales
        from models.quant import dequantize_kernel

        panels = dequantize_kernel(panels, scale, offset, jnp.float32)
    y = jnp.einsum("TI,PIC->TPC", jnp.asarray(x, jnp.float32), jnp.asarray(panels, jnp.float32),
                   precision=jax.lax.Precision.HIGHEST).reshape(x.shape[0], -1)
    return y if live is None else jnp.where(jnp.asarray(live)[:, None] != 0, y, 0.0)

