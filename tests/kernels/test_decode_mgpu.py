"""Tier (b): the Mosaic GPU decode kernel against the jnp reference (Mosaic GPU interpret mode on
CPU; compiled on the GPU under scripts/device_check.sh), plus its lowering for "cuda"."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from kernel_cases import (INTERPRET, assert_close, assert_sinks_matter, config_id, make_case, make_sinks,
                          reference_pool, release_outside_window, skip_unless_runnable, window_case_id)
from pallas_kernels import decode_attention_mgpu as mgpu
from pallas_kernels import reference

PAGES_PER_SEQ = 8  # 2 blocks of 64 keys at page_size 32, so the double buffer turns over

# (dtype, page_size, ratio, head_dim, num_kv_heads): every factor value with both dtypes.
CONFIGS = [
    (jnp.bfloat16, 16, 1, 64, 2),
    (jnp.bfloat16, 32, 8, 128, 1),
    (jnp.float32, 16, 3, 128, 1),
    (jnp.float32, 32, 1, 64, 2),
    (jnp.bfloat16, 8, 3, 64, 1),
]


def _skip_unless_available():
    skip_unless_runnable("gpu")
    if (reason := mgpu.unsupported_reason(jnp.bfloat16, jnp.bfloat16, 16, 1, 1, 64, interpret=INTERPRET)):
        pytest.skip(reason)


def _check(cfg, num_splits, seed=0, window=None, cap=None, sinks=False):
    _skip_unless_available()
    dtype, page_size, ratio, head_dim, num_kv_heads = cfg
    # 1 / page-aligned / unaligned / maximal / padding row (0).
    kv_lens = [1, 2 * page_size, 5 * page_size + 3, PAGES_PER_SEQ * page_size, 0]
    rng = np.random.default_rng(seed)
    case = make_case(
        rng, dtype=dtype, page_size=page_size, ratio=ratio, head_dim=head_dim,
        num_kv_heads=num_kv_heads, kv_lens=kv_lens, q_lens=[1] * len(kv_lens), pages_per_seq=PAGES_PER_SEQ,
    )
    case = release_outside_window(case, window)
    scale = head_dim ** -0.5
    sink = jnp.asarray(make_sinks(rng, ratio * num_kv_heads)) if sinks else None
    got = mgpu.decode_attention_mgpu(
        jnp.asarray(case.q[:, 0]), jnp.asarray(case.kv_pages), case.page_indices, case.kv_lens,
        sm_scale=scale, num_splits=num_splits, interpret=INTERPRET, sliding_window=window, soft_cap=cap,
        sinks=sink,
    )

    def want(sinks):
        return reference.paged_attention_ref(
            jnp.asarray(case.q), jnp.asarray(reference_pool(case.kv_pages)), case.page_indices,
            case.kv_lens, (case.kv_lens > 0).astype(np.int32), sm_scale=scale, sliding_window=window,
            soft_cap=cap, sinks=sinks,
        )[:, 0]

    assert got.dtype == dtype
    assert_close(got, want(sink), dtype)
    if sinks:
        assert_sinks_matter(want(sink), want(None), dtype)


@pytest.mark.parametrize("cfg", CONFIGS, ids=config_id)
def test_mgpu_decode_matches_reference(cfg):
    _check(cfg, num_splits=1)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_mgpu_decode_split_keys_combine_exactly(num_splits):
    # Splits whose whole range lies past a row's length must contribute nothing.
    _check(CONFIGS[0], num_splits=num_splits, seed=3)


@pytest.mark.parametrize("wc", [(5, None), (70, 3.0), (None, 2.0)], ids=window_case_id)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_mgpu_decode_sliding_window_and_soft_cap(wc, num_splits):
    """Blocks wholly before a row's window point at NaN pages (released): never copied or read."""
    _check(CONFIGS[0], num_splits=num_splits, seed=9, window=wc[0], cap=wc[1])


@pytest.mark.parametrize("cfg,num_splits,window,cap", [
    (CONFIGS[2], 2, 70, 3.0),  # GQA 3:1 f32, splits merged with the sinks, a window and a cap
    (CONFIGS[1], 1, None, None),  # GQA 8:1 bf16, one split
], ids=["gqa3-splits-window-cap", "gqa8"])
def test_mgpu_decode_sinks(cfg, num_splits, window, cap):
    """Attention sinks (gpt-oss) join the merge of the splits."""
    _check(cfg, num_splits=num_splits, seed=11, window=window, cap=cap, sinks=True)


def test_mgpu_rejects_unsupported():
    if mgpu.plgpu is None:
        pytest.skip(mgpu.IMPORT_ERROR)
    assert "head_dim" in mgpu.unsupported_reason(jnp.bfloat16, jnp.bfloat16, 16, 4, 1, 96)
    assert "page_size" in mgpu.unsupported_reason(jnp.bfloat16, jnp.bfloat16, 4, 4, 1, 64)
    assert "kv heads" in mgpu.unsupported_reason(jnp.bfloat16, jnp.bfloat16, 16, 32, 2, 64)
    assert "dtypes" in mgpu.unsupported_reason(jnp.bfloat16, jnp.float32, 16, 4, 1, 64)
    with pytest.raises(ValueError, match="head_dim 96"):
        mgpu.decode_attention_mgpu(
            jnp.zeros((1, 2, 96)), jnp.zeros((2, 2, 16, 1, 96)), jnp.zeros((1, 1), jnp.int32),
            jnp.ones((1,), jnp.int32), sm_scale=1.0, interpret=True,
        )


@pytest.mark.parametrize("dtype,sinks", [(jnp.float32, False), (jnp.bfloat16, False), (jnp.bfloat16, True)],
                         ids=["float32", "bfloat16", "bfloat16-sinks"])
def test_mgpu_decode_lowers_for_cuda(dtype, sinks):
    """jax.export runs the whole Pallas -> Mosaic GPU lowering (layouts, TMA, barriers) in Python;
    only the final PTX compile needs the device."""
    if mgpu.plgpu is None:
        pytest.skip(f"this jax has no Mosaic GPU Pallas: {mgpu.IMPORT_ERROR}")
    S = jax.ShapeDtypeStruct
    fn = functools.partial(mgpu.decode_attention_mgpu, sm_scale=0.1, num_splits=2, sliding_window=20,
                           soft_cap=30.0)
    args = (S((3, 8, 64), dtype), S((2, 32, 16, 2, 64), dtype), S((3, 8), jnp.int32), S((3,), jnp.int32))
    if sinks:  # gpt-oss's sinks, f32[N]
        fn = functools.partial(lambda q, kv, pt, lens, sinks, f: f(q, kv, pt, lens, sinks=sinks), f=fn)
        args = (*args, S((8,), jnp.float32))
    # Kernel custom calls carry no serialisation-compatibility promise; we only lower, never store.
    checks = [export.DisabledSafetyCheck.custom_call(n) for n in ("mosaic_gpu_v2", "mosaic_gpu")]
    try:
        exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)
    except Exception as e:  # noqa: BLE001 - classify: only a missing lowering path is a skip
        if "cuda" in str(e).lower() and "platform" in str(e).lower():
            pytest.skip(f"this jax cannot lower for cuda: {type(e).__name__}: {str(e)[:300]}")
        raise
    assert "mosaic_gpu" in exported.mlir_module()
