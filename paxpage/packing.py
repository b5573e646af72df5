"""Packing: the scheduler's rows for one step laid out as a StepBatch of host arrays.

`Packer.pack` takes each scheduled sequence's RowPlan (its tokens, page table, the span of new
tokens and the logits rows it wants) and lays them out in the step's fixed shapes: decode rows
of one token first, then prefill rows of `prefill_row_len` tokens, every count bucketed so a
steady phase never meets a new shape. Page tables persist across steps (paxpage/page_tables.py):
a row's table is synced by its changed entries, and decode rows are laid out with array
operations over them, so the host's work per step does not grow with the context. The decode
rows of the engine's persistent batch come as arrays (`DecodeRows`), laid out first: a step
plans only the rows that joined it.

Axis legend: T flat tokens, Bd decode rows, Bp prefill rows, P pages per sequence, R logits rows.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

import jax
import numpy as np

from paxpage.batch import StepBatch
from paxpage.config import ResolvedConfig
from paxpage.page_tables import PageTables


# Decode rows are padded to at least this many: on accelerators a decode step's cost barely
# grows with its first few rows (it reads every weight once either way), and 1 and 2 rows would
# be two more shapes for every prefill-row count. See `decode_rows` for the one exception.
MIN_DECODE_ROWS = 4
# Structured-outputs masks of a step are padded to at least this many rows (`mask_rows`).
MIN_MASK_ROWS = 4


def decode_rows(num_decodes: int, num_prefill_rows: int, single_row: bool) -> int:
    """Decode-row bucket of a step with these real decode and prefill rows. With `single_row`
    (the CPU backend) a step of one decode row and no prefill keeps its one row: XLA CPU runs a
    one-row matmul as a matrix-vector product, and SmolLM2's decode matmuls cost ~3x less CPU
    time at 1 row than at 4 (~20 against ~65 ms per step on a 2-core AMD EPYC), so a lone
    sequence decodes ~3x cheaper for one more compiled shape. Every other step pads as `bucket`."""
    if single_row and num_decodes == 1 and num_prefill_rows == 0:
        return 1
    return bucket(num_decodes, MIN_DECODE_ROWS)


def bucket(n: int, minimum: int = 1) -> int:
    """Shape bucket for n rows: powers of two up to 16, then also 1.5x steps (24, 48, 96, ...).

    Pure powers of two padded a 48-sequence decode batch to 64 rows (a third of the step's
    matmul work wasted); the half steps cap padding near 33% -> 25% at large batch for a
    few more compiled shapes. 0 stays 0."""
    if n <= 0:
        return 0
    n = max(n, minimum)
    power = 1 << (n - 1).bit_length()
    if power > 16 and n <= power * 3 // 4:
        return power * 3 // 4
    return power


def mask_rows(n: int) -> int:
    """The rows of a step's structured-outputs masks (structured_backend.RowMasks) for n
    constrained logits rows: powers of four from MIN_MASK_ROWS. The masking call compiles once
    per (R, this), so a few sizes per R cover every count (`mask_row_counts`); padding costs
    little, the call's work being the masked rows alone."""
    k = MIN_MASK_ROWS
    while k < n:
        k *= 4
    return k


def mask_row_counts(num_rows: int) -> list[int]:
    """Every `mask_rows(n)` of a step of num_rows logits rows (n <= num_rows): what precompile
    compiles the masking call for."""
    counts = [mask_rows(1)]
    while counts[-1] < num_rows:
        counts.append(mask_rows(counts[-1] + 1))
    return counts


def logprob_bucket(n: int) -> int:
    """Top-k widths compile separately; round up to a few sizes."""
    if n <= 0:
        return 0
    for size in (1, 5, 20):
        if n <= size:
            return size
    return n


