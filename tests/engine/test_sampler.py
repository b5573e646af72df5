"""Sampler: filtering supports and frequencies, penalties against HF / numpy, compiles, seeds."""

import dataclasses
import functools
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from paxpage.sampling.params import SamplingParams
from paxpage.sampling.sampler import apply_penalties, filter_logits, sample
from paxpage.sampling.tensors import RowInfo, SamplingTensors, row_key

# Upper 0.1% points of the chi-square distribution by degrees of freedom (scipy is not installed).
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}

PROBS = np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])
LOGITS = np.log(PROBS).astype(np.float32)  # [V=8], token i has probability PROBS[i]


def _draw(params: SamplingParams, logits=LOGITS, num_draws=4000, step=0, draw_impl="xla"):
    """num_draws independent samples of one logits row: one row per seed."""
    rows = [RowInfo(params, [1], [], seed, step) for seed in range(num_draws)]
    t = SamplingTensors.build(rows, vocab_size=len(logits))
    out = sample(jnp.tile(jnp.asarray(logits), (num_draws, 1)), t, draw_impl=draw_impl)
    return np.asarray(out.token_ids)


def _chi_square_check(tokens, expected_probs):
    """Support equals expected_probs > 0 and frequencies pass a chi-square test at 0.1%."""
    allowed = np.flatnonzero(expected_probs > 0)
    assert set(np.unique(tokens)) <= set(allowed), f"tokens outside {allowed}: {np.unique(tokens)}"
    counts = np.bincount(tokens, minlength=len(expected_probs))[allowed]
    expected = len(tokens) * expected_probs[allowed] / expected_probs[allowed].sum()
    stat = float(np.sum((counts - expected) ** 2 / expected))
    assert stat < CHI2_CRITICAL_0_001[len(allowed) - 1], (stat, counts, expected)


def _keep(probs, mask):
    return np.where(mask, probs, 0.0)


def test_plain_sampling_matches_softmax():
    _chi_square_check(_draw(SamplingParams()), PROBS)


def test_temperature_sharpens():
    sharpened = PROBS ** 2  # temperature 0.5 squares the probabilities (before renormalising)
    _chi_square_check(_draw(SamplingParams(temperature=0.5, top_k=4)), _keep(sharpened, np.arange(8) < 4))


def test_top_k():
    _chi_square_check(_draw(SamplingParams(top_k=3)), _keep(PROBS, np.arange(8) < 3))


def test_top_p():
    # mass of strictly better tokens: 0, .4, .65, .8 -> top_p .7 keeps the first 3
    _chi_square_check(_draw(SamplingParams(top_p=0.7)), _keep(PROBS, np.arange(8) < 3))


def test_top_p_applies_to_the_renormalised_top_k_set():
    # top-4 renormalised: .444 .278 .167 .111 -> mass before: 0, .444, .722: top_p .7 keeps 2
    # (without renormalising it would keep 3)
    _chi_square_check(_draw(SamplingParams(top_k=4, top_p=0.7)), _keep(PROBS, np.arange(8) < 2))


def test_min_p():
    # keeps p >= 0.5 * 0.4 = 0.2
    _chi_square_check(_draw(SamplingParams(min_p=0.5)), _keep(PROBS, PROBS >= 0.2))


def test_filters_tiny_top_p_keeps_the_best_token():
    assert set(_draw(SamplingParams(top_p=1e-6))) == {0}


def _reference_filter(x, top_k, top_p, min_p):
    """Sort-based numpy top-k -> top-p (renormalised) -> min-p, returning the kept mask."""
    order = np.argsort(-x, kind="stable")
    xs = x[order]
    k = len(x) if top_k <= 0 else top_k
    p = np.exp(xs[:k] - xs[0])
    p /= p.sum()
    before = np.cumsum(p) - p
    num_kept = max(1, int(np.sum(before < top_p))) if top_p < 1 else k
    threshold = xs[num_kept - 1]
    keep = x >= threshold
    if min_p > 0:
        keep &= x >= x.max() + np.log(min_p)
    return keep


