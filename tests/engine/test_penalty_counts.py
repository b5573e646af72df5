"""RunningCounts (penalty_counts.py) against collections.Counter over the current tokens, while
an output list grows, has its last token replaced, is cut back or swapped for another list."""

from collections import Counter

import numpy as np
import pytest

from paxpage.sampling.penalty_counts import CountSlab, RunningCounts, distinct_counts


def _reference(prompt, out) -> dict[int, int]:
    counts = Counter(out)
    return {t: counts.get(t, 0) for t in set(prompt) | set(out)}


def _as_dict(ids, counts) -> dict[int, int]:
    assert len(set(ids.tolist())) == len(ids), "ids must be distinct"
    return dict(zip(ids.tolist(), counts.tolist()))


def test_distinct_counts_by_hand():
    ids, counts = distinct_counts([5, 3, 5], [3, 9, 9, 3, 9])
    assert ids.tolist() == [3, 5, 9] and counts.tolist() == [2, 0, 3]


@pytest.mark.parametrize("seed", range(4))
def test_running_counts_follow_every_change(seed):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 30, int(rng.integers(0, 12))).tolist()
    out: list[int] = []
    running = RunningCounts(prompt, out)
    for _ in range(300):
        kind = rng.random()
        if kind < 0.6:
            out.extend(rng.integers(0, 40, int(rng.integers(1, 4))).tolist())
        elif kind < 0.7 and out:
            out[-1] = int(rng.integers(0, 40))  # a placeholder replaced by the sampled token
        elif kind < 0.8 and out:
            del out[int(rng.integers(0, len(out))):]  # cut back (a stop inside a multi-token step)
        elif kind < 0.85:
            out = out[:-1] + [int(rng.integers(0, 40))]  # a new list (a beam taking another history)
        elif kind < 0.9:
            prompt = [] if prompt else rng.integers(0, 30, 5).tolist()  # repetition penalty off / on
        want = _reference(prompt, out)
        assert _as_dict(*running.counts_of(prompt, out)) == want
        assert _as_dict(*distinct_counts(prompt, out)) == want



def test_running_counts_leave_out_a_trailing_placeholder():
    # Async scheduling: the output list ends in a placeholder (-1) for the token in flight; the
    # counts cover the outputs before it, and the placeholder's token once it is replaced.
    prompt, out = [4, 5], [5]
    running = RunningCounts(prompt, out)
    rng = np.random.default_rng(7)
    for _ in range(40):
        out.append(-1)
        assert _as_dict(*running.counts_of(prompt, out, len(out) - 1)) == _reference(prompt, out[:-1])
        out[-1] = int(rng.integers(0, 8))
    assert _as_dict(*running.counts_of(prompt, out, len(out))) == _reference(prompt, out)
    fresh = RunningCounts(prompt, out + [-1], len(out))
    assert _as_dict(*fresh.counts_of(prompt, fresh.out, len(out))) == _reference(prompt, out)


@pytest.mark.parametrize("seed", range(3))
def test_slab_add_counts_every_row_at_once(seed):
    # Many rows gain tokens in one call, some several (a row listed k times), some none, and
    # the slab widens on the way: each row equals Counter over everything it was given.
    rng = np.random.default_rng(seed)
    slab, given = CountSlab(capacity=4, width=2), {}
    for _ in range(30):
        rows = rng.integers(0, 9, int(rng.integers(0, 25)))
        tokens = rng.integers(0, 60, len(rows))
        slab.ensure(9, 1)
        slab.add(rows.astype(np.int64), tokens.astype(np.int32))
        for r, t in zip(rows.tolist(), tokens.tolist()):
            given.setdefault(r, []).append(t)
        for r in range(9):
            n = int(slab.n[r])
            assert _as_dict(slab.ids[r, :n], slab.counts[r, :n]) == dict(Counter(given.get(r, [])))
            assert (slab.ids[r, n:] == -1).all() and (slab.counts[r, n:] == 0).all()