@dataclasses.dataclass
class RowPlan:
    """Host-side description of one scheduled sequence's tokens in the step."""

    token_ids: Sequence[int]  # the sequence's tokens (prompt + output); read by index and slice
    page_table: Sequence[int]
    start: int  # first new token's position
    num_new: int  # q_len this step
    num_samples: int  # logits rows wanted for its last token (0 = mid-prefill chunk)
    num_prompt_tokens: int = 0  # > 0: also score each prompt token computed this step
    # Identity of the sequence in the persistent page tables (None: copy the table whole this
    # step), and a version that changes whenever entries before `start` may have changed.
    table_key: Hashable | None = None
    table_version: int = 0
    # Async scheduling: the token at `start` is not on the host yet; it is row `prev_row` of
    # the previous (still running) step's sampled tokens. -1: the host has it.
    prev_row: int = -1
    # Speculative decoding: the last num_drafts tokens are drafts; each of the row's last
    # num_drafts + 1 positions gets a logits row (num_samples == num_drafts + 1), in order.
    num_drafts: int = 0
    # Embedding requests: the pooled-output row (< the step's logits rows) that this row's tokens
    # at positions >= pool_from add their final-normed hidden states into; -1: none.
    pool_row: int = -1
    pool_from: int = 0
    lora_slot: int = -1  # the sequence's LoRA slab slot; -1: the base model


@dataclasses.dataclass
class DecodeRows:
    """Decode rows held as arrays (the persistent batch's, decode_batch.py), laid out before the
    step's planned rows: no RowPlan, no per-row Python."""

    table_slots: np.ndarray  # integer[B] the rows' PageTables rows (already synced)
    positions: np.ndarray  # integer[B] the position of the token each row writes
    # integer[B] the previous (still running) step's logits row whose sampled token each row
    # writes; None: row r reads row r
    prev_rows: np.ndarray | None = None
    lora_slots: np.ndarray | None = None  # integer[B] the rows' LoRA slab slots (with LoRA)

    def __len__(self) -> int:
        return len(self.positions)


