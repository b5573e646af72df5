"""The mixed-adapter LoRA delta as a native CPU kernel (native/lora_delta_cpu.cc, an XLA FFI
custom call), beside `lora_delta_ref`, the same delta in jnp with the same signature.

Each token of a step runs one adapter, named by its slot in the LoRA slab (paxpage/lora_slab.py;
-1: the base model), and adds (x @ A[slot]) @ B[slot] to a linear layer's output. The work is
small (per token (I + O) * R * 2 flops, a few percent of the base matmul), but XLA on CPU does
it as batched matvecs over per-row gathered copies of A and B, which cost several times the
arithmetic. The kernel groups tokens by slot, keeps one adapter's A and B in cache across its
tokens, skips base tokens (their rows are exactly 0) and spreads groups of tokens over XLA's
intra-op threads. Each token's sums run in a fixed order, so its row does not depend on the
other tokens of the step (batch-invariant mode relies on it).

Built with g++ on first use into the directory the caller names (paxpage: its cache dir +
/native) and registered for the CPU platform; `load` says whether that worked (one warning per
process when not: the caller keeps the XLA path).

Axis legend: T tokens, S slots, I input width, R rank, O output width.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels.native import build as native_build

TARGET = "paxpage_lora_delta_cpu"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "lora_delta_cpu.cc")
LIBRARY = native_build.NativeLibrary(SOURCE, {TARGET: "PaxpageLoraDeltaCpu"}, "the native CPU LoRA delta")
MAX_RANK = 256  # the kernel's kMaxRank


def load(build_dir: str, compiler: str = "g++") -> bool:
    """Builds (cached in build_dir), loads and registers the kernel once per process."""
    return LIBRARY.load(build_dir, compiler)


def loaded() -> bool:
    return LIBRARY.loaded()


def _check(x, a, b, token_slots) -> None:
    if x.ndim != 2 or a.ndim != 3 or b.ndim != 3 or token_slots.ndim != 1:
        raise ValueError(f"lora_delta: x {x.shape}, a {a.shape}, b {b.shape}, token_slots {token_slots.shape}; "
                         "expected [T, I], [S, I, R], [S, R, O], [T]")
    num_tokens, width = x.shape
    num_slots, _, rank = a.shape
    if a.shape[1] != width or b.shape[:2] != (num_slots, rank) or token_slots.shape[0] != num_tokens:
        raise ValueError(f"lora_delta: x {x.shape}, a {a.shape}, b {b.shape}, token_slots {token_slots.shape} "
                         "disagree (expected [T, I], [S, I, R], [S, R, O], [T])")
    if rank > MAX_RANK:
        raise ValueError(f"lora_delta: rank is {rank}; the native kernel takes at most {MAX_RANK}")


def lora_delta_native(
    x: jax.Array,  # f32[T, I]
    a: jax.Array,  # f32[S, I, R]: each slot's A
    b: jax.Array,  # f32[S, R, O]: each slot's B (the adapter's scale folded in)
    token_slots: jax.Array,  # i32[T]: each token's slot; -1 (or any value outside [0, S)): the base model
) -> jax.Array:  # f32[T, O]: (x[t] @ a[s]) @ b[s], 0 for base tokens
    if not loaded():
        raise RuntimeError("lora_delta_native: call native_lora.load(build_dir) first")
    _check(x, a, b, token_slots)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], b.shape[-1]), jnp.float32))
    f32 = [jnp.asarray(v, jnp.float32) for v in (x, a, b)]
    return call(*f32, jnp.asarray(token_slots, jnp.int32))


def lora_delta_ref(
    x: jax.Array,  # f32[T, I]
    a: jax.Array,  # f32[S, I, R]: each slot's A
    b: jax.Array,  # f32[S, R, O]: each slot's B (the adapter's scale folded in)
    token_slots: jax.Array,  # i32[T]: each token's slot; -1 (or any value outside [0, S)): the base model
) -> jax.Array:  # f32[T, O]: (x[t] @ a[s]) @ b[s], 0 for base tokens
    """The same delta in jnp, token by token: each token gathers its slot's A and B."""
    _check(x, a, b, token_slots)
    x = jnp.asarray(x, jnp.float32)
    num_slots = a.shape[0]
    kept = (token_slots >= 0) & (token_slots < num_slots)
    idx = jnp.where(kept, token_slots, 0)
    h = jnp.einsum("TI,TIR->TR", x, jnp.asarray(a, jnp.float32)[idx], precision=jax.lax.Precision.HIGHEST)
    out = jnp.einsum("TR,TRO->TO", h, jnp.asarray(b, jnp.float32)[idx], precision=jax.lax.Precision.HIGHEST)
    return jnp.where(kept[:, None], out, 0.0)
