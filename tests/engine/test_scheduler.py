"""Scheduler: hand-worked states of admission, token budget, preemption, fork/CoW, prefix caching."""

import ast
import inspect

import pytest

from paxpage import page_manager, scheduler, scheduler_types, sequence
from paxpage.scheduler import Scheduler, SchedulerConfig
from paxpage.sequence import Sequence, SequenceStatus


def make(**overrides) -> Scheduler:
    cfg = dict(num_pages=16, page_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32)
    cfg.update(overrides)
    return Scheduler(SchedulerConfig(**cfg))


def seq(seq_id: int, prompt_len: int, max_tokens: int, first: int = 0) -> Sequence:
    return Sequence(list(range(first, first + prompt_len)), max_tokens, seq_id=seq_id)


def fake_token(s: Sequence) -> int:
    return 100 * s.seq_id + s.num_tokens  # identifies who sampled it and at which position


def step(sched: Scheduler):
    """schedule + fake device + update; finishes sequences that reached max_tokens, like the engine."""
    out = sched.schedule()
    sched.update(out, {x.seq.seq_id: fake_token(x.seq) for x in out.scheduled if x.samples})
    for x in out.scheduled:
        if x.seq.status is SequenceStatus.RUNNING and x.seq.num_output_tokens == x.seq.max_tokens:
            sched.finish(x.seq, "length")
    sched.check_invariants()
    return out


def rows(out):
    return [(x.seq.seq_id, x.num_new_tokens, x.start, x.samples) for x in out.scheduled]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_pages=0), "num_pages is 0; must be an int >= 1"),
        (dict(page_size=-1), "page_size is -1"),
        (dict(max_num_seqs=2.0), "max_num_seqs is 2.0"),
        (dict(max_num_batched_tokens=True), "max_num_batched_tokens is True"),
        (dict(allocation="slab"), "allocation is 'slab'"),
        (
            dict(enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=32),
            r"max_num_batched_tokens is 16; without chunked prefill it must be >= max_model_len \(32\)",
        ),
        (dict(allocation="contiguous", num_pages=7), r"num_pages is 7; contiguous allocation needs >= 8"),
    ],
)
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        make(**overrides)


def test_config_is_frozen_and_reports_table_width():
    cfg = make(max_model_len=30).config
    assert cfg.max_pages_per_seq == 8
    with pytest.raises(Exception):
        cfg.num_pages = 3


def test_fifo_admission_token_budget_and_chunked_prefill():
    s = make(max_num_batched_tokens=8)
    a, b = seq(1, 10, 3), seq(2, 5, 3)
    s.add(a)
    s.add(b)
    assert (s.num_waiting, s.num_running, a.arrival, b.arrival) == (2, 0, 0, 1)

    out = step(s)
    assert rows(out) == [(1, 8, 0, False)]  # budget spent on a's first chunk; b waits
    assert (out.num_batched_tokens, a.page_table, a.output_token_ids) == (8, [0, 1], [])
    out = step(s)
    assert rows(out) == [(1, 2, 8, True), (2, 5, 0, True)]
    assert (a.page_table, b.page_table) == ([0, 1, 2], [3, 4])
    assert (a.output_token_ids, b.output_token_ids) == ([110], [205])
    out = step(s)
    assert rows(out) == [(1, 1, 10, True), (2, 1, 5, True)]
    assert out.num_batched_tokens == 2
    step(s)
    assert (a.output_token_ids, b.output_token_ids) == ([110, 111, 112], [205, 206, 207])
    assert a.status is b.status is SequenceStatus.FINISHED and a.finish_reason == "length"
    assert not s.has_unfinished()
    assert s.page_manager.free_pages() == list(range(16))


def test_max_num_seqs_limits_admission():
    s = make(max_num_seqs=2)
    for i in (1, 2, 3):
        s.add(seq(i, 2, 2))
    assert rows(step(s)) == [(1, 2, 0, True), (2, 2, 0, True)]
    assert rows(step(s)) == [(1, 1, 2, True), (2, 1, 2, True)]  # both finish at max_tokens 2
    assert rows(step(s)) == [(3, 2, 0, True)]


def test_without_chunked_prefill_whole_prompts_fifo_head_of_line():
    s = make(enable_chunked_prefill=False, max_num_batched_tokens=8, max_model_len=8)
    for i, n in ((1, 6), (2, 3), (3, 1)):
        s.add(seq(i, n, 2))
    assert rows(step(s)) == [(1, 6, 0, True)]  # 3 does not fit the 2 tokens left; 1 token would, but FIFO
    assert rows(step(s)) == [(1, 1, 6, True), (2, 3, 0, True), (3, 1, 0, True)]


