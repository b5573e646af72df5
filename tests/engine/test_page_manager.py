"""PageManager: exact free-list order, reference counts, fork + copy-on-write, prefix cache, LRU eviction."""

import pytest

from paxpage.page_manager import PageManager
from paxpage.sequence import Sequence


def computed_seq(pm: PageManager, tokens: list[int], num_computed: int | None = None) -> Sequence:
    """A sequence admitted without prefix hits whose first `num_computed` tokens (default all) are in the cache."""
    seq = Sequence(tokens, max_tokens=8)
    n = len(tokens) if num_computed is None else num_computed
    pm.acquire_prefix(seq, [])
    assert pm.prepare_write(seq, n) == []
    seq.num_computed_tokens = n
    pm.cache_full_pages(seq)
    return seq


def test_free_list_lowest_id_first():
    pm = PageManager(num_pages=8, page_size=4)
    assert pm.allocate(3) == [0, 1, 2]
    pm.free([1])
    assert pm.free_pages() == [1, 3, 4, 5, 6, 7]
    assert pm.allocate(2) == [1, 3]
    pm.free([2, 0])
    assert pm.allocate(1) == [0]
    assert (pm.num_free_pages, pm.num_used_pages) == (5, 3)
    assert pm.usage() == 3 / 8


def test_allocate_too_many_names_numbers():
    pm = PageManager(num_pages=4, page_size=2)
    pm.allocate(3)
    assert not pm.can_allocate(2)
    with pytest.raises(ValueError, match="cannot allocate 2 pages; 1 free of 4"):
        pm.allocate(2)
    assert pm.num_free_pages == 1  # nothing taken


def test_refcounts_incref_and_free():
    pm = PageManager(num_pages=4, page_size=2)
    a, b = pm.allocate(2)
    pm.incref([a, a, b])
    assert [pm.refcount(p) for p in range(4)] == [3, 2, 0, 0]
    pm.free([a, b])
    assert [pm.refcount(p) for p in range(4)] == [2, 1, 0, 0]
    pm.free([b])
    assert pm.free_pages() == [1, 2, 3]
    with pytest.raises(ValueError, match="page 1 has refcount 0; double free"):
        pm.free([b])
    with pytest.raises(ValueError, match="page 2 is free"):
        pm.incref([2])


def test_constructor_validates():
    with pytest.raises(ValueError, match="num_pages is 0"):
        PageManager(0, 4)
    with pytest.raises(ValueError, match="page_size is 0"):
        PageManager(4, 0)


def test_prepare_write_extends_table_only_as_needed():
    pm = PageManager(num_pages=8, page_size=4)
    seq = Sequence(list(range(6)), max_tokens=8)
    pm.acquire_prefix(seq, [])
    assert pm.num_pages_to_write(seq, 5) == 2
    assert pm.prepare_write(seq, 5) == []  # chunk of 5 tokens: 2 pages
    assert seq.page_table == [0, 1]
    seq.num_computed_tokens = 5
    assert pm.num_pages_to_write(seq, 1) == 0
    pm.prepare_write(seq, 1)
    assert seq.page_table == [0, 1]
    seq.num_computed_tokens = 6
    seq.append_token(9)
    seq.append_token(9)
    seq.append_token(9)  # 9 tokens: position 8 starts page 2
    seq.num_computed_tokens = 8
    assert pm.num_pages_to_write(seq, 1) == 1
    pm.prepare_write(seq, 1)
    assert seq.page_table == [0, 1, 2]
    # contiguous-style reservation: 16 tokens reserved -> 4 pages, then no growth
    other = Sequence([1, 2, 3], max_tokens=8)
    pm.acquire_prefix(other, [])
    pm.prepare_write(other, 3, reserve_tokens=16)
    assert other.page_table == [3, 4, 5, 6]


def test_fork_then_copy_on_write_of_shared_partial_page():
    pm = PageManager(num_pages=8, page_size=4)
    parent = computed_seq(pm, [1, 2, 3, 4, 5, 6])  # pages [0 full, 1 holds 2 tokens]
    parent.append_token(7)
    child = parent.clone()
    child.output_token_ids[-1] = 8  # diverging sampled token
    pm.fork(parent, child)
    assert child.page_table == [0, 1] and child.num_computed_tokens == 6
    assert [pm.refcount(p) for p in (0, 1)] == [2, 2]
    pm.check_invariants([parent, child])

    # the parent writes position 6 into shared page 1: gets page 2, a copy keeps tokens 4..5
    assert pm.num_pages_to_write(parent, 1) == 1
    assert pm.prepare_write(parent, 1) == [(1, 2)]
    assert parent.page_table == [0, 2]
    assert [pm.refcount(p) for p in (0, 1, 2)] == [2, 1, 1]
    # the child now owns page 1 alone: writes in place, no copy
    assert pm.num_pages_to_write(child, 1) == 0
    assert pm.prepare_write(child, 1) == []
    assert child.page_table == [0, 1]
    pm.check_invariants([parent, child])
    pm.release(parent)
    pm.release(child)
    assert pm.num_free_pages == 8
    pm.check_invariants([])


