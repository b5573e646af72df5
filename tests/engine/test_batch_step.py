"""The scheduler's bulk step for the persistent batch's rows (`Scheduler.schedule` given
`BatchRows`, its pass `_batch_step`): it must schedule and book exactly what the one-by-one
pass does. The reference is schedule() + update() on a copy of the same state: the same rows,
chunks, admissions and copies, and after update the same page tables, free pages and prefix
cache, with and without a sliding window. Pure Python."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from paxpage.scheduler import BatchRows, Scheduler, SchedulerConfig
from paxpage.sequence import Sequence


def _decoding_scheduler(seed: int, num_pages: int, prefix_caching: bool, allocation: str = "paged",
                        max_num_batched_tokens: int = 256, sliding_window: int | None = None):
    """A scheduler whose running sequences all decode (one pending token each), with random
    lengths, after general steps (so some pages are shared through the prefix cache)."""
    rng = np.random.default_rng(seed)
    sched = Scheduler(SchedulerConfig(num_pages=num_pages, page_size=4, max_num_seqs=16,
                                      max_num_batched_tokens=max_num_batched_tokens, max_model_len=64,
                                      enable_prefix_caching=prefix_caching, allocation=allocation,
                                      sliding_window=sliding_window))
    shared = rng.integers(0, 50, 8).tolist()
    for i in range(6):
        prompt = (shared if i % 2 else []) + rng.integers(0, 50, int(rng.integers(1, 12))).tolist()
        sched.add(Sequence(prompt, 30, seq_id=i))
    for _ in range(int(rng.integers(3, 9))):  # general steps until all decode
        out = sched.schedule()
        sched.update(out, {s.seq.seq_id: int(rng.integers(0, 50)) for s in out.scheduled if s.samples})
    assert not sched.waiting and all(s.num_uncomputed_tokens == 1 for s in sched.running)
    return sched, rng


def _state(sched: Scheduler):
    pm = sched.page_manager
    return ([(s.seq_id, list(s.page_table), s.num_computed_tokens, list(s.output_token_ids))
             for s in sched.running], pm.num_free_pages, pm.num_cached_pages, sched.stats())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("window", [None, 6])
def test_batch_step_equals_schedule_and_update(seed, prefix_caching, window):
    # window: every layer sees its last 6 keys, so pages wholly before a row's window are freed
    # as it decodes (the free list's order, and so the pages handed out next, must match too)
    fast, rng = _decoding_scheduler(seed, 64, prefix_caching, sliding_window=window)

    def num_released():
        return sum(page < 0 for s in fast.running for page in s.page_table)

    released = num_released()
    for step in range(12):
        general = copy.deepcopy(fast)
        out = general.schedule()
        seqs = list(fast.running)
        aligned = [i for i, s in enumerate(seqs) if s.num_computed_tokens % 4 == 0]
        step_out = fast._batch_step(BatchRows(seqs, aligned))
        grown, copies, admitted = step_out.grown, step_out.copies, step_out.scheduled
        assert copies == out.copies and admitted == []
        assert [s.seq.seq_id for s in out.scheduled] == [s.seq_id for s in seqs]
        assert all((s.num_new_tokens, s.samples) == (1, True) for s in out.scheduled)
        token = int(rng.integers(0, 50))
        general.update(out, {s.seq.seq_id: token for s in out.scheduled})
        fast.update(step_out, {}, decode_token=token)
        assert _state(fast) == _state(general), step
        assert set(grown) <= set(aligned)
        fast.check_invariants()
    if window is not None:  # rows released pages while they decoded
        assert num_released() > released


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_batch_step_admits_as_schedule_does(seed, prefix_caching):
    # Requests arrive while the running sequences decode, prompts longer than a step's 24
    # tokens run in chunks: the batch's step gives the prompts part way their next chunks and
    # admits what schedule() admits (same chunks, prefix hits, pages, copies), and refuses,
    # changing nothing, when the first waiting one is refused.
    fast, rng = _decoding_scheduler(seed, 64, prefix_caching, max_num_batched_tokens=24)
    shared = list(fast.running[0].prompt_token_ids)
    next_id, num_admitted, num_prefilling = 100, 0, 0

    def finish_done(sched):
        for seq in [s for s in sched.running if s.num_output_tokens >= s.max_tokens]:
            sched.finish(seq, "length")

    for step in range(10):
        finish_done(fast)
        for k in range(int(rng.integers(0, 3)) if step else 2):  # first a prompt longer than a step
            length = 30 if step == k == 0 else int(rng.integers(1, 30))
            prompt = (shared if rng.random() < 0.5 else []) + rng.integers(0, 50, length).tolist()
            fast.add(Sequence(prompt, 8, seq_id=next_id))
            next_id += 1
        # the decoding sequences, then those part way through their prompts (chunked)
        num_decoding = next((i for i, s in enumerate(fast.running) if s.num_uncomputed_tokens > 1),
                            len(fast.running))
        seqs, prefilling = list(fast.running[:num_decoding]), list(fast.running[num_decoding:])
        if any(s.num_uncomputed_tokens == 1 for s in prefilling):
            out = fast.schedule()  # a decoding sequence behind a prompt: the general step's
            fast.update(out, {s.seq.seq_id: 1 for s in out.scheduled if s.samples})
            continue
        num_prefilling += bool(prefilling)
        general = copy.deepcopy(fast)
        out = general.schedule()
        aligned = [i for i, s in enumerate(seqs) if s.num_computed_tokens % 4 == 0]
        if fast.waiting:
            before = _state(fast)
            assert fast._batch_step(BatchRows(seqs, aligned, lambda seq: False, prefilling)) is None
            assert _state(fast) == before
        if prefilling:
            assert fast._batch_step(BatchRows(seqs, aligned, lambda seq: True)) is None  # not the running queue
        scheduled = fast._batch_step(BatchRows(seqs, aligned, lambda seq: True, prefilling))
        if out.preempted:
            assert scheduled is None
            fast = general
            fast.update(out, {s.seq.seq_id: 1 for s in out.scheduled if s.samples})
            continue
        copies, admitted = scheduled.copies, scheduled.scheduled
        assert copies == out.copies
        expect = [(s.seq.seq_id, s.num_new_tokens, s.start, s.samples) for s in out.scheduled]
        assert [(s.seq_id, 1, s.num_computed_tokens, True) for s in seqs] + [
            (s.seq.seq_id, s.num_new_tokens, s.start, s.samples) for s in admitted] == expect
        token = int(rng.integers(0, 50))
        general.update(out, {s.seq.seq_id: token for s in out.scheduled if s.samples})
        fast.update(scheduled, {s.seq.seq_id: token for s in admitted if s.samples}, decode_token=token)
        assert _state(fast) == _state(general), step
        num_admitted += len(admitted)
        fast.check_invariants()
    assert num_admitted >= 2 and num_prefilling >= 1


def test_batch_step_declines_what_schedule_decides_otherwise():
    sched, _ = _decoding_scheduler(0, 64, False)
    pm = sched.page_manager
    for _ in range(8):  # general steps until a sequence's next token needs a new page
        seqs = list(sched.running)
        aligned = [i for i, s in enumerate(seqs) if s.num_computed_tokens % 4 == 0]
        if any(not pm.writes_in_place(seqs[i]) for i in aligned):
            break
        out = sched.schedule()
        sched.update(out, {s.seq.seq_id: 1 for s in out.scheduled})
    else:
        raise AssertionError("no sequence reached a page boundary")
    before = _state(sched)
    assert sched._batch_step(BatchRows(seqs[:-1], aligned)) is None  # not the running queue
    assert sched._batch_step(BatchRows(seqs[::-1], aligned)) is None  # not in its order
    held = pm.allocate(pm.num_free_pages)  # no page left: schedule() would preempt
    assert sched._batch_step(BatchRows(seqs, aligned)) is None
    pm.free(held)
    assert _state(sched)[0] == before[0]
    sched.add(Sequence([1, 2, 3], 4, seq_id=99))
    assert sched._batch_step(BatchRows(seqs, aligned)) is None  # a request waits: schedule() admits
    assert _state(sched)[0] == before[0]
    # schedule() given rows that cannot go on takes every sequence one by one, as without them
    for rows in (BatchRows(seqs[:-1], aligned), BatchRows(seqs, aligned)):
        with_rows, without = copy.deepcopy(sched), copy.deepcopy(sched)
        out, expect = with_rows.schedule(batch=rows), without.schedule()
        assert out.decodes == () and out.copies == expect.copies
        assert [(s.seq.seq_id, s.num_new_tokens, s.start, s.samples) for s in out.scheduled] == \
            [(s.seq.seq_id, s.num_new_tokens, s.start, s.samples) for s in expect.scheduled]
        assert _state(with_rows) == _state(without)


def test_batch_step_declines_when_schedule_would_admit_a_refused_sequence_behind_others():
    # Three requests wait, the second one the batch's step may not admit (a beam request, say):
    # schedule() admits all three, so the batch's step must not admit only the first.
    sched, _ = _decoding_scheduler(1, 64, False)
    seqs = list(sched.running)
    aligned = [i for i, s in enumerate(seqs) if s.num_computed_tokens % 4 == 0]
    for i in range(3):
        sched.add(Sequence([1, 2, 3 + i], 4, seq_id=90 + i))
    general = copy.deepcopy(sched)
    assert len(general.schedule().scheduled) == len(seqs) + 3  # schedule() admits all three
    before = _state(sched)
    assert sched._batch_step(BatchRows(seqs, aligned, lambda seq: seq.seq_id != 91)) is None
    assert _state(sched) == before and len(sched.waiting) == 3
    admitted = sched._batch_step(BatchRows(seqs, aligned, lambda seq: True)).scheduled
    assert [s.seq.seq_id for s in admitted] == [90, 91, 92]
