"""The persistent batch's step: a busy engine's common step, scheduled, packed and booked from
the batch's arrays (decode_batch.py).

When the step in flight is a plain decode batch and since then sequences only finished or were
aborted, the next step's rows are its rows still running, one token later, beside the next
chunks of the prompts that joined it part way (`DecodeBatch.prefilling`) and the fresh plain
requests and resumed sequences the scheduler admits (`joins`): only those prompts' rows are
planned. The step does what the engine's general step would (schedule, launch, read the
previous step's tokens, book this step's as pending), in numpy over the batch's arrays and a
few Python operations per row. When it cannot (a step that preempts, a request with beams, a
grammar or prompt logprobs waiting, a speculating step), `run` returns None having changed
nothing, and the general step runs; outputs are equal either way.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from paxpage.booking import Deltas, StepBooking
from paxpage.decode_batch import DecodeBatch
from paxpage.engine_stats import EngineStats
from paxpage.launched import PENDING_TOKEN, Launched, fetch
from paxpage.output_processor import OutputProcessor
from paxpage.packing import DecodeRows, logprob_bucket
from paxpage.sampling.batch import SamplingBatch
from paxpage.scheduler import Scheduler, SchedulerOutput
from paxpage.sequence import Sequence
from paxpage.step_plan import plan_step


class BatchStep:
    def __init__(self, scheduler: Scheduler, runner, outputs: OutputProcessor, sampling: SamplingBatch,
                 booking: StepBooking, stats: EngineStats, embeds: dict, config,
                 speculation=None, forget_ended: Callable | None = None):
        self.scheduler = scheduler
        self.runner = runner  # runner.ModelRunner (or multi-host's LockstepRunner)
        self.outputs = outputs
        self.sampling = sampling  # the running sequences' sampling slots
        self.booking = booking
        self.stats = stats
        self.embeds = embeds  # the engine's live embedding requests by request id
        self.page_size = config.page_size
        self.lora = bool(config.max_loras)
        self.speculation = speculation  # speculative.coordinator.SpeculationCoordinator, or None
        self.forget_ended = forget_ended  # (running queue) -> None: drops ended sequences' slots

    def joins(self, seq: Sequence) -> bool:
        """Whether waiting `seq` may join the batch's step: a sample of a request with no
        embedding, beams, grammar or prompt logprobs, fresh (a request with n > 1 forks its
        children in the step its prompt ends, `StepBooking.fork_pending`) or resumed after a
        preemption (its tokens are recomputed as a prompt is; none is still in flight, since a
        step that preempts admits nothing). Any other waits for the general step."""
        if seq.group_id in self.embeds:
            return False
        request, sample = self.outputs.lookup(seq.seq_id)
        return request.beam is None and sample.matcher is None and sample.prompt_logprobs is None

    def run(self, previous: Launched | None) -> tuple[Launched, Deltas] | None:
        """The step after `previous` (the step in flight) on its batch: (this step, left in
        flight, and the deltas of `previous`'s tokens), or None, having changed nothing."""
        batch = previous.decode if previous is not None else None
        scheduler, spec = self.scheduler, self.speculation
        if batch is None or (spec is not None and spec.active(scheduler.num_running)):
            return None  # a speculating step is the general step's
        keep = batch.survivors(scheduler.running)
        if not keep:
            return None
        resolved = batch  # the rows of the step in flight, whose tokens this step reads
        if len(keep) < len(batch):
            batch = batch.compacted(keep)
        scheduled = scheduler.schedule_decodes(batch.seqs, batch.page_aligned(self.page_size), self.joins,
                                               batch.prefilling)
        if scheduled is None:
            return None
        grown, copies, chunks = scheduled  # chunks: of the prefilling and the admitted prompts
        tail = scheduler.running[len(batch):]  # the prefilling and the admitted sequences, in order
        joined = SchedulerOutput(chunks, [], [], sum(s.num_new_tokens for s in chunks)) if chunks else None
        step, plan = self._launch(previous, batch, resolved, grown, copies, joined)
        deltas = self._read(previous, resolved)
        # this step's tokens, pending (as StepBooking.advance)
        scheduler.update_decodes(batch.seqs, PENDING_TOKEN)
        if joined is not None:  # the prompts' chunks are computed; those that end sample a token
            scheduler.update(joined, {s.seq.seq_id: PENDING_TOKEN for s in chunks if s.samples})
        self.booking.sample_kv_utilisation()
        if plan is not None:
            self.booking.fork_pending(step)  # the n - 1 children of the requests whose prompt ended
        batch.advance()
        step.decode = self._next_batch(batch, step, chunks, tail)
        self.stats.overlapped_steps += 1
        self.stats.decode_batch_steps += 1
        self.stats.steps += 1
        return step, deltas

    def _launch(self, previous: Launched, batch: DecodeBatch, resolved: DecodeBatch, grown: list[int],
                copies: list, joined: SchedulerOutput | None):
        """Copies pages, syncs the grown table rows, packs the batch's rows (and the rows planned
        for `joined`, the prompts' chunks, after them) and dispatches the model and the sampler."""
        runner, seqs = self.runner, batch.seqs
        runner.copy_pages(copies)
        if self.speculation is not None:  # a draft model's pool follows the target's
            self.speculation.on_copy_pages(copies)
        tables = runner.tables
        if self.forget_ended is not None:
            self.forget_ended(self.scheduler.running)  # the batch's rows and the admitted ones
        if grown:  # their new pages: the one changed entry of each table row
            tables.sync_many([seqs[i].seq_id for i in grown], [seqs[i].num_preemptions for i in grown],
                             [seqs[i].page_table for i in grown], [int(batch.positions[i]) for i in grown])
        held = DecodeRows(batch.table_slots, batch.positions, batch.prev_rows, batch.lora_slots)
        n = len(seqs)
        plan = None if joined is None else plan_step(joined, self.outputs.lookup, self.embeds, self.sampling, {})
        step_batch, _, _, prev_rows = runner.packer.pack(plan.plans if plan else [], held)

        def row_tokens(r):  # penalised rows: their outputs end in the pending token
            return (batch.rows[r][0].prompt_ids, seqs[r].output_token_ids) if r < n else plan.row_tokens(r - n)

        slots, offsets, steps = batch.sampling_slots, np.zeros(n, np.int64), batch.steps
        num_logprobs = batch.num_logprobs
        if plan is not None:
            slots, offsets, steps = (np.concatenate(pair) for pair in
                                     ((slots, plan.slots), (offsets, plan.offsets), (steps, plan.steps)))
            num_logprobs = max(num_logprobs, logprob_bucket(plan.num_logprobs))
        tensors = self.sampling.tensors(slots, offsets, steps, row_tokens, pad_rows_to=len(step_batch.logits_indices))
        logits = runner.forward(step_batch, prev_rows, previous.next_tokens)
        if self.speculation is not None:
            self.speculation.on_step(step_batch, prev_rows, previous.next_tokens)
        if batch is resolved and plan is None:
            step = Launched(None, batch.rows, previous.counts, [], None, None, None, previous.row_of_seq,
                            drafts=previous.drafts)
        else:
            rows, counts = batch.rows, [1] * n
            if plan is not None:
                rows, counts = rows + [(r, s, n + i) for r, s, i in plan.rows], counts + plan.counts
            step = Launched(None, rows, counts, [], None, None, None,
                            {sample.seq.seq_id: i for _, sample, i in rows}, drafts=[()] * len(rows),
                            sampling_rows=(slots, steps))
        step.result, step.prompt_result, step.next_tokens = runner.sample(
            step_batch, logits, tensors, num_logprobs, prev_rows=prev_rows, prev_tokens=previous.next_tokens)
        return step, plan

    def _read(self, previous: Launched, resolved: DecodeBatch) -> Deltas:
        """Reads the previous step's tokens (its rows are `resolved`'s) and books them: text,
        stops, logprobs; the sequences that stopped leave the scheduler."""
        t = time.perf_counter()
        result = previous.result
        top = (result.top_ids, result.top_logprobs) if resolved.with_logprobs else (None, None)
        token_ids, logprobs, top_ids, top_logprobs = fetch((result.token_ids, result.logprobs) + top)
        self.stats.device_seconds += time.perf_counter() - t
        m = len(resolved)
        deltas, to_finish, num_tokens = self.outputs.process(
            resolved.rows, token_ids[:m].tolist(), logprobs[:m].tolist(), top_ids, top_logprobs, pending=PENDING_TOKEN)
        self.booking.finish(to_finish)
        self.stats.generated_tokens += num_tokens
        return deltas

    def _next_batch(self, batch: DecodeBatch, step: Launched, chunks: list, tail: list[Sequence]
                    ) -> DecodeBatch | None:
        """The batch the next step starts from (after `batch.advance()`): the rows whose next
        token is their last by length leave the scheduler now (as StepBooking.advance); the
        prompts that ended this step join, in queue order, each with the children it forked;
        those part way stay after the rows."""
        n = len(batch)
        new_rows = step.rows[n:]  # the ended prompts' entries and their children, logits rows n ...
        sampled = {s.seq.seq_id for s in chunks if s.samples}
        joining, k = None, 0
        if chunks:
            k = next((i for i, seq in enumerate(tail) if seq.seq_id not in sampled), len(tail))
            if k and not any(seq.seq_id in sampled for seq in tail[k:]):
                slots, steps = step.sampling_rows
                joining = DecodeBatch.build([s for s in chunks if s.samples],
                                            [(r, s, i - n) for r, s, i in new_rows], step.counts[n:],
                                            slots[n:], steps[n:], self.runner.tables, lora=self.lora)
        # the batch's rows by their arrays (DecodeBatch.limits), the new entries by the rule
        by_length = [batch.seqs[i] for i in batch.finished_by_length()] + [
            sample.seq for _, sample, _ in new_rows if self.booking.ends_by_length(sample.seq)]
        self.booking.finish([(seq, "length") for seq in by_length])
        if not chunks:
            return batch
        if joining is not None:
            self.stats.joined_rows += len(new_rows)
            return batch.extended(joining, tail[k:])
        if sampled:  # a prompt ended behind one that did not: the general step's to order
            return None
        batch.prefilling = tail
        return batch
