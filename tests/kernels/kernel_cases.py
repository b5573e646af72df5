"""Shared builders for kernel tests: paged pools with permuted page tables and NaN-filled unused pages.

Axis legend: B rows, Tq query tokens per row, N query heads, K kv heads, D head dim, P pages.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# scripts/device_check.sh sets PAXPAGE_KERNEL_INTERPRET=0 to run the same tests compiled on the
# accelerator; by default (CPU CI) every kernel family runs in the Pallas interpreter.
INTERPRET = os.environ.get("PAXPAGE_KERNEL_INTERPRET", "1") != "0"
IMPL = "pallas-interpret" if INTERPRET else "pallas"


def skip_unless_runnable(backend: str) -> None:
    """Interpret mode runs both kernel families; compiled mode only the platform's own."""
    if not INTERPRET and backend != jax.default_backend():
        pytest.skip(f"{backend} kernels cannot compile on {jax.default_backend()}")

# One tolerance table per dtype: kernels sum in a different order than the reference, and bf16
# outputs may land one bf16 ulp apart.
TOLERANCE = {
    jnp.float32: dict(atol=3e-5, rtol=3e-5),
    jnp.bfloat16: dict(atol=2e-2, rtol=2e-2),
}

# A covering subset of dtype x page_size x head ratio (N // K) x head_dim: every value of every
# factor appears with both dtypes, so the file stays within the interpret-mode time budget.
CONFIGS = [
    # (dtype, page_size, ratio, head_dim, num_kv_heads)
    (jnp.float32, 8, 1, 64, 2),
    (jnp.float32, 16, 3, 128, 1),
    (jnp.float32, 32, 8, 64, 1),
    (jnp.bfloat16, 8, 8, 128, 1),
    (jnp.bfloat16, 16, 1, 64, 2),
    (jnp.bfloat16, 32, 3, 128, 2),
]

# The default tier's configurations (tests/kernels/conftest.py): f32 and bf16, D 64 and 128, MHA and
# GQA 8:1, pages of 8.
CORE_CONFIGS = [CONFIGS[0], CONFIGS[3]]


def config_id(cfg) -> str:
    dtype, page_size, ratio, head_dim, num_kv_heads = cfg
    return f"{jnp.dtype(dtype).name}-ps{page_size}-r{ratio}-d{head_dim}-k{num_kv_heads}"


@dataclasses.dataclass
class PagedCase:
    kv_pages: np.ndarray  # [2, P, page_size, K, D]; pages nobody uses are NaN
    page_indices: np.ndarray  # i32[B, pages_per_seq]; entries past a row's pages point at NaN pages
    kv_lens: np.ndarray  # i32[B]
    q_lens: np.ndarray  # i32[B]
    q: np.ndarray  # [B, Tq, N, D]