def test_filter_logits_matches_sort_reference():
    rng = np.random.default_rng(0)
    num_rows, vocab = 64, 300
    x = rng.normal(size=(num_rows, vocab)).astype(np.float32) * rng.uniform(0.5, 4, size=(num_rows, 1))
    x[:4, :10] = x[:4].max(axis=1, keepdims=True) + 1  # ten-way ties at the top
    top_k = rng.choice([0, 1, 2, 7, 50, 299], size=num_rows)
    top_p = rng.choice([1.0, 0.9, 0.5, 0.1, 0.99], size=num_rows)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.3], size=num_rows)
    params = [SamplingParams(top_k=int(k), top_p=float(p), min_p=float(m))
              for k, p, m in zip(top_k, top_p, min_p)]
    t = SamplingTensors.build([RowInfo(p, [0], [], 0) for p in params], vocab)
    kept = np.isfinite(np.asarray(jax.jit(filter_logits)(jnp.asarray(x), t)))
    for r in range(num_rows):
        ref = _reference_filter(x[r].astype(np.float64), top_k[r], top_p[r], min_p[r])
        # float32 vs float64 cumulative sums may differ right at a top_p boundary: allow 1 token
        assert np.sum(kept[r] != ref) <= 1, (r, top_k[r], top_p[r], min_p[r])
    assert kept[:4, :10].all()  # ties at the threshold are all kept


def test_repetition_penalty_matches_hf():
    rng = np.random.default_rng(1)
    vocab = 50
    logits = rng.normal(size=(3, vocab)).astype(np.float32) * 3
    cases = [(1.3, [1, 2, 3, 3], [4, 49]), (0.7, [5], [5, 6, 7, 8, 9, 10]), (2.0, list(range(20)), [])]
    rows = [RowInfo(SamplingParams(repetition_penalty=pen), prompt, out, 0) for pen, prompt, out in cases]
    got = np.asarray(apply_penalties(jnp.asarray(logits), SamplingTensors.build(rows, vocab)))
    for r, (pen, prompt, out) in enumerate(cases):
        ids = torch.tensor([prompt + out], dtype=torch.long)
        want = RepetitionPenaltyLogitsProcessor(pen)(ids, torch.tensor(logits[r:r + 1]))[0].numpy()
        np.testing.assert_allclose(got[r], want, rtol=1e-6)


def test_presence_and_frequency_penalties_match_numpy():
    rng = np.random.default_rng(2)
    vocab = 40
    logits = rng.normal(size=(2, vocab)).astype(np.float32)
    cases = [(0.5, 0.25, [1, 2, 2, 2, 7], [3, 3]), (-1.0, 1.5, [0, 0, 39], [])]
    rows = [RowInfo(SamplingParams(presence_penalty=pp, frequency_penalty=fp), prompt, out, 0)
            for pp, fp, out, prompt in cases]
    got = np.asarray(apply_penalties(jnp.asarray(logits), SamplingTensors.build(rows, vocab)))
    for r, (pp, fp, out, _) in enumerate(cases):
        counts = np.bincount(out, minlength=vocab)  # output tokens only: the prompt is not penalised
        want = logits[r] - fp * counts - pp * (counts > 0)
        np.testing.assert_allclose(got[r], want, rtol=1e-6)


def test_all_penalties_together_and_logprobs_before_temperature():
    rng = np.random.default_rng(3)
    vocab = 32
    logits = rng.normal(size=(1, vocab)).astype(np.float32) * 2
    prompt, out = [3, 4, 5], [5, 6, 6]
    p = SamplingParams(temperature=2.0, repetition_penalty=1.5, presence_penalty=0.3,
                       frequency_penalty=0.2, logprobs=4)
    t = SamplingTensors.build([RowInfo(p, prompt, out, 9)], vocab)
    result = sample(jnp.asarray(logits), t, num_logprobs=4)

    want = logits[0].copy()
    seen = list(set(prompt + out))  # HF first, then OpenAI penalties on output counts
    want[seen] = np.where(want[seen] < 0, want[seen] * 1.5, want[seen] / 1.5)
    counts = np.bincount(out, minlength=vocab)
    want = want - 0.2 * counts - 0.3 * (counts > 0)
    logprobs = want - np.log(np.sum(np.exp(want - want.max()))) - want.max()  # no temperature
    token = int(result.token_ids[0])
    np.testing.assert_allclose(float(result.logprobs[0]), logprobs[token], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(result.top_ids[0]), np.argsort(-logprobs)[:4])
    np.testing.assert_allclose(np.asarray(result.top_logprobs[0]), np.sort(logprobs)[::-1][:4], rtol=1e-5)



