"""Seeded draws survive rounding noise: logits changed by ~1e-6 (another reduction order in the
final norm or a tensor-parallel matmul, a smaller data-parallel batch) change a seeded token only
at a near tie of two noisy scores. The reference is a float64 numpy Gumbel-max written from
paxpage/sampling/noise.py's definition of the noise."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from paxpage.sampling.params import SamplingParams
from paxpage.sampling.sampler import sample
from paxpage.sampling.tensors import RowInfo, SamplingTensors

NUM_ROWS, VOCAB, HEAD, BLOCK = 256, 49152, 16, 256
NEAR_TIE = 1e-4  # a score gap below this may flip under a 1e-6 change of the logits


def _fmix32(h):
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _gumbel(keys, stream, index):
    """float64 Gumbel noise [R, M] for keys u32[R, 2], a stream, indices [M] or [R, M]."""
    with np.errstate(over="ignore"):
        k0, k1 = keys[:, 0].astype(np.uint32), keys[:, 1].astype(np.uint32)
        a = _fmix32(k0 ^ _fmix32(np.uint32(stream) + np.uint32(0x632BE5AB)))
        b = _fmix32(k1 + a)
        h = np.asarray(index).astype(np.uint32) * np.uint32(0x9E3779B9) + a[:, None]
        h = _fmix32(_fmix32(h) ^ b[:, None])
    v = np.minimum((h.astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -32), np.float32(1 - 2.0 ** -24))
    return -np.log(-np.log1p(-v.astype(np.float64)))


def _top2_gap(scores):
    top = np.sort(scores, axis=-1)[:, -2:]
    return top[:, 1] - top[:, 0]


def reference_draw(logits, keys, temperature):
    """The two-level Gumbel-max of paxpage/sampling/draw.py (round 0, no filter) in float64:
    (tokens [R], margin [R]: the smaller of the block and the token stage's top-two score gaps)."""
    x = logits.astype(np.float64) / temperature
    x -= x.max(axis=-1, keepdims=True)
    num_rows, vocab = x.shape
    xb = x.reshape(num_rows, vocab // BLOCK, BLOCK)
    block_scores = np.log(np.exp(xb).sum(-1)) + _gumbel(keys, 0, np.arange(vocab // BLOCK))
    block = np.argmax(block_scores, axis=-1)
    ids = block[:, None] * BLOCK + np.arange(BLOCK)
    token_scores = np.take_along_axis(x, ids, -1) + _gumbel(keys, 1, ids)
    tokens = np.take_along_axis(ids, np.argmax(token_scores, -1)[:, None], -1)[:, 0]
    return tokens, np.minimum(_top2_gap(block_scores), _top2_gap(token_scores))


@pytest.fixture(scope="module")
def logits():
    """A trained model's shape: a few strong tokens at low ids (frequent tokens come first in a
    BPE vocabulary) hold most of the mass, a long tail holds the rest; and the same logits scaled
    by 1 + 1e-6, as a final norm summed in another order scales them."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((NUM_ROWS, VOCAB)).astype(np.float32)
    x[:, :HEAD] += 9.0
    return x, (x * np.float32(1 + 1e-6)).astype(np.float32)


def _tokens(logits, params, seed=11):
    rows = [RowInfo(params, [1], [], seed, step) for step in range(NUM_ROWS)]
    t = SamplingTensors.build(rows, VOCAB)
    return np.asarray(sample(jnp.asarray(logits), t).token_ids), np.asarray(t.keys)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.95),
                                    SamplingParams(temperature=1.0, min_p=1e-6)], ids=["plain", "top_p", "min_p"])
def test_a_rounding_change_moves_a_seeded_token_only_at_a_near_tie(logits, params):
    x, x_scaled = logits
    tokens, keys = _tokens(x, params)
    tokens_scaled, _ = _tokens(x_scaled, params)
    want, margin = reference_draw(x, keys, params.temperature)
    far = margin > NEAR_TIE
    assert far.mean() > 0.95
    assert (tokens >= HEAD).sum() > 30  # the case that matters: draws from the tail
    if params.top_p == 1.0 and params.min_p < 1e-3:  # (filters keep every drawn token here)
        np.testing.assert_array_equal(tokens[far], want[far])
    changed = np.flatnonzero(tokens != tokens_scaled)
    assert not far[changed].any(), f"rows {changed[far[changed]]} changed without a near tie"


def test_top_k_candidates_survive_rounding(logits):
    x, x_scaled = logits
    params = SamplingParams(temperature=1.5, top_k=100)  # beyond the 16 strong tokens: tail draws
    a, _ = _tokens(x, params)
    b, _ = _tokens(x_scaled, params)
    assert (a >= HEAD).sum() > 0
    assert (a != b).sum() <= 1
