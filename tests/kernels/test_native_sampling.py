"""The native CPU proposal draw (pallas_kernels/native_sampling.py) against its jnp reference and
against exact probabilities, and the sampler's draw through it."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import native_sampling
from pallas_kernels.native_sampling import proposal_draw_native, proposal_draw_ref
from paxpage.sampling import sampler as sampler_lib
from paxpage.sampling.tensors import RowInfo, SamplingTensors, row_keys
from paxpage.sampling.params import SamplingParams

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the native kernel"),
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel; the default backend is not CPU"),
]

NATIVE = jax.jit(proposal_draw_native)
REF = jax.jit(proposal_draw_ref)


@pytest.fixture(scope="module", autouse=True)
def native():
    from models.cache import NATIVE_DIR, cache_dir

    assert native_sampling.load(os.path.join(cache_dir(), NATIVE_DIR)), native_sampling.LIBRARY.error


def _rows(logits, temperature=1.0, top_p=1.0, min_p=0.0, active=None, seed=0):
    """The kernel's per-row operands for logits f32[R, V] (numpy), as the sampler builds them:
    row r's key is the sampler's for seed `seed` at position r."""
    num_rows = logits.shape[0]
    t = np.full(num_rows, temperature, np.float32)
    best_logit = np.nanmax(logits, axis=-1)
    best = best_logit / t
    l_min = (best_logit + t * np.log(min_p)) if min_p > 0 else np.full(num_rows, -np.inf)
    keys = row_keys(np.full(num_rows, seed), np.arange(num_rows))
    active = np.ones(num_rows, bool) if active is None else active
    return [jnp.asarray(a) for a in (logits, t, best, l_min.astype(np.float32),
                                     np.full(num_rows, top_p, np.float32), keys, active)]


@pytest.mark.parametrize("vocab", [1000, 4099, 49152])
@pytest.mark.parametrize("temperature,top_p,min_p", [(1.0, 1.0, 0.0), (0.7, 0.9, 0.0), (1.3, 0.5, 0.0),
                                                      (0.7, 1.0, 0.05), (0.5, 0.8, 0.02)])
def test_native_matches_reference(vocab, temperature, top_p, min_p):
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal((64, vocab)) * rng.uniform(0.1, 3.0, (64, 1))).astype(np.float32)
    args = _rows(logits, temperature, top_p, min_p, seed=vocab)
    (tok, acc), (tok_ref, acc_ref) = (tuple(np.asarray(x) for x in f(*args)) for f in (NATIVE, REF))
    same = tok == tok_ref
    # the same Gumbel-max draw: only a near tie between two noisy scores, decided by the exp
    # polynomial's or the summation order's rounding, may differ
    assert same.mean() >= 0.98, f"{same.mean():.2f} of draws equal"
    np.testing.assert_array_equal(acc[same], acc_ref[same])
    assert np.all((0 <= tok) & (tok < vocab))


def test_draws_follow_the_distribution():
    """20000 rows of one distribution (50 banned tokens), one key each: the kernel's draws pass a
    chi-square test against the exact probabilities, over 20 groups of tokens."""
    rng = np.random.default_rng(7)
    vocab, n, temperature = 700, 20000, 0.8
    row = (rng.standard_normal(vocab) * 1.5).astype(np.float32)
    row[rng.choice(vocab, 50, replace=False)] = -np.inf  # banned tokens: never drawn
    logits = np.repeat(row[None], n, axis=0)
    tok, acc = (np.asarray(x) for x in NATIVE(*_rows(logits, temperature)))
    p = np.exp((row.astype(np.float64) - row[np.isfinite(row)].max()) / temperature)
    p /= p.sum()
    counts = np.bincount(tok, minlength=vocab)
    assert np.all(counts[np.isneginf(row)] == 0)
    groups = np.arange(vocab) * 20 // vocab
    observed, expected = (np.bincount(groups, weights=w) for w in (counts, n * p))
    chi2 = float(np.sum((observed - expected) ** 2 / expected))
    assert chi2 < 43.8, (observed, expected)  # chi-square, 19 degrees of freedom, p = 0.001
    assert acc.all()  # top_p 1, min_p off: every draw is kept


def test_top_p_and_min_p_acceptance_is_exact():
    """Acceptance against hand-computed sets: top-p keeps the smallest prefix (by probability)
    whose strictly-better mass is below top_p; min-p keeps p_i >= min_p * p_max."""
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 4000, np.float32))
    tok, acc = (np.asarray(x) for x in NATIVE(*_rows(logits, top_p=0.7)))
    # strictly-better masses 0, 0.5, 0.8, 0.95: tokens 0 and 1 are kept
    np.testing.assert_array_equal(acc, tok <= 1)
    tok, acc = (np.asarray(x) for x in NATIVE(*_rows(logits, min_p=0.4)))
    np.testing.assert_array_equal(acc, tok <= 1)  # p >= 0.2: tokens 0 and 1


def test_inactive_rows_and_odd_inputs():
    logits = np.zeros((4, 300), np.float32)
    logits[1, :] = -np.inf
    logits[1, 123] = 2.0  # one finite logit: always drawn
    logits[2, 5] = np.nan  # NaN weighs nothing
    logits[2, :5] = -np.inf
    active = np.array([True, True, True, False])
    tok, acc = (np.asarray(x) for x in NATIVE(*_rows(logits, 0.9, active=active)))
    assert tok[1] == 123 and acc[1]
    assert tok[2] >= 6
    assert tok[3] == 0 and not acc[3]


def test_sampler_draws_through_the_native_kernel():
    """`sample(..., draw_impl="native")` against exact probabilities (top-p 0.8 over a known
    distribution) and with the same greedy rows as the XLA path."""
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = jnp.asarray(np.log(np.tile(probs, (3000, 1))).astype(np.float32))
    rows = [RowInfo(SamplingParams(top_p=0.8, seed=r), [1], [], r) for r in range(3000)]
    t = SamplingTensors.build(rows, len(probs))
    tokens = np.asarray(sampler_lib.sample(logits, t, draw_impl="native").token_ids)
    kept = probs[:3] / probs[:3].sum()  # strictly-better mass below 0.8: tokens 0, 1, 2
    counts = np.bincount(tokens, minlength=len(probs))
    assert counts[3:].sum() == 0
    expected = 3000 * kept
    chi2 = float(np.sum((counts[:3] - expected) ** 2 / expected))
    assert chi2 < 13.8, (counts, expected)  # chi-square, 2 degrees of freedom, p = 0.001
    greedy = [RowInfo(SamplingParams(temperature=0), [1], [], r) for r in range(4)]
    tg = SamplingTensors.build(greedy, len(probs))
    np.testing.assert_array_equal(np.asarray(sampler_lib.sample(logits[:4], tg, draw_impl="native").token_ids),
                                  np.zeros(4))


def test_unknown_draw_impl_raises():
    rows = [RowInfo(SamplingParams(temperature=0.5), [1], [], 0)]
    t = SamplingTensors.build(rows, 8)
    with pytest.raises(ValueError, match="draw_impl"):
        sampler_lib.sample(jnp.zeros((1, 8)), t, draw_impl="fast")
