"""The persistent batch: the decoding rows a step keeps for the next (vLLM v1's InputBatch idea).

Most steps of a busy engine are the same step again: every running sequence decodes one token.
When the step in flight is such a plain step (every row one sample drawing one token: no beams
or prompt logprobs; a request's n samples a row each; see `DecodeBatch.build`), the engine keeps its rows
here, with their positions, page-table rows, sampling slots and output counts as arrays, and the
next step is scheduled, packed and booked with numpy over those arrays (`Scheduler.schedule`
given them as `BatchRows`, whose output lists the rows as `decodes`, `Packer.pack` with
`DecodeRows`, `OutputProcessor.process`) and a few Python operations per sequence. The step changes the batch by diffs:
sequences that finished or were aborted since leave it (`survivors`, `compacted`), the rows left
keeping their order and arrays; fresh plain requests that the scheduler admits join it (only
their rows are planned; a prompt longer than a step's tokens runs its chunks behind the rows,
`prefilling`, and once it has run it is a row of the batch, with the n - 1 children it forked
if it asked for n samples: `extended`), and so do sequences resumed after a preemption.
Rows that follow a grammar are rows like the others; the step builds their bitmasks
(`constrained`) once the tokens before them are read. Anything else (a step that preempts, a
request with beams or prompt logprobs, a request with n > 1 samples and a grammar) plans
every row from the scheduler's full schedule, equal in outputs (the step: engine_step.py). Pure
Python and numpy (no jax).

Axis legend: B rows (the running sequences, in the scheduler's order; row i of the step in
flight is row i of the next, or row j of the compacted batch that keeps it).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from paxpage.packing import logprob_bucket
from paxpage.sequence import Sequence


def plain_sample(request, sample) -> bool:
    """Whether a request's sample may be a row of the batch: the request's samples are forked
    (n > 1 forks on its first token) and it has no beams. A sample with a grammar is a row like
    any other; the step builds its bitmask (`DecodeBatch.constrained`)."""
    return request.forked and request.beam is None


class DecodeBatch:
    def __init__(self, rows: list, seqs: list[Sequence], positions: np.ndarray, table_slots: np.ndarray,
                 sampling_slots: np.ndarray, steps: np.ndarray, limits: np.ndarray,
                 lora_slots: np.ndarray | None = None):
        self.rows = rows  # (request, sample, logits row i) per row, as the engine's _Launched.rows
        self.seqs = seqs  # [B] the rows' sequences
        self.positions = positions  # i64[B] position of the token the next step writes
        self.table_slots = table_slots  # i64[B] the rows' PageTables rows
        self.sampling_slots = sampling_slots  # i64[B] the rows' SamplingBatch slots
        self.steps = steps  # i64[B] output tokens (placeholders included) when the next step samples
        self.limits = limits  # i64[B] output tokens at which a row finishes by length (Sample.limit)
        self.lora_slots = lora_slots  # i64[B] the rows' LoRA slab slots (-1: base), or None without LoRA
        # rows whose samples take per-token logprobs: the widest one's top-k width (bucketed) is the sampler's
        widths = [request.params.logprobs or 0 for request, sample, _ in rows if sample.logprobs is not None]
        self.with_logprobs = bool(widths)
        self.num_logprobs = logprob_bucket(max(widths, default=0))
        # the rows whose samples follow a grammar, as a step's `Launched.constrained`: (matcher, row, 1)
        self.constrained = [(sample.matcher, row, 1) for _, sample, row in rows if sample.matcher is not None]
        # i32[B] the previous step's logits row each row reads its input token from (None: row i
        # reads row i, the packer's constant)
        self.prev_rows: np.ndarray | None = None
        # the sequences after the rows in the running queue, part way through their prompts:
        # fresh plain requests that joined a step of this batch and need more steps for their
        # prompt (a row of the batch once it has run)
        self.prefilling: list[Sequence] = []

    @classmethod
    def build(cls, scheduled: Seq, rows: list, counts: Seq[int], sampling_slots: Seq[int], steps: Seq[int],
              tables, lora: bool = False) -> DecodeBatch | None:
        """From a step that is about to stay in flight, once booked (`EngineStep._book_pending`:
        positions are the sequences' computed tokens): `scheduled` its
        ScheduledSeqs, `rows` / `counts` its sampling entries (with the children a fork started
        in it, `StepBooking.fork_pending`), `sampling_slots` / `steps` per logits row, and
        `tables` (page_tables.PageTables) its sequences' page-table rows (a fork's child, which
        no step has packed yet, gets its row here); `lora`: keep the rows' adapter slots. None
        unless every scheduled sequence samples and every entry is a plain sampling row (see the
        module docstring), one logits row each, in order."""
        n = len(rows)
        if n == 0 or len(sampling_slots) != n or any(not item.samples or item.draft_token_ids for item in scheduled):
            return None
        ids = {item.seq.seq_id for item in scheduled}
        if sum(sample.seq.seq_id in ids for _, sample, _ in rows) != len(scheduled):
            return None  # a scheduled sequence is no entry (e.g. an embedding's chunk)
        seqs, positions, limits, table_slots = [], [], [], []
        for (request, sample, row), count in zip(rows, counts):
            seq = sample.seq
            if count != 1 or not plain_sample(request, sample) or sample.finish_reason is not None \
                    or row != len(seqs):
                return None
            slot = tables.slot(seq.seq_id)
            if slot is None:  # a fork's child: the parent's pages
                slot = tables.sync(seq.seq_id, seq.num_preemptions, seq.page_table, seq.num_computed_tokens)
            seqs.append(seq)
            positions.append(seq.num_computed_tokens)
            limits.append(sample.limit)
            table_slots.append(slot)
        as_array = lambda values: np.asarray(values, np.int64)  # noqa: E731
        return cls(rows, seqs, as_array(positions), as_array(table_slots), as_array(sampling_slots),
                   as_array(steps) + 1, as_array(limits),
                   as_array([seq.lora_slot for seq in seqs]) if lora else None)

    def __len__(self) -> int:
        return len(self.seqs)

    def survivors(self, running: Seq[Sequence]) -> list[int] | None:
        """The rows whose sequences are still `running` (the scheduler's queue), when the queue is
        exactly those sequences in the batch's order (others only finished or were aborted), then
        the `prefilling` ones still running; None otherwise (one joined, was preempted or resumed).
        Drops the prefilling sequences that finished from `prefilling`."""
        if self.prefilling:
            self.prefilling = [seq for seq in self.prefilling if not seq.is_finished]
            tail = len(running) - len(self.prefilling)
            if tail < 0 or any(a is not b for a, b in zip(running[tail:], self.prefilling)):
                return None
            running = running[:tail]
        seqs = self.seqs
        if len(running) > len(seqs):
            return None
        if len(running) == len(seqs):
            return list(range(len(seqs))) if running == seqs else None  # Sequence compares by identity
        keep = [i for i, seq in enumerate(seqs) if not seq.is_finished]
        if len(keep) != len(running) or any(seqs[i] is not seq for i, seq in zip(keep, running)):
            return None
        return keep

    def compacted(self, keep: list[int]) -> DecodeBatch:
        """The batch of rows `keep` (in order), renumbered 0..len(keep) - 1; its `prev_rows` say
        which of this batch's rows (the step in flight's logits rows) each reads its token from."""
        index = np.asarray(keep, np.int64)
        rows = [(request, sample, j) for j, (request, sample, _) in enumerate(self.rows[i] for i in keep)]
        batch = DecodeBatch(rows, [self.seqs[i] for i in keep], self.positions[index], self.table_slots[index],
                            self.sampling_slots[index], self.steps[index], self.limits[index],
                            self.lora_slots[index] if self.lora_slots is not None else None)
        batch.prev_rows = index.astype(np.int32)
        batch.prefilling = self.prefilling
        return batch

    def extended(self, joined: DecodeBatch, prefilling: list[Sequence]) -> DecodeBatch:
        """This batch with `joined`'s rows after its own (renumbered from len(self)), the rows
        whose prompts ended in a step of this batch (their logits rows in it followed this
        batch's), and `prefilling` after them. Call it after `advance`: every row then reads its
        own row of that step."""
        assert self.prev_rows is None and joined.prev_rows is None
        n = len(self)
        rows = self.rows + [(request, sample, n + row) for request, sample, row in joined.rows]
        cat = lambda a, b: np.concatenate([a, b])  # noqa: E731
        lora = None if self.lora_slots is None else cat(self.lora_slots, joined.lora_slots)
        batch = DecodeBatch(rows, self.seqs + joined.seqs, cat(self.positions, joined.positions),
                            cat(self.table_slots, joined.table_slots), cat(self.sampling_slots, joined.sampling_slots),
                            cat(self.steps, joined.steps), cat(self.limits, joined.limits), lora)
        batch.prefilling = prefilling
        return batch

    def page_aligned(self, page_size: int) -> list[int]:
        """Rows whose next token starts a page (with a fork's rows before their first write, the
        scheduler knows, the only ones that may need one)."""
        return np.flatnonzero(self.positions % page_size == 0).tolist()

    def advance(self) -> None:
        """The step scheduled from these arrays was dispatched: each row's next token is one later,
        and comes from the same row of that step."""
        self.positions += 1
        self.steps += 1
        self.prev_rows = None

    def finished_by_length(self) -> list[int]:
        """Rows whose booked outputs (placeholders included) reached their length limit."""
        return np.flatnonzero(self.steps >= self.limits).tolist()

    def check(self) -> None:
        """AssertionError unless the arrays equal what the rows' sequences say now (for tests):
        each position is the sequence's computed tokens and each step count its output tokens
        (finished sequences, which keep the batch from being used again, are skipped)."""
        for i, seq in enumerate(self.seqs):
            if seq.is_finished:
                continue
            assert self.positions[i] == seq.num_computed_tokens, (i, seq, self.positions[i])
            assert self.steps[i] == seq.num_output_tokens, (i, seq, self.steps[i])

