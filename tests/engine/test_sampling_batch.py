"""SamplingBatch (persistent per-sequence sampling slots) against SamplingTensors.build, the
from-scratch packing of the same rows, after random joins and leaves; row_keys and row_key
against splitmix64 on Python ints."""

import numpy as np
import pytest

from paxpage.sampling.batch import SamplingBatch
from paxpage.sampling.params import SamplingParams
from paxpage.sampling.tensors import RowInfo, SamplingTensors, row_key, row_keys

VOCAB = 50
EOS = (3, 7)
FIELDS = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "keys", "token_ids", "token_counts", "banned_ids"]


def _splitmix64(x: int) -> int:  # the reference: splitmix64's finaliser on Python ints
    mask = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def _reference_row_key(seed: int, step: int) -> np.ndarray:
    x = _splitmix64(_splitmix64(seed & ((1 << 64) - 1)) ^ step)
    return np.array([x >> 32, x & 0xFFFFFFFF], dtype=np.uint32)


def test_row_keys_equal_row_key():
    rng = np.random.default_rng(0)
    seeds = [0, 1, 2**32 - 1, 2**63 + 5, 2**64 - 1, 2**70 + 3] + rng.integers(0, 2**62, 20).tolist()
    steps = rng.integers(0, 5000, len(seeds)).tolist()
    got = row_keys(np.array([s & (2**64 - 1) for s in seeds], np.uint64), np.array(steps))
    want = np.stack([_reference_row_key(s, t) for s, t in zip(seeds, steps)])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.stack([row_key(s, t) for s, t in zip(seeds, steps)]), want)


def _by_id(tensors, name: str) -> np.ndarray:
    """token_ids or token_counts with each row's entries in ascending id order."""
    order = np.argsort(np.asarray(tensors.token_ids), axis=1, kind="stable")
    return np.take_along_axis(np.asarray(getattr(tensors, name)), order, axis=1)


def _params(rng) -> SamplingParams:
    kind = rng.integers(0, 5)
    if kind == 0:
        return SamplingParams(temperature=0.0)
    if kind == 1:
        return SamplingParams(temperature=0.7, top_p=0.9, top_k=int(rng.integers(-1, 80)), min_p=0.05)
    if kind == 2:
        return SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5,
                              frequency_penalty=0.25)
    if kind == 3:
        return SamplingParams(temperature=0.5, min_tokens=3, stop_token_ids=[11, 12])
    return SamplingParams(temperature=0.9, min_tokens=2, ignore_eos=True, presence_penalty=1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tensors_equal_build_after_joins_and_leaves(seed):
    rng = np.random.default_rng(seed)
    batch = SamplingBatch(VOCAB, EOS, token_width=64, capacity=2)  # grows while the test runs
    live: dict[int, tuple] = {}  # seq id -> (params, seed, prompt, outputs)
    next_id = 0
    for _ in range(12):
        for _ in range(int(rng.integers(0, 4))):  # joins
            live[next_id] = (_params(rng), int(rng.integers(0, 2**40)),
                             rng.integers(0, VOCAB, int(rng.integers(1, 8))).tolist(), [])
            next_id += 1
        for key in list(live):  # leaves
            if rng.random() < 0.2:
                del live[key]
        batch.retain(set(live))
        for _, _, _, out in live.values():  # everyone decodes a token
            out.append(int(rng.integers(0, VOCAB)))
        # Rows: a plain row, or n parallel samples (seed + i), or a verify row's drafts.
        infos, slots, offsets, steps, tokens = [], [], [], [], []
        for key, (p, s, prompt, out) in live.items():
            slot = batch.slot(key, p, s)
            kind = rng.integers(0, 3)
            count = 1 if kind == 0 else int(rng.integers(2, 4))
            drafts = rng.integers(0, VOCAB, count - 1).tolist() if kind == 2 else []
            for i in range(count):
                seen = out + drafts[:i] if drafts and i else out  # the same list as last step: counts run on
                infos.append(RowInfo(p, prompt, seen, s if drafts else s + i, len(seen)))
                slots.append(slot)
                offsets.append(0 if drafts else i)
                steps.append(len(seen))
                tokens.append((prompt, seen))
        pad = len(infos) + int(rng.integers(0, 3))
        want = SamplingTensors.build(infos, VOCAB, pad_rows_to=pad, eos_token_ids=EOS, token_width=64)
        got = batch.tensors(np.array(slots, np.int64), np.array(offsets, np.int64), np.array(steps, np.int64),
                            lambda r: tokens[r], pad_rows_to=pad)
        assert (got.greedy_only, got.penalised) == (want.greedy_only, want.penalised)
        for name in FIELDS:
            if name == "keys" and want.greedy_only:
                continue  # no row draws: SamplingBatch may hand back a previous step's keys
            if name in ("token_ids", "token_counts"):  # a row's penalty tokens may come in any order
                np.testing.assert_array_equal(_by_id(got, name), _by_id(want, name), name)
                continue
            np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)
    assert batch.num_slots == len(live)


