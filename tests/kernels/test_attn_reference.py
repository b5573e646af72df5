"""Tier (a): the jnp reference and write_kv against hand-computed numpy values."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference


def _softmax_attend(q, keys, values, scale):
    """q [D], keys/values [S, D] -> [D], written out by hand."""
    scores = np.array([scale * float(np.dot(q, k)) for k in keys])
    weights = np.exp(scores - scores.max())
    weights /= weights.sum()
    return (weights[:, None] * values).sum(axis=0)


def test_one_row_one_page_decode():
    # Pool: P=1 page of 2 slots, K=1, D=2. keys (1,0),(0,1); values (1,2),(3,4). q=(1,0), scale 1.
    kv = np.zeros((2, 1, 2, 1, 2), np.float32)
    kv[0, 0, :, 0] = [[1, 0], [0, 1]]
    kv[1, 0, :, 0] = [[1, 2], [3, 4]]
    q = np.array([[[[1.0, 0.0]]]], np.float32)  # [B=1, Tq=1, N=1, D=2]
    out = reference.paged_attention_ref(
        jnp.asarray(q), jnp.asarray(kv), np.array([[0]], np.int32), np.array([2], np.int32),
        np.array([1], np.int32), sm_scale=1.0,
    )
    w = np.exp(1.0) / (np.exp(1.0) + 1.0)  # softmax(1, 0)
    np.testing.assert_allclose(np.asarray(out)[0, 0, 0], [w * 1 + (1 - w) * 3, w * 2 + (1 - w) * 4], rtol=1e-6)


def test_two_pages_permuted_with_causal_prefill():
    rng = np.random.default_rng(1)
    page_size, head_dim = 2, 4
    kv = rng.standard_normal((2, 3, page_size, 1, head_dim)).astype(np.float32)
    table = np.array([[2, 0]], np.int32)  # logical page 0 -> physical 2, 1 -> 0
    keys = np.concatenate([kv[0, 2, :, 0], kv[0, 0, :, 0]])  # [4, D] in logical order
    values = np.concatenate([kv[1, 2, :, 0], kv[1, 0, :, 0]])
    q = rng.standard_normal((1, 3, 1, head_dim)).astype(np.float32)  # Tq=3, 2 real tokens
    out = np.asarray(reference.paged_attention_ref(
        jnp.asarray(q), jnp.asarray(kv), table, np.array([3], np.int32), np.array([2], np.int32),
        sm_scale=0.5,
    ))
    # kv_len 3, q_len 2: token 0 is at position 1 (sees keys 0..1), token 1 at position 2 (0..2).
    np.testing.assert_allclose(out[0, 0, 0], _softmax_attend(q[0, 0, 0], keys[:2], values[:2], 0.5), rtol=1e-5)
    np.testing.assert_allclose(out[0, 1, 0], _softmax_attend(q[0, 1, 0], keys[:3], values[:3], 0.5), rtol=1e-5)
    np.testing.assert_array_equal(out[0, 2], 0.0)  # padding token


def test_gqa_heads_share_kv_head_and_padding_row_is_zero():
    rng = np.random.default_rng(2)
    kv = rng.standard_normal((2, 2, 4, 2, 3)).astype(np.float32)  # K=2, D=3
    q = rng.standard_normal((2, 1, 4, 3)).astype(np.float32)  # N=4 -> heads 0,1 use kv 0; 2,3 use kv 1
    out = np.asarray(reference.paged_attention_ref(
        jnp.asarray(q), jnp.asarray(kv), np.array([[1], [0]], np.int32), np.array([3, 0], np.int32),
        np.array([1, 0], np.int32), sm_scale=0.7,
    ))
    for n in range(4):
        h = n // 2
        want = _softmax_attend(q[0, 0, n], kv[0, 1, :3, h], kv[1, 1, :3, h], 0.7)
        np.testing.assert_allclose(out[0, 0, n], want, rtol=1e-5)
    np.testing.assert_array_equal(out[1], 0.0)


def test_write_kv_sets_slots_and_skips_padding():
    kv = np.zeros((2, 2, 2, 1, 1), np.float32)  # P=2, page_size=2 -> slots 0..3
    k = np.array([[[1.0]], [[2.0]], [[3.0]]], np.float32)
    v = -k
    out = np.asarray(reference.write_kv(jnp.asarray(kv), jnp.asarray(k), jnp.asarray(v), np.array([3, -1, 0], np.int32)))
    want = np.zeros_like(kv)
    want[0, 1, 1, 0, 0], want[1, 1, 1, 0, 0] = 1.0, -1.0  # slot 3 = page 1, offset 1
    want[0, 0, 0, 0, 0], want[1, 0, 0, 0, 0] = 3.0, -3.0  # slot 0
    np.testing.assert_array_equal(out, want)


def test_sliding_window_and_soft_cap_by_hand():
    """Window W = 2 (the query and one key before it, HF's `kv_idx > q_idx - W`) and a soft cap."""
    rng = np.random.default_rng(3)
    page_size, head_dim, cap, scale = 2, 4, 0.8, 0.5
    kv = rng.standard_normal((2, 3, page_size, 1, head_dim)).astype(np.float32)
    table = np.array([[1, 2, 0]], np.int32)
    keys = np.concatenate([kv[0, p, :, 0] for p in (1, 2, 0)])  # [6, D] logical order
    values = np.concatenate([kv[1, p, :, 0] for p in (1, 2, 0)])
    q = rng.standard_normal((1, 3, 1, head_dim)).astype(np.float32)  # 3 tokens at positions 3, 4, 5
    out = np.asarray(reference.paged_attention_ref(
        jnp.asarray(q), jnp.asarray(kv), table, np.array([6], np.int32), np.array([3], np.int32),
        sm_scale=scale, sliding_window=2, soft_cap=cap,
    ))
    for i, pos in enumerate((3, 4, 5)):
        qi = q[0, i, 0]
        scores = np.array([cap * np.tanh(scale * float(np.dot(qi, keys[j])) / cap) for j in (pos - 1, pos)])
        w = np.exp(scores - scores.max())
        w /= w.sum()
        np.testing.assert_allclose(out[0, i, 0], w @ values[pos - 1:pos + 1], rtol=1e-5)


def _paged_attention_f64(q, kv, table, kv_lens, q_lens, scale, *, window=None, cap=None, sinks=None):
    """Float64 numpy paged attention, loop by loop, with gpt-oss sinks in the denominator."""
    batch, num_q, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = kv.shape
    group = num_heads // num_kv_heads
    out = np.zeros(q.shape, np.float64)
    for b in range(batch):
        keys = np.concatenate([kv[0, p] for p in table[b]]).astype(np.float64)  # [S, K, D]
        values = np.concatenate([kv[1, p] for p in table[b]]).astype(np.float64)
        for t in range(q_lens[b]):
            pos = kv_lens[b] - q_lens[b] + t
            seen = [j for j in range(pos + 1) if window is None or j > pos - window]
            for n in range(num_heads):
                h = n // group
                s = np.array([scale * np.dot(q[b, t, n].astype(np.float64), keys[j, h]) for j in seen])
                if cap is not None:
                    s = cap * np.tanh(s / cap)
                top = s.max() if sinks is None else max(s.max(), float(sinks[n]))
                w = np.exp(s - top)
                denom = w.sum() + (0.0 if sinks is None else np.exp(float(sinks[n]) - top))
                out[b, t, n] = (w / denom) @ values[seen, h]
    return out


def test_sinks_by_hand():
    """One key of score 0 and a sink of log 3: the key gets weight 1 / (1 + 3)."""
    kv = np.zeros((2, 1, 1, 1, 2), np.float32)
    kv[1, 0, 0, 0] = [4.0, -8.0]
    q = np.zeros((1, 1, 1, 2), np.float32)
    out = reference.paged_attention_ref(jnp.asarray(q), jnp.asarray(kv), np.array([[0]], np.int32),
                                        np.array([1], np.int32), np.array([1], np.int32), sm_scale=1.0,
                                        sinks=jnp.asarray([np.log(3.0)], jnp.float32))
    np.testing.assert_allclose(np.asarray(out)[0, 0, 0], [1.0, -2.0], rtol=1e-6)


@pytest.mark.parametrize("window,cap", [(None, None), (3, None), (4, 1.5)])
def test_sinks_against_float64(window, cap):
    """GQA (N = 6 over K = 2), permuted pages, a prefill row and a decode row, against the f64 loop."""
    rng = np.random.default_rng(7)
    page_size, head_dim, scale = 4, 8, 8 ** -0.5
    kv = rng.standard_normal((2, 5, page_size, 2, head_dim)).astype(np.float32)
    table = np.array([[3, 0, 4], [1, 2, 2]], np.int32)
    kv_lens, q_lens = np.array([10, 6], np.int32), np.array([4, 1], np.int32)
    q = rng.standard_normal((2, 4, 6, head_dim)).astype(np.float32)
    sinks = rng.uniform(-1.0, 3.0, 6).astype(np.float32)
    got = np.asarray(reference.paged_attention_ref(
        jnp.asarray(q), jnp.asarray(kv), table, kv_lens, q_lens, sm_scale=scale, sliding_window=window,
        soft_cap=cap, sinks=jnp.asarray(sinks)))
    want = _paged_attention_f64(q, kv, table, kv_lens, q_lens, scale, window=window, cap=cap, sinks=sinks)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    plain = _paged_attention_f64(q, kv, table, kv_lens, q_lens, scale, window=window, cap=cap)
    assert np.abs(want - plain).max() > 0.05  # the sinks take a visible share
    np.testing.assert_array_equal(got[1, 1:], 0.0)  # padding tokens