def test_a_pending_token_counts_as_if_the_host_had_listed_it():
    # Async scheduling: the host builds a penalised row's lists before its last token is back
    # from the device, and the sampler adds that token (`pending`). Each row: the logits must be
    # those of its full history, penalised by hand (HF's repetition over prompt + outputs,
    # OpenAI's presence / frequency over output counts).
    rng = np.random.default_rng(4)
    vocab = 24
    logits = rng.normal(size=(7, vocab)).astype(np.float32) * 2
    both = dict(repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2)
    cases = [  # (params, prompt, outputs the host has, pending token or -1)
        (SamplingParams(**both), [1, 2], [3, 3, 4], 3),  # already an output: one more occurrence
        (SamplingParams(**both), [1, 2], [3], 2),  # only in the prompt so far
        (SamplingParams(**both), [1, 2], [3], 9),  # new
        (SamplingParams(frequency_penalty=0.5), [5], [], 6),  # the first output
        (SamplingParams(**both), [1, 2], [3, 4], -1),  # nothing in flight
        (SamplingParams(), [1], [2], 7),  # no penalty: untouched
        (SamplingParams(repetition_penalty=1.4, min_tokens=4, stop_token_ids=[11]), [0], [8], 11),  # banned
    ]
    rows = [RowInfo(p, prompt, out, 0) for p, prompt, out, _ in cases]
    t = SamplingTensors.build(rows, vocab, eos_token_ids=[])
    pending = jnp.asarray([tok for *_, tok in cases], jnp.int32)
    got = np.asarray(apply_penalties(jnp.asarray(logits), t, pending))
    for r, (p, prompt, out, tok) in enumerate(cases):
        full = out + ([tok] if tok >= 0 else [])
        want = logits[r].copy()
        seen = sorted(set(prompt + full))
        want[seen] = np.where(want[seen] < 0, want[seen] * p.repetition_penalty, want[seen] / p.repetition_penalty)
        counts = np.bincount(np.asarray(full, np.int64), minlength=vocab)
        want = want - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        if p.min_tokens > len(out):
            want[p.stop_token_ids] = -np.inf
        np.testing.assert_allclose(got[r], want, rtol=1e-6, err_msg=f"row {r}")

def test_min_tokens_bans_eos_and_stop_tokens():
    vocab, eos = 16, 2
    logits = np.zeros((3, vocab), np.float32)
    logits[:, eos], logits[:, 9], logits[:, 5] = 10.0, 9.0, 8.0
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[9])
    rows = [RowInfo(p, [1], [7, 7], 0),  # 2 < 3 generated: EOS and 9 banned
            RowInfo(p, [1], [7, 7, 7], 0),  # min_tokens reached
            RowInfo(p.replace(ignore_eos=True), [1], [], 0)]  # ignore_eos: EOS is not a stop
    t = SamplingTensors.build(rows, vocab, eos_token_ids=(eos,))
    out = sample(jnp.asarray(logits), t, num_logprobs=2)
    assert out.token_ids.tolist() == [5, eos, eos]
    assert float(out.logprobs[0]) > -1.0  # banned tokens carry no probability
    assert out.top_ids[0].tolist() == [5, 0]


def test_greedy_rows_take_argmax_and_ignore_filters():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(6, 100)).astype(np.float32)
    greedy = SamplingParams(temperature=0, top_k=3, top_p=0.1, min_p=0.9)
    rows = [RowInfo(greedy if r % 2 == 0 else SamplingParams(), [1], [], r) for r in range(6)]
    out = sample(jnp.asarray(logits), SamplingTensors.build(rows, 100))
    np.testing.assert_array_equal(np.asarray(out.token_ids)[::2], logits[::2].argmax(-1))


def test_any_mix_of_rows_compiles_once():
    num_rows, vocab = 5, 37  # a shape no other test uses
    logits = jnp.asarray(np.random.default_rng(5).normal(size=(num_rows, vocab)), jnp.float32)
    variants = [
        [SamplingParams(temperature=0)] * num_rows,
        [SamplingParams()] * num_rows,
        [SamplingParams(temperature=0), SamplingParams(top_k=5), SamplingParams(top_p=0.8),
         SamplingParams(min_p=0.1, temperature=0.7), SamplingParams(repetition_penalty=1.2)],
        [SamplingParams(presence_penalty=1.0, frequency_penalty=-0.5, temperature=0)] * num_rows,
    ]
    before = sample._cache_size()
    sizes = []
    for params in variants:
        t = SamplingTensors.build([RowInfo(p, [1, 2], [3], i) for i, p in enumerate(params)], vocab)
        jax.block_until_ready(sample(logits, t, num_logprobs=2))
        sizes.append(sample._cache_size() - before)
    # all-greedy rows (the host knows: SamplingTensors.greedy_only) get the argmax-only variant,
    # unpenalised rows (SamplingTensors.penalised False) the draw alone; every penalised mix
    # shares the one full executable
    built = [SamplingTensors.build([RowInfo(p, [1, 2], [3], 0) for p in v], vocab) for v in variants]
    assert [(t.greedy_only, t.penalised) for t in built] == [
        (True, False), (False, False), (False, True), (False, True)]
    assert sizes == [1, 2, 3, 3]