def test_preemption_picks_most_recent_and_resumes_exactly():
    s = make(num_pages=4, page_size=2, max_model_len=8)
    a, b = Sequence([1, 2, 3], 4, seq_id=1), Sequence([4, 5, 6], 4, seq_id=2)
    s.add(a)
    s.add(b)
    assert rows(step(s)) == [(1, 3, 0, True), (2, 3, 0, True)]
    assert (a.page_table, b.page_table) == ([0, 1], [2, 3])
    assert rows(step(s)) == [(1, 1, 3, True), (2, 1, 3, True)]  # positions 3 fit the second pages
    assert b.output_token_ids == [203, 204]

    out = step(s)  # a needs a third page, none free: b (admitted last) is preempted
    assert rows(out) == [(1, 1, 4, True)]
    assert out.preempted == [b] and out.copies == []
    assert (b.status, b.page_table, b.num_computed_tokens, b.num_preemptions) == (SequenceStatus.WAITING, [], 0, 1)
    assert b.token_ids == [4, 5, 6, 203, 204]  # tokens kept
    assert a.page_table == [0, 1, 2] and list(s.waiting) == [b]

    assert rows(step(s)) == [(1, 1, 5, True)]  # b needs 3 pages for 5 tokens, 1 free: waits; a finishes
    assert a.output_token_ids == [103, 104, 105, 106] and a.status is SequenceStatus.FINISHED
    out = step(s)
    assert rows(out) == [(2, 5, 0, True)]  # recompute prompt + outputs, then sample the next token
    assert b.page_table == [0, 1, 2] and b.output_token_ids == [203, 204, 205]
    step(s)
    assert b.output_token_ids == [203, 204, 205, 206] and b.status is SequenceStatus.FINISHED
    assert s.stats().num_preemptions == s.num_preemptions == 1


def test_last_running_sequence_preempts_itself():
    s = make(num_pages=4, page_size=2, max_model_len=8)
    a, b = Sequence([1, 2, 3], 2, seq_id=1), Sequence([4, 5, 6, 7], 2, seq_id=2)
    s.add(a)
    s.add(b)
    step(s)
    out = step(s)  # a writes position 3 in place; b needs a page for position 4, nobody after it
    assert rows(out) == [(1, 1, 3, True)] and out.preempted == [b]
    assert a.status is SequenceStatus.FINISHED
    assert rows(step(s)) == [(2, 5, 0, True)]


def test_several_preemptions_keep_admission_order_in_waiting():
    s = make(num_pages=3, page_size=2, max_model_len=6, max_num_seqs=3)
    a, b, c = (Sequence([i, i], 4, seq_id=i) for i in (1, 2, 3))
    for x in (a, b, c):
        s.add(x)
    step(s)  # each holds one full page; each now needs a second one
    out = step(s)
    assert rows(out) == [(1, 1, 2, True)]
    assert out.preempted == [c, b]
    assert list(s.waiting) == [b, c]


def test_oversized_requests_raise_with_numbers_others_proceed():
    s = make(num_pages=3, page_size=4, max_model_len=16)
    good = seq(1, 4, 4)
    s.add(good)
    with pytest.raises(ValueError, match=r"prompt has 10 tokens \+ max_tokens 7 = 17; max_model_len is 16"):
        s.add(seq(2, 10, 7))
    with pytest.raises(ValueError, match="14 tokens need 4 pages of 4; the cache has 3 pages"):
        s.add(seq(3, 10, 4))
    with pytest.raises(ValueError, match="seq_id 1 is already scheduled"):
        s.add(seq(1, 2, 2))
    assert s.num_waiting == 1
    assert rows(step(s)) == [(1, 4, 0, True)]


def test_abort_frees_pages_waiting_running_and_mid_step():
    s = make(max_num_seqs=2)
    a, b, c = seq(1, 5, 4), seq(2, 3, 4), seq(3, 3, 4)
    for x in (a, b, c):
        s.add(x)
    step(s)
    assert (a.page_table, b.page_table) == ([0, 1], [2])
    assert s.abort(1) is a
    assert (a.status, a.finish_reason, a.page_table) == (SequenceStatus.FINISHED, "abort", [])
    assert s.page_manager.free_pages() == list(range(0, 2)) + list(range(3, 16))
    assert s.abort(3) is c and s.num_waiting == 0
    assert s.abort(1) is None and s.abort(999) is None
    s.check_invariants()

    d = seq(4, 3, 4)
    s.add(d)
    out = s.schedule()
    assert rows(out) == [(2, 1, 3, True), (4, 3, 0, True)]
    s.abort(4)  # between schedule and update: skipped by update, its token ignored
    s.update(out, {2: 7, 4: 8})
    assert b.output_token_ids == [203, 7] and d.output_token_ids == []
    s.check_invariants()