def make_case(rng, *, dtype, page_size, ratio, head_dim, num_kv_heads, kv_lens, q_lens,
              pages_per_seq, num_q=None, spare_pages=3) -> PagedCase:
    kv_lens = np.asarray(kv_lens, np.int32)
    q_lens = np.asarray(q_lens, np.int32)
    batch = len(kv_lens)
    num_q = num_q or max(1, int(q_lens.max(initial=1)))
    used = [-(-int(n) // page_size) for n in kv_lens]
    num_pages = sum(used) + spare_pages
    perm = rng.permutation(num_pages).astype(np.int32)
    spare = perm[sum(used):]
    pool = rng.standard_normal((2, num_pages, page_size, num_kv_heads, head_dim)).astype(np.float32)
    pool[:, spare] = np.nan
    table = rng.choice(spare, size=(batch, pages_per_seq)).astype(np.int32)  # stray entries -> NaN
    start = 0
    for b, n in enumerate(used):
        table[b, :n] = perm[start:start + n]
        start += n
    # NaN in the tail of a used page, past the row's length, must not leak either.
    for b, n in enumerate(kv_lens):
        if n % page_size:
            pool[:, table[b, n // page_size], n % page_size:] = np.nan
    num_heads = ratio * num_kv_heads
    q = rng.standard_normal((batch, num_q, num_heads, head_dim)).astype(np.float32)
    return PagedCase(
        kv_pages=np.asarray(jnp.asarray(pool, dtype)), page_indices=table, kv_lens=kv_lens,
        q_lens=q_lens, q=np.asarray(jnp.asarray(q, dtype)),
    )


def assert_close(got, want, dtype):
    got = np.asarray(jnp.asarray(got, jnp.float32))
    want = np.asarray(jnp.asarray(want, jnp.float32))
    assert np.isfinite(got).all(), "kernel output has NaN/inf: a stray page or padding leaked"
    np.testing.assert_allclose(got, want, **TOLERANCE[dtype])


def reference_pool(kv_pages: np.ndarray) -> np.ndarray:
    """The jnp reference gathers every listed page and 0 * NaN poisons its einsum, so it sees the
    NaNs as zeros; the kernels get the NaN pool and must never let those entries through."""
    return np.nan_to_num(np.asarray(jnp.asarray(kv_pages, jnp.float32))).astype(kv_pages.dtype)


# Sliding window and soft cap cases: (window, soft cap). Windows smaller than a page, a few
# pages, and longer than every row (= plain causal); caps that bend typical scores.
WINDOW_CASES = [(5, None), (16, 3.0), (None, 2.0), (1000, None)]


def window_case_id(wc) -> str:
    window, cap = wc
    return f"w{window}-cap{cap}"


def release_outside_window(case: PagedCase, window: int | None) -> PagedCase:
    """Points each row's pages wholly before its first query's window at NaN pages, as if the
    engine had released them: a kernel must neither read them nor let them into its output."""
    if window is None:
        return case
    page_size = case.kv_pages.shape[2]
    nan_pages = np.flatnonzero(np.isnan(np.asarray(jnp.asarray(case.kv_pages[0, :, 0, 0, 0], jnp.float32))))
    table = case.page_indices.copy()
    if len(nan_pages) == 0:
        return case
    for b, (kv_len, q_len) in enumerate(zip(case.kv_lens, case.q_lens)):
        first_key = max(0, int(kv_len) - int(q_len) - window + 1)
        table[b, :first_key // page_size] = nan_pages[0]
    return dataclasses.replace(case, page_indices=table)


# Quantised pools (EngineConfig.kv_cache_dtype): a few (kv dtype, config) pairs per kernel, not the
# product. The kernels and the reference read the same stored int8 / fp8 values and scales, so the
# table above still applies (by the query's dtype).
KV_QUANT_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
QUANT_CASES = [("int8", CONFIGS[1]), ("fp8", CONFIGS[0]), ("int8", CONFIGS[4])]


def quant_case_id(qc) -> str:
    return f"{qc[0]}-{config_id(qc[1])}"


def quantize_case(case: PagedCase, kv_cache_dtype: str):
    """(pool for the kernel, pool for the reference), both kv_quant.QuantizedKV of the case's
    values. Rows that are NaN in the case (unused pages, slots past a row's length) get NaN
    scales in the kernel's pool, so a stray read poisons its output; the reference gets zeros
    there (see reference_pool)."""
    from pallas_kernels import kv_quant

    pool = np.asarray(jnp.asarray(case.kv_pages, jnp.float32))
    nan_rows = np.isnan(pool).any(axis=-1)  # [2, P, page_size, K]
    values, scales = kv_quant.quantize(jnp.asarray(np.nan_to_num(pool)), KV_QUANT_DTYPES[kv_cache_dtype])
    scales = np.asarray(scales, np.float32)
    poisoned = np.where(nan_rows, np.nan, scales)
    # Both in the pool's scale dtype, so the kernels read what an engine's pool holds.
    return (kv_quant.QuantizedKV(values, jnp.asarray(poisoned, kv_quant.SCALE_DTYPE)),
            kv_quant.QuantizedKV(values, jnp.asarray(np.where(nan_rows, 0.0, scales), kv_quant.SCALE_DTYPE)))


# Attention sinks (gpt-oss): (window, soft cap) cases run with a per-head sink; a plain causal
# one, a window under a page with GQA, and a window with a cap.
SINK_CASES = [(None, None), (5, None), (16, 3.0)]


def make_sinks(rng, num_heads: int) -> np.ndarray:
    """f32[N] sink logits around the scaled scores' range, so each takes a visible share of its
    head's weight (a kernel that drops or misplaces one fails the tolerance)."""
    return rng.uniform(-1.0, 3.0, num_heads).astype(np.float32)


def assert_sinks_matter(got_with, got_without, dtype):
    """A nonzero sink must move the output well past the tolerance (the test could fail)."""
    diff = np.abs(np.asarray(jnp.asarray(got_with, jnp.float32)) - np.asarray(jnp.asarray(got_without, jnp.float32)))
    assert diff.max() > 5 * TOLERANCE[dtype]["atol"], f"sinks moved the output by only {diff.max()}"
