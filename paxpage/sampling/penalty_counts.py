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
sampling slot): a step adds every row's new tokens with one vectorised `CountSlab.add` (a row's
new tokens are found in its ids by one comparison over the rows, not a lookup per token) and
lays its rows' lists out with one gather rather than a copy per row.
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
    """Running counts of many sequences as rows of two [C, W] arrays: row c's first n[c] entries
    are its ids and counts, the rest -1 / 0 (so a gather of rows and a prefix of columns is a
    step's padded token_ids / token_counts). Widens (doubling) as a row outgrows it."""

    def __init__(self, capacity: int = 64, width: int = 16):
        self.ids = np.full((capacity, width), -1, np.int32)
        self.counts = np.zeros((capacity, width), np.int32)
        self.n = np.zeros(capacity, np.int64)  # [C] entries in use per row

    def ensure(self, rows: int, width: int) -> None:
        """Room for row index rows - 1 and `width` entries a row."""
        capacity, current = self.ids.shape
        if rows <= capacity and width <= current:
            return
        shape = (capacity if rows <= capacity else max(rows, 2 * capacity),
                 current if width <= current else max(width, 2 * current))
        ids, counts, n = np.full(shape, -1, np.int32), np.zeros(shape, np.int32), np.zeros(shape[0], np.int64)
        ids[:capacity, :current], counts[:capacity, :current], n[:capacity] = self.ids, self.counts, self.n
        self.ids, self.counts, self.n = ids, counts, n

    def write(self, row: int, ids: np.ndarray, counts: np.ndarray) -> None:
        """Row `row` holds ids / counts (its entries past them must be -1 / 0 already)."""
        n = len(ids)
        self.ensure(row + 1, n)
        self.ids[row, :n], self.counts[row, :n] = ids, counts
        self.n[row] = n

    def clear(self, row: int) -> None:
        if row < self.ids.shape[0]:
            n = int(self.n[row])
            self.ids[row, :n], self.counts[row, :n], self.n[row] = -1, 0, 0

    def add(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Counts tokens[j] once more in row rows[j] (appended after the row's ids where new),
        for every j in order: all rows at once, a row listed k times in k rounds."""
        if len(rows) == 0:
            return
        order = np.argsort(rows, kind="stable")  # a row's tokens keep their order
        rows, tokens = rows[order], tokens[order]
        starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
        rank = np.arange(len(rows)) - np.repeat(starts, np.diff(np.r_[starts, len(rows)]))
        for k in range(int(rank.max()) + 1):
            at = rank == k
            self._add_once(rows[at], tokens[at])

    def _add_once(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """`add` for distinct rows."""
        n = self.n[rows]
        hit = self.ids[rows, :max(int(n.max()), 1)] == tokens[:, None]  # [M, max n] (-1 past a row's ids)
        found = hit.any(axis=1)
        k = np.where(found, hit.argmax(axis=1), n)
        self.ensure(1, int(k.max()) + 1)
        self.ids[rows, k] = tokens
        self.counts[rows, k] += 1
        self.n[rows] = np.maximum(n, k + 1)

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
    list grows (ids in first-seen order, not ascending), held as row `row` of a CountSlab (its
    own one-row slab by default). `advance` says which tokens a call must add, so a caller with
    many sequences adds all of theirs with one `CountSlab.add`."""

    __slots__ = ("prompt_ids", "out", "seen", "last", "slab", "row")

    def __init__(self, prompt_ids: Sequence[int], output_ids: list[int], num_known: int | None = None,
                 slab: CountSlab | None = None, row: int = 0):
        self.slab, self.row = (slab, row) if slab is not None else (CountSlab(1), 0)
        self._recount(prompt_ids, output_ids, len(output_ids) if num_known is None else num_known)

    @property
    def n(self) -> int:
        """The number of distinct ids."""
        return int(self.slab.n[self.row])

    def _recount(self, prompt_ids: Sequence[int], output_ids: list[int], num_known: int) -> None:
        known = output_ids if num_known == len(output_ids) else output_ids[:num_known]
        self.slab.clear(self.row)
        self.slab.write(self.row, *distinct_counts(prompt_ids, known))
        self.prompt_ids, self.out, self.seen = prompt_ids, output_ids, num_known
        self.last = output_ids[num_known - 1] if num_known else None

    def advance(self, prompt_ids: Sequence[int], output_ids: list[int], num_known: int) -> list[int]:
        """The tokens to add to the row (`CountSlab.add`) to bring it to prompt_ids and
        output_ids[:num_known]: the outputs appended since, or none after a recount, when the
        history is not the one counted. Outputs past num_known (async scheduling's placeholder
        for a token still on the device) are left for a later call."""
        seen = self.seen
        if prompt_ids is not self.prompt_ids or output_ids is not self.out or num_known < seen \
                or (seen and output_ids[seen - 1] != self.last):
            self._recount(prompt_ids, output_ids, num_known)
            return []
        if num_known == seen:
            return []
        self.seen, self.last = num_known, output_ids[num_known - 1]
        return output_ids[seen:num_known]

    def update(self, prompt_ids: Sequence[int], output_ids: list[int], num_known: int | None = None) -> int:
        """Brings the counts to prompt_ids and output_ids[:num_known] (default: all of them) and
        returns the number of distinct ids (see `advance`)."""
        new = self.advance(prompt_ids, output_ids, len(output_ids) if num_known is None else num_known)
        if new:
            self.slab.add(np.full(len(new), self.row, np.int64), np.asarray(new, np.int32))
        return self.n

    def counts_of(self, prompt_ids: Sequence[int], output_ids: list[int], num_known: int | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
        """`update`, then (ids, counts) as views, valid until the next call."""
        n = self.update(prompt_ids, output_ids, num_known)
        return self.slab.ids[self.row, :n], self.slab.counts[self.row, :n]

    def release(self) -> None:
        """Empties the row (its slab's invariant: entries past a row's ids are -1 / 0)."""
        self.slab.clear(self.row)
