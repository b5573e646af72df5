"""Page tables of the running sequences, kept between steps (vLLM v1's BlockTable idea).

One int32[capacity, pages_per_seq] array holds a row per running sequence. A step only
copies the entries that can have changed since the last one: a write that starts at
position `start` appends pages after index start // page_size and, by copy-on-write, may
replace the shared page at that index, but never touches earlier (full, immutable) pages. So
a decode step copies O(1) entries per sequence instead of its whole table, and the batch's
tables are one fancy-indexing gather. Pure numpy, no jax.

Entries a sliding window released (page_manager.RELEASED, -1) are written as page 0: kernels
never read a page wholly outside the window, but a block gather may touch its id, which must
then still lie inside the pool.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np


class PageTables:
    def __init__(self, pages_per_seq: int, page_size: int, capacity: int = 64):
        self.page_size = page_size
        self.table = np.zeros((capacity, pages_per_seq), np.int32)  # i32[slots, pages_per_seq]
        self._rows: dict[Hashable, list] = {}  # key -> [slot, version, synced length]
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def sync(self, key: Hashable, version: int, page_table: Sequence[int], start: int) -> int:
        """Brings `key`'s row up to date for a write from position `start`; returns its slot.
        `version` must change whenever the table may have changed before `start` (a preemption
        rebuilds it from scratch)."""
        n = len(page_table)
        row = self._rows.get(key)
        if row is None or row[1] != version:
            if row is None:
                row = self._rows[key] = [self._take(), version, 0]
            slot, old = row[0], row[2]
            self.table[slot, :n] = page_table
            np.maximum(self.table[slot, :n], 0, out=self.table[slot, :n])
            if old > n:
                self.table[slot, n:old] = 0
            row[1], row[2] = version, n
            return slot
        slot = row[0]
        lo = min(start // self.page_size, row[2], n)
        if n > lo:
            self.table[slot, lo:n] = page_table[lo:]
            np.maximum(self.table[slot, lo:n], 0, out=self.table[slot, lo:n])
        row[2] = max(row[2], n)
        return slot

    def sync_many(self, keys: Sequence[Hashable], versions: Sequence[int],
                  page_tables: Sequence[Sequence[int]], starts: Sequence[int]) -> list[int]:
        """`sync` for many rows (keys distinct); returns their slots. The common case, a known
        row whose write starts in its table's last entry with every earlier entry synced (a
        decode step), costs a few Python operations; its one entry is written with those of the
        other such rows in one numpy assignment. Other rows go through `sync`."""
        page_size, known = self.page_size, self._rows
        slots, fast_slots, fast_index, fast_pages = [], [], [], []
        for key, version, pages, start in zip(keys, versions, page_tables, starts):
            row = known.get(key)
            n = len(pages)
            last = n - 1
            if row is not None and row[1] == version and start // page_size == last and row[2] >= last:
                fast_slots.append(row[0])
                fast_index.append(last)
                fast_pages.append(pages[last])
                if row[2] < n:
                    row[2] = n
                slots.append(row[0])
            else:
                slots.append(self.sync(key, version, pages, start))
        if fast_slots:
            self.table[fast_slots, fast_index] = np.maximum(fast_pages, 0)
        return slots

    def slot(self, key: Hashable) -> int | None:
        """The row of `key` (None: it has none)."""
        row = self._rows.get(key)
        return None if row is None else row[0]

    def release(self, keys) -> None:
        for key in keys:
            row = self._rows.pop(key, None)
            if row is not None:
                self.table[row[0], :row[2]] = 0
                self._free.append(row[0])

    def retain(self, live_keys) -> None:
        """Releases every row whose key is not in `live_keys`."""
        self.release([k for k in self._rows if k not in live_keys])

    def _take(self) -> int:
        if not self._free:
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()
