"""The mixed-adapter delta against a token-by-token float64 reference: decode and prefill rows,
base rows (-1), repeated and unused slots."""

from __future__ import annotations

import numpy as np

from models.lora_ops import LoraRows, lora_delta, lora_delta_reference


def test_delta_matches_reference_per_row():
    rng = np.random.default_rng(0)
    S, I, R, O, row_len = 3, 12, 4, 10, 5
    a = rng.normal(size=(S, I, R)).astype(np.float32)
    b = rng.normal(size=(S, R, O)).astype(np.float32)
    dec, pre = np.array([2, -1, 0, 2], np.int32), np.array([1, -1, 2], np.int32)
    x = rng.normal(size=(len(dec) + len(pre) * row_len, I)).astype(np.float32)
    got = np.asarray(lora_delta(x, a, b, LoraRows(dec, pre)))
    want = lora_delta_reference(x, a, b, (dec, pre))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not got[1].any() and not got[4 + row_len:4 + 2 * row_len].any()  # base rows: no delta
    # hand value: token 0 on slot 2
    np.testing.assert_allclose(got[0], x[0].astype(np.float64) @ a[2] @ b[2], rtol=1e-5, atol=1e-5)
    only_decode = np.asarray(lora_delta(x[:4], a, b, LoraRows(dec, pre[:0])))
    np.testing.assert_allclose(only_decode, want[:4], rtol=1e-5, atol=1e-5)
    assert not np.asarray(lora_delta(x, a, b, LoraRows(np.full(4, -1, np.int32), np.full(3, -1, np.int32)))).any()