@pytest.mark.parametrize("seed", [0, 1])
def test_penalised_counts_follow_growth_and_placeholders(seed):
    # Penalised rows whose outputs grow by 0 to 3 tokens a step (a speculative step's accepted
    # tokens), each ending in the async placeholder half the time: the counts run on per slot
    # and the tensors equal build's over the outputs without the placeholder.
    rng = np.random.default_rng(seed)
    pending = -1
    batch = SamplingBatch(VOCAB, EOS, token_width=64, capacity=2, pending_token=pending)
    params = SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.25)
    live = {key: (rng.integers(0, VOCAB, int(rng.integers(1, 8))).tolist(), []) for key in range(12)}
    for _ in range(10):
        infos, slots, steps = [], [], []
        for key, (prompt, out) in live.items():
            if out and out[-1] == pending:
                out[-1] = int(rng.integers(0, VOCAB))
            out.extend(rng.integers(0, VOCAB, int(rng.integers(0, 4))).tolist())
            known = list(out)
            if rng.random() < 0.5:
                out.append(pending)
            slots.append(batch.slot(key, params, key))
            steps.append(len(out))
            infos.append(RowInfo(params, prompt, known, key, len(out)))
        want = SamplingTensors.build(infos, VOCAB, pad_rows_to=len(infos), eos_token_ids=EOS, token_width=64)
        rows = list(live.values())
        got = batch.tensors(np.array(slots, np.int64), np.zeros(len(slots), np.int64), np.array(steps, np.int64),
                            lambda r: rows[r])
        for name in ("token_ids", "token_counts"):
            np.testing.assert_array_equal(_by_id(got, name), _by_id(want, name), name)


def test_repeated_slots_reuse_device_tensors():
    batch = SamplingBatch(VOCAB, EOS, token_width=64)
    greedy = [batch.slot(k, SamplingParams(temperature=0.0), k) for k in range(3)]
    slots, zeros = np.array(greedy, np.int64), np.zeros(3, np.int64)
    first = batch.tensors(slots, zeros, np.array([1, 2, 3]), None, pad_rows_to=4)
    again = batch.tensors(slots, zeros, np.array([2, 3, 4]), None, pad_rows_to=4)
    assert first.greedy_only and again is first  # nothing a greedy row reads has changed
    sampled = batch.slot(9, SamplingParams(temperature=0.8, seed=5), 5)
    slots = np.array(greedy + [sampled], np.int64)
    a = batch.tensors(slots, np.zeros(4, np.int64), np.array([1, 2, 3, 4]), None)
    b = batch.tensors(slots, np.zeros(4, np.int64), np.array([2, 3, 4, 5]), None)
    want = SamplingTensors.build([RowInfo(SamplingParams(temperature=0.8, seed=5), [], [0] * 5, 5)], VOCAB)
    assert not b.greedy_only and b.temperature is a.temperature  # reused, with fresh keys
    np.testing.assert_array_equal(np.asarray(b.keys)[3], np.asarray(want.keys)[0])