def test_finish_and_abort_group():
    s = make()
    a = seq(1, 3, 4)
    s.add(a)
    s.finish(a, "stop")  # a waiting sequence may be finished too
    with pytest.raises(ValueError, match="sequence 1 is not waiting or running"):
        s.finish(a, "stop")
    p = seq(2, 3, 4)
    s.add(p)
    step(s)
    kid = p.clone(seq_id=3)
    s.fork(p, kid)
    assert s.abort_group(2) == [p, kid]
    assert not s.has_unfinished() and s.page_manager.num_free_pages == 16


def test_contiguous_reserves_max_model_len_pages():
    s = make(num_pages=8, page_size=4, max_model_len=16, allocation="contiguous", max_num_batched_tokens=32)
    a, b, c = seq(1, 3, 2), seq(2, 5, 2), seq(3, 1, 2)
    for x in (a, b, c):
        s.add(x)
    step(s)
    assert (a.page_table, b.page_table, c.page_table) == ([0, 1, 2, 3], [4, 5, 6, 7], [])
    st = s.stats()
    assert (st.num_used_pages, st.kv_utilization) == (8, 8 / 32)
    step(s)  # a and b finish; tables never grew
    assert rows(step(s)) == [(3, 1, 0, True)] and c.page_table == [0, 1, 2, 3]

    paged = make(num_pages=8, page_size=4, max_model_len=16, max_num_batched_tokens=32)
    for x in (seq(1, 3, 2), seq(2, 5, 2), seq(3, 1, 2)):
        paged.add(x)
    step(paged)
    st = paged.stats()
    assert (st.num_used_pages, st.kv_utilization) == (4, 9 / 16)


def test_fork_shares_pages_copy_on_write_and_group_order():
    s = make(max_num_seqs=3)
    p, q = Sequence([1, 2, 3, 4, 5, 6], 3, seq_id=1), Sequence([9], 3, seq_id=2)
    s.add(p)
    s.add(q)
    step(s)
    assert (p.page_table, q.page_table, p.output_token_ids) == ([0, 1], [2], [106])
    kids = []
    for kid_id, last in ((11, 7), (12, 8)):
        kid = p.clone(seq_id=kid_id)
        kid.output_token_ids[-1] = last  # the engine's other samples from p's logits
        s.fork(p, kid)
        kids.append(kid)
    assert s.running == [p, *kids, q]
    assert [k.group_id for k in kids] == [1, 1] and kids[0].page_table == [0, 1]
    assert [s.page_manager.refcount(x) for x in (0, 1)] == [3, 3]
    s.check_invariants()

    out = step(s)
    assert rows(out) == [(1, 1, 6, True), (11, 1, 6, True), (12, 1, 6, True)]  # max_num_seqs 3: q waits
    assert out.copies == [(1, 3), (1, 4)]
    assert [x.page_table for x in (p, *kids)] == [[0, 3], [0, 4], [0, 1]]
    assert [x.output_token_ids for x in (p, *kids)] == [[106, 107], [7, 1107], [8, 1207]]
    assert s.page_manager.refcount(0) == 3


def test_fork_of_waiting_parent_and_validation():
    s = make()
    p = seq(1, 3, 2)
    s.add(p)
    kid = p.clone(seq_id=2)
    s.fork(p, kid)
    assert list(s.waiting) == [p, kid] and kid.page_table == []
    assert rows(step(s)) == [(1, 3, 0, True), (2, 3, 0, True)]
    with pytest.raises(ValueError, match="must extend parent 1's 3 computed tokens"):
        s.fork(p, Sequence([0, 1, 9, 9], 2, seq_id=3))
    done = seq(4, 1, 1)
    s.add(done)
    s.finish(done, "stop")
    with pytest.raises(ValueError, match="fork parent 4 is not waiting or running"):
        s.fork(done, done.clone())


