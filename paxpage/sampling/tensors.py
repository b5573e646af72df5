"""A step's sampling parameters as per-row host arrays: the SamplingTensors the jitted sampler
(sampler.py) takes, and the row keys its draws use.

`SamplingTensors.build` packs rows from their SamplingParams and tokens (tests, precompile, the
verify path); batch.py's SamplingBatch builds the same tensors from per-slot arrays kept between
steps; both end in `SamplingTensors.from_host`. Every field is numpy until the sampler's jitted
call moves it. Shapes that compile are bucketed here: the penalty lists' width S (powers of two
>= 16, capped at token_width) and the banned ids' width E (powers of two >= 4).

Axis legend: R logits rows, S distinct penalty-token slots per row, E banned-token slots per row.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np

from paxpage.sampling import fields
from paxpage.sampling.params import GREEDY_TEMPERATURE, SamplingParams
from paxpage.sampling.penalty_counts import CountSlab, distinct_counts

_MASK64 = (1 << 64) - 1
_MIN_TOKEN_WIDTH = 16  # smallest width of the token-id lists, so short sequences share one compile
_MIN_BANNED_WIDTH = 4  # EOS ids + stop_token_ids rarely exceed this


def row_key(seed: int, step: int) -> np.ndarray:
    """Raw threefry key data u32[2] for the token at position `step` of a sequence with `seed`
    (any non-negative ints, taken modulo 2**64): `row_keys` for one row."""
    return row_keys(np.array([seed & _MASK64], np.uint64), np.array([step & _MASK64], np.uint64))[0]


def row_keys(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Raw threefry key data u32[R, 2] for the tokens at positions steps integer[R] of sequences
    with seeds integer[R] (taken modulo 2**64; uint64 arithmetic wraps likewise):
    splitmix64(splitmix64(seed) ^ step), split into two words.

    A pure function of (seed, step), computed on the host, so a row samples the same token
    whatever batch it is in. Splitmix64 only has to decorrelate the inputs: threefry does the
    mixing."""
    return keys_of_hashed(hash_seeds(seeds), steps)


def hash_seeds(seeds: np.ndarray) -> np.ndarray:
    """`row_keys`'s first stage, u64[R] splitmix64(seed): a row's seed never changes, so a batch
    that keeps its rows (batch.py) computes it once."""
    return _splitmix64_array(np.asarray(seeds).astype(np.uint64))