def test_three_way_fork_copies_twice_and_last_writer_keeps_page():
    pm = PageManager(num_pages=8, page_size=4)
    parent = computed_seq(pm, [1, 2, 3, 4, 5])
    parent.append_token(0)
    kids = [parent.clone(), parent.clone()]
    for kid in kids:
        pm.fork(parent, kid)
    assert pm.refcount(1) == 3
    assert pm.prepare_write(kids[0], 1) == [(1, 2)]
    assert pm.prepare_write(parent, 1) == [(1, 3)]
    assert pm.prepare_write(kids[1], 1) == []
    assert [s.page_table for s in (parent, kids[0], kids[1])] == [[0, 3], [0, 2], [0, 1]]
    assert [pm.refcount(p) for p in range(4)] == [3, 1, 1, 1]
    pm.check_invariants([parent, *kids])


def test_fork_at_page_boundary_needs_no_copy():
    pm = PageManager(num_pages=8, page_size=4)
    parent = computed_seq(pm, [1, 2, 3, 4])  # exactly one full page
    parent.append_token(5)
    child = parent.clone()
    pm.fork(parent, child)
    assert pm.prepare_write(parent, 1) == []
    assert pm.prepare_write(child, 1) == []
    assert (parent.page_table, child.page_table) == ([0, 1], [0, 2])
    assert pm.refcount(0) == 2


def test_shared_page_past_computed_tokens_is_replaced_without_copy():
    # a forked child sharing reserved-but-unwritten pages (contiguous mode) gets fresh pages, no copy
    pm = PageManager(num_pages=8, page_size=2)
    parent = Sequence([1, 2, 3], max_tokens=4)
    pm.acquire_prefix(parent, [])
    pm.prepare_write(parent, 3, reserve_tokens=8)
    parent.num_computed_tokens = 3
    parent.append_token(4)
    child = parent.clone()
    pm.fork(parent, child)
    child.append_token(5)  # child writes positions 3, 4: page 1 (copy) and page 2 (fresh)
    assert pm.num_pages_to_write(child, 2) == 2
    assert pm.prepare_write(child, 2) == [(1, 4)]
    assert child.page_table == [0, 4, 5, 3]


def test_prefix_cache_hits_chain_and_cap():
    pm = PageManager(num_pages=8, page_size=4, enable_prefix_caching=True)
    a = computed_seq(pm, list(range(10)))  # pages 0, 1 full -> cached; page 2 partial
    assert [pm.is_cached(p) for p in range(3)] == [True, True, False]
    assert pm.num_cached_pages == 2

    assert pm.match_prefix(Sequence(list(range(8)) + [99], 1)) == [0, 1]
    assert pm.match_prefix(Sequence(list(range(9)), 1)) == [0, 1]
    # exactly two pages of tokens: capped at (8 - 1) // 4 = 1 page so one token is left to compute
    assert pm.match_prefix(Sequence(list(range(8)), 1)) == [0]
    assert pm.match_prefix(Sequence(list(range(4)), 1)) == []
    assert pm.match_prefix(Sequence([0, 1, 2, 99, 4, 5, 6, 7, 8], 1)) == []
    # same second page, different first page: the chained key misses
    assert pm.match_prefix(Sequence([9, 9, 9, 9, 4, 5, 6, 7, 8], 1)) == []

    b = Sequence(list(range(8)) + [50, 51], max_tokens=4)
    hits = pm.match_prefix(b)
    assert pm.num_revived(hits) == 0  # still held by a
    pm.acquire_prefix(b, hits)
    assert (b.page_table, b.num_computed_tokens, b.num_cached_tokens) == ([0, 1], 8, 8)
    assert [pm.refcount(p) for p in (0, 1)] == [2, 2]
    assert (pm.prefix_queries_tokens, pm.prefix_hit_tokens) == (20, 8)  # a: 10 looked up, 0 hit
    assert pm.hit_rate == pytest.approx(0.4)
    pm.prepare_write(b, 2)
    assert b.page_table == [0, 1, 3]
    pm.check_invariants([a, b])


