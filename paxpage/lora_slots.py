"""Which LoRA adapter sits in which slot of the device slab, swapped least recently used first.
Pure Python (no jax).

The slab has `num_slots` (max_loras) slots. A sequence running an adapter holds a reference
to its slot from its admission until it finishes (a preempted sequence keeps it: it will
resume on the same adapter), and a forked child takes one more. An adapter not resident is
loaded into a free slot, else into the least recently used slot that nobody holds; when every
slot is held the sequence waits (`acquire` returns None) until one is released. `load(slot,
adapter)` writes the adapter's matrices into the slab (the runner's device call).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable


class LoraSlots:
    def __init__(self, num_slots: int, load: Callable[[int, Hashable], None]):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._load = load
        self._adapter: list[Hashable | None] = [None] * num_slots  # slot -> resident adapter
        self._slot_of: dict[Hashable, int] = {}
        self._refs = [0] * num_slots
        self._lru: OrderedDict[int, None] = OrderedDict()  # resident, unreferenced slots; oldest first
        self.num_loads = 0

    def slot_of(self, adapter: Hashable) -> int | None:
        return self._slot_of.get(adapter)

    def refcount(self, slot: int) -> int:
        return self._refs[slot]

    def acquire(self, adapter: Hashable) -> int | None:
        """A reference to `adapter`'s slot, loading it there first if it is not resident; None
        when every slot is held by other adapters."""
        slot = self._slot_of.get(adapter)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            old = self._adapter[slot]
            if old is not None:
                del self._slot_of[old]
            self._load(slot, adapter)
            self.num_loads += 1
            self._adapter[slot] = adapter
            self._slot_of[adapter] = slot
        self.retain(slot)
        return slot

    def retain(self, slot: int) -> None:
        self._refs[slot] += 1
        self._lru.pop(slot, None)

    def release(self, slot: int) -> None:
        assert self._refs[slot] > 0, f"slot {slot} released more often than acquired"
        self._refs[slot] -= 1
        if self._refs[slot] == 0:
            self._lru[slot] = None  # most recently used last

    def forget(self, adapter: Hashable) -> None:
        """Drops a resident adapter nobody holds (it was replaced or removed): its slot is free."""
        slot = self._slot_of.get(adapter)
        if slot is not None and self._refs[slot] == 0:
            del self._slot_of[adapter]
            self._adapter[slot] = None
            self._lru.pop(slot, None)

    def _free_slot(self) -> int | None:
        for slot, adapter in enumerate(self._adapter):
            if adapter is None:
                return slot
        if self._lru:
            slot, _ = self._lru.popitem(last=False)
            return slot
        return None

    def residents(self) -> list[Hashable | None]:
        return list(self._adapter)
