"""Engine-facing entry points: row-layout paged attention and KV write on the Pallas kernels.

Axis legend: B rows, Tq query tokens per row, T flat tokens, N query heads, K kv heads, D head dim,
P pages. Semantics are exactly `reference.paged_attention_ref` / `reference.write_kv` (their
docstrings define the row layout).

GPU family: every step (decode, prefill, chunked prefill, mixed, speculative verify) runs the one
ragged kernel `gpu_attention.paged_attention`, which takes the row layout as it is. TPU family:
rows with Tq == 1 go to the decode kernel; Tq > 1 packs the real tokens of all rows back to back
and runs the ragged kernel.

impl: "pallas" compiles for an accelerator: the one this compiles for ("gpu" or "tpu", from
`tpu_target.compile_platform()`: the abstract mesh's device, else jax's default device), or, when
`backend` is given, that kernel family whatever this host has, so that
`jax.export(..., platforms=["cuda"])` can lower the GPU kernels on a CPU-only machine (running
such a function here fails at compile time). "pallas-interpret" runs the same kernels in the
Pallas interpreter (slow; CPU tests); `backend` picks the family, by default the platform's,
"gpu" on CPU.

GPU decode kernel (`gpu_decode`, backend "gpu", Tq == 1 only): "auto" (the default) and "triton"
are the ragged kernel above (Triton lowering); "mosaic" is the Mosaic GPU decode kernel
(`decode_attention_mgpu`), opt-in: on the first native run (H200, jax 0.11.2, B=64, S=32768) it
read KV at 82 GB/s. Asking for "mosaic" where it cannot run (it needs dtype f32/bf16/f16,
head_dim % 64 == 0, page_size in 8..64, N // K <= 8 and, when compiling, compute capability
>= 9.0 for TMA) raises ValueError with the reason.

Attention sinks (gpt-oss, `sinks` f32[N]: a logit per query head in the softmax's denominator
only) reach every kernel family; each folds them into its final normalisation or split merge.

KV layout (kv_layout.py): the GPU family reads the canonical pool [2, P, page_size, K, D]; the
TPU family reads it or the tpu layout [P, K, page_size, 2D], which tiles on TPU (`layout`).

Quantised KV cache (kv_quant.QuantizedKV, EngineConfig.kv_cache_dtype "int8" / "fp8"): every
kernel here takes it except Mosaic GPU (`decode_attention_mgpu.QUANTIZED_REASON`), so "auto"
decodes such a pool with the ragged kernel and "mosaic" raises.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import decode_attention_mgpu, gpu_attention, kv_layout, kv_quant, kv_write, tpu_target
from pallas_kernels.decode_attention import check_sinks, decode_attention
from pallas_kernels.ragged_attention import ragged_paged_attention

IMPLS = ("pallas", "pallas-interpret")
GPU_DECODE_KERNELS = ("auto", "mosaic", "triton")


def _mosaic_device_reason() -> str | None:
    """Why the local GPU cannot run Mosaic GPU kernels (TMA, sm_90+), else None."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    try:
        major = int(str(capability).split(".")[0])
    except ValueError:
        return f"unknown compute capability {capability!r} of {device.device_kind}"
    return None if major >= 9 else f"{device.device_kind} is sm_{capability}; Mosaic GPU needs sm_90+"


def select_gpu_decode(choice: str, q_dtype, kv_shape, kv_dtype, num_heads: int, *, interpret: bool) -> str:
    """"mosaic" or "triton" for a decode step on the GPU family (rule in the module docstring)."""
    if choice not in GPU_DECODE_KERNELS:
        raise ValueError(f"gpu_decode is {choice!r}; expected one of {GPU_DECODE_KERNELS}")
    if choice in ("triton", "auto"):
        return "triton"
    _, _, page_size, num_kv_heads, head_dim = kv_shape
    reason = decode_attention_mgpu.unsupported_reason(
        q_dtype, kv_dtype, page_size, num_heads, num_kv_heads, head_dim, interpret=interpret
    )
    if reason is None and not interpret:
        reason = _mosaic_device_reason()
    if reason is not None:
        raise ValueError(f"gpu_decode='mosaic' cannot run here: {reason}")
    return "mosaic"


def resolve_impl(impl: str, backend: str | None = None) -> tuple[str, bool]:
    """(kernel backend, interpret) for `impl`."""
    if impl not in IMPLS:
        raise ValueError(f"impl is {impl!r}; expected one of {IMPLS}")
    platform = tpu_target.compile_platform()  # the device this compiles for (tpu_target.py)
    if backend is not None and backend not in ("gpu", "tpu"):
        raise ValueError(f"backend is {backend!r}; expected 'gpu' or 'tpu'")
    if impl == "pallas":
        if backend is not None:  # an explicit family: lowered for it, e.g. under jax.export
            return backend, False
        if platform not in ("gpu", "tpu"):
            raise ValueError(
                f"impl='pallas' needs a GPU or TPU but the compile target is {platform!r}; "
                "use impl='pallas-interpret' (slow, for tests) or 'xla' on CPU, or name the "
                "backend to lower for it (jax.export)"
            )
        return platform, False
    if backend is None:
        backend = platform if platform in ("gpu", "tpu") else "gpu"
    return backend, True