def test_prefix_cache_lru_eviction_order_and_revival():
    pm = PageManager(num_pages=6, page_size=2, enable_prefix_caching=True)
    a = computed_seq(pm, [1, 2, 3, 4, 5])  # pages 0, 1 cached, 2 partial
    b = computed_seq(pm, [7, 7, 7])  # page 3 cached, 4 partial
    pm.release(a)  # freed last page first: 2 -> free, then 1, 0 -> evictable
    pm.release(b)
    assert pm.free_pages() == [2, 4, 5]
    assert pm.evictable_pages() == [1, 0, 3]
    assert pm.num_free_pages == 6 and pm.num_used_pages == 0
    pm.check_invariants([])

    # revive a's head page: leaves the evictable set
    c = Sequence([1, 2, 9, 9], max_tokens=2)
    hits = pm.match_prefix(c)
    assert hits == [0] and pm.num_revived(hits) == 1
    pm.acquire_prefix(c, hits)
    assert pm.evictable_pages() == [1, 3]
    assert pm.refcount(0) == 1

    # free pages go first, then evict LRU: page 1 (a's tail) before page 3
    assert pm.allocate(3) == [2, 4, 5]
    assert pm.allocate(1) == [1]
    assert not pm.is_cached(1) and pm.evictable_pages() == [3]
    assert pm.match_prefix(Sequence([1, 2, 3, 4, 5], 1)) == [0]  # head survives its evicted tail
    assert pm.match_prefix(Sequence([7, 7, 7], 1)) == [3]


def test_duplicate_content_stays_private():
    pm = PageManager(num_pages=4, page_size=2, enable_prefix_caching=True)
    a = computed_seq(pm, [1, 2, 3])
    b = computed_seq(pm, [1, 2, 4])  # computed the same first page independently (no hit at admission)
    assert (a.page_table[0], b.page_table[0]) == (0, 2)
    assert pm.is_cached(0) and not pm.is_cached(2)
    pm.release(b)
    assert pm.free_pages() == [2, 3] and pm.evictable_pages() == []


def test_hash_collision_is_a_miss():
    pm = PageManager(num_pages=4, page_size=2, enable_prefix_caching=True)
    a = computed_seq(pm, [1, 2, 3])
    other = Sequence([5, 6, 7], max_tokens=1)
    other.page_keys = list(a.page_keys[:1])  # force the same key for different tokens
    assert pm.match_prefix(other) == []


def test_prefix_caching_disabled_never_hits():
    pm = PageManager(num_pages=4, page_size=2)
    a = computed_seq(pm, [1, 2, 3])
    assert pm.num_cached_pages == 0
    assert pm.match_prefix(Sequence([1, 2, 3], 1)) == []
    pm.release(a)
    assert pm.free_pages() == [0, 1, 2, 3]


def test_check_invariants_catches_corruption():
    pm = PageManager(num_pages=4, page_size=2)
    seq = computed_seq(pm, [1, 2, 3])
    pm.check_invariants([seq])
    with pytest.raises(AssertionError, match="page 0: refcount 1 but 0 tables hold it"):
        pm.check_invariants([])
    pm.incref([1])
    with pytest.raises(AssertionError, match="page 1: refcount 2 but 1 tables hold it"):
        pm.check_invariants([seq])


def test_release_outside_window_frees_leading_pages_and_keeps_indices():
    """W = 5, page_size 4: the token at position p sees keys p - 4..p, so after 13 computed tokens
    (next position 13 sees 9..13) pages 0 and 1 (keys 0..7) are never read again; page 2 (8..11) is."""
    from paxpage.page_manager import RELEASED

    pm = PageManager(num_pages=8, page_size=4)
    seq = computed_seq(pm, list(range(14)), num_computed=13)
    assert seq.page_table == [0, 1, 2, 3]
    assert pm.release_outside_window(seq, 5) == [0, 1]
    assert seq.page_table == [RELEASED, RELEASED, 2, 3] and seq.num_released_pages == 2
    assert pm.free_pages() == [0, 1, 4, 5, 6, 7]
    assert pm.release_outside_window(seq, 5) == []  # idempotent
    seq.num_computed_tokens = 14  # next position 14 sees 10..14: page 2 still needed
    assert pm.release_outside_window(seq, 5) == []
    pm.check_invariants([seq])
    pm.release(seq)  # frees the rest, skipping released entries
    assert pm.num_free_pages == 8 and seq.num_released_pages == 0
    pm.check_invariants([seq])


def test_released_cached_pages_stay_hittable_until_evicted():
    """A released page of the prefix cache becomes evictable (K/V intact): a later sequence with the
    same prefix still gets it; forks share the released entries without references."""
    from paxpage.page_manager import RELEASED

    pm = PageManager(num_pages=6, page_size=2, enable_prefix_caching=True)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    a = computed_seq(pm, tokens, num_computed=6)
    assert pm.release_outside_window(a, 2) == [0, 1]  # next position 6 sees 5..6: pages 0, 1 unused
    assert pm.evictable_pages() == [0, 1] and pm.refcount(0) == 0
    child = Sequence(tokens, max_tokens=8)
    pm.fork(a, child)
    assert child.page_table == [RELEASED, RELEASED, 2] and pm.refcount(2) == 2
    pm.check_invariants([a, child])
    b = Sequence(tokens[:5], max_tokens=8)
    assert pm.match_prefix(b) == [0, 1]
    pm.acquire_prefix(b, [0, 1])
    assert pm.refcount(0) == 1 and pm.evictable_pages() == []
    pm.check_invariants([a, child, b])
