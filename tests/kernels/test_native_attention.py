"""The native CPU paged-attention kernel (pallas_kernels/native_attention.py) against the jnp
reference, its build cache, and the fallback when it cannot be built."""

from __future__ import annotations

import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import (CONFIGS, SINK_CASES, WINDOW_CASES, assert_close, assert_sinks_matter, config_id,
                          make_case, make_sinks, quant_case_id, quantize_case, QUANT_CASES, reference_pool,
                          release_outside_window, window_case_id)
from pallas_kernels import kv_quant, native_attention
from pallas_kernels.native import build as native_build
from pallas_kernels.reference import paged_attention_ref
from pallas_kernels.xla_attention import paged_attention_xla

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the native kernel"),
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel; the default backend is not CPU"),
]


@pytest.fixture(scope="module", autouse=True)
def native():
    """The kernel, built where the engine builds it (paxpage's cache directory), so a machine
    compiles it once for the tests and the engine alike."""
    from models.cache import NATIVE_DIR, cache_dir

    assert native_attention.load(os.path.join(cache_dir(), NATIVE_DIR)), native_attention.LIBRARY.error


def _run(case, sinks=None, **kw):
    fn = jax.jit(lambda *a, sinks: native_attention.paged_attention_native(*a, sinks=sinks, **kw))
    return fn(jnp.asarray(case.q), jnp.asarray(case.kv_pages), case.page_indices, case.kv_lens, case.q_lens,
              sinks=sinks)


def _want(case, **kw):
    return paged_attention_ref(jnp.asarray(case.q), jnp.asarray(reference_pool(case.kv_pages)),
                               case.page_indices, case.kv_lens, case.q_lens, **kw)


# Lengths 0 / 1 / page-aligned / unaligned; rows of different lengths; decode (Tq == 1) and
# prefill chunks (Tq > 1, rows with fewer real tokens than Tq). Unused pages and the slots past
# each row's length are NaN.
LENGTH_CASES = {
    "decode": ([0, 1, 8, 16, 24, 31, 32, 5, 70], [0, 1, 1, 1, 1, 1, 1, 1, 1]),
    "prefill": ([0, 1, 16, 23, 32, 9, 70], [0, 1, 16, 7, 3, 9, 12]),
}
# CONFIGS covers dtype x page_size x N // K x head dims 64 / 128; these add head dims the kernel
# takes on its generic path (24) and its smallest unrolled one (16).
EXTRA_CONFIGS = [(jnp.float32, 4, 2, 24, 3), (jnp.float32, 16, 1, 16, 4)]