def test_penalty_stage_leaves_unpenalised_rows_alone():
    # the `penalised` variant runs the penalty stage on every row: rows without penalties must
    # sample exactly what the variant without the stage samples (same keys, same logprobs)
    num_rows, vocab = 6, 41
    logits = jnp.asarray(np.random.default_rng(9).normal(size=(num_rows, vocab)), jnp.float32)
    params = [SamplingParams(temperature=0), SamplingParams(), SamplingParams(top_p=0.7),
              SamplingParams(top_k=3, temperature=0.5), SamplingParams(min_p=0.2), SamplingParams(seed=4)]
    t = SamplingTensors.build([RowInfo(p, [1, 2, 5], [3, 3], i) for i, p in enumerate(params)], vocab)
    assert not t.penalised
    plain = jax.device_get(sample(logits, t, num_logprobs=3))
    full = jax.device_get(sample(logits, dataclasses.replace(t, penalised=True), num_logprobs=3))
    for a, b in zip(plain.__dict__.values(), full.__dict__.values()):
        np.testing.assert_array_equal(a, b)


def test_row_key_is_a_pure_function():
    k = row_key(1234, 7)
    assert k.dtype == np.uint32 and k.shape == (2,)
    np.testing.assert_array_equal(k, row_key(1234, 7))
    assert not np.array_equal(k, row_key(1234, 8))
    assert not np.array_equal(k, row_key(1235, 7))
    row_key(2**70, 0)  # any non-negative int is accepted


def test_same_row_same_tokens_whatever_the_batch():
    vocab = 512
    rng = np.random.default_rng(6)
    logits_row = rng.normal(size=vocab).astype(np.float32) * 2
    target = SamplingParams(temperature=0.9, top_k=100, top_p=0.95, frequency_penalty=0.3)
    prompt = [5, 6, 7]
    for step in range(8):
        output = list(rng.integers(0, vocab, size=step))
        alone = sample(jnp.asarray(logits_row[None]),
                       SamplingTensors.build([RowInfo(target, prompt, output, 1234)], vocab))
        # 32 rows, the target at row 17, neighbours with other params, longer token lists, and
        # padding rows: the row must not notice.
        neighbours = [RowInfo(SamplingParams(temperature=float(rng.uniform(0, 2)),
                                             repetition_penalty=1.1, top_k=int(rng.integers(0, 50))),
                              list(rng.integers(0, vocab, size=40)), list(rng.integers(0, vocab, size=70)),
                              int(rng.integers(0, 2**31)))
                      for _ in range(29)]
        rows = neighbours[:17] + [RowInfo(target, prompt, output, 1234)] + neighbours[17:]
        batch_logits = rng.normal(size=(32, vocab)).astype(np.float32)
        batch_logits[17] = logits_row
        batch = sample(jnp.asarray(batch_logits), SamplingTensors.build(rows, vocab, pad_rows_to=32))
        assert int(batch.token_ids[17]) == int(alone.token_ids[0]), step
        assert float(batch.logprobs[17]) == pytest.approx(float(alone.logprobs[0]), abs=1e-6)


def test_seeds_and_steps_change_the_draw():
    draws_by_seed = _draw(SamplingParams())[:64]
    draws_by_step = [int(_draw(SamplingParams(), num_draws=1, step=s)[0]) for s in range(16)]
    assert len(set(draws_by_seed.tolist())) > 3 and len(set(draws_by_step)) > 3


