"""The engine step: scheduler (host) -> runner (device) -> sampler -> output processor.

`LLMEngine.step()` runs one continuous-batching step: requests join and leave every step,
long prompts are prefilled in chunks beside running decodes, and when pages run out the
scheduler preempts and later resumes sequences, so nothing is lost. What happens to the
tokens afterwards (text, stops, logprobs, per-request outputs) is the output processor's
job (output_processor.py); driving the step for many callers is the engine loop's
(engine_loop.py). The engine itself is single-threaded: one owner calls it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping

import jax

from models.config import ModelConfig
from paxpage import beam as beam_lib
from paxpage.admission import Admission
from paxpage import compile_counter, kv_sizing
from paxpage import speculative as spec_lib
from paxpage.engine_step import EngineStep
from paxpage.booking import StepBooking
from paxpage.config import EngineConfig
from paxpage.embedding import EmbeddingOutput, EmbeddingRequest, Pooling
from paxpage.engine_stats import EngineStats
from paxpage.lora_slots import LoraSlots
from paxpage.launched import PENDING_TOKEN
from paxpage.output_processor import OutputProcessor, Request
from paxpage.outputs import RequestOutput, StreamDelta
from paxpage.runner import ModelRunner
from paxpage.sampling.batch import SamplingBatch
from paxpage.sampling.params import SamplingParams
from paxpage.sampling.tensors import SamplingTensors
from paxpage.scheduler import Scheduler, SchedulerConfig
from paxpage.speculative.coordinator import SpeculationCoordinator
from paxpage.structured_backend import GrammarBackend, bitmask_words


log = logging.getLogger("paxpage")


class LLMEngine:
    def __init__(self, model_cfg: ModelConfig, params, tokenizer, config: EngineConfig | None = None,
                 *, mesh=None, runner: ModelRunner | None = None, loras: Mapping[str, Any] | None = None):
        """`mesh`: the 1-D ("model",) mesh of this engine's devices when it is one data-parallel
        replica (paxpage/data_parallel.py builds them); by default the config's own mesh.
        `runner`: an existing engine's runner (weights, compiled steps) to start afresh on; see
        `rebuilt`. `loras`: name -> models.lora.LoraAdapter, the adapters requests may name
        (read at each request: adapters loaded later are seen; needs max_loras > 0)."""
        compile_counter.install()
        self.model_cfg = model_cfg
        self.tokenizer = tokenizer
        fresh = runner is None
        if fresh:
            cfg = (config or EngineConfig()).resolve(model_cfg)
            if mesh is None and cfg.is_parallel:
                from paxpage.mesh import replica_meshes

                if cfg.data_parallel_size > 1:
                    raise ValueError(f"data_parallel_size is {cfg.data_parallel_size}; one LLMEngine is one "
                                     "replica: use paxpage.generate / stream / AsyncEngine, or give mesh=")
                mesh = replica_meshes(cfg.tensor_parallel_size, 1, cfg.mesh)[0]
            runner = ModelRunner(model_cfg, params, cfg, mesh)
        self.runner = runner
        # num_pages is set now (on GPU / TPU maybe from the device's free memory)
        self.config = cfg = self.runner.cfg
        if jax.process_count() > 1:  # multi-host: every device call also runs on the followers
            from paxpage.multihost import LockstepRunner

            self.runner = LockstepRunner(self.runner)
        log.info("paxpage: %s", self.describe_kv_cache())
        log.info("paxpage: %s", self.describe_memory())
        self.scheduler = Scheduler(SchedulerConfig(
            num_pages=cfg.num_pages,
            page_size=cfg.page_size,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            allocation=cfg.kv_allocation,
            # Pages outside the window are released only when no layer is global (Gemma's are).
            sliding_window=model_cfg.max_window,
            max_prefill_rows=cfg.prefill_rows,
            prefill_row_len=cfg.prefill_row_len,
        ))
        # config.json's eos ids and generation_config.json's / the GGUF's end-of-turn ids
        self.eos_token_ids = model_cfg.end_token_ids or (
            (tokenizer.eos_token_id,) if tokenizer is not None and tokenizer.eos_token_id is not None else ()
        )
        self.stats = EngineStats()
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids, cfg.max_model_len)
        self._embeds: dict[int, EmbeddingRequest] = {}  # live embedding requests by request id
        self.loras = loras if loras is not None else {}
        self.admission = Admission(model_cfg, cfg, tokenizer, self.eos_token_ids, self.scheduler, self.outputs,
                                   self.stats, self._embeds, self.loras)
        new_sequence = self.admission.new_sequence
        self._beams = beam_lib.BeamCoordinator(self.scheduler, self.outputs, new_sequence)
        proposer = spec_lib.make_proposer(cfg, model_cfg, tokenizer)
        if proposer is not None and jax.process_count() > 1:
            raise ValueError("speculative decoding is not supported on multi-host engines")
        self._spec = (None if proposer is None else SpeculationCoordinator(
            proposer, cfg.resolved_speculative_max_batch, cfg.max_model_len, PENDING_TOKEN))
        # the running sequences' sampling parameters, one slot each, kept between steps
        self._sampling = SamplingBatch(model_cfg.vocab_size, self.eos_token_ids, token_width=cfg.max_model_len,
                                       pending_token=PENDING_TOKEN)  # token_width caps the penalty-token width
        self._booking = StepBooking(self.scheduler, self.outputs, self._beams, self.stats, self._embeds,
                                    new_sequence, tokenizer, self._sampling, self._spec)

        self._step = EngineStep(self.scheduler, self.runner, self.outputs, self._sampling, self._booking,
                                self._beams, self.stats, self._embeds, cfg, self.admission.grammars, self._spec)

        if cfg.max_loras:
            self.scheduler.lora_slots = LoraSlots(cfg.max_loras, self.runner.load_lora)

        self.precompiled: tuple[int, float] | None = None  # (shapes, seconds) once precompile() ran
        if self.config.precompile and fresh:  # a rebuilt engine's runner has its steps compiled
            self.precompile()

    def rebuilt(self) -> "LLMEngine":
        """A fresh engine on this one's weights and compiled steps, with an empty KV pool and no
        requests: what the engine loop runs after a step failed (this engine is then unusable).
        Not for multi-host engines, whose followers would have to rebuild in step."""
        if jax.process_count() > 1:
            raise RuntimeError("a multi-host engine cannot be rebuilt in place")
        self._step.inflight = None
        self.runner.reset_state()
        return LLMEngine(self.model_cfg, None, self.tokenizer, None, runner=self.runner, loras=self.loras)

    def describe_kv_cache(self) -> str:
        """One line: pages, tokens, GiB, and where the size came from."""
        cfg, budget = self.config, self.runner.memory_budget
        source = cfg.kv_source
        if budget is not None:
            source = (f"gpu_memory_utilization {budget.utilization:g} of {budget.bytes_limit / kv_sizing.GIB:.1f} "
                      f"GiB, after {budget.bytes_in_use / kv_sizing.GIB:.2f} GiB in use and a "
                      f"{budget.step_bytes / kv_sizing.GIB:.2f} GiB step")
        line = kv_sizing.describe_pool(cfg.num_pages, cfg.page_size, cfg.page_bytes, source)
        return line if cfg.kv_cache_dtype == "auto" else f"{line}, {cfg.kv_cache_dtype} with per-token scales"

    def describe_memory(self) -> str:
        """One line: the weights' bytes by dtype (per device when sharded: what the runner holds
        on each) and the KV bytes of a token and of a max_model_len sequence."""
        from models.quant import bytes_by_dtype

        cfg = self.config
        runner = getattr(self.runner, "runner", self.runner)  # multi-host wraps the runner
        by_dtype = bytes_by_dtype(runner.params, per_device=True)
        return (f"{kv_sizing.describe_weights(by_dtype)}; "
                f"{kv_sizing.describe_kv_per_sequence(cfg.page_bytes, cfg.page_size, cfg.max_model_len)}")

    def precompile(self) -> tuple[int, float]:
        """Compiles every step shape this config can produce now, so no request waits for a
        compile later (with jax's persistent compilation cache, e.g. as the CLI and `paxpage
        serve` enable it, a later process loads them instead). Returns (shapes, seconds)."""
        t = time.perf_counter()
        vocab = self.model_cfg.vocab_size

        def padding_rows(num_rows: int) -> SamplingTensors:
            return SamplingTensors.build([], vocab, pad_rows_to=num_rows, eos_token_ids=self.eos_token_ids,
                                         token_width=self.config.max_model_len)

        # With a tokenizer, structured outputs may come: their sampler (with a bitmask) too.
        words = bitmask_words(max(vocab, len(self.tokenizer))) if self.tokenizer is not None else 0
        count = self.runner.precompile(padding_rows, words)
        self.precompiled = (count, time.perf_counter() - t)
        return self.precompiled

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams, *, index: int = 0,
                    prompt: str | None = None, stream: bool = True, lora: str | None = None) -> int:
        """Queues a prompt and returns its request id (`Admission.add_request`: ValueError at once
        if it can never be served)."""
        return self.admission.add_request(prompt_ids, params, index=index, prompt=prompt, stream=stream, lora=lora)

    def add_embedding(self, prompt_ids: list[int], pooling: Pooling | str = "last", *, index: int = 0) -> int:
        """Queues an embedding request and returns its id (`Admission.add_embedding`)."""
        return self.admission.add_embedding(prompt_ids, pooling, index=index)

    def grammars(self) -> GrammarBackend:
        """The engine's grammar backend (`Admission.grammars`); any thread may call it."""
        return self.admission.grammars()

    def abort(self, request_id: int) -> None:
        embed = self._embeds.pop(request_id, None)
        if embed is not None:
            self.scheduler.abort(embed.seq.seq_id)
            embed.finish_reason = "abort"
            return
        _, seqs = self.outputs.abort(request_id)
        for seq in seqs:
            if seq.output_token_ids and seq.output_token_ids[-1] == PENDING_TOKEN:
                seq.output_token_ids.pop()  # its in-flight token is discarded
            self.scheduler.abort(seq.seq_id)
            if self._spec is not None:
                self._spec.on_free(seq.seq_id)

    def request(self, request_id: int) -> Request | None:
        """A live request (None once it finished or was aborted)."""
        embed = self._embeds.get(request_id)
        return embed if embed is not None else self.outputs.get(request_id)

    def output(self, request: Request | EmbeddingRequest) -> RequestOutput | EmbeddingOutput:
        if isinstance(request, EmbeddingRequest):
            return request.output()
        if request.beam is not None:
            return self._beams.output(request, self.tokenizer)
        return self.outputs.output(request)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[tuple[Request, list[StreamDelta]]]:
        """Runs one step; returns, per request that produced text, its new deltas (a request
        added with stream=False: only in the step it finishes, with no deltas).

        With async scheduling (the default) a plain decode step stays in flight on the device
        while the host schedules and dispatches the next one; its tokens are read, checked for
        stops and returned by the next call, one step late. Sequences that stopped meanwhile
        have their one extra token discarded, so outputs equal the synchronous engine's.
        Finished requests leave the engine (`request.finished`); read them via `output(request)`."""
        t0, waited = time.perf_counter(), self.stats.device_seconds
        deltas = self._step.run()
        self.stats.host_seconds += time.perf_counter() - t0 - (self.stats.device_seconds - waited)
        return deltas

    def wait_for_compiles(self, timeout: float | None = None) -> bool:
        """Blocks until no step shape is compiling in the background (ahead_compile.py), or
        `timeout` seconds passed; True if none is. For benchmarks that measure after a warm-up."""
        ahead = getattr(self.runner, "ahead", None)
        return True if ahead is None else ahead.wait(timeout)

    def has_unfinished(self) -> bool:
        # An in-flight step with no live request left carries only tokens to discard.
        return len(self.outputs) > 0 or bool(self._embeds)
