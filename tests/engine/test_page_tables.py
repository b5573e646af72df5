"""Persistent page tables and token views: exact states after each kind of change."""

from __future__ import annotations

import numpy as np

from paxpage.page_tables import PageTables
from paxpage.sequence import Sequence


def test_rows_follow_appends_copy_on_write_and_rebuilds():
    t = PageTables(pages_per_seq=6, page_size=4, capacity=2)
    a = t.sync("a", 0, [7, 3], start=0)
    assert t.table[a].tolist() == [7, 3, 0, 0, 0, 0]
    # decode at position 9 (page 2): a new page appended
    assert t.sync("a", 0, [7, 3, 5], start=9) == a
    assert t.table[a].tolist() == [7, 3, 5, 0, 0, 0]
    # copy-on-write replaced page 2 (the page being written) before the write at position 10
    t.sync("a", 0, [7, 3, 8], start=10)
    assert t.table[a].tolist() == [7, 3, 8, 0, 0, 0]
    # entries before start // page_size are never re-read: a stale change there stays unseen...
    t.sync("a", 0, [1, 3, 8], start=10)
    assert t.table[a, 0] == 7
    # ...unless the version changes (a preemption rebuilt the table): then the row is copied whole
    t.sync("a", 1, [2], start=0)
    assert t.table[a].tolist() == [2, 0, 0, 0, 0, 0]


def test_slots_are_reused_and_the_table_grows():
    t = PageTables(pages_per_seq=3, page_size=4, capacity=2)
    slots = [t.sync(k, 0, [k, k + 1], start=0) for k in range(5)]
    assert len(set(slots)) == 5 and t.table.shape == (8, 3)
    for k, s in enumerate(slots):
        assert t.table[s].tolist() == [k, k + 1, 0]
    t.retain({1, 3})
    assert t.num_rows == 2
    assert t.table[slots[0]].tolist() == [0, 0, 0]  # released rows are cleared
    again = t.sync(9, 0, [4], start=0)
    assert again in {slots[0], slots[2], slots[4]}
    np.testing.assert_array_equal(t.table[slots[3]], [3, 4, 0])


def test_token_view_matches_the_concatenated_list():
    seq = Sequence([5, 6, 7], max_tokens=8)
    for tok in (8, 9):
        seq.append_token(tok)
    whole = seq.token_ids
    view = seq.tokens
    assert len(view) == 5
    assert [view[i] for i in range(5)] == whole and view[-1] == 9
    for lo in range(6):
        for hi in range(lo, 6):
            assert view[lo:hi] == whole[lo:hi]


def test_sync_many_rows_equal_a_rebuild_after_random_steps():
    """Decode steps (batched fast path), prefill chunks, copy-on-write, preemptions (new
    version), released window entries (-1 -> 0), joins and leaves: every synced row equals its
    page table rebuilt from scratch."""
    rng = np.random.default_rng(0)
    page_size, pages_per_seq = 4, 12
    t = PageTables(pages_per_seq, page_size, capacity=2)
    seqs: dict[int, dict] = {}  # key -> {"pages", "computed", "version"}
    next_page, next_key = 100, 0
    for _ in range(60):
        if rng.random() < 0.3 or not seqs:
            seqs[next_key] = {"pages": [], "computed": 0, "version": 0}
            next_key += 1
        keys, versions, tables, starts = [], [], [], []
        for key, s in list(seqs.items()):
            if rng.random() < 0.1:  # leaves
                del seqs[key]
                t.release([key])
                continue
            if rng.random() < 0.1:  # preempted and resumed: rebuilt from scratch
                s.update(pages=[], computed=0, version=s["version"] + 1)
            num_new = 1 if s["computed"] and rng.random() < 0.7 else int(rng.integers(1, 9))
            end = min(s["computed"] + num_new, pages_per_seq * page_size)
            if end <= s["computed"]:
                continue
            first = s["computed"] // page_size
            if first < len(s["pages"]) and rng.random() < 0.2:  # copy-on-write of the written page
                s["pages"][first] = next_page
                next_page += 1
            while len(s["pages"]) * page_size < end:
                s["pages"].append(next_page)
                next_page += 1
            if first >= 2 and rng.random() < 0.2:  # a sliding window released an early page
                s["pages"][0] = -1
            keys.append(key)
            versions.append(s["version"])
            tables.append(list(s["pages"]))
            starts.append(s["computed"])
            s["computed"] = end
        slots = t.sync_many(keys, versions, tables, starts)
        assert len(set(slots)) == len(slots)
        for slot, pages, start in zip(slots, tables, starts):
            want = np.zeros(pages_per_seq, np.int32)
            want[:len(pages)] = np.maximum(pages, 0)
            # an entry released after its sync stays stale by design (no kernel reads it)
            kept = np.ones(pages_per_seq, bool)
            kept[:len(pages)] = np.array(pages) >= 0
            np.testing.assert_array_equal(t.table[slot][kept], want[kept])
