"""What a dispatched step's tokens do to the engine's state: in-flight bookkeeping.

A step that stays in flight (async scheduling) has its tokens booked as pending placeholders
first (engine_step.py), so the next step can be scheduled, and replaced once read (`resolve`);
the n - 1 children a forking request starts with are forked then, with pending tokens too
(`fork_pending`: they share the parent's pages, copied on their first write), and the rows whose
pending token is their last by length leave the scheduler (`finish_by_length`). A step the engine
waits for is booked whole (`complete`): prompt logprobs, accepted drafts of a speculating row,
the target's token, the children of a forking request, the beams beam.py picks, and the pooled
rows of embedding requests. Then the output processor turns tokens into text and stops, and the
sequences that stopped leave the scheduler. Pure Python on the host, but for `fetch`.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from paxpage.embedding import EmbeddingRequest
from paxpage.engine_stats import EngineStats
from paxpage.launched import PENDING_TOKEN, Launched, fetch
from paxpage.output_processor import OutputProcessor, Request
from paxpage.outputs import StreamDelta
from paxpage.sampling.batch import SamplingBatch
from paxpage.scheduler import Scheduler


KV_SAMPLE_EVERY = 8  # steps between samples of the KV pool's utilisation

Deltas = list[tuple[Request, list[StreamDelta]]]


class StepBooking:
    def __init__(self, scheduler: Scheduler, outputs: OutputProcessor, beams, stats: EngineStats,
                 embeds: dict[int, EmbeddingRequest], new_sequence: Callable, tokenizer,
                 sampling: SamplingBatch, speculation=None):
        self.scheduler = scheduler
        self.sampling = sampling  # the running sequences' sampling slots
        self.outputs = outputs
        self.beams = beams  # beam.BeamCoordinator
        self.stats = stats
        self.embeds = embeds  # the engine's live embedding requests by request id
        self.new_sequence = new_sequence  # (prompt ids, max tokens, request id) -> Sequence
        self.tokenizer = tokenizer
        self.speculation = speculation  # speculative.coordinator.SpeculationCoordinator, or None

    def fork_pending(self, step: Launched) -> None:
        """The n - 1 children of each request that samples its n tokens in `step` (in flight, its
        update done), each with a pending first token from its own logits row (parent's row +
        i): forked in the scheduler (they share the parent's pages), registered as samples, and
        made entries of `step` of their own, so that `step.rows` has one entry per sample, each
        one logits row, in the running queue's order. The children's sampling slots replace the
        parent's in `step.sampling_rows` (child i draws with the parent's seed + i)."""
        forking = [i for i, count in enumerate(step.counts) if count != 1]
        if not forking:
            return
        # The entries between forking ones stay as they are: copied by the slice (a step that
        # admits one request beside a batch of hundreds of rows touches that one in Python).
        rows, start, slots, steps = [], 0, np.array(step.sampling_rows[0]), np.array(step.sampling_rows[1])
        for i in forking:
            rows += step.rows[start:i + 1]
            start = i + 1
            request, parent, first_row = step.rows[i]
            assert parent.matcher is None and request.beam is None, request  # those fork when read
            for extra in range(1, step.counts[i]):
                child = self._child(request, parent, extra, PENDING_TOKEN)
                seq_id = child.seq.seq_id
                rows.append((request, child, first_row + extra))
                step.row_of_seq[seq_id] = first_row + extra
                slots[first_row + extra] = self.sampling.slot(seq_id, request.params, child.seed)
            request.forked = True
        rows += step.rows[start:]
        step.rows, step.counts, step.drafts = rows, [1] * len(rows), [()] * len(rows)
        step.sampling_rows = (slots, steps)

    def finish_by_length(self, step: Launched) -> None:
        """Maps the in-flight step's sequences to their logits rows; those whose pending token
        is their last by length leave the scheduler now."""
        for _, sample, row in step.rows:
            seq = sample.seq
            step.row_of_seq[seq.seq_id] = row
            if seq.is_finished:  # stopped when the previous step's tokens were read
                continue
            if self.ends_by_length(sample):
                self.scheduler.finish(seq, "length")
                self._freed(seq.seq_id)

    @staticmethod
    def ends_by_length(sample) -> bool:
        """Whether the token `sample` was just booked (pending) is its last by length: its
        max_tokens-th output, or its max_model_len-th token (`Sample.limit`)."""
        return sample.seq.num_output_tokens >= sample.limit

    def resolve(self, step: Launched) -> Deltas:
        """Reads an in-flight step's tokens (one array; top logprobs in it only when some row asked)
        and hands them to the output processor, each in place of its sample's pending
        placeholder."""
        t = time.perf_counter()
        result = fetch(step.result)
        self.stats.device_seconds += time.perf_counter() - t
        return self._process(step.rows, result.token_ids.tolist(), result, pending=PENDING_TOKEN)

    def complete(self, step: Launched) -> Deltas:
        """The synchronous path: waits for the step's tokens, then books them."""
        t = time.perf_counter()
        result, prompt_result, accepted, pooled = fetch((step.result, step.prompt_result, step.accepted,
                                                         step.pooled))
        self.stats.device_seconds += time.perf_counter() - t
        sched = step.sched
        embedded = self._pool(step.pooling, pooled)
        for j, (plan_index, position) in enumerate(step.prompt_plan):
            self.outputs.record_prompt_logprobs(
                sched.scheduled[plan_index].seq, position, prompt_result.target_logprobs[j],
                prompt_result.top_ids[j], prompt_result.top_logprobs[j])
        token_ids = result.token_ids.tolist()
        sampled: dict[int, int | list[int]] = {}  # seq_id -> its token (a speculating row: its tokens)
        forks: list[tuple[Request, object, int]] = []  # (request, parent sample, first row)
        entries: list[tuple[Request, object, int]] = []  # one per new token, for the output processor
        indices: list[int | None] = []  # each one's position among its sample's outputs (None: the last)
        beam_rows: list[tuple[Request, object, int]] = []  # beam.py picks their tokens
        verified = []  # sequences that speculated, for the proposer
        for (request, sample, row), count, drafts in zip(step.rows, step.counts, step.drafts):
            if request.beam is not None:
                beam_rows.append((request, sample, row))
                continue
            if sample.finish_reason is not None:  # stopped while the previous step was in flight
                continue
            if drafts:  # the accepted drafts, then the target's token at the first rejection
                num_accepted = 0
                while num_accepted < len(drafts) and accepted[row + num_accepted]:
                    num_accepted += 1
                first = sample.seq.num_output_tokens
                sampled[sample.seq.seq_id] = token_ids[row:row + num_accepted + 1]
                entries += [(request, sample, row + j) for j in range(num_accepted + 1)]
                indices += range(first, first + num_accepted + 1)
                verified.append(sample.seq)
                self.stats.spec_rows += 1
                self.stats.draft_tokens += len(drafts)
                self.stats.accepted_tokens += num_accepted
                continue
            sampled[sample.seq.seq_id] = token_ids[row]
            entries.append((request, sample, row))
            indices.append(None)
            if count > 1:
                forks.append((request, sample, row))
            request.forked = True
        self.beams.select(beam_rows, result, sampled)
        self.scheduler.update(sched, sampled)
        self.sample_kv_utilisation()
        children = self._fork(forks, token_ids)
        entries += children
        indices += [None] * len(children)
        if verified:
            self.stats.spec_steps += 1
        deltas = self._process(entries, token_ids, result, indices=indices if verified else None)
        for seq in verified:
            if not seq.is_finished:
                self.speculation.on_verified(seq.seq_id, seq.num_tokens)
        deltas += self.beams.apply(self.tokenizer)  # forks, dropped beams, finished beam requests
        return deltas + embedded

    def _fork(self, forks: list[tuple[Request, object, int]], token_ids: list[int]
              ) -> list[tuple[Request, object, int]]:
        """Parallel samples fork after the parent's prompt is in the cache: they share its
        pages, and the first write into the shared last page copies it. Child i draws with the
        parent's seed + i; its first token is logits row first_row + i. Returns the children's
        (request, sample, logits row) entries."""
        entries = []
        for request, parent, first_row in forks:
            for extra in range(1, request.params.n):
                child = self._child(request, parent, extra, token_ids[first_row + extra])
                entries.append((request, child, first_row + extra))
        return entries

    def _child(self, request: Request, parent, extra: int, token: int):
        """Sample `extra` of a forking request: a sequence of its own whose first output is
        `token` (PENDING_TOKEN while in flight), sharing the parent's pages, drawing with the
        parent's seed + extra, and the parent's grammar state before its first token."""
        seq = self.new_sequence(request.prompt_ids, request.params.max_tokens, request.request_id)
        child = self.outputs.new_sample(request, seq, parent.seed + extra)
        if parent.matcher is not None:
            child.matcher = parent.matcher.deep_copy()
        seq.append_token(token)
        self.scheduler.fork(parent.seq, seq)
        request.samples.append(child)
        return child

    def _pool(self, pooling, pooled) -> list[tuple[EmbeddingRequest, list]]:
        """Adds a step's pooled rows to their embedding requests; those whose last chunk ran
        finish (their pages are freed before `scheduler.update`, which then skips them)."""
        done = []
        for embed, start, last, row in pooling:
            if embed.finished:  # aborted while the step ran
                continue
            embed.add(start, pooled[row])
            if last:
                embed.finish()
                self.scheduler.finish(embed.seq, "stop")
                del self.embeds[embed.request_id]
                done.append((embed, []))
        return done

    def _process(self, entries: list, token_ids: list[int], result, *, pending: int | None = None,
                 indices: list[int | None] | None = None) -> Deltas:
        """The output processor's booking of the entries' tokens (`OutputProcessor.process`; the
        top alternatives only when some row asked for them); the sequences it stopped leave the
        scheduler."""
        top = (result.top_ids, result.top_logprobs) if result.num_top else (None, None)
        deltas, to_finish, num_taken = self.outputs.process(entries, token_ids, result.logprobs.tolist(), *top,
                                                            pending=pending, indices=indices)
        self.finish(to_finish)
        self.stats.generated_tokens += num_taken
        return deltas

    def finish(self, to_finish) -> None:
        """The (sequence, reason) pairs the output processor stopped leave the scheduler (a
        sequence finished early by length already left)."""
        for seq, reason in to_finish:
            if not seq.is_finished:
                self.scheduler.finish(seq, reason)
                self._freed(seq.seq_id)

    def _freed(self, seq_id: int) -> None:
        if self.speculation is not None:
            self.speculation.on_free(seq_id)

    def sample_kv_utilisation(self) -> None:
        # Measured while this step's sequences still hold their pages (before stops free them).
        if self.stats.steps % KV_SAMPLE_EVERY == 0:
            self.stats.kv_utilisation_sum += self.scheduler.stats().kv_utilization
            self.stats.kv_utilisation_samples += 1
