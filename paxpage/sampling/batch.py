"""Sampling parameters of the running sequences, kept in per-slot arrays between steps.

`SamplingTensors.build` packs every logits row from its SamplingParams each step: a Python loop
over the rows and a splitmix64 key per row. A sequence's parameters and seed never change while
it runs, so this keeps them in one slot per sequence (vLLM v1's InputBatch idea), written once when
the sequence first samples; a step's tensors are then numpy gathers over its rows' slots plus one
vectorised key derivation. Rows that need per-token data (penalties, and banned ids below
min_tokens) go through the same code as `build`'s (`SamplingTensors.from_host`), so the tensors are
equal to `build`'s for the same rows. A step whose rows are the last step's, with no banned ids,
reuses the last step's arrays with only its new keys (the seeds' half of the key hash kept too)
and its penalised rows' counts laid out again. Host-side numpy throughout: the sampler's jitted
call moves the tensors to the device.

Axis legend: R logits rows, C slot capacity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from paxpage.sampling import fields
from paxpage.sampling.params import SamplingParams
from paxpage.sampling.penalty_counts import CountSlab, RunningCounts
from paxpage.sampling.tensors import SamplingTensors, hash_seeds, keys_of_hashed

_MASK64 = (1 << 64) - 1
KEYS_AHEAD = 16  # decode steps whose keys sampled rows get at once


class SamplingBatch:
    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], token_width: int | None = None,
                 capacity: int = 64, pending_token: int | None = None):
        """pending_token: the placeholder async scheduling leaves as an output's last token while
        the device still has the token (launched.PENDING_TOKEN); a penalised row's counts leave it
        out, and the sampler adds the token on the device (sampler.apply_penalties' `pending`)."""
        self.vocab_size = vocab_size
        self.pending_token = pending_token
        self.eos_token_ids = tuple(eos_token_ids)
        self.token_width = token_width
        self._slots: dict[Hashable, int] = {}
        self._params: list[SamplingParams | None] = [None] * capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._alloc(capacity)
        # the tensors last built, when they need no per-step data (see _Reusable)
        self._reusable: _Reusable | None = None
        self._neutral_tensors: dict[int, SamplingTensors] = {}  # padded rows -> all-neutral rows' tensors
        # per penalised slot (penalty_counts.py), its counts row `slot` of one slab
        self._counts: dict[int, RunningCounts] = {}
        self._slab = CountSlab(capacity)

    def _alloc(self, capacity: int) -> None:
        def grow(name, dtype):
            new = np.zeros(capacity, dtype)
            old = getattr(self, name, None)
            if old is not None:
                new[:old.shape[0]] = old
            setattr(self, name, new)

        for name, dtype in (*((f.name, f.dtype) for f in fields.FIELDS), ("seed", np.uint64),
                            ("min_tokens", np.int64), ("neutral", bool)):
            grow(name, dtype)  # each [C]; neutral[c]: every field of slot c's params has its neutral value

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def slot(self, key: Hashable, params: SamplingParams, seed: int) -> int:
        """The slot of `key` (a sequence id), registered with its params and seed on first use.
        A key's params and seed must not change while it holds a slot."""
        slot = self._slots.get(key)
        if slot is None:
            self._reusable = None  # a slot's contents change
            slot = self._slots[key] = self._take()
            self._params[slot] = params
            for f in fields.FIELDS:
                getattr(self, f.name)[slot] = f.value(params, self.vocab_size)
            self.neutral[slot] = all(getattr(self, f.name)[slot] == f.neutral for f in fields.FIELDS)
            self.seed[slot] = seed & _MASK64
            self.min_tokens[slot] = params.min_tokens
        return slot

    def release(self, keys) -> None:
        for key in keys:
            slot = self._slots.pop(key, None)
            if slot is not None:
                self._reusable = None
                self._params[slot] = None
                counts = self._counts.pop(slot, None)
                if counts is not None:
                    counts.release()
                self._free.append(slot)

    def retain(self, live_keys) -> None:
        """Releases every slot whose key is not in `live_keys`."""
        self.release([k for k in self._slots if k not in live_keys])

    def tensors(self, slots: np.ndarray, seed_offsets: np.ndarray, steps: np.ndarray,
                row_tokens: Callable[[int], tuple[Sequence[int], Sequence[int]]],
                pad_rows_to: int | None = None) -> SamplingTensors:
        """SamplingTensors for logits rows r < n: slot slots[r], seed + seed_offsets[r] (a
        request's n parallel samples), token position steps[r] (its output tokens so far, as
        `RowInfo.step` and for min_tokens). `row_tokens(r) -> (prompt_ids, output_ids)` is called
        only for rows with a penalty (output_ids may end in the pending token: see __init__);
        their counts run on per slot (penalty_counts.RunningCounts, row `slot` of one CountSlab),
        so a row whose output list is the one it had last step costs only its new tokens, and the
        step's lists are one gather of the slab's rows. Rows n .. pad_rows_to are padding
        (greedy, no penalties). All index arrays are integer[n]."""
        n = slots.shape[0]
        num_rows = n if pad_rows_to is None else pad_rows_to
        if num_rows < n:
            raise ValueError(f"pad_rows_to={pad_rows_to} is smaller than the {n} rows")

        def rows_of(values: np.ndarray, pad) -> np.ndarray:
            out = np.full(num_rows, pad, values.dtype)
            out[:n] = values[slots]
            return out

        def lists(counted: np.ndarray, with_prompt: np.ndarray):
            counted_slots = slots[counted]
            if len(np.unique(counted_slots)) < len(counted_slots):
                # a slot in several rows (a verify step's draft positions, each its own history):
                # each row counted afresh into a slab of its own
                slab = CountSlab(len(counted))
                for j, (r, prompt) in enumerate(zip(counted.tolist(), with_prompt.tolist())):
                    RunningCounts(*self._known(*row_tokens(r), prompt), slab, j)
                return slab, np.arange(len(counted)), slab.n[:len(counted)].copy()
            self._count_rows(counted.tolist(), counted_slots.tolist(), with_prompt.tolist(), row_tokens)
            return self._slab, counted_slots, self._slab.n[counted_slots]

        # Rows with no banned ids: every tensor but the keys and the penalty lists follows from
        # the slots alone, so the same slots as last time reuse last time's arrays. All-greedy
        # tensors (greedy_only) reuse the keys too: the argmax-only sampler never reads them.
        # Sampled rows get the keys of the next KEYS_AHEAD steps at once (a decode step's rows are
        # the last step's, one token later): a step then costs a lookup, not a dozen array ops;
        # penalised rows then lay out only their counts.
        reuse_key = (num_rows, slots.tobytes(), seed_offsets.tobytes())
        cached = self._reusable
        if cached is not None and cached.key == reuse_key:
            past_min_tokens = cached.min_tokens == 0 or n == 0 or int(steps.min()) >= cached.min_tokens
            if cached.tensors.greedy_only:
                if past_min_tokens:
                    return cached.tensors
            else:
                by_steps = steps.tobytes()
                ahead = cached.ahead.get(by_steps)
                if ahead is None and past_min_tokens:  # (steps only grow: the window stays past it)
                    cached.ahead = self._keys_ahead(cached, steps, num_rows)
                    ahead = cached.ahead[by_steps]
                if ahead is not None:
                    if not len(cached.counted):
                        return ahead
                    token_ids, token_counts = SamplingTensors.penalty_lists(
                        num_rows, cached.counted, cached.with_prompt, lists, self.token_width)
                    return dataclasses.replace(ahead, token_ids=token_ids, token_counts=token_counts)
        if self._neutral(slots, steps):
            # Every row greedy, unfiltered and unpenalised, none below min_tokens (a batch that
            # lost rows or gained some, all of them so): the tensors depend on the padded row
            # count alone, one kept per count (no row draws, so their keys are never read).
            tensors = self._neutral_tensors.get(num_rows)
            if tensors is None:
                tensors = self._neutral_tensors[num_rows] = SamplingTensors.build(
                    [], self.vocab_size, pad_rows_to=num_rows, token_width=self.token_width)  # padding rows
            self._reusable = _Reusable(reuse_key, tensors, 0, np.zeros(n, np.uint64), np.zeros(0, np.int64),
                                       np.zeros(0, bool))
            return tensors
        below = self.min_tokens[slots] > steps
        keys = np.zeros((num_rows, 2), np.uint32)
        with np.errstate(over="ignore"):
            hashed = hash_seeds(self.seed[slots] + seed_offsets.astype(np.uint64))
        keys[:n] = keys_of_hashed(hashed, steps)
        banned = {}
        for r in np.flatnonzero(below):  # rare: below min_tokens
            banned[int(r)] = self._params[slots[r]].banned_token_ids(int(steps[r]), self.eos_token_ids)
        arrays = {f.name: rows_of(getattr(self, f.name), f.neutral) for f in fields.FIELDS}
        tensors = SamplingTensors.from_host(arrays, keys, banned, lists, self.token_width)
        self._reusable = None
        if not below.any():
            counted = np.flatnonzero(fields.counted_rows(arrays.__getitem__))
            self._reusable = _Reusable(reuse_key, tensors, int(self.min_tokens[slots].max(initial=0)), hashed,
                                       counted, arrays["repetition_penalty"][counted] != 1.0)
        return tensors

    def _neutral(self, slots: np.ndarray, steps: np.ndarray) -> bool:
        """Whether every field of the rows of `slots` is neutral and none bans an id at `steps`."""
        return bool(self.neutral[slots].all() and (self.min_tokens[slots] <= steps).all())

    @staticmethod
    def _keys_ahead(cached: _Reusable, steps: np.ndarray, num_rows: int) -> dict[bytes, SamplingTensors]:
        """{steps.tobytes() for steps + t, t < KEYS_AHEAD: cached.tensors with those steps' keys}."""
        window = steps[None, :] + np.arange(KEYS_AHEAD, dtype=steps.dtype)[:, None]  # [KEYS_AHEAD, n]
        keys = np.zeros((KEYS_AHEAD, num_rows, 2), np.uint32)
        keys[:, :steps.shape[0]] = keys_of_hashed(cached.hashed_seeds[None, :], window)
        return {window[t].tobytes(): dataclasses.replace(cached.tensors, keys=keys[t]) for t in range(KEYS_AHEAD)}

    def _known(self, prompt_ids, output_ids, with_prompt: bool) -> tuple:
        """(prompt_ids counted, output_ids, how many of them are known: all but a trailing pending token)."""
        num_known = len(output_ids)
        if num_known and output_ids[-1] == self.pending_token:
            num_known -= 1
        return prompt_ids if with_prompt else (), output_ids, num_known

    def _count_rows(self, rows: list[int], slots: list[int], with_prompt: list[bool], row_tokens) -> None:
        """Brings the counts of `slots` (their rows of the slab) up to date with logits rows
        `rows`' tokens: each row's new outputs found here, all added with one `CountSlab.add`.
        The common case, a decode row whose output list gained one known token since it was
        counted, is checked inline (the conditions of `RunningCounts.advance`, which takes every
        other case)."""
        new_slots, new_tokens = [], []
        counts_by_slot, slab, pending = self._counts, self._slab, self.pending_token
        for r, slot, prompt in zip(rows, slots, with_prompt):
            prompt_ids, output_ids = row_tokens(r)
            if not prompt:
                prompt_ids = ()
            num_known = len(output_ids)
            if num_known and output_ids[-1] == pending:
                num_known -= 1
            counts = counts_by_slot.get(slot)
            if counts is None:
                counts_by_slot[slot] = RunningCounts(prompt_ids, output_ids, num_known, slab, slot)
                continue
            seen = counts.seen
            if num_known == seen + 1 and output_ids is counts.out and prompt_ids is counts.prompt_ids \
                    and (not seen or output_ids[seen - 1] == counts.last):
                counts.seen, counts.last = num_known, output_ids[seen]
                new_slots.append(slot)
                new_tokens.append(counts.last)
                continue
            new = counts.advance(prompt_ids, output_ids, num_known)
            if new:
                new_slots += [slot] * len(new)
                new_tokens += new
        slab.add(new_slots, new_tokens)

    def _take(self) -> int:
        if not self._free:
            old = self.temperature.shape[0]
            self._alloc(2 * old)
            self._params.extend([None] * old)
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()


@dataclasses.dataclass
class _Reusable:
    """Tensors built for rows that banned no ids, reusable while the rows stay (with new keys
    and, for penalised rows, new lists)."""

    key: tuple[int, bytes, bytes]  # (padded rows, slots bytes, seed offsets bytes)
    tensors: SamplingTensors
    min_tokens: int  # the rows' largest min_tokens: from this step on none of them bans a token
    hashed_seeds: np.ndarray  # u64[n] hash_seeds of the rows' seeds
    counted: np.ndarray  # int64[k] the rows with a penalty (their lists are laid out every step)
    with_prompt: np.ndarray  # bool[k] which of them count their prompt (a repetition penalty)
    # sampled rows: steps bytes -> the tensors with those steps' keys, for a window of steps
    ahead: dict[bytes, SamplingTensors] = dataclasses.field(default_factory=dict)