def test_prefix_cache_hit_on_admission():
    s = make(enable_prefix_caching=True)
    a = Sequence(list(range(10)), 1, seq_id=1)
    s.add(a)
    step(s)  # a finishes: full pages 0, 1 stay cached and evictable, partial page 2 is freed
    assert s.page_manager.evictable_pages() == [1, 0]
    b = Sequence(list(range(8)) + [77, 78, 79], 2, seq_id=2)
    s.add(b)
    out = step(s)
    assert rows(out) == [(2, 3, 8, True)]
    assert (b.num_cached_tokens, b.page_table) == (8, [0, 1, 2])
    st = s.stats()
    assert st.prefix_hit_rate == pytest.approx(8 / 21)
    assert (st.num_cached_pages, st.num_used_pages, st.num_free_pages) == (2, 3, 13)


def test_preempted_sequence_hits_its_own_cached_pages():
    s = make(num_pages=4, page_size=2, max_model_len=8, enable_prefix_caching=True)
    a, b = Sequence([1, 2, 3], 4, seq_id=1), Sequence([4, 5, 6], 4, seq_id=2)
    s.add(a)
    s.add(b)
    step(s)
    step(s)
    out = step(s)
    assert out.preempted == [b]
    # b freed its tail page 3 first, so a's new page evicted page 3 and b's head page 2 survives
    assert a.page_table == [0, 1, 3] and s.page_manager.evictable_pages() == [2]
    step(s)  # a finishes; b (5 tokens) re-admitted next step with its head page cached
    out = step(s)
    assert rows(out) == [(2, 3, 2, True)] and b.num_cached_tokens == 2 and b.page_table[0] == 2


def test_update_validates_before_changing_anything():
    s = make()
    a, b = seq(1, 2, 1), seq(2, 2, 1)
    s.add(a)
    s.add(b)
    out = s.schedule()
    with pytest.raises(ValueError, match="no sampled token for seq_id 2"):
        s.update(out, {1: 5})
    with pytest.raises(ValueError, match=r"seq_ids \[9\], which did not sample"):
        s.update(out, {1: 5, 2: 6, 9: 0})
    assert a.num_computed_tokens == 0 and a.output_token_ids == []
    s.update(out, {1: 5, 2: 6})
    with pytest.raises(ValueError, match="stale output"):
        s.update(out, {1: 5, 2: 6})
    out = s.schedule()  # the engine forgot to finish them at max_tokens 1
    with pytest.raises(ValueError, match="already has 1 output tokens; max_tokens is 1; finish"):
        s.update(out, {1: 5, 2: 6})


def test_no_progress_is_a_runtime_error():
    s = make()
    s.add(seq(1, 2, 2))
    s.page_manager.can_allocate = lambda n: False  # simulate a broken allocator
    with pytest.raises(RuntimeError, match="scheduler made no progress"):
        s.schedule()
    assert make().schedule().is_empty  # nothing to do is fine


def test_admission_counts_revived_cached_pages_against_free_memory():
    s = make(num_pages=4, page_size=2, max_model_len=8, enable_prefix_caching=True)
    a = Sequence([1, 2, 3, 4, 5], 1, seq_id=1)
    s.add(a)
    step(s)  # a finishes: pages 0, 1 cached and evictable; 2 free
    c = Sequence([7, 7, 7], 2, seq_id=2)
    s.add(c)
    step(s)
    assert c.page_table == [2, 3] and s.page_manager.evictable_pages() == [1, 0]
    d = Sequence([1, 2, 3, 4, 9], 2, seq_id=3)
    s.add(d)
    # d would hit pages 0, 1 but reviving them leaves no page for its fifth token: 2 + 1 > 2 free
    assert rows(step(s)) == [(2, 1, 3, True)]
    assert s.waiting[0] is d and s.page_manager.evictable_pages() == [1, 0, 3, 2]  # c finished and cached
    assert rows(step(s)) == [(3, 1, 4, True)]  # d admitted with 4 cached tokens; its new page evicts 3
    assert (d.num_cached_tokens, d.page_table, s.page_manager.evictable_pages()) == (4, [0, 1, 3], [2])


def test_sequence_basics_and_clone():
    a = Sequence([5, 6, 7], 4, seq_id=40)
    a.append_token(8)
    assert (a.token_ids, a.num_tokens, a.num_prompt_tokens, a.num_output_tokens) == ([5, 6, 7, 8], 4, 3, 1)
    assert (a.group_id, a.status, a.last_token_id, a.page_tokens(1, 2)) == (40, SequenceStatus.WAITING, 8, (7, 8))
    b = a.clone(seq_id=41)
    assert (b.seq_id, b.group_id, b.token_ids, b.max_tokens, b.page_table) == (41, 40, [5, 6, 7, 8], 4, [])
    b.append_token(9)
    assert a.output_token_ids == [8]  # the clone's lists are its own
    with pytest.raises(ValueError, match="prompt has 0 tokens"):
        Sequence([], 1)
    with pytest.raises(ValueError, match="max_tokens is 0"):
        Sequence([1], 0)


