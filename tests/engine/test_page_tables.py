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