def test_build_pads_rows_and_buckets_token_lists():
    p = SamplingParams(repetition_penalty=1.1, top_k=10_000)
    rows = [RowInfo(p, list(range(20)), [7, 8, 9, 25, 25], 0),
            RowInfo(SamplingParams(), list(range(100)), list(range(100)), 1),  # no penalty
            RowInfo(SamplingParams(presence_penalty=1.0), [5] * 50, [4, 4], 2)]  # output only
    t = SamplingTensors.build(rows, vocab_size=1000, pad_rows_to=4)
    assert t.num_rows == 4
    assert t.token_ids.shape == t.token_counts.shape == (4, 32)  # 21 distinct -> power of two >= 16
    # distinct ids of prompt + output, each with its count among the output tokens
    assert t.token_ids[0, :22].tolist() == list(range(20)) + [25, -1]
    assert t.token_counts[0, :22].tolist() == [0] * 7 + [1, 1, 1] + [0] * 10 + [2, 0]
    assert t.token_ids[1].tolist() == [-1] * 32  # no penalty: its tokens are not shipped
    assert t.token_ids[2, :2].tolist() == [4, -1] and t.token_counts[2, :2].tolist() == [2, 0]
    assert t.top_k.tolist() == [0, 0, 0, 0]  # top_k >= vocab is off
    assert t.temperature[3] == 0.0  # padding rows are greedy
    assert t.banned_ids.shape == (4, 4)
    with pytest.raises(ValueError, match="pad_rows_to=1 is smaller than the 2 rows"):
        SamplingTensors.build(rows[:2], 1000, pad_rows_to=1)


def test_token_width_caps_a_small_fixed_set_of_widths():
    p = SamplingParams(frequency_penalty=0.5)
    widths = set()
    for length in (0, 5, 17, 60, 64):
        widths.add(SamplingTensors.build([RowInfo(p, [1], list(range(length)), 0)], 1000,
                                         token_width=64).token_ids.shape[1])
    assert widths == {16, 32, 64}
    # No penalised row: the smallest width, however long the sequences and token_width.
    t = SamplingTensors.build([RowInfo(SamplingParams(), [1] * 500, [3] * 500, 0)], 1000,
                              token_width=2048)
    assert t.token_ids.shape == t.token_counts.shape == (1, 16)
    assert t.token_ids.tolist() == [[-1] * 16]
    with pytest.raises(ValueError, match="token_width=64 is smaller than the 66 distinct penalty"):
        SamplingTensors.build([RowInfo(p.replace(repetition_penalty=1.2), [1000 - 1] * 5,
                                       list(range(65)), 0)], 1000, token_width=64)


def test_bfloat16_logits_and_no_logprobs():
    logits = jnp.asarray(np.random.default_rng(7).normal(size=(2, 64)), jnp.bfloat16)
    t = SamplingTensors.build([RowInfo(SamplingParams(), [1], [], i) for i in range(2)], 64)
    out = sample(logits, t)
    assert out.token_ids.dtype == jnp.int32 and out.top_ids.shape == (2, 0)
    assert np.all(np.asarray(out.logprobs) <= 0)


# ---- the draw's paths (paxpage/sampling/draw.py): candidates, proposal, exact fallback ----

def _grouped_check(tokens, expected_probs, num_groups=5):
    """Support within expected_probs > 0, and a chi-square test at 0.1% on the counts of
    num_groups contiguous groups of token ids (many-token supports have too few draws per id)."""
    allowed = np.flatnonzero(expected_probs > 0)
    assert set(np.unique(tokens)) <= set(allowed), f"tokens outside the support: {np.unique(tokens)}"
    edges = np.linspace(0, len(expected_probs), num_groups + 1).astype(int)
    counts = np.add.reduceat(np.bincount(tokens, minlength=len(expected_probs)), edges[:-1])
    probs = np.add.reduceat(expected_probs / expected_probs.sum(), edges[:-1])
    keep = probs > 0
    expected = len(tokens) * probs[keep]
    stat = float(np.sum((counts[keep] - expected) ** 2 / expected))
    assert stat < CHI2_CRITICAL_0_001[int(keep.sum()) - 1], (stat, counts, expected)


def test_top_p_mass_spread_over_more_tokens_than_candidates():
    # 300 tokens at logit 1 hold 53.8% of the mass, 700 at logit 0 the rest: top_p 0.5 keeps
    # exactly the 300 (more than the 128 candidates); proposals from the other 700 are rejected
    # and those rows finish on the exact path.
    logits = np.where(np.arange(1000) < 300, 1.0, 0.0).astype(np.float32)
    _grouped_check(_draw(SamplingParams(top_p=0.5), logits), _keep(np.exp(logits), np.arange(1000) < 300))
    # top_p 0.7 needs the second level too: ties at the threshold keep all 1000 tokens.
    _grouped_check(_draw(SamplingParams(top_p=0.7), logits), np.exp(logits))


