"""Running token counts of a penalised sequence, so a step's penalty tensors cost O(new tokens).

Repetition, presence and frequency penalties need, per logits row, the distinct tokens it has
seen (its prompt too for the repetition penalty) and how often each occurs in its output.
Counting them afresh every step (np.unique over prompt + output) costs O(context) per row and
step: ~50 us per row at 1536 tokens, 13 ms a step at 256 rows. A `RunningCounts` keeps them for
one sequence and, each step, adds only the tokens appended since; `SamplingBatch` keeps one per
penalised slot. Pure Python and numpy.

It trusts the output list only while it is the same list object, at least as long as when last
counted, with the same token where counting stopped; anything else (a beam that took a new
history, an output cut back, an async placeholder replaced) recounts from scratch, so the counts
equal `distinct_counts` of the current tokens (up to the order of the ids). That holds as long as
a list is not cut back and regrown to its old length between two calls, which the engine never
does: it appends, replaces the last token, or cuts an output back when its sequence finishes.
A call may count a prefix of the list only (`num_known`): with async scheduling an output's last
entry is a placeholder for a token the device has not returned yet, and the sampler adds that
token to the counts on the device (sampler.apply_penalties' `pending`).

`SamplingBatch` keeps its sequences' counts as rows of one `CountSlab` (row = the sequence's
sampling slot), so a step lays its rows' lists out with one gather rather than a copy per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def distinct_counts(prompt_ids: Sequence[int], output_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, counts): the distinct tokens of prompt_ids + output_ids, ascending, and each one's
    number of occurrences in output_ids. Both integer[U]."""
    out = np.asarray(output_ids, np.int64).reshape(-1)
    prompt = np.asarray(prompt_ids, np.int64).reshape(-1)
    ids, inverse = np.unique(np.concatenate([prompt, out]), return_inverse=True)
    return ids, np.bincount(inverse[len(prompt):], minlength=len(ids))


class CountSlab:
    """Running counts of many sequences as rows of two [C, W] arrays: row c's first n_c entries
    are its ids and counts, the rest -1 / 0 (so a gather of rows and a prefix of columns is a
    step's padded token_ids / token_counts). Widens (doubling) as a row outgrows it."""

    def __init__(self, capacity: int = 64, width: int = 16):
        self.ids = np.full((capacity, width), -1, np.int32)
        self.counts = np.zeros((capacity, width), np.int32)

    def ensure(self, rows: int, width: int) -> None:
        """Room for row index rows - 1 and `width` entries a row."""
        capacity, current = self.ids.shape
        if rows <= capacity and width <= current:
            return
        shape = (capacity if rows <= capacity else max(rows, 2 * capacity),
                 current if width <= current else max(width, 2 * current))
        ids, counts = np.full(shape, -1, np.int32), np.zeros(shape, np.int32)
        ids[:capacity, :current], counts[:capacity, :current] = self.ids, self.counts
        self.ids, self.counts = ids, counts

    def write(self, row: int, ids: np.ndarray, counts: np.ndarray) -> None:
        """Row `row` holds ids / counts (its entries past them must be -1 / 0 already)."""
        n = len(ids)
        self.ensure(row + 1, n)
        self.ids[row, :n], self.counts[row, :n] = ids, counts

    def clear(self, row: int, n: int) -> None:
        if row < self.ids.shape[0]:
            self.ids[row, :n], self.counts[row, :n] = -1, 0

    def gather(self, rows: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, counts) int32[len(rows), width] of slab rows `rows` (-1: an empty row), each
        row's first `width` entries (at least its ids)."""
        self.ensure(1, width)
        taken = np.flatnonzero(rows >= 0)
        if len(taken) == len(rows):
            return self.ids[rows, :width], self.counts[rows, :width]
        ids = np.full((len(rows), width), -1, np.int32)
        counts = np.zeros((len(rows), width), np.int32)
        ids[taken], counts[taken] = self.ids[rows[taken], :width], self.counts[rows[taken], :width]
        return ids, counts


class RunningCounts:
    """`distinct_counts(prompt_ids, output_ids)` of one sequence, kept up to date as its output
    list grows (ids in first-seen order, not ascending), held in its own arrays or as row `row`
    of a CountSlab."""

    __slots__ = ("prompt_ids", "out", "seen", "last", "index", "n", "slab", "row")

    def __init__(self, prompt_ids: Sequence[int], output_ids: list[int], num_known: int | None = None,
                 slab: CountSlab | None = None, row: int = 0):
        self.slab, self.row = (slab, row) if slab is not None else (CountSlab(1), 0)
        self.n = 0
        self._recount(prompt_ids, output_ids, len(output_ids) if num_known is None else num_known)

    def _recount(self, prompt_ids: Sequence[int], output_ids: list[int], num_known: int) -> None:
        known = output_ids if num_known == len(output_ids) else output_ids[:num_known]
        ids, counts = distinct_counts(prompt_ids, known)
        self.slab.clear(self.row, self.n)
        self.slab.write(self.row, ids, counts)
        self.n = n = len(ids)
        self.index: dict[int, int] = dict(zip(ids.tolist(), range(n)))
        self.prompt_ids, self.out, self.seen = prompt_ids, output_ids, num_known
        self.last = output_ids[num_known - 1] if num_known else None

    def update(self, prompt_ids: Sequence[int], output_ids: list[int], num_known: int | None = None) -> int:
        """Brings the counts to prompt_ids and output_ids[:num_known] (default: all of them):
        the running counts plus the outputs appended since, or a recount when the history is not
        the one counted. Outputs past num_known (async scheduling's placeholder for a token still
        on the device) are left for a later call. Returns the number of distinct ids."""
        seen = self.seen
        num_known = len(output_ids) if num_known is None else num_known
        if prompt_ids is not self.prompt_ids or output_ids is not self.out or num_known < seen \
                or (seen and output_ids[seen - 1] != self.last):
            self._recount(prompt_ids, output_ids, num_known)
        elif num_known > seen:
            self._count_new(num_known)
        return self.n

    def counts_of(self, prompt_ids: Sequence[int], output_ids: list[int], num_known: int | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
        """`update`, then (ids, counts) as views, valid until the next call."""
        n = self.update(prompt_ids, output_ids, num_known)
        return self.slab.ids[self.row, :n], self.slab.counts[self.row, :n]

    def release(self) -> None:
        """Empties the row (its slab's invariant: entries past a row's ids are -1 / 0)."""
        self.slab.clear(self.row, self.n)
        self.n = 0

    def _count_new(self, num_known: int) -> None:
        out, index, row = self.out, self.index, self.row
        ids, counts = self.slab.ids, self.slab.counts
        for token in out[self.seen:num_known]:
            k = index.get(token)
            if k is None:
                k = self.n
                if k == ids.shape[1]:
                    self.slab.ensure(row + 1, k + 1)
                    ids, counts = self.slab.ids, self.slab.counts
                ids[row, k] = token
                index[token] = k
                self.n = k + 1
            counts[row, k] += 1
        self.seen = num_known
        self.last = out[num_known - 1] if num_known else None