def paged_attention(
    q: jax.Array,  # [B, Tq, N, D] f32/bf16; row b has q_lens[b] real tokens, rest padding
    kv_pages,  # one layer's pool in `layout`, already holding this step's K/V (or a QuantizedKV)
    page_indices: jax.Array,  # i32[B, pages_per_seq]
    kv_lens: jax.Array,  # i32[B] keys of row b including this step's (0 = padding row)
    q_lens: jax.Array,  # i32[B] new tokens of row b (<= kv_lens[b], <= Tq)
    *,
    sm_scale: float,
    impl: str,
    backend: str | None = None,
    gpu_decode: str = "auto",  # GPU decode kernel: "auto", "mosaic" or "triton" (module docstring)
    sliding_window: int | None = None,  # W: a query at position p sees keys p - W + 1..p
    soft_cap: float | None = None,  # c: scaled scores s -> c * tanh(s / c)
    batch_invariant: bool = False,  # a row's result independent of the launch (GPU ragged kernel only)
    sinks: jax.Array | None = None,  # f32[N] per query head (gpt-oss): a logit in the denominator only
    layout: str = "canonical",  # the pool's kv_layout name; "tpu" only for the TPU family
) -> jax.Array:  # [B, Tq, N, D]; padding tokens are zeros
    kernel_backend, interpret = resolve_impl(impl, backend)
    check_layout(layout, kernel_backend)
    if batch_invariant and (kernel_backend != "gpu" or gpu_decode == "mosaic"):
        raise ValueError(f"batch_invariant runs the GPU ragged kernel only; got backend {kernel_backend!r}, "
                         f"gpu_decode {gpu_decode!r}")
    batch, num_q, num_heads, head_dim = q.shape
    if page_indices.shape[0] != batch or kv_lens.shape != (batch,) or q_lens.shape != (batch,):
        raise ValueError(
            f"page_indices {page_indices.shape}, kv_lens {kv_lens.shape}, q_lens {q_lens.shape} "
            f"do not match {batch} rows"
        )
    check_sinks(sinks, num_heads)
    q_lens = q_lens.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    masking = dict(sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    if kernel_backend == "gpu":
        pages, _ = kv_quant.split(kv_pages)  # a quantised pool's 1-byte dtype keeps it off Mosaic GPU
        if num_q == 1 and not batch_invariant and select_gpu_decode(
                gpu_decode, q.dtype, pages.shape, pages.dtype, num_heads, interpret=interpret) == "mosaic":
            out = decode_attention_mgpu.decode_attention_mgpu(
                q[:, 0], kv_pages, page_indices, kv_lens, sm_scale=sm_scale, interpret=interpret, **masking,
            )  # [B, N, D]
            return jnp.where(q_lens[:, None, None] > 0, out, jnp.zeros_like(out))[:, None]
        return gpu_attention.paged_attention(
            q, kv_pages, page_indices, kv_lens, q_lens, sm_scale=sm_scale, interpret=interpret,
            batch_invariant=batch_invariant, **masking,
        )
    if num_q == 1:
        out = decode_attention(
            q[:, 0], kv_pages, page_indices, kv_lens,
            sm_scale=sm_scale, backend=kernel_backend, interpret=interpret, layout=layout, **masking,
        )  # [B, N, D]
        return jnp.where(q_lens[:, None, None] > 0, out, jnp.zeros_like(out))[:, None]

    # Pack real tokens: token i of row b -> flat cu[b] + i; padding tokens go out of range.
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])  # [B + 1]
    i = jnp.arange(num_q, dtype=jnp.int32)
    real = i[None, :] < q_lens[:, None]  # [B, Tq]
    dest = jnp.where(real, cu[:-1, None] + i[None, :], batch * num_q).reshape(-1)  # [B * Tq]
    flat_q = jnp.zeros((batch * num_q, num_heads, head_dim), q.dtype)
    flat_q = flat_q.at[dest].set(q.reshape(-1, num_heads, head_dim), mode="drop")
    flat_out = ragged_paged_attention(
        flat_q, kv_pages, page_indices, cu, kv_lens, jnp.full((1,), batch, jnp.int32),
        sm_scale=sm_scale, backend=kernel_backend, interpret=interpret, layout=layout, **masking,
    )  # [B * Tq, N, D]
    out = flat_out[jnp.minimum(dest, batch * num_q - 1)].reshape(q.shape)
    return jnp.where(real[:, :, None, None], out, jnp.zeros_like(out))


def write_kv(
    kv_pages,  # one layer's pool in `layout` or a QuantizedKV (donate it in the caller's jit)
    k: jax.Array,  # [T, K, D]
    v: jax.Array,  # [T, K, D]
    slot_mapping: jax.Array,  # i32[T]; -1 = padding, not written
    *,
    impl: str,
    backend: str | None = None,
    layout: str = "canonical",  # the pool's kv_layout name; "tpu" only for the TPU family
) -> jax.Array:  # the pool with token t's K/V at slot_mapping[t]
    kernel_backend, interpret = resolve_impl(impl, backend)
    check_layout(layout, kernel_backend)
    return kv_write.write_kv(kv_pages, k, v, slot_mapping, backend=kernel_backend, interpret=interpret,
                             layout=layout)


def check_layout(layout, kernel_backend: str) -> None:
    """ValueError unless `layout` (a kv_layout name) is one the kernel family reads: the GPU
    family reads the canonical layout only, the TPU family both."""
    name = kv_layout.get(layout).name
    if name != "canonical" and kernel_backend != "tpu":
        raise ValueError(f"the {name!r} KV layout is read by the TPU kernels only; the backend is {kernel_backend!r}")
