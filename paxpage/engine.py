"""The engine loop: scheduler (host) -> runner (device) -> sampler -> stops -> scheduler.

`LLMEngine.step()` runs one continuous-batching step: requests join and leave every step,
long prompts are prefilled in chunks beside running decodes, and when pages run out the
scheduler preempts and later resumes sequences, so nothing is lost.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any


from models.config import ModelConfig
from paxpage import beam as beam_lib
from paxpage import compile_counter
from paxpage.config import EngineConfig
from paxpage.detokenizer import IncrementalDetokenizer
from paxpage.outputs import Completion, RequestOutput, StreamDelta
from paxpage.runner import ModelRunner, RowPlan
from paxpage.sampler import RowInfo, SamplingTensors
from paxpage.sampling_params import SamplingParams
from paxpage.scheduler import Scheduler, SchedulerConfig
from paxpage.sequence import Sequence


@dataclasses.dataclass
class _Sample:
    """Host state of one generated sequence of a request."""

    seq: Sequence
    seed: int
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: Any = None
    emitted_text: int = 0  # characters already streamed
    emitted_tokens: int = 0
    # prompt position p -> {prompt[p + 1]: logprob, top alternatives...}; only when asked
    prompt_logprobs: dict[int, dict[int, float]] | None = None


@dataclasses.dataclass
class _Request:
    request_id: int
    index: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    forked: bool = False  # True once the n samples exist
    beam: beam_lib.BeamSearch | None = None  # beam search state; samples are then the live beams

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return len(self.samples) == self.params.n and all(s.finish_reason for s in self.samples)


@dataclasses.dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    host_seconds: float = 0.0  # scheduling + packing + stop checks
    device_seconds: float = 0.0  # jitted step incl. the token transfer
    kv_utilisation_sum: float = 0.0  # summed over steps; divide by steps

    @property
    def mean_kv_utilisation(self) -> float:
        return self.kv_utilisation_sum / max(1, self.steps)


class LLMEngine:
    def __init__(self, model_cfg: ModelConfig, params, tokenizer, config: EngineConfig | None = None):
        compile_counter.install()
        self.model_cfg = model_cfg
        self.tokenizer = tokenizer
        self.config = (config or EngineConfig()).resolve(model_cfg)
        cfg = self.config
        self.runner = ModelRunner(model_cfg, params, cfg)
        self.scheduler = Scheduler(SchedulerConfig(
            num_pages=cfg.num_pages,
            page_size=cfg.page_size,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            allocation=cfg.kv_allocation,
        ))
        self.eos_token_ids = tuple(model_cfg.eos_token_ids) or (
            (tokenizer.eos_token_id,) if tokenizer is not None and tokenizer.eos_token_id is not None else ()
        )
        self.stats = EngineStats()
        self._requests: dict[int, _Request] = {}
        self._by_seq: dict[int, tuple[_Request, _Sample]] = {}
        self._next_request = 0
        self._next_seq = 0
        self._beams = beam_lib.BeamCoordinator(self)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams, *, index: int = 0,
                    prompt: str | None = None) -> int:
        """Queues a prompt; raises ValueError at once if it can never be served."""
        params.validate_for(self.model_cfg.vocab_size, self.config.max_model_len, len(prompt_ids),
                            prompt_token_ids=prompt_ids)
        request_id = self._next_request
        self._next_request += 1
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        request = _Request(request_id, index, prompt, list(prompt_ids), params, [])
        if params.beam_width > 1:  # rows of its beams sample greedily with top-K logprobs
            request.beam = beam_lib.BeamSearch(params, len(prompt_ids), self.eos_token_ids,
                                               self.model_cfg.vocab_size, self.config)
            request.params = request.beam.row_params
        sample = self._new_sample(request, list(prompt_ids), seed)
        self.scheduler.add(sample.seq)  # raises ValueError for a request that can never fit
        request.samples.append(sample)
        request.forked = params.n == 1
        self._requests[request_id] = request
        self.stats.prompt_tokens += len(prompt_ids)
        return request_id

    def _new_sample(self, request: _Request, prompt_ids: list[int], seed: int) -> _Sample:
        seq = Sequence(prompt_ids, request.params.max_tokens, seq_id=self._next_seq,
                       group_id=request.request_id)
        self._next_seq += 1
        p = request.params
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, p.skip_special_tokens, p.stop,
                                       p.include_stop_str_in_output, p.min_tokens) if self.tokenizer else None
        sample = _Sample(seq, seed, detok, [] if p.logprobs is not None else None)
        if p.prompt_logprobs is not None and not request.samples:
            sample.prompt_logprobs = {}
            seq.use_prefix_cache = False  # cached prompt pages would skip their logprobs
        self._by_seq[seq.seq_id] = (request, sample)
        return sample

    def abort(self, request_id: int) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        for s in request.samples:
            if s.finish_reason is None:
                s.finish_reason = "abort"
                self.scheduler.abort(s.seq.seq_id)
            self._by_seq.pop(s.seq.seq_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[tuple[_Request, list[StreamDelta]]]:
        """Runs one step; returns, per request that produced text, its new deltas.

        Finished requests are removed from the engine; read them via `output(request)`."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        self.runner.copy_pages(sched.copies)
        if self._beams.hold_back(sched):  # a beam request runs all its live beams in a step or none
            return []
        plans = []
        for item in sched.scheduled:
            request, sample = self._by_seq[item.seq.seq_id]
            fork_now = item.samples and not request.forked
            wants_prompt = sample.prompt_logprobs is not None and item.start < item.seq.num_prompt_tokens
            plans.append(RowPlan(item.seq.token_ids, item.seq.page_table, item.start,
                                 item.num_new_tokens,
                                 (request.params.n if fork_now else 1) if item.samples else 0,
                                 item.seq.num_prompt_tokens if wants_prompt else 0))
        batch, logits_plan, prompt_plan = self.runner.pack(plans)
        # Rows of one request's first sample draw its n samples with seeds seed + i.
        infos, rows, row_counter = [], [], {}
        for plan_index in logits_plan:
            request, sample = self._by_seq[sched.scheduled[plan_index].seq.seq_id]
            i = row_counter.get(plan_index, 0)
            row_counter[plan_index] = i + 1
            rows.append(request)
            infos.append(RowInfo(request.params, request.prompt_ids, sample.seq.output_token_ids,
                                 sample.seed + i))
        tensors = SamplingTensors.build(infos, self.model_cfg.vocab_size,
                                        pad_rows_to=len(batch.logits_indices),
                                        eos_token_ids=self.eos_token_ids,
                                        # A fixed width: a growing one would recompile the fused step.
                                        token_width=self.config.max_model_len)
        num_logprobs = _logprob_bucket(max((r.params.logprobs or 0) for r in rows) if rows else 0)
        num_prompt_logprobs = _logprob_bucket(max(
            (self._by_seq[sched.scheduled[i].seq.seq_id][0].params.prompt_logprobs or 0
             for i, _ in prompt_plan), default=0))
        t1 = time.perf_counter()
        result, prompt_result = self.runner.run(batch, tensors, num_logprobs, num_prompt_logprobs)
        t2 = time.perf_counter()
        self._record_prompt_logprobs(sched, prompt_plan, prompt_result)

        # Each logits row holds a token: rows of one sequence are contiguous in `logits_plan`.
        sampled: dict[int, int] = {}
        forks: list[tuple[_Request, _Sample, int]] = []  # (request, parent, first row)
        new_tokens: list[tuple[_Request, _Sample, int, int]] = []  # (request, sample, token, row)
        beam_rows: list[tuple[_Request, _Sample, int]] = []  # beam.py picks their tokens
        row = 0
        while row < len(logits_plan):
            item = sched.scheduled[logits_plan[row]]
            request, sample = self._by_seq[item.seq.seq_id]
            count = logits_plan.count(logits_plan[row])
            if request.beam is not None:
                beam_rows.append((request, sample, row))
                row += count
                continue
            sampled[item.seq.seq_id] = int(result.token_ids[row])
            new_tokens.append((request, sample, int(result.token_ids[row]), row))
            if count > 1:
                forks.append((request, sample, row))
            request.forked = True
            row += count
        self._beams.select(beam_rows, result, sampled)
        self.scheduler.update(sched, sampled)
        # Measured while this step's sequences still hold their pages (before stops free them).
        self.stats.kv_utilisation_sum += self.scheduler.stats().kv_utilization
        # Parallel samples fork after the parent's prompt is in the cache: they share its
        # pages, and the first write into the shared last page copies it.
        for request, parent, first_row in forks:
            for extra in range(1, request.params.n):
                child = self._new_sample(request, request.prompt_ids, parent.seed + extra)
                token = int(result.token_ids[first_row + extra])
                child.seq.append_token(token)
                self.scheduler.fork(parent.seq, child.seq)
                request.samples.append(child)
                new_tokens.append((request, child, token, first_row + extra))
        deltas = self._check_stops(new_tokens, result)
        deltas += self._beams.apply()  # forks, dropped beams, finished beam requests
        self.stats.steps += 1
        self.stats.generated_tokens += len(new_tokens)
        self.stats.host_seconds += (t1 - t0) + (time.perf_counter() - t2)
        self.stats.device_seconds += t2 - t1
        return deltas

    def _record_prompt_logprobs(self, sched, prompt_plan, res) -> None:
        for j, (plan_index, position) in enumerate(prompt_plan):
            seq = sched.scheduled[plan_index].seq
            request, sample = self._by_seq[seq.seq_id]
            k = request.params.prompt_logprobs
            entry = {seq.prompt_token_ids[position + 1]: float(res.target_logprobs[j])}
            for tid, lp in zip(res.top_ids[j][:k], res.top_logprobs[j][:k]):
                entry.setdefault(int(tid), float(lp))
            sample.prompt_logprobs[position] = entry  # a recompute after preemption overwrites

    def _check_stops(self, new_tokens, result) -> list[tuple[_Request, list[StreamDelta]]]:
        by_request: dict[int, tuple[_Request, list[StreamDelta]]] = {}
        for request, sample, token, row in new_tokens:
            p = request.params
            seq = sample.seq
            if sample.logprobs is not None:
                entry = {token: float(result.logprobs[row])}
                for tid, lp in zip(result.top_ids[row][:p.logprobs], result.top_logprobs[row][:p.logprobs]):
                    entry.setdefault(int(tid), float(lp))
                sample.logprobs.append(entry)
            sample.cumulative_logprob += float(result.logprobs[row])
            if sample.detok is not None:
                sample.detok.add(token)
            num_out = len(seq.output_token_ids)
            reason, stop = None, None
            if num_out >= p.min_tokens:
                if not p.ignore_eos and token in self.eos_token_ids:
                    reason, stop = "stop", token
                elif token in p.stop_token_ids:
                    reason, stop = "stop", token
                elif sample.detok is not None and sample.detok.stopped_by is not None:
                    reason, stop = "stop", sample.detok.stopped_by
            if reason is None and (num_out >= p.max_tokens or seq.num_tokens >= self.config.max_model_len):
                reason = "length"
            if reason is not None:
                sample.finish_reason, sample.stop_reason = reason, stop
                self.scheduler.finish(seq, reason)
                if sample.detok is not None:
                    sample.detok.finish()  # flush text held back as a possible stop-string start
            text = sample.detok.text if sample.detok is not None else ""
            delta = StreamDelta(request.index, text[sample.emitted_text:],
                                tuple(seq.output_token_ids[sample.emitted_tokens:]),
                                sample.finish_reason, request.samples.index(sample))
            sample.emitted_text, sample.emitted_tokens = len(text), len(seq.output_token_ids)
            by_request.setdefault(request.request_id, (request, []))[1].append(delta)
        for request, _ in by_request.values():
            if request.finished:
                self._requests.pop(request.request_id, None)
                for s in request.samples:
                    self._by_seq.pop(s.seq.seq_id, None)
        return list(by_request.values())

    def output(self, request: _Request) -> RequestOutput:
        if request.beam is not None:
            return self._beams.output(request)
        completions = [
            Completion(i, s.detok.text if s.detok is not None else "", list(s.seq.output_token_ids),
                       s.finish_reason, s.stop_reason, s.logprobs, s.cumulative_logprob)
            for i, s in enumerate(request.samples)
        ]
        first = request.samples[0]
        prompt_logprobs = None
        if first.prompt_logprobs is not None:
            # vLLM layout: None for the first prompt token, then one entry per later token.
            prompt_logprobs = [None] + [first.prompt_logprobs.get(p)
                                        for p in range(len(request.prompt_ids) - 1)]
        return RequestOutput(request.index, request.prompt, request.prompt_ids, completions,
                             prompt_logprobs=prompt_logprobs,
                             num_cached_tokens=first.seq.num_cached_tokens)

    def request(self, request_id: int) -> _Request | None:
        return self._requests.get(request_id)


def _logprob_bucket(n: int) -> int:
    """Top-k widths compile separately; round up to a few sizes."""
    if n <= 0:
        return 0
    for size in (1, 5, 20):
        if n <= size:
            return size
    return n
