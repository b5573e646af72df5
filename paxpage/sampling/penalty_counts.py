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
sampling slot): a step adds every row's new tokens with one `CountSlab.add` (a token's entry found
through its row's id -> column dict, not by a search of the row) and lays its rows' lists out with
`CountSlab.gather`, which brings the arrays it laid out for the same rows before up to date with
the entries written since. A step's host work on penalties is then O(rows + new tokens), not
O(rows x context).
"""

from __future__ import annotations

import dataclasses
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
    step's padded token_ids / token_counts). Widens (doubling) as a row outgrows it.

    `add` finds a token's entry through a [C, V] map from (row, id) to its column, built on the
    first `add` (a slab that is only written and gathered never holds one), so a step's tokens are
    placed with a few numpy operations, not a search of each row or a Python loop over them. The
    map costs 4 bytes per row and vocabulary entry (~50 MB for a slab of 256 rows and a
    49,152-token vocabulary), held from the first penalised step while the slab lives.
    `gather` keeps the arrays it returned and, asked for the same rows again, brings a kept pair
    up to date with the entries written since instead of copying every row (a decode step asks
    for its rows of last step with one token more each)."""

    def __init__(self, capacity: int = 64, width: int = 16):
        self.ids = np.full((capacity, width), -1, np.int32)
        self.counts = np.zeros((capacity, width), np.int32)
        self.n = np.zeros(capacity, np.int64)  # [C] entries in use per row
        self._where: np.ndarray | None = None  # i32[C, V] row, id -> its column (-1: none), see add
        self._version = 0  # bumped by every write
        self._changes: list[tuple[int, np.ndarray, np.ndarray | None]] = []  # see _changed
        self._laid: list[_LaidOut | None] = [None] * _LAID_OUT  # gather's kept pairs, used in turn
        self._turn = 0

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
        if self._where is not None and shape[0] > capacity:
            self._where = _grown(self._where, shape[0], self._where.shape[1])

    def _map(self, num_ids: int) -> np.ndarray:
        """The (row, id) -> column map, covering ids below num_ids (built from the rows on first use)."""
        where = self._where
        if where is None:
            num_ids = max(num_ids, int(self.ids.max(initial=-1)) + 1)
            where = self._where = np.full((self.ids.shape[0], num_ids), -1, np.int32)
            r, c = np.nonzero(self.ids >= 0)
            where[r, self.ids[r, c]] = c
        elif num_ids > where.shape[1]:
            where = self._where = _grown(where, where.shape[0], max(num_ids, 2 * where.shape[1]))
        return where

    def write(self, row: int, ids: np.ndarray, counts: np.ndarray) -> None:
        """Row `row` holds ids / counts, distinct ids (its entries past them must be -1 / 0 already)."""
        n = len(ids)
        self.ensure(row + 1, n)
        self.ids[row, :n], self.counts[row, :n] = ids, counts
        self.n[row] = n
        if self._where is not None:
            self._map(int(np.max(ids, initial=-1)) + 1)[row, ids] = np.arange(n, dtype=np.int32)
        self._changed(np.array([row], np.int64))

    def clear(self, row: int) -> None:
        if row < self.ids.shape[0]:
            n = int(self.n[row])
            if self._where is not None:
                self._where[row, self.ids[row, :n]] = -1
            self.ids[row, :n], self.counts[row, :n], self.n[row] = -1, 0, 0
            self._changed(np.array([row], np.int64))

    def add(self, rows: Sequence[int] | np.ndarray, tokens: Sequence[int] | np.ndarray) -> None:
        """Counts tokens[j] once more in row rows[j] (appended after the row's ids where new),
        for every j in order."""
        if len(rows) == 0:
            return
        rows, tokens = np.asarray(rows, np.int64), np.asarray(tokens, np.int64)
        where = self._map(int(tokens.max()) + 1)
        if len(np.unique(rows)) == len(rows):  # one token per row (a decode step)
            columns = where[rows, tokens].astype(np.int64)
            new = columns < 0
            columns[new] = self.n[rows[new]]
            where[rows[new], tokens[new]] = columns[new]
            self.n[rows[new]] += 1
            unique = True
        else:  # a row taking several tokens, in order (a new one may repeat)
            columns = np.empty(len(rows), np.int64)
            n = self.n
            for j, (r, t) in enumerate(zip(rows.tolist(), tokens.tolist())):
                k = int(where[r, t])
                if k < 0:
                    k = where[r, t] = n[r]
                    n[r] += 1
                columns[j] = k
            unique = False
        self.ensure(1, int(columns.max()) + 1)
        at = (rows, columns)
        self.ids[at] = tokens
        if unique:
            self.counts[at] += 1
        else:
            np.add.at(self.counts, at, 1)
        self._changed(*at)

    def _changed(self, rows: np.ndarray, cols: np.ndarray | None = None) -> None:
        """Notes entries written: (rows[j], cols[j]) each, or whole rows when cols is None, for
        `gather` to bring its kept pairs up to date. Only changes a kept pair has not seen are
        kept."""
        self._version += 1
        if len(self._changes) >= _MAX_CHANGES:  # the kept pairs are too far behind: gather afresh
            self._laid = [None] * _LAID_OUT
        if self._forget_seen_changes() < self._version:
            self._changes.append((self._version, rows, cols))

    def _forget_seen_changes(self) -> int:
        """Drops the changes every kept pair has seen; returns the oldest pair's version (the
        slab's own when none is kept)."""
        oldest = min((laid.version for laid in self._laid if laid is not None), default=self._version)
        self._changes = [c for c in self._changes if c[0] > oldest]
        return oldest

    def gather(self, rows: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, counts) int32[len(rows), width] of slab rows `rows` (-1: an empty row; no row
        twice), each row's first `width` entries (at least its ids). The arrays stay as returned
        for the next _LAID_OUT - 1 calls, then may be written over: a step's sampler has read
        them by then (it is at most one step behind the host)."""
        self.ensure(1, width)
        key = (rows.tobytes(), width)
        self._turn = turn = (self._turn + 1) % _LAID_OUT
        laid = self._laid[turn]
        if laid is not None and laid.key == key:
            self._bring_up_to_date(laid, rows, width)
        else:
            taken = np.flatnonzero(rows >= 0)
            ids = np.full((len(rows), width), -1, np.int32)
            counts = np.zeros((len(rows), width), np.int32)
            ids[taken], counts[taken] = self.ids[rows[taken], :width], self.counts[rows[taken], :width]
            laid = self._laid[turn] = _LaidOut(key, ids, counts, self._version)
        laid.version = self._version
        self._forget_seen_changes()
        return laid.ids, laid.counts

    def _bring_up_to_date(self, laid: _LaidOut, rows: np.ndarray, width: int) -> None:
        changes = [c for c in self._changes if c[0] > laid.version]
        if not changes:
            return
        position = np.full(self.ids.shape[0], -1, np.int64)  # slab row -> row of the pair
        taken = np.flatnonzero(rows >= 0)
        position[rows[taken]] = taken
        cells = [(r, c) for _, r, c in changes if c is not None]
        if cells:
            r = np.concatenate([r for r, _ in cells])
            c = np.concatenate([c for _, c in cells])
            at = position[r]
            keep = (at >= 0) & (c < width)
            r, c, at = r[keep], c[keep], at[keep]
            laid.ids[at, c], laid.counts[at, c] = self.ids[r, c], self.counts[r, c]
        for r in {int(r) for _, rs, c in changes if c is None for r in rs}:
            if position[r] >= 0:
                laid.ids[position[r]], laid.counts[position[r]] = self.ids[r, :width], self.counts[r, :width]


def _grown(where: np.ndarray, rows: int, num_ids: int) -> np.ndarray:
    out = np.full((rows, num_ids), -1, np.int32)
    out[:where.shape[0], :where.shape[1]] = where
    return out


_LAID_OUT = 3  # pairs gather keeps (the step being built, the one in flight, and one spare)
_MAX_CHANGES = 64  # changes kept for them


@dataclasses.dataclass
class _LaidOut:
    key: tuple[bytes, int]  # (rows.tobytes(), width) of the gather
    ids: np.ndarray
    counts: np.ndarray
    version: int  # the slab's writes it includes


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
            self.slab.add([self.row] * len(new), new)
        return self.n

    def counts_of(self, prompt_ids: Sequence[int], output_ids: list[int], num_known: int | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
        """`update`, then (ids, counts) as views, valid until the next call."""
        n = self.update(prompt_ids, output_ids, num_known)
        return self.slab.ids[self.row, :n], self.slab.counts[self.row, :n]

    def release(self) -> None:
        """Empties the row (its slab's invariant: entries past a row's ids are -1 / 0)."""
        self.slab.clear(self.row)