def test_host_side_modules_import_no_jax():
    allowed = {"__future__", "collections", "dataclasses", "enum", "heapq", "itertools", "typing"}
    allowed |= {"paxpage.page_manager", "paxpage.sequence", "paxpage.scheduler_types"}
    for module in (sequence, page_manager, scheduler_types, scheduler):
        tree = ast.parse(inspect.getsource(module))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert {n for n in names if n not in allowed and n.split(".")[0] not in allowed} == set(), module


def test_sliding_window_releases_pages_and_long_sequences_fit():
    """W = 4, page_size 2, budget 4 tokens: a sequence holds at most cdiv(4 - 1 + 4, 2) + 1 = 5 pages,
    so a 40-token sequence fits an 8-page pool; the pages it leaves behind are free for others."""
    from paxpage.page_manager import RELEASED

    s = make(num_pages=8, page_size=2, max_num_batched_tokens=4, max_model_len=64, sliding_window=4)
    assert s.config.max_held_pages(40) == 5
    a = seq(1, 10, 30)
    s.add(a)  # 20 pages without the window; 5 with it
    step(s)  # prefill 0..3
    assert a.page_table == [0, 1] and a.num_computed_tokens == 4
    step(s)  # 4..7; next position 8 sees 5..8: page 0 (keys 0, 1) and page 1 (2, 3) released
    assert a.page_table == [RELEASED, RELEASED, 2, 3]
    assert s.page_manager.free_pages() == [0, 1, 4, 5, 6, 7]
    while a.status is SequenceStatus.RUNNING:
        step(s)
        assert len([p for p in a.page_table if p != RELEASED]) <= 5
    assert a.num_output_tokens == 30 and s.page_manager.num_free_pages == 8
    with pytest.raises(ValueError, match="need 5 pages"):
        make(num_pages=4, page_size=2, max_num_batched_tokens=4, max_model_len=64, sliding_window=4).add(seq(2, 10, 30))


def test_sliding_window_preemption_recomputes_from_zero():
    from paxpage.page_manager import RELEASED

    s = make(num_pages=5, page_size=2, max_num_batched_tokens=4, max_model_len=64, sliding_window=3)
    a, b, c = seq(1, 8, 20), seq(2, 8, 20, first=50), seq(3, 5, 20, first=80)
    for x in (a, b, c):
        s.add(x)
    preempted = 0
    step(s)
    step(s)  # a's prompt in two chunks; positions 0..5 lie before the window of position 8
    assert a.page_table[:3] == [RELEASED] * 3
    for _ in range(100):
        if not s.has_unfinished():
            break
        if step(s).preempted:
            preempted = s.num_preemptions
    assert not s.has_unfinished() and preempted > 0
    # Fake tokens encode (seq, position): recomputation changed nothing.
    assert a.output_token_ids == [100 + n for n in range(8, 28)]
    assert b.output_token_ids == [200 + n for n in range(8, 28)]
    assert c.output_token_ids == [300 + n for n in range(5, 25)]


def test_prefill_rows_cap_cuts_chunks_and_stops_admission():
    """max_prefill_rows 2 of 4 tokens: a chunk is cut to the rows left; a 1-token prompt needs no
    prefill row (it is laid out as a decode row), so it is admitted after one that got none."""
    s = make(max_num_batched_tokens=16, num_pages=32, max_prefill_rows=2, prefill_row_len=4)
    for x in (seq(1, 10, 3), seq(2, 3, 3), seq(3, 1, 3), seq(4, 2, 3)):
        s.add(x)
    assert rows(step(s)) == [(1, 8, 0, False)]  # two rows of a's 10 tokens; b gets none and waits
    # a's last 2 tokens take one row, b's 3 the other; c's single token none; d must wait
    assert rows(step(s)) == [(1, 2, 8, True), (2, 3, 0, True), (3, 1, 0, True)]
    assert rows(step(s)) == [(1, 1, 10, True), (2, 1, 3, True), (3, 1, 1, True), (4, 2, 0, True)]


@pytest.mark.parametrize("rows_cap", [0, True, 2.0])
def test_prefill_rows_cap_validation(rows_cap):
    with pytest.raises(ValueError, match=f"max_prefill_rows is {rows_cap!r}"):
        make(max_prefill_rows=rows_cap)
