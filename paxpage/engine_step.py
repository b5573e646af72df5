"""The engine's step, every kind of it: schedule, launch, read the step in flight, book.

A step's rows come in two parts, from one `Scheduler.schedule` call. First the persistent batch
(decode_batch.py): when the step in flight is a plain decode batch and since then its sequences
only finished or were aborted, its rows still running decode one token more, scheduled, packed
and booked from the batch's arrays with a few Python operations per row (the scheduler takes
them as `BatchRows`). Then the planned rows, one `RowPlan` each (step_plan.py): the chunks the
scheduler hands out beside the batch (prompts part way, fresh requests and resumed sequences it
admits), or, when the batch cannot go on (the first step, a step that preempts, a request with
beams or prompt logprobs, or with n > 1 samples and a grammar, waiting; speculation), every
sequence the scheduler takes one by one. Both parts go through the same launch (one
`Packer.pack`, sampling tensors, forward, sampler), the same read of the step in flight
(`StepBooking.resolve`) and the same booking: pending placeholders when the step may stay in
flight (async scheduling; the batch it leaves is the next step's), or a wait for its tokens when
it may not (`StepBooking.complete`). Outputs are equal whichever rows come from the batch.

With async scheduling (the default) the step is dispatched before the previous step's tokens
are read, so the host schedules, packs and books while the device runs.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from paxpage.booking import Deltas, StepBooking
from paxpage.decode_batch import DecodeBatch
from paxpage.engine_stats import EngineStats
from paxpage.launched import PENDING_TOKEN, Launched
from paxpage.output_processor import OutputProcessor
from paxpage.packing import DecodeRows, logprob_bucket, mask_rows
from paxpage.sampling.batch import SamplingBatch
from paxpage.scheduler import BatchRows, Scheduler, SchedulerOutput
from paxpage.sequence import Sequence
from paxpage.step_plan import plan_step


class EngineStep:
    def __init__(self, scheduler: Scheduler, runner, outputs: OutputProcessor, sampling: SamplingBatch,
                 booking: StepBooking, beams, stats: EngineStats, embeds: dict, config, grammars: Callable,
                 speculation=None):
        self.scheduler = scheduler
        self.runner = runner  # runner.ModelRunner (or multi-host's LockstepRunner)
        self.outputs = outputs
        self.sampling = sampling  # the running sequences' sampling slots
        self.booking = booking
        self.beams = beams  # beam.BeamCoordinator
        self.stats = stats
        self.embeds = embeds  # the engine's live embedding requests by request id
        self.config = config
        self.grammars = grammars  # () -> the engine's GrammarBackend (structured rows' bitmasks)
        self.speculation = speculation  # speculative.coordinator.SpeculationCoordinator, or None
        self.lora = bool(config.max_loras)
        self.inflight: Launched | None = None  # async scheduling: the step still on the device

    def run(self) -> Deltas:
        """One step: this step dispatched (left in flight when it may be), the step in flight
        before it read. Returns the deltas of the tokens read (see `LLMEngine.step`)."""
        previous, self.inflight = self.inflight, None
        batch, sched = self._schedule(previous)
        tail = self.scheduler.running[len(batch):] if batch is not None else []
        launched = None
        if sched is not None:
            self.runner.copy_pages(sched.copies)
            if self.speculation is not None:  # a draft model's pool follows the target's
                self.speculation.on_copy_pages(sched.copies)
            # a beam request runs all its live beams in a step or none
            if batch is not None or not self.beams.hold_back(sched):
                launched = self._launch(previous, batch, sched)
        deltas: Deltas = self.booking.resolve(previous) if previous is not None else []
        if launched is None:
            return deltas
        if launched.result is None:
            self._dispatch_sampler(launched)  # its bitmasks needed the tokens just read
        if batch is not None or self._can_overlap(launched):
            self._book_pending(launched, batch, sched, tail)
            self.inflight = launched
        else:
            deltas += self.booking.complete(launched)
        self.stats.steps += 1
        return deltas

    # ---- the step's rows --------------------------------------------------------------------------
    def joins(self, seq: Sequence) -> bool:
        """Whether waiting `seq` may join a step of the batch: a sample of a request with no
        embedding, beams or prompt logprobs, fresh (a request with n > 1 forks its children in
        the step its prompt ends, `StepBooking.fork_pending`, unless it has a grammar: its
        children copy the parent's state after its first token is read) or resumed after a
        preemption (its tokens are recomputed as a prompt is; none is still in flight, since a
        step that preempts admits nothing). Any other waits for a step of the full schedule."""
        if seq.group_id in self.embeds:
            return False
        request, sample = self.outputs.lookup(seq.seq_id)
        return request.beam is None and sample.prompt_logprobs is None \
            and (sample.matcher is None or request.forked or request.params.n == 1)

    def _schedule(self, previous: Launched | None) -> tuple[DecodeBatch | None, SchedulerOutput | None]:
        """The step's schedule, from the batch the step in flight left (`previous.decode`; its
        rows still running, compacted) when there is one and no step speculates: (that batch,
        or None when the scheduler took every sequence one by one; the SchedulerOutput, or None
        when nothing runs). A speculating step's drafts come from the speculation."""
        scheduler, spec = self.scheduler, self.speculation
        if not scheduler.has_unfinished():
            return None, None
        speculating = spec is not None and spec.active(scheduler.num_running)
        batch = previous.decode if previous is not None and not speculating else None
        keep = batch.survivors(scheduler.running) if batch is not None else None
        rows = None
        if keep:
            if len(keep) < len(batch):
                batch = batch.compacted(keep)
            rows = BatchRows(batch.seqs, batch.page_aligned(self.config.page_size), self.joins, batch.prefilling)
        drafts = spec.propose(scheduler.running, self.outputs.lookup, self.embeds.__contains__) if speculating else None
        sched = scheduler.schedule(drafts, rows)
        if not sched.decodes:
            batch = None
            if not sched.scheduled:
                return None, None
        return batch, sched

    # ---- launch -----------------------------------------------------------------------------------
    def _launch(self, previous: Launched | None, batch: DecodeBatch | None, sched: SchedulerOutput) -> Launched:
        """Packs the batch's rows (from its arrays) and then `sched.scheduled` (planned) and
        dispatches the model and, but for structured rows while a step is in flight, the sampler;
        returns without waiting. Structured rows' bitmasks follow from every earlier token: with
        a step in flight they are built once its tokens are read (`run`), while the device runs
        this step's model, and only its sampler waits for them."""
        runner, n = self.runner, len(batch) if batch is not None else 0
        self._forget_ended(self.scheduler.running)
        held = None
        if batch is not None:
            seqs, grown = batch.seqs, sched.grown
            if grown:  # their new pages: the one changed entry of each table row
                runner.tables.sync_many([seqs[i].seq_id for i in grown], [seqs[i].num_preemptions for i in grown],
                                        [seqs[i].page_table for i in grown], [int(batch.positions[i]) for i in grown])
            held = DecodeRows(batch.table_slots, batch.positions, batch.prev_rows, batch.lora_slots)
        inflight = previous.row_of_seq if previous is not None else {}
        plan = plan_step(sched, self.outputs.lookup, self.embeds, self.sampling, inflight) if sched.scheduled else None
        step_batch, _, prompt_plan, prev_rows = runner.packer.pack(plan.plans if plan is not None else [], held)

        if plan is None:
            slots, offsets, steps, num_logprobs = batch.sampling_slots, np.zeros(n, np.int64), batch.steps, \
                batch.num_logprobs
        elif n:
            slots, offsets, steps = (np.concatenate(pair) for pair in ((batch.sampling_slots, plan.slots),
                                     (np.zeros(n, np.int64), plan.offsets), (batch.steps, plan.steps)))
            num_logprobs = max(batch.num_logprobs, logprob_bucket(plan.num_logprobs))
        else:
            slots, offsets, steps, num_logprobs = plan.slots, plan.offsets, plan.steps, \
                logprob_bucket(plan.num_logprobs)

        def row_tokens(r):  # penalised rows: their outputs end in the pending token
            return (batch.rows[r][0].prompt_ids, batch.seqs[r].output_token_ids) if r < n else plan.row_tokens(r - n)

        tensors = self.sampling.tensors(slots, offsets, steps, row_tokens, pad_rows_to=len(step_batch.logits_indices))
        num_prompt_logprobs = logprob_bucket(max(
            (self.outputs.lookup(sched.scheduled[i].seq.seq_id)[0].params.prompt_logprobs or 0
             for i, _ in prompt_plan), default=0))
        prev_tokens = previous.next_tokens if previous is not None else None
        pooled = None
        if plan is not None and plan.pooling:
            logits, pooled = runner.forward_pooled(step_batch, prev_rows, prev_tokens)
        else:
            logits = runner.forward(step_batch, prev_rows, prev_tokens)
        if self.speculation is not None:
            self.speculation.on_step(step_batch, prev_rows, prev_tokens)
        sampler_args = (step_batch, logits, tensors, num_logprobs, num_prompt_logprobs, prev_rows, prev_tokens)
        constrained = list(batch.constrained) if n else []  # (their bitmasks: _dispatch_sampler)
        if plan is None and batch is previous.decode:  # the rows of the step in flight, as they were
            return self._dispatched(Launched(sched, batch.rows, previous.counts, [], None, None, None,
                                             previous.row_of_seq, sampler_args=sampler_args, constrained=constrained,
                                             drafts=previous.drafts),
                                    previous)
        rows, counts, drafts, row_of_seq = [], [], [], {}
        if n:
            rows, counts, drafts = list(batch.rows), [1] * n, [()] * n
            row_of_seq = {sample.seq.seq_id: i for _, sample, i in rows}
        step = Launched(sched, rows, counts, prompt_plan, None, None, None, row_of_seq, sampler_args=sampler_args,
                        constrained=constrained, drafts=drafts, sampling_rows=(slots, steps))
        if plan is not None:
            step.rows += [(request, sample, n + i) for request, sample, i in plan.rows]
            step.counts += plan.counts
            step.drafts += plan.drafts
            step.pooling, step.pooled = plan.pooling, pooled
            if n:
                step.row_of_seq.update((sample.seq.seq_id, n + i) for _, sample, i in plan.rows)
            step.constrained += [(sample.matcher, row, count) for (_, sample, row), count
                                 in zip(step.rows[n:], plan.counts) if sample.matcher is not None]
        return self._dispatched(step, previous)

    def _dispatched(self, step: Launched, previous: Launched | None) -> Launched:
        if not step.constrained or previous is None:
            self._dispatch_sampler(step)
        return step

    def _forget_ended(self, running) -> None:
        """Drops the page-table rows and sampling slots of sequences not in `running` (the
        running queue), once as many have piled up as run."""
        if self.runner.tables.num_rows > 2 * len(running) + 64:
            live = {s.seq_id for s in running}
            self.runner.tables.retain(live)
            self.sampling.retain(live)

    def _dispatch_sampler(self, step: Launched) -> None:
        batch, logits, tensors, num_logprobs, num_prompt_logprobs, prev_rows, prev_tokens = step.sampler_args
        allowed = None
        if step.constrained:
            allowed = self.grammars().bitmask(step.constrained, len(batch.logits_indices),
                                              mask_rows(sum(count for _, _, count in step.constrained)))
        if step.speculates:
            draft_ids, draft_dists = self.speculation.draft_rows(step.rows, step.drafts, len(batch.logits_indices))
            step.result, step.prompt_result, step.accepted = self.runner.verify(
                batch, logits, tensors, draft_ids, draft_dists, num_logprobs, num_prompt_logprobs, allowed,
                prev_rows, prev_tokens)
        else:
            step.result, step.prompt_result, step.next_tokens = self.runner.sample(
                batch, logits, tensors, num_logprobs, num_prompt_logprobs, allowed, prev_rows, prev_tokens)
        step.sampler_args = None

    # ---- booking ----------------------------------------------------------------------------------
    def _can_overlap(self, step: Launched) -> bool:
        """A step of the full schedule may stay in flight when the next step can be scheduled
        without its tokens: no beams, no prompt logprobs, no speculation. A request whose n > 1
        samples start in it forks them with pending tokens (`StepBooking.fork_pending`), unless
        it has a grammar (the children copy the parent's state before its first token). Rows
        that reach their length limit finish early (`StepBooking.finish_by_length`). Penalised
        rows overlap: their counts lack the token in flight, which the sampler adds on the
        device (sampler.apply_penalties). Structured rows overlap too: the next step's bitmasks
        wait for these tokens, but only its sampler does (see `_launch`), not its model. While
        speculation is on (few sequences run, see `SpeculationCoordinator.active`) no step stays
        in flight: proposals need every last token on the host. A step of the batch always may."""
        if not self.config.async_scheduling or step.prompt_plan or step.pooling or step.speculates \
                or (self.speculation is not None and self.speculation.active(self.scheduler.num_running)):
            return False
        return all(request.beam is None and (count == 1 or sample.matcher is None)
                   for (request, sample, _), count in zip(step.rows, step.counts))

    def _book_pending(self, step: Launched, batch: DecodeBatch | None, sched: SchedulerOutput,
                      tail: list[Sequence]) -> None:
        """Books a step that stays in flight: each sampling sequence gets a placeholder token
        (`StepBooking.resolve` replaces it), the n - 1 children of the requests whose prompt
        ended are forked, the rows whose pending token is their last by length leave the
        scheduler now, and the step keeps the batch the next step starts from (`step.decode`)."""
        self.scheduler.update(sched, {s.seq.seq_id: PENDING_TOKEN for s in sched.scheduled if s.samples},
                              decode_token=PENDING_TOKEN)
        self.booking.sample_kv_utilisation()
        if sched.scheduled:
            self.booking.fork_pending(step)
        if batch is not None:
            batch.advance()
            step.decode = self._next_batch(batch, step, sched.scheduled, tail)
            self.stats.decode_batch_steps += 1
        else:
            self.booking.finish_by_length(step)
            step.decode = DecodeBatch.build(sched.scheduled, step.rows, step.counts, *step.sampling_rows,
                                            self.runner.tables, lora=self.lora)
        self.stats.overlapped_steps += 1

    def _next_batch(self, batch: DecodeBatch, step: Launched, chunks: list, tail: list[Sequence]
                    ) -> DecodeBatch | None:
        """The batch the next step starts from (after `batch.advance()`): the rows whose next
        token is their last by length leave the scheduler now (as StepBooking.finish_by_length);
        the prompts that ended this step join, in queue order, each with the children it forked;
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
            sample.seq for _, sample, _ in new_rows if self.booking.ends_by_length(sample)]
        self.booking.finish([(seq, "length") for seq in by_length])
        if not chunks:
            return batch
        if joining is not None:
            self.stats.joined_rows += len(new_rows)
            return batch.extended(joining, tail[k:])
        if sampled:  # a prompt ended behind one that did not: the full schedule's to order
            return None
        batch.prefilling = tail
        return batch