@pytest.mark.parametrize("cfg", CONFIGS + EXTRA_CONFIGS, ids=config_id)
@pytest.mark.parametrize("kind", sorted(LENGTH_CASES))
def test_native_matches_reference(cfg, kind):
    dtype, page_size, ratio, head_dim, num_kv_heads = cfg
    kv_lens, q_lens = LENGTH_CASES[kind]
    case = make_case(np.random.default_rng(11), dtype=dtype, page_size=page_size, ratio=ratio,
                     head_dim=head_dim, num_kv_heads=num_kv_heads, kv_lens=kv_lens, q_lens=q_lens,
                     pages_per_seq=-(-70 // page_size) + 2)
    got = _run(case, sm_scale=head_dim ** -0.5)
    assert got.dtype == case.q.dtype and got.shape == case.q.shape
    assert_close(got, _want(case, sm_scale=head_dim ** -0.5), dtype)
    # Padding rows and padding query tokens are exact zeros, as in the reference.
    pad = np.arange(case.q.shape[1])[None, :] >= case.q_lens[:, None]
    assert not np.asarray(jnp.asarray(got, jnp.float32))[pad].any()


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[4], EXTRA_CONFIGS[0]], ids=config_id)
@pytest.mark.parametrize("wc", WINDOW_CASES, ids=window_case_id)
@pytest.mark.parametrize("kind", sorted(LENGTH_CASES))
def test_sliding_window_and_soft_cap(cfg, wc, kind):
    """Pages wholly before a row's window are NaN (released): never read."""
    dtype, page_size, ratio, head_dim, num_kv_heads = cfg
    window, cap = wc
    kv_lens, q_lens = LENGTH_CASES[kind]
    kv_lens = [n + 40 * (n > 0) for n in kv_lens]  # long enough to leave pages behind the window
    case = make_case(np.random.default_rng(21), dtype=dtype, page_size=page_size, ratio=ratio,
                     head_dim=head_dim, num_kv_heads=num_kv_heads, kv_lens=kv_lens, q_lens=q_lens,
                     pages_per_seq=-(-110 // page_size) + 1)
    case = release_outside_window(case, window)
    kw = dict(sm_scale=head_dim ** -0.5, sliding_window=window, soft_cap=cap)
    assert_close(_run(case, **kw), _want(case, **kw), dtype)


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[3], CONFIGS[5], EXTRA_CONFIGS[0]], ids=config_id)
@pytest.mark.parametrize("wc", SINK_CASES, ids=window_case_id)
@pytest.mark.parametrize("kind", sorted(LENGTH_CASES))
def test_sinks(cfg, wc, kind):
    """Per-head sinks (GQA; the vector and generic head-dim paths), with a window and a cap."""
    dtype, page_size, ratio, head_dim, num_kv_heads = cfg
    window, cap = wc
    kv_lens, q_lens = LENGTH_CASES[kind]
    rng = np.random.default_rng(25)
    case = make_case(rng, dtype=dtype, page_size=page_size, ratio=ratio, head_dim=head_dim,
                     num_kv_heads=num_kv_heads, kv_lens=kv_lens, q_lens=q_lens,
                     pages_per_seq=-(-70 // page_size) + 1)
    case = release_outside_window(case, window)
    sinks = jnp.asarray(make_sinks(rng, ratio * num_kv_heads))
    kw = dict(sm_scale=head_dim ** -0.5, sliding_window=window, soft_cap=cap)
    got = _run(case, sinks=sinks, **kw)
    assert_close(got, _want(case, sinks=sinks, **kw), dtype)
    assert_sinks_matter(got, _run(case, **kw), dtype)
    pad = np.arange(case.q.shape[1])[None, :] >= case.q_lens[:, None]
    assert not np.asarray(jnp.asarray(got, jnp.float32))[pad].any()


def test_sinks_of_the_wrong_shape_raise():
    case = make_case(np.random.default_rng(1), dtype=jnp.float32, page_size=8, ratio=2, head_dim=16,
                     num_kv_heads=1, kv_lens=[3], q_lens=[1], pages_per_seq=1)
    with pytest.raises(ValueError, match="one per query head"):
        _run(case, sinks=jnp.zeros((3,), jnp.float32), sm_scale=0.25)


def test_table_entries_out_of_the_pool_and_all_padding():
    rng = np.random.default_rng(8)
    case = make_case(rng, dtype=jnp.float32, page_size=8, ratio=3, head_dim=16, num_kv_heads=1,
                     kv_lens=[13, 4, 0], q_lens=[1, 1, 0], pages_per_seq=6)
    want = _want(case, sm_scale=0.25)
    case.page_indices[0, 2:] = [10**6, -7, 2**31 - 1, -(2**31)]  # past the row's pages: anything
    case.page_indices[1, 1:] = 999
    assert_close(_run(case, sm_scale=0.25), want, jnp.float32)
    padding = make_case(rng, dtype=jnp.float32, page_size=8, ratio=2, head_dim=16, num_kv_heads=2,
                        kv_lens=[0, 0, 0], q_lens=[0, 0, 0], pages_per_seq=4)
    got = _run(padding, sm_scale=0.25)
    assert got.shape == padding.q.shape and not np.asarray(got).any()


def test_many_rows_spread_over_threads():
    """Enough rows that XLA's pool takes items too: every row still gets its own result."""
    rng = np.random.default_rng(4)
    kv_lens = rng.integers(1, 90, size=64)
    case = make_case(rng, dtype=jnp.float32, page_size=16, ratio=3, head_dim=64, num_kv_heads=3,
                     kv_lens=kv_lens, q_lens=np.ones(64, np.int32), pages_per_seq=6)
    assert_close(_run(case, sm_scale=0.125), _want(case, sm_scale=0.125), jnp.float32)


# Quantised pools: int8 / fp8 values read as stored, with bf16 scales (the engine's native pool)
# or f32 ones (the XLA path's); the generic head-dim path (24) and a window with a cap too.
QUANT_NATIVE_CASES = [(kind, cfg) for kind, cfg in QUANT_CASES] + [("fp8", EXTRA_CONFIGS[0]), ("int8", CONFIGS[3])]


@pytest.mark.parametrize("qc", QUANT_NATIVE_CASES, ids=quant_case_id)
@pytest.mark.parametrize("kind", sorted(LENGTH_CASES))
@pytest.mark.parametrize("scale_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("wc", [(None, None), (16, 3.0)], ids=window_case_id)
def test_quantised_pool_matches_the_reference(qc, kind, scale_dtype, wc):
    """Against the jnp reference on the dequantised pool. Unused rows have NaN scales (their
    values are finite): a stray read poisons the output."""
    kv_cache_dtype, (dtype, page_size, ratio, head_dim, num_kv_heads) = qc
    window, cap = wc
    kv_lens, q_lens = LENGTH_CASES[kind]
    case = make_case(np.random.default_rng(13), dtype=dtype, page_size=page_size, ratio=ratio,
                     head_dim=head_dim, num_kv_heads=num_kv_heads, kv_lens=kv_lens, q_lens=q_lens,
                     pages_per_seq=-(-70 // page_size) + 2)
    case = release_outside_window(case, window)
    pool, ref_pool = quantize_case(case, kv_cache_dtype)
    pool = kv_quant.QuantizedKV(pool.pages, pool.scales.astype(scale_dtype))
    kw = dict(sm_scale=head_dim ** -0.5, sliding_window=window, soft_cap=cap)
    args = (jnp.asarray(case.q), pool, case.page_indices, case.kv_lens, case.q_lens)
    got = jax.jit(lambda *a: native_attention.paged_attention_native(*a, **kw))(*args)
    hlo = jax.jit(lambda *a: native_attention.paged_attention_native(*a, **kw)).lower(*args).as_text()
    assert native_attention.TARGET in hlo  # the kernel ran, not the XLA-ops fallback
    want = paged_attention_ref(jnp.asarray(case.q), ref_pool, case.page_indices, case.kv_lens, case.q_lens, **kw)
    assert got.dtype == case.q.dtype
    assert_close(got, want, dtype)
    pad = np.arange(case.q.shape[1])[None, :] >= case.q_lens[:, None]
    assert not np.asarray(jnp.asarray(got, jnp.float32))[pad].any()


def test_a_pool_it_cannot_read_takes_the_xla_path():
    """float16 values (no native form) go through XLA ops, equal to the XLA path's result."""
    case = make_case(np.random.default_rng(9), dtype=jnp.float32, page_size=8, ratio=2, head_dim=16,
                     num_kv_heads=2, kv_lens=[5, 13], q_lens=[1, 1], pages_per_seq=3)
    pool = jnp.asarray(reference_pool(case.kv_pages), jnp.float16)
    args = (jnp.asarray(case.q), pool, case.page_indices, case.kv_lens, case.q_lens)
    hlo = jax.jit(lambda *a: native_attention.paged_attention_native(*a, sm_scale=0.1)).lower(*args).as_text()
    assert native_attention.TARGET not in hlo
    got = native_attention.paged_attention_native(*args, sm_scale=0.1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(paged_attention_xla(*args, sm_scale=0.1)))


def test_build_is_cached_and_keyed_by_source(tmp_path):
    from models.cache import NATIVE_DIR, cache_dir

    build_dir = os.path.join(cache_dir(), NATIVE_DIR)
    path = native_build.build(native_attention.SOURCE, build_dir)  # built by the fixture: a lookup
    mtime = os.stat(path).st_mtime_ns
    assert native_build.build(native_attention.SOURCE, build_dir) == path and os.stat(path).st_mtime_ns == mtime
    edited = tmp_path / "paged_attention_cpu.cc"
    edited.write_bytes(open(native_attention.SOURCE, "rb").read() + b"\n// edited\n")
    assert native_build.library_path(str(edited), build_dir) != path



def test_build_key_covers_the_headers(tmp_path):
    """parallel.h and simd.h are compiled into every kernel: editing one must change the key."""
    folder = os.path.dirname(native_attention.SOURCE)
    for name in os.listdir(folder):
        if name.endswith((".cc", ".h")):
            shutil.copy(os.path.join(folder, name), tmp_path / name)
    source = str(tmp_path / os.path.basename(native_attention.SOURCE))
    before = native_build.library_path(source, str(tmp_path))
    with open(tmp_path / "simd.h", "a") as f:
        f.write("\n// edited\n")
    assert native_build.library_path(source, str(tmp_path)) != before

def test_no_compiler_warns_once_and_reports_unavailable(tmp_path, monkeypatch):
    monkeypatch.setattr(native_attention, "LIBRARY", native_build.NativeLibrary(
        native_attention.SOURCE, {native_attention.TARGET: "PaxpagePagedAttentionCpu"}, "the native CPU attention kernel"))
    with pytest.warns(RuntimeWarning, match="native CPU attention kernel is unavailable"):
        assert not native_attention.load(str(tmp_path), compiler=str(tmp_path / "no-such-g++"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call: no second warning
        assert not native_attention.load(str(tmp_path), compiler=str(tmp_path / "no-such-g++"))
    assert not native_attention.loaded()
