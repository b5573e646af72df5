"""The kernels lower for real accelerators from this host (jax.export to "cuda" / "tpu").

This runs the Pallas -> Triton IR and Pallas -> Mosaic TPU lowering in Python, which catches
unsupported ops, block shapes and dtypes; the final compile (Triton -> PTX, Mosaic -> TPU code)
needs the device. A jax that cannot lower for a platform at all is skipped with the reason.
The GPU attention kernel is lowered through the engine's entry point in
test_gpu_attention_lowering.py; here the TPU attention kernels and both KV writes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.decode_attention import decode_attention, triton_params
from pallas_kernels.gpu_launches import export_for as _export
from pallas_kernels.kv_write import write_kv
from pallas_kernels.ragged_attention import ragged_paged_attention

PLATFORMS = {"gpu": "cuda", "tpu": "tpu"}


@functools.cache
def _platform_unavailable(backend: str) -> str | None:
    """Why this jax cannot lower even a trivial Pallas kernel for the platform, else None."""
    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    params = triton_params() if backend == "gpu" else None
    fn = lambda x: pl.pallas_call(
        copy, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), compiler_params=params
    )(x)
    try:
        _export(fn, (jax.ShapeDtypeStruct((16, 128), jnp.float32),), PLATFORMS[backend])
    except Exception as e:  # noqa: BLE001 - any failure here means "this jax cannot target it"
        return f"{type(e).__name__}: {e}"[:300]
    return None


S = jax.ShapeDtypeStruct
I32 = jnp.int32
T, N, K, D, P, PAGE, PPS, SLOTS = 20, 24, 3, 128, 32, 16, 4, 4


def _cases(dtype, backend):
    attention = {} if backend == "gpu" else {
        "decode": (
            functools.partial(decode_attention, sm_scale=0.1, num_splits=2, backend=backend),
            (S((3, N, D), dtype), S((2, P, PAGE, K, D), dtype), S((3, PPS), I32), S((3,), I32)),
        ),
        "ragged": (
            functools.partial(ragged_paged_attention, sm_scale=0.1, backend=backend),
            (S((T, N, D), dtype), S((2, P, PAGE, K, D), dtype), S((SLOTS, PPS), I32),
             S((SLOTS + 1,), I32), S((SLOTS,), I32), S((1,), I32)),
        ),
    }
    return {
        **attention,
        "kv_write": (
            functools.partial(write_kv, backend=backend),
            (S((2, P, PAGE, K, D), dtype), S((T, K, D), dtype), S((T, K, D), dtype), S((T,), I32)),
        ),
    }


KERNELS = [("gpu", "kv_write"), ("tpu", "decode"), ("tpu", "ragged"), ("tpu", "kv_write")]


def _with_sinks(fn, args):
    """(fn, args) taking gpt-oss's sinks f32[N] as one more argument."""
    return (lambda *a: fn(*a[:-1], sinks=a[-1])), (*args, S((N,), jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("backend,kernel", KERNELS)
def test_kernel_lowers_for_platform(backend, dtype, kernel):
    _assert_lowers(backend, lambda: _cases(dtype, backend)[kernel])


@pytest.mark.parametrize("kernel", ["decode", "ragged"])
def test_sinks_lower_for_tpu(kernel):
    _assert_lowers("tpu", lambda: _with_sinks(*_cases(jnp.bfloat16, "tpu")[kernel]))


def _assert_lowers(backend, case):
    """Exports case() = (fn, args) for the backend's platform: a Triton / Mosaic TPU custom call."""
    reason = _platform_unavailable(backend)
    if reason:
        pytest.skip(f"this jax cannot lower Pallas for {PLATFORMS[backend]}: {reason}")
    fn, args = case()
    text = _export(fn, args, PLATFORMS[backend]).mlir_module()
    assert ("triton" if backend == "gpu" else "tpu_custom_call") in text


def _quantized_cases(kv_dtype, backend):
    """The same kernels on a quantised pool: QuantizedKV(values [2, P, page, K, D], scales in the
    pool's SCALE_DTYPE)."""
    from pallas_kernels.kv_quant import SCALE_DTYPE, QuantizedKV

    pool = QuantizedKV(S((2, P, PAGE, K, D), kv_dtype), S((2, P, PAGE, K), SCALE_DTYPE))
    cases = _cases(jnp.bfloat16, backend)
    return {name: (fn, (args[0], pool, *args[2:]) if name != "kv_write" else (pool, *args[1:]))
            for name, (fn, args) in cases.items()}


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("backend,kernel", KERNELS)
def test_quantized_kernel_lowers_for_platform(backend, kv_dtype, kernel):
    _assert_lowers(backend, lambda: _quantized_cases(kv_dtype, backend)[kernel])
