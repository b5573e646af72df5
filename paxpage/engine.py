"""The engine step: scheduler (host) -> runner (device) -> sampler -> output processor.

`LLMEngine.step()` runs one continuous-batching step: requests join and leave every step,
long prompts are prefilled in chunks beside running decodes, and when pages run out the
scheduler preempts and later resumes sequences, so nothing is lost. What happens to the
tokens afterwards (text, stops, logprobs, per-request outputs) is the output processor's
job (output_processor.py); driving the step for many callers is the engine loop's
(engine_loop.py). The engine itself is single-threaded: one owner calls it.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time

from models.config import ModelConfig
from paxpage import beam as beam_lib
from paxpage import compile_counter
from paxpage.config import EngineConfig
from paxpage.output_processor import NewToken, OutputProcessor, Request
from paxpage.outputs import RequestOutput, StreamDelta
from paxpage.runner import ModelRunner, RowPlan
from paxpage.sampler import RowInfo, SamplingTensors
from paxpage.sampling_params import SamplingParams
from paxpage.scheduler import Scheduler, SchedulerConfig
from paxpage.sequence import Sequence


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
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids, cfg.max_model_len)
        self._request_ids = itertools.count()
        self._seq_ids = itertools.count()
        self._beams = beam_lib.BeamCoordinator(self.scheduler, self.outputs, self.new_sequence)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams, *, index: int = 0,
                    prompt: str | None = None) -> int:
        """Queues a prompt; raises ValueError at once if it can never be served."""
        params.validate_for(self.model_cfg.vocab_size, self.config.max_model_len, len(prompt_ids),
                            prompt_token_ids=prompt_ids)
        request_id = next(self._request_ids)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        request = Request(request_id, index, prompt, list(prompt_ids), params, [])
        if params.beam_width > 1:  # rows of its beams sample greedily with top-K logprobs
            request.beam = beam_lib.BeamSearch(params, len(prompt_ids), self.eos_token_ids,
                                               self.model_cfg.vocab_size, self.config)
            request.params = request.beam.row_params
        seq = self.new_sequence(prompt_ids, request.params.max_tokens, request_id)
        sample = self.outputs.new_sample(request, seq, seed)
        try:
            self.scheduler.add(seq)  # raises ValueError for a request that can never fit
        except ValueError:
            self.outputs.drop_sample(seq.seq_id)
            raise
        request.samples.append(sample)
        request.forked = params.n == 1
        self.outputs.add(request)
        self.stats.prompt_tokens += len(prompt_ids)
        return request_id

    def new_sequence(self, prompt_ids: list[int], max_tokens: int, request_id: int) -> Sequence:
        return Sequence(prompt_ids, max_tokens, seq_id=next(self._seq_ids), group_id=request_id)

    def abort(self, request_id: int) -> None:
        _, seqs = self.outputs.abort(request_id)
        for seq in seqs:
            self.scheduler.abort(seq.seq_id)

    def has_unfinished(self) -> bool:
        return len(self.outputs) > 0

    def request(self, request_id: int) -> Request | None:
        """A live request (None once it finished or was aborted)."""
        return self.outputs.get(request_id)

    def output(self, request: Request) -> RequestOutput:
        if request.beam is not None:
            return self._beams.output(request, self.tokenizer)
        return self.outputs.output(request)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[tuple[Request, list[StreamDelta]]]:
        """Runs one step; returns, per request that produced text, its new deltas.

        Finished requests leave the engine (`request.finished`); read them via `output(request)`."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        self.runner.copy_pages(sched.copies)
        if self._beams.hold_back(sched):  # a beam request runs all its live beams in a step or none
            return []
        plans = []
        for item in sched.scheduled:
            request, sample = self.outputs.lookup(item.seq.seq_id)
            fork_now = item.samples and not request.forked
            wants_prompt = sample.prompt_logprobs is not None and item.start < item.seq.num_prompt_tokens
            plans.append(RowPlan(item.seq.token_ids, item.seq.page_table, item.start,
                                 item.num_new_tokens,
                                 (request.params.n if fork_now else 1) if item.samples else 0,
                                 item.seq.num_prompt_tokens if wants_prompt else 0))
        batch, logits_plan, prompt_plan = self.runner.pack(plans)
        # Rows of one request's first sample draw its n samples with seeds seed + i.
        infos, row_params, row_counter = [], [], {}
        for plan_index in logits_plan:
            request, sample = self.outputs.lookup(sched.scheduled[plan_index].seq.seq_id)
            i = row_counter.get(plan_index, 0)
            row_counter[plan_index] = i + 1
            row_params.append(request.params)
            infos.append(RowInfo(request.params, request.prompt_ids, sample.seq.output_token_ids,
                                 sample.seed + i))
        tensors = SamplingTensors.build(infos, self.model_cfg.vocab_size,
                                        pad_rows_to=len(batch.logits_indices),
                                        eos_token_ids=self.eos_token_ids,
                                        # A fixed width: a growing one would recompile the fused step.
                                        token_width=self.config.max_model_len)
        num_logprobs = _logprob_bucket(max((p.logprobs or 0) for p in row_params) if row_params else 0)
        num_prompt_logprobs = _logprob_bucket(max(
            (self.outputs.lookup(sched.scheduled[i].seq.seq_id)[0].params.prompt_logprobs or 0
             for i, _ in prompt_plan), default=0))
        t1 = time.perf_counter()
        result, prompt_result = self.runner.run(batch, tensors, num_logprobs, num_prompt_logprobs)
        t2 = time.perf_counter()
        for j, (plan_index, position) in enumerate(prompt_plan):
            self.outputs.record_prompt_logprobs(
                sched.scheduled[plan_index].seq, position, prompt_result.target_logprobs[j],
                prompt_result.top_ids[j], prompt_result.top_logprobs[j])

        # Each logits row holds a token: rows of one sequence are contiguous in `logits_plan`.
        sampled: dict[int, int] = {}
        forks: list[tuple[Request, object, int]] = []  # (request, parent sample, first row)
        new_tokens: list[NewToken] = []
        beam_rows: list[tuple[Request, object, int]] = []  # beam.py picks their tokens
        row = 0
        while row < len(logits_plan):
            item = sched.scheduled[logits_plan[row]]
            request, sample = self.outputs.lookup(item.seq.seq_id)
            count = logits_plan.count(logits_plan[row])
            if request.beam is not None:
                beam_rows.append((request, sample, row))
                row += count
                continue
            token = int(result.token_ids[row])
            sampled[item.seq.seq_id] = token
            new_tokens.append(NewToken(request, sample, token, row))
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
                seq = self.new_sequence(request.prompt_ids, request.params.max_tokens, request.request_id)
                child = self.outputs.new_sample(request, seq, parent.seed + extra)
                token = int(result.token_ids[first_row + extra])
                seq.append_token(token)
                self.scheduler.fork(parent.seq, seq)
                request.samples.append(child)
                new_tokens.append(NewToken(request, child, token, first_row + extra))
        deltas, to_finish = self.outputs.process(new_tokens, result)
        for seq, reason in to_finish:
            self.scheduler.finish(seq, reason)
        deltas += self._beams.apply(self.tokenizer)  # forks, dropped beams, finished beam requests
        self.stats.steps += 1
        self.stats.generated_tokens += len(new_tokens)
        self.stats.host_seconds += (t1 - t0) + (time.perf_counter() - t2)
        self.stats.device_seconds += t2 - t1
        return deltas


def _logprob_bucket(n: int) -> int:
    """Top-k widths compile separately; round up to a few sizes."""
    if n <= 0:
        return 0
    for size in (1, 5, 20):
        if n <= size:
            return size
    return n