def test_greedy_batches_share_tensors_per_padded_row_count_while_they_equal_builds():
    """Rows leaving or joining a batch of plain greedy rows (every field neutral): the same tensors
    serve any such rows padded to as many rows, equal to build's, whatever batches came between.
    A greedy row with a filter set, or one still below min_tokens, gets tensors of its own
    (build's again)."""
    batch = SamplingBatch(VOCAB, EOS, token_width=64)
    plain = SamplingParams(temperature=0.0)
    others = {10: SamplingParams(temperature=0.0, top_p=0.5), 11: SamplingParams(temperature=0.0, min_tokens=9)}
    params = {k: plain for k in range(6)} | others
    slot_of = {k: batch.slot(k, p, k) for k, p in params.items()}

    def tensors(keys, step=4, pad=8):
        got = batch.tensors(np.array([slot_of[k] for k in keys], np.int64), np.zeros(len(keys), np.int64),
                            np.full(len(keys), step, np.int64), None, pad_rows_to=pad)
        want = SamplingTensors.build([RowInfo(params[k], [], [0] * step, k) for k in keys], VOCAB, pad_rows_to=pad,
                                     eos_token_ids=EOS, token_width=64)
        assert (got.greedy_only, got.penalised) == (want.greedy_only, want.penalised)
        for name in FIELDS:
            if name != "keys":  # (no row draws)
                np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)
        return got

    first = tensors(range(6))
    assert tensors([0, 2, 3, 5]) is first and tensors([2, 5]) is first
    assert tensors([2, 5, 10]) is not first  # top_p set: its row's values differ from the neutral ones
    below = tensors([2, 11])
    assert below is not first and (np.asarray(below.banned_ids)[1] >= 0).any()
    assert tensors([1, 4]) is first  # plain rows again, after the others
    wider = tensors(range(6), pad=16)
    assert wider is not first and tensors([0, 3], pad=16) is wider and tensors(range(5)) is first
    assert tensors([0, 11], step=9) is first  # row 11 past its min_tokens: plain now


def test_reused_rows_get_each_steps_keys_across_windows():
    """The steady decode step asks for the same rows one token later, step after step (keys are
    made KEYS_AHEAD steps at a time); steps that jump or go back, and rows still below min_tokens,
    must get what build gives too."""
    batch = SamplingBatch(VOCAB, EOS, token_width=64)
    params = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, min_tokens=20, max_tokens=200), SamplingParams(temperature=0.5, seed=9)]
    seeds = [11, 12, 2**63 + 7, 9]
    slots = np.array([batch.slot(k, p, s) for k, (p, s) in enumerate(zip(params, seeds))], np.int64)
    base = np.array([3, 0, 5, 40], np.int64)
    for offset in list(range(0, 45)) + [7, 100, 99, 101]:
        steps = base + offset
        got = batch.tensors(slots, np.zeros(4, np.int64), steps, None, pad_rows_to=8)
        want = SamplingTensors.build([RowInfo(p, [], [0] * int(t), s) for p, s, t in zip(params, seeds, steps)],
                                     VOCAB, pad_rows_to=8, eos_token_ids=EOS, token_width=64)
        for name in ("keys", "temperature", "top_p", "banned_ids"):
            np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                                          f"{name} at offset {offset}")


def test_steady_penalised_rows_reuse_their_arrays_with_this_steps_counts():
    """The steady decode step with penalised rows: the same rows one token later, step after
    step (each output ending in the async placeholder), some below min_tokens at first. The
    fields and keys are reused and only the counts laid out again; every step equals build's
    over the outputs without the placeholder."""
    rng = np.random.default_rng(3)
    pending = -1
    batch = SamplingBatch(VOCAB, EOS, token_width=64, pending_token=pending)
    params = [SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.25),
              SamplingParams(temperature=0.0, presence_penalty=0.5),
              SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=0.7, repetition_penalty=1.1, min_tokens=4, max_tokens=100)]
    prompts = [rng.integers(0, VOCAB, 6).tolist() for _ in params]
    outs = [[] for _ in params]
    slots = np.array([batch.slot(k, p, 100 + k) for k, p in enumerate(params)], np.int64)
    previous, reused = None, 0
    for _ in range(40):
        for out in outs:  # the placeholder of the step read, replaced; this step's, pending
            if out:
                out[-1] = int(rng.integers(0, VOCAB))
            out.append(pending)
        steps = np.array([len(out) for out in outs], np.int64)
        got = batch.tensors(slots, np.zeros(len(params), np.int64), steps, lambda r: (prompts[r], outs[r]),
                            pad_rows_to=6)
        # counts: the outputs before the placeholder; the rest (min_tokens' banned ids): as many
        # outputs as the row has, the placeholder one of them
        counted, full = (SamplingTensors.build(
            [RowInfo(p, prompt, seen, 100 + k, len(out))
             for k, (p, prompt, out, seen) in enumerate(zip(params, prompts, outs, seens))],
            VOCAB, pad_rows_to=6, eos_token_ids=EOS, token_width=64)
            for seens in ([out[:-1] for out in outs], [out[:-1] + [0] for out in outs]))
        for name in FIELDS:
            if name in ("token_ids", "token_counts"):
                np.testing.assert_array_equal(_by_id(got, name), _by_id(counted, name), name)
            else:
                np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(full, name)), name)
        reused += previous is not None and got.temperature is previous.temperature
        previous = got
    assert reused >= 30  # past min_tokens every step reuses the fields
