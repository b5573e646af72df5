"""The mixed-adapter LoRA delta of one linear layer over a step's rows.

Every row of the step (a decode row of one token, or a prefill row of Tq tokens of one
sequence) runs one adapter, named by its slot in the device slab (-1: the base model). The
delta of row b's tokens is (x @ A[slot_b]) @ B[slot_b], B holding the adapter's scale, so a
step mixing any adapters (and the base) is one fixed-shape computation: the slots are data.

Two implementations, chosen once per runner (static at trace time, `resolve_lora_impl`):
"native" (CPU with the native kernels on, single device): the native kernel
(pallas_kernels/native_lora.py) over the step's tokens, each naming its row's slot; it groups
tokens by slot and skips base tokens itself. "xla" (elsewhere): each row gathers its own A and B
(BGMV-style; a decode row pays I*R + R*O gathered values for one token, a prefill row the same
for its Tq tokens) under a `lax.cond` that skips steps whose rows all run the base model. On
CPU the gather measured faster than multiplying every token by every slot and masking, whose
work grows with max_loras; the native kernel took 25-45 us per layer at 64 tokens, 8 slots,
rank 16, against the gather's 320-900 us (2-core AMD EPYC, I, O of 576 / 1536).

Axis legend: T flat tokens, Bd decode rows, Bp prefill rows, Tq prefill row width, S slots,
I input width, R rank, O output width.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

LORA_IMPLS = ("xla", "native")


class LoraRows(NamedTuple):
    """A step's adapter slot per row, as models pass it to their Linear layers."""
    dec: jax.Array  # i32[Bd]: each decode row's slot (-1: the base model)
    pre: jax.Array  # i32[Bp]: each prefill row's slot
    impl: str = "xla"  # LORA_IMPLS: how the delta runs (static)


def row_slots(batch, impl: str = "xla"):
    """LoraRows of a StepBatch's rows for `impl`, or None without LoRA."""
    slots = getattr(batch, "lora_slots", None)
    if slots is None:
        return None
    num_decode = batch.num_decode_rows
    return LoraRows(slots[:num_decode], slots[num_decode:], impl)


def resolve_lora_impl(native_allowed: bool, max_rank: int) -> str:
    """"native" when native kernels are allowed here (the runner's attention resolved to its native
    CPU kernel, one device), the kernel takes max_rank and it builds and loads, else "xla"."""
    from pallas_kernels import native_lora

    if not native_allowed or max_rank > native_lora.MAX_RANK:
        return "xla"
    from models.cache import native_dir

    return "native" if native_lora.load(native_dir()) else "xla"


def token_slots(dec, pre, num_tokens: int):
    """i32[T]: each token's slot: a decode row's one token, then each prefill row's Tq tokens."""
    num_prefill = pre.shape[0]
    row_len = (num_tokens - dec.shape[0]) // max(num_prefill, 1)
    return jnp.concatenate([dec, jnp.repeat(pre, row_len, total_repeat_length=num_prefill * row_len)])


def lora_delta(x, a, b, slots):
    """x [T, I]; a [S, I, R]; b [S, R, O]; slots LoraRows -> delta [T, O]. Rows with slot -1 get
    zeros; base rows cost nothing natively, and on the XLA path a step whose rows all run the
    base model skips the work."""
    dec, pre, impl = slots
    if impl not in LORA_IMPLS:
        raise ValueError(f"lora impl is {impl!r}; expected one of {LORA_IMPLS}")
    if impl == "native":
        from pallas_kernels.native_lora import lora_delta_native

        return lora_delta_native(x, a, b, token_slots(dec, pre, x.shape[0])).astype(x.dtype)
    a, b = jnp.asarray(a), jnp.asarray(b)
    any_adapter = jnp.any(jnp.concatenate([dec, pre]) >= 0)
    return jax.lax.cond(any_adapter, lambda: _gathered_delta(x, a, b, dec, pre),
                        lambda: jnp.zeros((x.shape[0], b.shape[-1]), x.dtype))


def _gathered_delta(x, a, b, dec, pre):
    num_decode, num_prefill = dec.shape[0], pre.shape[0]
    outs = []
    if num_decode:
        xd = x[:num_decode]
        idx = jnp.maximum(dec, 0)
        h = jnp.einsum("BI,BIR->BR", xd, a[idx].astype(x.dtype))
        h = h * (dec >= 0)[:, None].astype(x.dtype)
        outs.append(jnp.einsum("BR,BRO->BO", h, b[idx].astype(x.dtype)))
    if num_prefill:
        xp = x[num_decode:].reshape(num_prefill, -1, x.shape[-1])  # [Bp, Tq, I]
        idx = jnp.maximum(pre, 0)
        h = jnp.einsum("BTI,BIR->BTR", xp, a[idx].astype(x.dtype))
        h = h * (pre >= 0)[:, None, None].astype(x.dtype)
        outs.append(jnp.einsum("BTR,BRO->BTO", h, b[idx].astype(x.dtype)).reshape(-1, b.shape[-1]))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)


def lora_delta_reference(x, a, b, slots):
    """The same delta token by token, for tests: each token looks up its row's slot."""
    import numpy as np

    dec, pre = (np.asarray(s) for s in slots[:2])
    x = np.asarray(x, np.float64)
    num_decode = dec.shape[0]
    row_len = (x.shape[0] - num_decode) // max(pre.shape[0], 1)
    token_slot = np.concatenate([dec, np.repeat(pre, row_len)])
    out = np.zeros((x.shape[0], b.shape[-1]))
    for t, s in enumerate(token_slot):
        if s >= 0:
            out[t] = x[t] @ np.asarray(a[s], np.float64) @ np.asarray(b[s], np.float64)
    return out
