"""PrefixRouter: hand-worked routing decisions (pure Python)."""

from __future__ import annotations

import pytest

from paxpage.dp_router import PrefixRouter


def test_least_loaded_without_prefix_then_lowest_index():
    r = PrefixRouter(3, page_size=4)
    assert r.route([1, 2, 3], [2, 0, 1]) == 1  # shorter than a page: no key, least loaded
    assert r.route([9, 9, 9], [1, 1, 1]) == 0  # tie: lowest index


def test_longest_cached_prefix_wins_over_load():
    r = PrefixRouter(2, page_size=4)
    system = list(range(100, 108))  # two full pages
    assert r.route(system + [1, 2], [0, 0]) == 0
    assert r.route([7] * 8, [5, 0]) == 1  # unrelated prompt: least loaded
    # shares both pages with what replica 0 got: goes there although it is busier
    assert r.route(system + [3], [9, 0]) == 0
    # shares only the first page of replica 0's prefix, nothing of replica 1's
    assert r.route(system[:4] + [55] * 4, [9, 0]) == 0
    # the first page differs: the chained keys of later pages differ too
    assert r.route([0] + system[1:], [9, 0]) == 1


def test_longer_prefix_beats_shorter():
    r = PrefixRouter(2, page_size=2)
    assert r.route([1, 2], [0, 0]) == 0  # replica 0: page (1, 2)
    assert r.route([1, 2, 3, 4, 5, 6], [0, 1]) == 0  # replica 0 extends to 3 pages
    assert r.route([8, 8], [5, 0]) == 1
    r._seen[1].update({k: None for k in r.page_keys([1, 2, 3, 4])})  # 2 pages on replica 1
    assert r.cached_pages(0, r.page_keys([1, 2, 3, 4, 5, 6])) == 3
    assert r.cached_pages(1, r.page_keys([1, 2, 3, 4, 5, 6])) == 2
    assert r.route([1, 2, 3, 4, 5, 6, 7], [9, 0]) == 0


def test_memory_is_bounded_lru():
    r = PrefixRouter(1, page_size=1, max_pages=3)
    r.route([1, 2, 3], [0])
    assert len(r._seen[0]) == 3
    r.route([5, 6], [0])
    assert len(r._seen[0]) == 3
    assert r.cached_pages(0, r.page_keys([5, 6])) == 2
    assert r.cached_pages(0, r.page_keys([1])) == 0  # the oldest key was dropped


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_replicas 0"):
        PrefixRouter(0, 4)
    with pytest.raises(ValueError, match="got 1 loads for 2 replicas"):
        PrefixRouter(2, 4).route([1], [0])
