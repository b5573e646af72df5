"""Speculative acceptance (paxpage/speculative/verify.py) on known distributions: every emitted token
is distributed as the target's processed distribution p whatever the draft's q (chi-square, as
the sampler's tests), sampled rows accept with probability sum_x min(p(x), q(x)), greedy rows
accept exactly the argmax."""

import jax.numpy as jnp
import numpy as np

from paxpage.sampling.params import SamplingParams
from paxpage.sampling.tensors import RowInfo, SamplingTensors
from paxpage.speculative.verify import verify
from tests.engine.test_sampler import LOGITS, PROBS, _chi_square_check, _draw, _keep

NUM_DRAWS = 6000


def _verify(params, drafts, q=None, logits=LOGITS):
    """One verify row per draft (seed = row): (emitted tokens, accepted) as numpy."""
    rows = [RowInfo(params, [1], [], seed, 0) for seed in range(len(drafts))]
    t = SamplingTensors.build(rows, vocab_size=len(logits))
    dists = None if q is None else jnp.tile(jnp.asarray(q, jnp.float32), (len(drafts), 1))
    out, accepted = verify(jnp.tile(jnp.asarray(logits), (len(drafts), 1)), t,
                           jnp.asarray(drafts, jnp.int32), dists)
    return np.asarray(out.token_ids), np.asarray(accepted)


def test_one_hot_drafts_keep_the_target_distribution():
    # n-gram drafts: q is one-hot, so a draft x is kept with probability p(x)
    params = SamplingParams(temperature=0.9, top_p=0.9)
    plain = _draw(params, num_draws=NUM_DRAWS)  # the plain sampler, the same seeds
    for draft in (0, 3, 7):
        tokens, accepted = _verify(SamplingParams(), [draft] * NUM_DRAWS)
        _chi_square_check(tokens, PROBS)
        assert abs(accepted.mean() - PROBS[draft]) < 4 * np.sqrt(PROBS[draft] / NUM_DRAWS) + 0.005
        assert np.all(tokens[accepted] == draft) and np.all(tokens[~accepted] != draft)
        # coupled to the plain sampler's draw: a seeded row emits what it emits unspeculated
        assert np.array_equal(_verify(params, [draft] * NUM_DRAWS)[0], plain)


def test_drafts_from_another_distribution_keep_the_target_distribution():
    q = np.array([0.05, 0.1, 0.4, 0.05, 0.2, 0.1, 0.05, 0.05])
    drafts = np.random.default_rng(0).choice(8, size=NUM_DRAWS, p=q)
    tokens, accepted = _verify(SamplingParams(), drafts, q)
    _chi_square_check(tokens, PROBS)
    expected = np.minimum(PROBS, q).sum()  # the acceptance rate of rejection sampling
    assert abs(accepted.mean() - expected) < 4 * np.sqrt(expected * (1 - expected) / NUM_DRAWS)


def test_filtered_target_distribution():
    # top_k 3 at temperature 0.5: p is the sharpened top-3 set, a draft outside it never stays
    params = SamplingParams(temperature=0.5, top_k=3)
    sharpened = _keep(PROBS ** 2, np.arange(8) < 3)
    drafts = np.random.default_rng(1).integers(0, 8, NUM_DRAWS)
    tokens, accepted = _verify(params, drafts, np.full(8, 1 / 8))
    _chi_square_check(tokens, sharpened / sharpened.sum())
    assert not np.any(accepted & (drafts >= 3))


def test_greedy_rows_accept_exactly_the_argmax_and_rows_without_drafts_sample():
    tokens, accepted = _verify(SamplingParams(temperature=0), [0, 1, 5, -1])
    assert accepted.tolist() == [True, False, False, False]
    assert tokens.tolist() == [0, 0, 0, 0]  # the correction (and the bonus) is the argmax
    tokens, accepted = _verify(SamplingParams(), [-1] * NUM_DRAWS)
    assert not accepted.any()
    _chi_square_check(tokens, PROBS)