class Packer:
    """Lays out a step's rows (RowPlan) into a StepBatch, over the persistent page tables.

    `with_lora`: the batch carries each row's LoRA slot. `single_row_decode`: see decode_rows.
    `keep_on_device`: the steady decode step's constant arrays are placed on the device once
    (one process, no mesh); otherwise they stay numpy, as everything `pack` returns."""

    def __init__(self, cfg: ResolvedConfig, *, with_lora: bool, single_row_decode: bool, keep_on_device: bool):
        self.cfg = cfg
        self.with_lora = with_lora
        self.single_row_decode = single_row_decode
        self.keep_on_device = keep_on_device
        self.tables = PageTables(cfg.pages_per_seq, cfg.page_size)
        self._decode_consts: dict[int, tuple] = {}  # see _decode_constants

    def reset(self) -> None:
        """Empty page tables (the engine's state was dropped: a failed step, a reset)."""
        self.tables = PageTables(self.cfg.pages_per_seq, self.cfg.page_size)

    def lora_rows(self, dec_slots, num_dec: int, pre_slots, num_pre: int) -> np.ndarray | None:
        """The batch's lora_slots i32[Bd + Bp] (padding rows -1), or None without LoRA."""
        if not self.with_lora:
            return None
        out = np.full(num_dec + num_pre, -1, np.int32)
        out[:len(dec_slots)] = dec_slots
        out[num_dec:num_dec + len(pre_slots)] = pre_slots
        return out

    def pack(self, rows: Sequence[RowPlan], held: DecodeRows | None = None
             ) -> tuple[StepBatch, list[int], list[tuple[int, int]], np.ndarray]:
        """Lays out the step's rows: `held` decode rows first (their logits rows are 0..B-1, in
        order), then the planned rows. Returns the batch, the plan index of each of the planned
        rows' sampling rows (which follow the held rows'), (plan index, position) of each
        prompt-logprob row, and i32[T] `prev_rows` (the previous step's sampled-token row for each
        flat token whose id the host does not have yet, else -1).

        Decode rows (one token) are laid out with array operations over the persistent page
        tables, so their host cost does not grow with context length."""
        if held is not None and not rows:
            batch, prev_rows = self._pack_held(held)
            return batch, [], [], prev_rows
        num_held = len(held) if held is not None else 0
        page_size, row_len = self.cfg.page_size, self.cfg.prefill_row_len
        pages_per_seq = self.cfg.pages_per_seq
        keys = [r.table_key for r in rows]
        transient = []
        for i, key in enumerate(keys):
            if key is None:  # a row with no identity: its table is copied whole, then dropped
                keys[i] = ("transient", i)
                transient.append(keys[i])
        slot_of = self.tables.sync_many(keys, [r.table_version for r in rows], [r.page_table for r in rows],
                                        [r.start for r in rows])
        table = self.tables.table
        decode = [i for i, r in enumerate(rows) if r.num_new == 1]
        prefill = [i for i, r in enumerate(rows) if r.num_new > 1]
        if prefill and all(rows[i].num_drafts for i in prefill):
            # Only speculative verify rows (1 + k tokens): rows as wide as the longest, bucketed,
            # instead of prefill_row_len, so a verify step costs little more than a decode step.
            row_len = min(row_len, bucket(max(rows[i].num_new for i in prefill), 4))
        # A sequence's prefill rows are consecutive and all full but its last: its tokens fill one
        # flat run of rows, laid out per sequence with array operations, not per row or token.
        runs = np.fromiter((-(-rows[i].num_new // row_len) for i in prefill), np.int64, len(prefill))
        first_rows = np.cumsum(runs) - runs  # [len(prefill)] each sequence's first prefill row
        num_pre_rows = int(runs.sum())
        num_dec = decode_rows(num_held + len(decode), num_pre_rows, self.single_row_decode)
        num_pre = bucket(num_pre_rows)
        total = num_dec + num_pre * row_len
        token_ids = np.zeros(total, np.int32)
        positions = np.zeros(total, np.int32)
        slots = np.full(total, -1, np.int32)
        dec_pages = np.zeros((num_dec, pages_per_seq), np.int32)
        dec_lens = np.zeros(num_dec, np.int32)
        pre_pages = np.zeros((num_pre, pages_per_seq), np.int32)
        pre_lens = np.zeros(num_pre, np.int32)
        pre_q = np.zeros(num_pre, np.int32)
        last_token_index = {}
        verify_index: dict[int, list[int]] = {}  # plan -> flat index of each verify position
        prompt_rows: list[tuple[int, int, int, int]] = []  # (plan, position, flat index, target)

        prev_rows = np.full(total, -1, np.int32)
        n = len(decode)
        if n or num_held:
            pos = np.fromiter((rows[i].start for i in decode), np.int32, n)
            table_slots = np.fromiter((slot_of[i] for i in decode), np.int64, n)
            if num_held:  # their token ids stay 0: every one is read from the device (prev_rows)
                pos = np.concatenate([np.asarray(held.positions, np.int32), pos])
                table_slots = np.concatenate([np.asarray(held.table_slots, np.int64), table_slots])
                prev_rows[:num_held] = (held.prev_rows if held.prev_rows is not None
                                        else np.arange(num_held, dtype=np.int32))
            self._lay_out_decodes(table_slots, pos, positions, slots, dec_pages, dec_lens)
            token_ids[num_held:num_held + n] = [rows[i].token_ids[rows[i].start] for i in decode]
            prev_rows[num_held:num_held + n] = [rows[i].prev_row for i in decode]
            for row, i in enumerate(decode, num_held):
                last_token_index[i] = row
                if rows[i].num_prompt_tokens - 1 > rows[i].start:  # a 1-token prompt chunk
                    prompt_rows.append((i, rows[i].start, row, rows[i].token_ids[rows[i].start + 1]))
        for i, row, num_rows in zip(prefill, first_rows.tolist(), runs.tolist()):
            plan = rows[i]
            lo, k = plan.start, plan.num_new
            hi = lo + k
            flat = num_dec + row * row_len
            pos = np.arange(lo, hi, dtype=np.int32)
            pages = table[slot_of[i]]
            token_ids[flat:flat + k] = plan.token_ids[lo:hi]
            positions[flat:flat + k] = pos
            slots[flat:flat + k] = pages[pos // page_size] * page_size + pos % page_size
            for p in range(lo, min(hi, plan.num_prompt_tokens - 1)):
                prompt_rows.append((i, p, flat + p - lo, plan.token_ids[p + 1]))
            starts = lo + row_len * np.arange(num_rows, dtype=np.int32)
            ends = np.minimum(starts + row_len, hi)
            pre_pages[row:row + num_rows] = pages
            pre_lens[row:row + num_rows] = ends
            pre_q[row:row + num_rows] = ends - starts
            last_token_index[i] = flat + k - 1
            if plan.num_drafts:  # verify rows: every position from the sequence's last token on
                first = hi - 1 - plan.num_drafts
                verify_index[i] = [flat + p - lo for p in range(max(lo, first), hi)]
        self.tables.release(transient)

        logits_plan = [i for i, r in enumerate(rows) for _ in range(r.num_samples)]
        # R follows from (Bd, Bp) rather than being a third bucket (only n > 1 parallel
        # samples can need more), and stays a power of two so the sampler is shared.
        num_logits = bucket(max(num_dec + num_pre, num_held + len(logits_plan)))
        logits_indices = np.zeros(num_logits, np.int32)
        logits_indices[:num_held] = np.arange(num_held, dtype=np.int32)
        logits_indices[num_held:num_held + len(logits_plan)] = [
            j for i, r in enumerate(rows)
            for j in (verify_index[i] if r.num_drafts else [last_token_index[i]] * r.num_samples)]
        num_prompt_rows = bucket(len(prompt_rows))
        prompt_indices = np.zeros(num_prompt_rows, np.int32)
        prompt_targets = np.zeros(num_prompt_rows, np.int32)
        for j, (_, _, flat, target) in enumerate(prompt_rows):
            prompt_indices[j], prompt_targets[j] = flat, target
        dec_lora = [rows[i].lora_slot for i in decode]
        if num_held and self.with_lora:
            dec_lora = np.concatenate([np.asarray(held.lora_slots, np.int32), np.asarray(dec_lora, np.int32)])
        pre_lora = np.repeat(np.asarray([rows[i].lora_slot for i in prefill], np.int32), runs) if self.with_lora else []
        lora = self.lora_rows(dec_lora, num_dec, pre_lora, num_pre)
        pool_rows = self._pool_rows(rows, decode, num_held, zip(prefill, first_rows.tolist()), num_dec, row_len, total,
                                    num_logits)
        batch = StepBatch(token_ids, positions, slots, dec_pages, dec_lens, pre_pages, pre_lens,
                          pre_q, logits_indices, prompt_indices, prompt_targets, pool_rows, lora)
        return batch, logits_plan, [(plan, pos) for plan, pos, _, _ in prompt_rows], prev_rows

    @staticmethod
    def _pool_rows(rows: Sequence[RowPlan], decode: list[int], num_held: int, prefill_runs,
                   num_dec: int, row_len: int, total: int, num_logits: int) -> np.ndarray | None:
        """StepBatch.pool_rows i32[T] for `pack`'s layout (held decode rows, which never pool,
        the planned decode rows, then prefill rows of row_len tokens, each prefilling sequence's
        one flat run from its first row: prefill_runs (plan, first row)); None when no row pools."""
        if all(r.pool_row < 0 for r in rows):
            return None
        pool_rows = np.full(total, num_logits, np.int32)
        for flat, i in enumerate(decode, num_held):
            if rows[i].pool_row >= 0 and rows[i].start >= rows[i].pool_from:
                pool_rows[flat] = rows[i].pool_row
        for i, row in prefill_runs:
            plan = rows[i]
            lo, hi = plan.start, plan.start + plan.num_new
            if plan.pool_row >= 0 and hi > plan.pool_from:
                assert plan.pool_row < num_logits, (plan.pool_row, num_logits)
                flat = num_dec + row * row_len
                pool_rows[flat + max(lo, plan.pool_from) - lo:flat + hi - lo] = plan.pool_row
        return pool_rows

    def _pack_held(self, held: DecodeRows) -> tuple[StepBatch, np.ndarray]:
        """`pack` of held decode rows alone, the steady decode step: the arrays that depend on
        the padded row count alone come from `_decode_constants`."""
        n = len(held)
        num_dec = decode_rows(n, 0, self.single_row_decode)
        pos = np.zeros(num_dec, np.int32)
        slots = np.full(num_dec, -1, np.int32)
        dec_pages = np.zeros((num_dec, self.cfg.pages_per_seq), np.int32)
        dec_lens = np.zeros(num_dec, np.int32)
        self._lay_out_decodes(held.table_slots, held.positions, pos, slots, dec_pages, dec_lens)
        token_ids, constant_prev_rows, logits_indices, empty, rows0 = self._decode_constants(num_dec)
        if held.prev_rows is None:
            prev_rows = constant_prev_rows
        else:  # rows left after others finished: each reads its own row of the previous step
            prev_rows = np.concatenate([np.asarray(held.prev_rows, np.int32), np.arange(n, num_dec, dtype=np.int32)])
        lora = self.lora_rows(held.lora_slots if held.lora_slots is not None else [], num_dec, [], 0)
        batch = StepBatch(token_ids, pos, slots, dec_pages, dec_lens, rows0, empty, empty,
                          logits_indices, empty, empty, lora_slots=lora)
        return batch, prev_rows

    def _decode_constants(self, num_dec: int) -> tuple:
        """The arrays of a steady decode step that depend on its padded row count alone: token
        ids (unused: prev_rows points every row at a token of the device's), prev_rows (row r
        reads row r of the previous step), logits indices and the empty prefill arrays. Padding
        rows read a token too, like any row; their K/V writes are dropped and their logits rows
        are not read. Kept on the device once made, so a step transfers only its positions,
        slots, tables and lengths (each host array a jitted call takes costs it a transfer at
        dispatch), however many of its rows are real. Sharded or multi-process runners pass them
        as numpy, as `pack`."""
        made = self._decode_consts.get(num_dec)
        if made is None:
            rows = np.arange(num_dec, dtype=np.int32)
            logits_indices = np.minimum(np.arange(bucket(num_dec), dtype=np.int32), num_dec - 1)
            made = (np.zeros(num_dec, np.int32), rows, logits_indices, np.zeros(0, np.int32),
                    np.zeros((0, self.cfg.pages_per_seq), np.int32))
            if self.keep_on_device:
                made = tuple(jax.device_put(made))
            self._decode_consts[num_dec] = made
        return made

    def _lay_out_decodes(self, table_slots, pos: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                         dec_pages: np.ndarray, dec_lens: np.ndarray) -> None:
        """Rows [:n] of a batch's decode arrays for n decode rows: each
        row's table (table_slots integer[n], rows of `self.tables`), position (pos integer[n], the
        token it writes), KV slot and length."""
        n, page_size = len(pos), self.cfg.page_size
        dec_pages[:n] = self.tables.table[table_slots]
        positions[:n] = pos
        slots[:n] = dec_pages[np.arange(n), pos // page_size] * page_size + pos % page_size
        dec_lens[:n] = pos + 1

    def padding_batch(self, dec: int, pre: int) -> StepBatch:
        """An all-padding batch of `dec` decode rows and `pre` prefill rows (its K/V writes are dropped)."""
        row_len, pages_per_seq = self.cfg.prefill_row_len, self.cfg.pages_per_seq
        total = dec + pre * row_len
        num_logits = bucket(dec + pre)
        return StepBatch(
            np.zeros(total, np.int32), np.zeros(total, np.int32), np.full(total, -1, np.int32),
            np.zeros((dec, pages_per_seq), np.int32), np.zeros(dec, np.int32),
            np.zeros((pre, pages_per_seq), np.int32), np.zeros(pre, np.int32), np.zeros(pre, np.int32),
            np.zeros(num_logits, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32),
            lora_slots=self.lora_rows([], dec, [], pre))