def test_slab_add_finds_entries_written_before_its_first_add():
    # A recount writes whole rows before any add; the first add must find their ids (count them
    # in place) rather than append them again, also once the slab has grown past its rows.
    slab = CountSlab(capacity=2, width=2)
    slab.write(0, *distinct_counts([7, 3], [3]))  # ids 3, 7: counts 1, 0
    slab.write(1, *distinct_counts([], [5, 5]))  # id 5: count 2
    slab.add([0, 1, 0], [7, 5, 9])
    slab.ensure(5, 1)
    slab.add([4, 0], [7, 3])
    assert _as_dict(slab.ids[0, :slab.n[0]], slab.counts[0, :slab.n[0]]) == {3: 2, 7: 1, 9: 1}
    assert _as_dict(slab.ids[1, :slab.n[1]], slab.counts[1, :slab.n[1]]) == {5: 3}
    assert _as_dict(slab.ids[4, :slab.n[4]], slab.counts[4, :slab.n[4]]) == {7: 1}
    slab.clear(0)
    slab.add([0], [3])
    assert slab.n[0] == 1 and slab.ids[0, 0] == 3 and slab.counts[0, 0] == 1


def test_repetition_penalised_greedy_generation_matches_hf(tiny_llama_dir):
    """The engine's running counts over a whole generation: greedy with a repetition penalty
    (prompt and outputs penalised, HF's definition) equals HF transformers' generate."""
    import torch
    from transformers import AutoModelForCausalLM

    import paxpage
    from paxpage.sampling.params import SamplingParams
    from tests.conftest import random_prompts

    model = paxpage.load(tiny_llama_dir)
    prompts = random_prompts(3, 64, [5, 12, 3], seed=4)  # a small id range: repeats are likely
    params = SamplingParams(temperature=0.0, repetition_penalty=1.8, max_tokens=20, ignore_eos=True)
    config = paxpage.EngineConfig()  # async scheduling: each step's last token reaches the counts on device
    outs = paxpage.generate(model, prompts, sampling_params=params, engine_config=config, use_tqdm=False)
    assert model.engine(config).stats.overlapped_steps >= 15
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                               repetition_penalty=1.8, pad_token_id=0,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert out.outputs[0].token_ids == want[0, len(prompt):].tolist()


@pytest.mark.parametrize("seed", range(3))
def test_slab_gather_follows_every_write_and_keeps_what_it_returned(seed):
    # A step gathers its rows, mostly the same rows as last step after a few adds (the kept
    # pairs are brought up to date), sometimes other rows or another width, while rows are
    # rewritten and cleared (a recount, a released slot). Every gather equals Counter over what
    # each row was given, and the last two gathers' arrays stay as they were returned (the steps
    # that may still be reading them).
    rng = np.random.default_rng(seed)
    slab, given = CountSlab(capacity=4, width=2), {}
    rows = rng.permutation(12)[:6].astype(np.int64)
    recent = []
    for step in range(60):
        kind = rng.random()
        if kind < 0.1:
            rows = rng.permutation(12)[:int(rng.integers(1, 8))].astype(np.int64)
            rows[rng.random(len(rows)) < 0.2] = -1  # padding rows
        elif kind < 0.2:
            r = int(rng.integers(0, 12))
            slab.clear(r)
            given.pop(r, None)
        elif kind < 0.3:
            r = int(rng.integers(0, 12))
            tokens = rng.integers(0, 40, int(rng.integers(1, 30))).tolist()
            slab.clear(r)
            slab.write(r, *distinct_counts([], tokens))
            given[r] = tokens
        add_rows = rng.integers(0, 12, int(rng.integers(0, 10))).astype(np.int64)
        tokens = rng.integers(0, 40, len(add_rows)).astype(np.int32)
        slab.ensure(12, 1)
        slab.add(add_rows, tokens)
        for r, t in zip(add_rows.tolist(), tokens.tolist()):
            given.setdefault(r, []).append(t)
        width = max(16, int(slab.n.max()))
        width = width if rng.random() < 0.9 else width + 8
        ids, counts = slab.gather(rows, width)
        for j, r in enumerate(rows.tolist()):
            if r < 0:
                assert (ids[j] == -1).all() and (counts[j] == 0).all()
                continue
            n = len(set(given.get(r, [])))
            assert _as_dict(ids[j, :n], counts[j, :n]) == dict(Counter(given.get(r, []))), (step, r)
            assert (ids[j, n:] == -1).all() and (counts[j, n:] == 0).all()
        for old, (old_ids, old_counts) in recent[-2:]:
            np.testing.assert_array_equal(old_ids, old[0])
            np.testing.assert_array_equal(old_counts, old[1])
        recent.append(((ids.copy(), counts.copy()), (ids, counts)))
