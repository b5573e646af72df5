"""The engine-facing GPU attention lowers for CUDA on this host, and its launches fill an H200.

`dispatch.paged_attention(impl="pallas", backend="gpu")` is exported for "cuda" (jax.export runs
the Pallas -> Triton lowering without a GPU); the grid is read back from the module's Triton call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import dispatch, gpu_attention, gpu_launches
from pallas_kernels.kv_quant import SCALE_DTYPE, QuantizedKV

S = jax.ShapeDtypeStruct
I32 = jnp.int32
N, K, D, PAGE = 32, 8, 128, 16


def _args(batch, num_q, context, dtype=jnp.bfloat16, kv_dtype=None, num_heads=N, num_kv_heads=K, head_dim=D):
    pages_per_seq = -(-context // PAGE)
    pool_shape = (2, batch * pages_per_seq, PAGE, num_kv_heads, head_dim)
    pool = S(pool_shape, dtype) if kv_dtype is None else QuantizedKV(S(pool_shape, kv_dtype),
                                                                     S(pool_shape[:-1], SCALE_DTYPE))
    return (S((batch, num_q, num_heads, head_dim), dtype), pool, S((batch, pages_per_seq), I32),
            S((batch,), I32), S((batch,), I32))


def _launches(args, **kw):
    fn = functools.partial(dispatch.paged_attention, sm_scale=0.1, impl="pallas", backend="gpu", **kw)
    launches = gpu_launches.triton_launches(gpu_launches.export_for(fn, args, "cuda").mlir_module())
    assert [launch.name for launch in launches] == ["paxpage_paged_attention_gpu"]
    return launches[0]


@pytest.mark.parametrize("num_q", [1, 5], ids=["decode", "verify"])
@pytest.mark.parametrize("dtype,kv_dtype", [(jnp.float32, None), (jnp.bfloat16, None), (jnp.bfloat16, jnp.int8),
                                            (jnp.bfloat16, jnp.float8_e4m3fn)],
                         ids=["f32", "bf16", "int8", "fp8"])
def test_engine_attention_lowers_for_cuda(num_q, dtype, kv_dtype):
    # Odd shapes on purpose: 3 query heads per kv head, a window and a cap.
    args = _args(3, num_q, 100, dtype, kv_dtype, num_heads=12, num_kv_heads=4, head_dim=64)
    launch = _launches(args, sliding_window=40, soft_cap=30.0)
    assert launch.num_warps == 4


@pytest.mark.parametrize("context,batch_invariant", [(64, False), (1000, False), (64, True), (1000, True)],
                         ids=["one-segment", "segments", "batch-invariant-one-segment", "batch-invariant-segments"])
def test_sinks_lower_for_cuda(context, batch_invariant):
    """gpt-oss's sinks f32[N] in the kernel's final normalisation (a table of one key tile: one
    segment) and in the merge of the segments, the in-order merge included."""
    args = (*_args(3, 5, context, num_heads=12, num_kv_heads=4, head_dim=64), S((12,), jnp.float32))
    fn = lambda q, kv, pt, kvl, ql, sinks: dispatch.paged_attention(  # noqa: E731
        q, kv, pt, kvl, ql, sm_scale=0.1, impl="pallas", backend="gpu", sliding_window=40,
        batch_invariant=batch_invariant, sinks=sinks)
    launches = gpu_launches.triton_launches(gpu_launches.export_for(fn, args, "cuda").mlir_module())
    assert [launch.name for launch in launches] == ["paxpage_paged_attention_gpu"]
    geometry = gpu_attention.plan(3, 5, 12, 4, 64, -(-context // PAGE), PAGE, batch_invariant=batch_invariant)
    assert (geometry.num_splits == 1) == (context == 64)


@pytest.mark.parametrize("batch,num_q,context", [(8, 1, 4096), (64, 1, 32768), (1, 2048, 2048)],
                         ids=["decode-B8-S4k", "decode-B64-S32k", "prefill-2048"])
def test_launch_fills_the_device(batch, num_q, context):
    """At least 4 programs per SM of a 132-SM H200 at bench_kernels.py's shapes."""
    launch = _launches(_args(batch, num_q, context))
    assert launch.programs >= gpu_attention.MIN_PROGRAMS == 528, launch


def test_impl_pallas_names_its_backend_off_device():
    assert dispatch.resolve_impl("pallas", "gpu") == ("gpu", False)
    with pytest.raises(ValueError, match="backend"):
        dispatch.resolve_impl("pallas", "cuda")
