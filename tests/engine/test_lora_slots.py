"""The LoRA slot table (pure Python) and prefix caching keyed by adapter: exact states."""

from __future__ import annotations

import pytest

from paxpage.lora_slots import LoraSlots
from paxpage.page_manager import PageManager
from paxpage.sequence import Sequence


def test_slots_load_once_and_swap_least_recently_used_unheld():
    loads = []
    slots = LoraSlots(2, lambda slot, adapter: loads.append((slot, adapter)))
    assert slots.acquire("a") == 0 and slots.acquire("b") == 1
    assert slots.acquire("a") == 0  # resident: no load
    assert loads == [(0, "a"), (1, "b")]
    assert slots.acquire("c") is None  # both held
    slots.release(1)  # b unheld
    slots.release(0)
    slots.release(0)  # a unheld after b: b is the least recently used
    assert slots.acquire("c") == 1
    assert loads[-1] == (1, "c") and slots.slot_of("b") is None and slots.slot_of("a") == 0
    slots.retain(1)
    assert slots.refcount(1) == 2
    assert slots.acquire("b") == 0  # a, unheld, makes room
    assert slots.residents() == ["b", "c"] and slots.num_loads == 4


def test_slots_need_one():
    with pytest.raises(ValueError, match="num_slots"):
        LoraSlots(0, lambda *a: None)


def _computed(tokens, lora):
    seq = Sequence(tokens, 4)
    seq.lora = lora
    return seq


def test_prefix_cache_never_shares_pages_across_adapters():
    pm = PageManager(16, 4, enable_prefix_caching=True)
    tokens = list(range(13))
    first = _computed(tokens, "a")
    pm.acquire_prefix(first, pm.match_prefix(first))
    first.page_table = pm.allocate(4)
    first.num_computed_tokens = 13
    pm.cache_full_pages(first)
    assert pm.num_cached_pages == 3
    same = _computed(tokens, "a")
    assert pm.match_prefix(same) == first.page_table[:3]
    assert pm.match_prefix(_computed(tokens, "b")) == []
    assert pm.match_prefix(_computed(tokens, None)) == []
    base = _computed(tokens, None)
    base.page_table = pm.allocate(4)
    base.num_computed_tokens = 13
    pm.cache_full_pages(base)  # the base model's pages are cached apart
    assert pm.num_cached_pages == 6
    assert pm.match_prefix(_computed(tokens, None)) == base.page_table[:3]