def keys_of_hashed(hashed: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """`row_keys` from its first stage: hashed u64[R] (hash_seeds), steps integer[R] -> u32[R, 2]."""
    x = _splitmix64_array(hashed ^ np.asarray(steps).astype(np.uint64))
    return np.stack([x >> np.uint64(32), x & np.uint64(0xFFFFFFFF)], axis=-1).astype(np.uint32)


def _splitmix64_array(x: np.ndarray) -> np.ndarray:  # u64[R] -> u64[R], splitmix64's finaliser
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _bucket(n: int, minimum: int) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


class RowInfo(NamedTuple):
    """What the host knows about one logits row. `step` defaults to len(output_ids)."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    seed: int
    step: int | None = None


def _with_row_fields(cls):
    """Declares one array per row field of the table (fields.FIELDS), before cls's own fields."""
    cls.__annotations__ = {**{f.name: "jax.Array" for f in fields.FIELDS}, **cls.__annotations__}
    return cls


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[*fields.NAMES, "keys", "token_ids", "token_counts", "banned_ids"],
    meta_fields=["greedy_only", "penalised"],
)
@dataclasses.dataclass(frozen=True)
@_with_row_fields
class SamplingTensors:
    # Before these, one array per field of the table (fields.FIELDS: temperature, top_p, ...),
    # each [R] of the field's dtype, a padding row holding the field's neutral value.
    keys: jax.Array  # u32[R, 2] raw threefry key data, from row_keys
    # Penalty tokens in compact form: each distinct id once (-1 pad) with its number of
    # occurrences among the output tokens. Rows with repetition_penalty list prompt ids too
    # (count 0 if only in the prompt); rows without any penalty list nothing. S is a power of
    # two >= 16 fitting the row with the most distinct ids (at most token_width).
    token_ids: jax.Array  # i32[R, S]
    token_counts: jax.Array  # i32[R, S] occurrences of token_ids[r, s] in row r's output
    banned_ids: jax.Array  # i32[R, E] tokens forced to -inf (min_tokens), -1 pad
    # Static: the host knows no row draws, penalises or bans (every row greedy). `sample` then
    # compiles to the argmax alone: the draw's executable takes ~50x longer to compile, and an
    # all-greedy workload never needs it. False is always correct (the device checks per row).
    # With greedy_only the keys are never read (SamplingBatch may leave a previous step's there).
    greedy_only: bool = False
    # Static: some row is penalised or bans tokens, so `sample` writes a penalised copy of the
    # logits first (rows without penalties copy theirs unchanged). False compiles the sampler
    # without that stage: deciding it on device (a lax.cond around the whole draw) made a
    # 256 x 49152 temperature + top-p batch ~15 ms (~40%) slower on CPU even when the cond
    # skipped the penalties. True is always correct.
    penalised: bool = True

    @property
    def num_rows(self) -> int:
        return self.keys.shape[0]

    @classmethod
    def build(cls, rows: Sequence[RowInfo | tuple], vocab_size: int, pad_rows_to: int | None = None,
              eos_token_ids: Sequence[int] | int | None = (),
              token_width: int | None = None) -> SamplingTensors:
        """Pack host rows into padded arrays. Padding rows are greedy with no penalties.

        rows: RowInfo or (params, prompt_ids, output_ids, seed[, step]) tuples.
        eos_token_ids: banned (with each row's stop_token_ids) while a row is below min_tokens.
        token_width: the largest S (e.g. max_model_len), so the widths a run meets are a small
            fixed set: powers of two >= 16 below token_width, and token_width itself (the
            widest a row can need). None: powers of two without a cap.
        """
        rows = [r if isinstance(r, RowInfo) else RowInfo(*r) for r in rows]
        num_real = len(rows)
        num_rows = num_real if pad_rows_to is None else pad_rows_to
        if num_rows < num_real:
            raise ValueError(f"pad_rows_to={pad_rows_to} is smaller than the {num_real} rows")
        eos_token_ids = _eos_tuple(eos_token_ids)

        arrays = fields.neutral_rows(num_rows)
        seeds = np.zeros(num_rows, np.uint64)
        steps = np.zeros(num_rows, np.uint64)
        banned: dict[int, tuple[int, ...]] = {}
        for i, (p, _, out, seed, step) in enumerate(rows):
            fields.write_row(arrays, i, p, vocab_size)
            seeds[i], steps[i] = seed & _MASK64, (len(out) if step is None else step) & _MASK64
            banned[i] = p.banned_token_ids(len(out), eos_token_ids)
        keys = np.zeros((num_rows, 2), np.uint32)
        keys[:num_real] = row_keys(seeds[:num_real], steps[:num_real])
        def lists(counted: np.ndarray, with_prompt: np.ndarray):
            slab, sizes = CountSlab(max(len(counted), 1)), []
            for j, (i, prompt) in enumerate(zip(counted.tolist(), with_prompt.tolist())):
                ids, counts = distinct_counts(rows[i].prompt_ids if prompt else (), rows[i].output_ids)
                slab.write(j, ids, counts)
                sizes.append(len(ids))
            return slab, np.arange(len(counted)), np.asarray(sizes, np.int64)

        return cls.from_host(arrays, keys, banned, lists, token_width)

    @classmethod
    def from_host(cls, arrays: dict[str, np.ndarray], keys, banned: dict[int, Sequence[int]], lists,
                  token_width: int | None = None) -> SamplingTensors:
        """The tensors from per-row numpy arrays (arrays: {field name: [R] array}, every field of
        the table, padding rows included; keys u32[R, 2]), the banned ids of the rows that have
        any ({row: ids}), and `lists(rows, with_prompt) -> (slab, slab_rows, sizes)`, called with
        the rows that have a penalty (int64[k]) and whether each counts its prompt (a repetition
        penalty): penalty_counts.py's distinct_counts of each one's prompt (when with_prompt) and
        output tokens, kept as row slab_rows[j] of the CountSlab `slab`, sizes[j] ids long (one
        gather lays them out). `build` and batch.py SamplingBatch both end here. The leaves stay
        numpy (see the end)."""
        num_rows = keys.shape[0]
        # Distinct penalty tokens only for rows that use them. A batch without penalties ships
        # the smallest width (the same shape as a short penalised batch, so no extra compile)
        # and its penalty stage is skipped on device.
        needs_output = fields.counted_rows(arrays.__getitem__)
        counted = np.flatnonzero(needs_output)
        token_ids, token_counts = cls.penalty_lists(num_rows, counted, arrays["repetition_penalty"][counted] != 1.0,
                                                    lists, token_width)
        banned_ids = np.full((num_rows, _bucket(max(map(len, banned.values()), default=0), _MIN_BANNED_WIDTH)),
                             -1, np.int32)
        for i, ids in banned.items():
            banned_ids[i, :len(ids)] = ids

        penalised = bool(needs_output.any() or np.any(banned_ids >= 0))
        greedy_only = bool(np.all(arrays["temperature"] <= GREEDY_TEMPERATURE)) and not penalised
        # Host arrays: the sampler's jitted call moves them as it dispatches. Not jnp.asarray (it
        # compiled a copy per shape and dtype the first time and dispatched one op per array every
        # step), nor jax.device_put: on CPU, while the device runs the previous step, a device_put
        # costs ~0.35 ms of the host's time against ~0.05 ms for the same array passed to jit
        # (jax 0.10.2).
        return cls(**{name: arrays[name] for name in fields.NAMES}, keys=keys, token_ids=token_ids,
                   token_counts=token_counts, banned_ids=banned_ids, greedy_only=greedy_only, penalised=penalised)

    @staticmethod
    def penalty_lists(num_rows: int, counted: np.ndarray, with_prompt: np.ndarray, lists,
                      token_width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(token_ids, token_counts) int32[num_rows, S] of `from_host`: rows `counted` (int64[k])
        laid out by `lists(counted, with_prompt)` (see from_host), the other rows empty (-1 / 0);
        S the bucketed width of the row with the most distinct tokens."""
        slab, slab_rows, sizes = None, None, np.zeros(0, np.int64)
        if len(counted):
            slab, slab_rows, sizes = lists(counted, with_prompt)
        needed = int(sizes.max(initial=0))
        if token_width is not None and token_width < needed:
            raise ValueError(f"token_width={token_width} is smaller than the {needed} distinct "
                             "penalty tokens (prompt + output) of the row with the most")
        width = _bucket(needed, _MIN_TOKEN_WIDTH)
        if token_width is not None:
            width = min(width, max(token_width, needed))
        if slab is None:
            return np.full((num_rows, width), -1, np.int32), np.zeros((num_rows, width), np.int32)
        rows = np.full(num_rows, -1, np.int64)
        rows[counted] = slab_rows
        return slab.gather(rows, width)


def _eos_tuple(eos_token_ids: Sequence[int] | int | None) -> tuple[int, ...]:
    if eos_token_ids is None:
        return ()
    if isinstance(eos_token_ids, int):
        return (eos_token_ids,)
    return tuple(eos_token_ids)
