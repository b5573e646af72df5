"""Speculative decoding's host side, hand-worked: n-gram lookups, the scheduler's verify rows
and rollback (exact page states, prefix caching of accepted tokens only), config validation."""

import numpy as np
import pytest

from paxpage import EngineConfig
from paxpage.scheduler import Scheduler, SchedulerConfig
from paxpage.sequence import Sequence
from paxpage.speculative.ngram import NgramProposer, lookup
from paxpage.speculative.proposer import SpecInput


def test_ngram_lookup_hand_computed():
    t = np.array([5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7])
    # suffix (5, 6, 7) last occurred at 5..7: its continuation is 1, 2, 5
    assert lookup(t, 1, 3, 3).tolist() == [1, 2, 5]
    assert lookup(t, 1, 3, 10).tolist() == [1, 2, 5, 6, 7]  # up to the end of the sequence
    # only n = 1 allowed: the last earlier 7 (position 7) is followed by 1, 2
    assert lookup(t, 1, 1, 2).tolist() == [1, 2]
    # n from 4: (7, 5, 6, 7)? no; (5, 6, 7) yes -> the longest n that recurs wins
    assert lookup(t, 3, 4, 2).tolist() == [1, 2]
    assert lookup(np.array([1, 2, 3, 4]), 1, 3, 4).tolist() == []  # nothing recurs
    assert lookup(np.array([4, 4]), 1, 3, 4).tolist() == [4]
    assert lookup(np.array([4]), 1, 3, 4).tolist() == []


def test_ngram_proposer_caps_each_row():
    p = NgramProposer(4, 1, 2)
    inputs = [SpecInput(0, [1, 2, 3, 1, 2, 3, 1, 2], 8, 2, True),
              SpecInput(1, [9, 8, 7], 3, 4, True),
              SpecInput(2, [1, 2, 3, 4, 5, 1, 2], 7, 4, False)]
    out = p.propose(inputs)
    assert out.num_drafts.tolist() == [2, 0, 4] and out.draft_dists is None
    assert out.drafts(0) == [3, 1] and out.drafts(2) == [3, 4, 5, 1]


def make(**overrides) -> Scheduler:
    cfg = dict(num_pages=8, page_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32,
               enable_prefix_caching=True)
    cfg.update(overrides)
    return Scheduler(SchedulerConfig(**cfg))


def _prefilled(sched: Scheduler, prompt_len: int = 6) -> Sequence:
    seq = Sequence(list(range(prompt_len)), 20, seq_id=0)
    sched.add(seq)
    out = sched.schedule()
    sched.update(out, {0: 50})
    return seq


def test_verify_row_and_rollback_of_rejected_drafts():
    sched = make()
    seq = _prefilled(sched)  # 6 prompt tokens + 50: pages [0, 1], computed 6
    assert seq.page_table == [0, 1]
    out = sched.schedule({0: (51, 52, 53, 54)})
    (item,) = out.scheduled
    assert (item.num_new_tokens, item.start, item.samples, item.draft_token_ids) == (5, 6, True, (51, 52, 53, 54))
    assert seq.page_table == [0, 1, 2]  # positions 6..10
    sched.update(out, {0: [51, 77]})  # one draft accepted, then the target's correction 77
    assert seq.output_token_ids == [50, 51, 77]
    assert seq.num_computed_tokens == 8  # the last token (50) and the accepted draft (51)
    assert seq.page_table == [0, 1]  # page 2 held only rejected K/V: freed
    pm = sched.page_manager
    assert pm.is_cached(0) and pm.is_cached(1)  # full and computed: 0..3 and 4, 5, 50, 51
    assert pm.free_pages() == [2, 3, 4, 5, 6, 7]
    sched.check_invariants()
    # all rejected: only the last token's K/V counts; the page holding 77's position stays
    out = sched.schedule({0: (60, 61)})
    assert seq.page_table == [0, 1, 2]
    sched.update(out, {0: [78]})
    assert seq.output_token_ids == [50, 51, 77, 78] and seq.num_computed_tokens == 9
    assert seq.page_table == [0, 1, 2] and not pm.is_cached(2)
    sched.check_invariants()
    sched.finish(seq, "stop")
    assert pm.num_free_pages == 8


def test_drafts_cut_to_the_budget_and_dropped_when_pages_run_short():
    sched = make(max_num_batched_tokens=3)
    seq = Sequence(list(range(3)), 20, seq_id=0)
    sched.add(seq)
    sched.update(sched.schedule(), {0: 50})
    out = sched.schedule({0: (1, 2, 3, 4)})
    assert out.scheduled[0].draft_token_ids == (1, 2)  # 1 + 2 tokens fill the budget
    sched.update(out, {0: [1, 2, 9]})
    assert seq.num_computed_tokens == 6 and seq.page_table == [0, 1]
    # a pool with no page to spare: the drafts are dropped, nothing is preempted
    sched = make(num_pages=1)
    seq = Sequence([1, 2], 2, seq_id=0)
    sched.add(seq)
    sched.update(sched.schedule(), {0: 7})
    out = sched.schedule({0: (8, 9)})
    assert (out.scheduled[0].num_new_tokens, out.scheduled[0].draft_token_ids, out.preempted) == (1, (), [])


def test_update_refuses_tokens_that_are_not_an_accepted_prefix():
    sched = make()
    _prefilled(sched)
    out = sched.schedule({0: (51, 52)})
    for bad in ([52, 1], [51, 52, 53, 54], []):
        with pytest.raises(ValueError, match="accepted prefix"):
            sched.update(out, {0: bad})


@pytest.mark.parametrize("bad, match", [
    (dict(speculative_method="eagle"), "speculative_method"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative_method="ngram", num_speculative_tokens=17), "at most 16"),
    (dict(speculative_method="ngram", ngram_min=3, ngram_max=2), "ngram_min"),
    (dict(speculative_method="ngram", speculative_max_batch=-1), "speculative_max_batch"),
    (dict(speculative_method="draft"), "draft_model"),
])
def test_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**bad)