# "select": the GPU lowering's draw (no branches; the exact path for every row at once), run here.
@pytest.mark.parametrize("draw_impl", ["xla", "select"])
def test_min_p_rejections_finish_on_the_exact_path(draw_impl):
    # min_p 0.5 keeps the 10 tokens at logit 2 (7% of the mass): most proposals are rejected.
    logits = np.where(np.arange(1000) < 10, 2.0, 0.0).astype(np.float32)
    _grouped_check(_draw(SamplingParams(min_p=0.5), logits, draw_impl=draw_impl), _keep(np.exp(logits), np.arange(1000) < 10),
                   num_groups=500)  # pairs of tokens: 5 groups with support


@pytest.mark.parametrize("draw_impl", ["xla"])
def test_top_k_beyond_the_candidates_and_ties(draw_impl):
    draw = functools.partial(_draw, draw_impl=draw_impl)
    # 200 tokens tied at the top: top_k 150 (> 128 candidates) keeps all 200 (ties are kept).
    logits = np.where(np.arange(400) < 200, 0.0, -1.0).astype(np.float32)
    _grouped_check(draw(SamplingParams(top_k=150), logits, num_draws=2000),
                   _keep(np.exp(logits), np.arange(400) < 200))
    # top_k 10 inside the candidates, but its threshold ties with the 128th candidate: tokens
    # 5..299 tie, so all 295 of them are kept besides the 5 best.
    logits = np.full(400, -2.0, np.float32)
    logits[:5] = [3.0, 2.5, 2.0, 1.5, 1.0]
    logits[5:300] = 0.0
    _grouped_check(draw(SamplingParams(top_k=10), logits, num_draws=2000),
                   _keep(np.exp(logits), np.arange(400) < 300), num_groups=4)
    # top_k 3 with top_p 0.85 on the candidates: the renormalised top 3 are .51 .31 .19, so
    # the first two (.82) fall short and all 3 stay
    _grouped_check(draw(SamplingParams(top_k=3, top_p=0.85), logits, num_draws=2000),
                   _keep(np.exp(logits), np.arange(400) < 3), num_groups=400)
    # ... while top_p 0.8 keeps 2
    _grouped_check(draw(SamplingParams(top_k=3, top_p=0.8), logits, num_draws=2000),
                   _keep(np.exp(logits), np.arange(400) < 2), num_groups=400)


def test_draws_stay_inside_filter_logits_support(draw_impl="xla"):
    rng = np.random.default_rng(8)
    num_rows, vocab, seeds = 48, 700, 40
    x = rng.normal(size=(num_rows, vocab)).astype(np.float32) * rng.uniform(0.1, 4, size=(num_rows, 1))
    x[:4, :200] = x[:4].max(axis=1, keepdims=True)  # 200-way ties at the top
    top_k = rng.choice([0, 0, 1, 5, 50, 127, 128, 129, 500], size=num_rows)
    top_p = rng.choice([1.0, 0.95, 0.5, 0.05], size=num_rows)
    min_p = rng.choice([0.0, 0.0, 0.02, 0.4], size=num_rows)
    temperature = rng.choice([0.3, 1.0, 1.7], size=num_rows)
    params = [SamplingParams(temperature=float(t), top_k=int(k), top_p=float(p), min_p=float(m))
              for t, k, p, m in zip(temperature, top_k, top_p, min_p)]
    t = SamplingTensors.build([RowInfo(p, [0], [], 0) for p in params], vocab)
    kept = np.isfinite(np.asarray(jax.jit(filter_logits)(jnp.asarray(x / temperature[:, None]), t)))
    rows = [RowInfo(params[r], [0], [], seed) for seed in range(seeds) for r in range(num_rows)]
    out = sample(jnp.asarray(np.tile(x, (seeds, 1))), SamplingTensors.build(rows, vocab), draw_impl=draw_impl)
    tokens = np.asarray(out.token_ids).reshape(seeds, num_rows)
    assert kept[np.arange(num_rows)[None, :], tokens].all()


@pytest.mark.parametrize("vocab", [37, 256, 1000])
def test_argmax_rows_is_numpys_first_argmax(vocab):
    from paxpage.sampling.draw import argmax_rows

    rng = np.random.default_rng(vocab)
    x = rng.integers(-3, 4, size=(7, vocab)).astype(np.float32)  # many ties at the maximum
    x[1] = -np.inf  # no finite logit: index 0, as np.argmax
    x[2, -1] = 10.0  # the maximum in the last (padded) block
    x[3, :] = 0.0
    x[3, 300 % vocab] = 1.0
    np.testing.assert_array_equal(np.asarray(argmax_rows(jnp.asarray(x))), np.argmax(x, axis=-1))
