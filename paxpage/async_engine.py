"""The asyncio front end: `AsyncEngine`, like vLLM's `AsyncLLM`.

    engine = paxpage.AsyncEngine(paxpage.load(), paxpage.EngineConfig(max_num_seqs=32))
    async for delta in engine.stream(token_ids, paxpage.SamplingParams(max_tokens=64)):
        print(delta.text, end="")
    out = await engine.generate(token_ids, params, request_id="a")   # the final RequestOutput
    emb = await engine.embed(token_ids, "mean")                      # an EmbeddingOutput

It owns one engine (and so one KV pool) driven by an `EngineLoop` thread; every request's
outputs come back through its own asyncio queue. Cancelling the awaiting task, or closing the
`stream` generator, aborts the request, and its pages are free before the next engine step.

A request with structured outputs has its grammar compiled on a small thread pool before it is
submitted (llguidance compiles outside the GIL), so a large schema never stalls the engine loop
and the other requests' steps; past `grammar_timeout_s` the request fails with a ValueError.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Sequence

from paxpage.config import EngineConfig
from paxpage.data_parallel import make_engine, make_loop
from paxpage.embedding import EmbeddingOutput, Pooling
from paxpage.engine_loop import (FINAL_OUTPUTS, EngineDeadError, EngineOverloadedError, EngineSnapshot,
                                 EngineStepError, Submission)
from paxpage.outputs import RequestOutput, StreamDelta
from paxpage.sampling.params import SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError", "EngineOverloadedError", "EngineSnapshot", "EngineStepError"]


class AsyncEngine:
    def __init__(self, model, engine_config: EngineConfig | None = None, *,
                 max_waiting_requests: int | None = None, restart_on_error: bool = False,
                 max_restarts_per_minute: int = 3, grammar_timeout_s: float = 10.0):
        """restart_on_error: after a failed step (its live requests get an EngineStepError), rebuild
        the engine and go on, at most max_restarts_per_minute times a minute (engine_loop.py).
        grammar_timeout_s: the longest a request's structured-output grammar may take to compile."""
        if not grammar_timeout_s > 0:
            raise ValueError(f"grammar_timeout_s must be > 0, got {grammar_timeout_s!r}")
        self.grammar_timeout_s = grammar_timeout_s
        self._grammar_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="paxpage-grammar")
        if engine_config is not None and not isinstance(engine_config, EngineConfig):
            raise TypeError(f"engine_config must be an EngineConfig, got {type(engine_config).__name__}")
        self.model = model
        # data_parallel_size > 1: one loop per replica behind a router (data_parallel.py), and
        # `engine` is replica 0 (config and eos ids are the same on every replica)
        params = getattr(model, "param_forms", model.params)  # a Model's: one weight copy for all its engines
        loras = getattr(model, "loras", None)  # a Model's LoRA adapters (Model.load_lora)
        self._loop = make_loop(make_engine(model.config, params, model.tokenizer, engine_config, loras),
                               max_waiting_requests=max_waiting_requests, restart_on_error=restart_on_error,
                               max_restarts_per_minute=max_restarts_per_minute)
        self.config = self.engine.config

    @property
    def engine(self):
        """The engine now running (a new one after each restart); replica 0's when data-parallel."""
        return self._loop.engine
        self.eos_token_ids = self.engine.eos_token_ids

    @property
    def tokenizer(self):
        return self.model.tokenizer

    async def generate(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams, *,
                       request_id: str | None = None, prompt: str | None = None,
                       lora: str | None = None) -> RequestOutput:
        """The request's final output (all n completions, logprobs, metrics). `lora`: the name of
        a LoRA adapter of the model (Model.load_lora), or None for the base model."""
        return await self._final(self._items(prompt_token_ids, sampling_params, request_id, prompt, stream=False,
                                             lora=lora))

    async def stream(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams, *,
                     request_id: str | None = None, prompt: str | None = None,
                     lora: str | None = None) -> AsyncIterator[StreamDelta]:
        """Text deltas as tokens are produced; each sample's last delta carries its finish_reason."""
        items = self._items(prompt_token_ids, sampling_params, request_id, prompt, stream=True, lora=lora)
        try:
            async for item in items:
                if isinstance(item, StreamDelta):
                    yield item
        finally:
            await items.aclose()

    async def embed(self, prompt_token_ids: Sequence[int], pooling: Pooling | str = "last", *,
                    request_id: str | None = None) -> EmbeddingOutput:
        """The prompt's embedding (paxpage/embedding.py), computed in the same engine steps as
        the generating requests. pooling: "last", "mean", "last-unnormalized", "mean-unnormalized"."""
        return await self._final(self._items(prompt_token_ids, None, request_id, None, stream=False,
                                             pooling=Pooling.parse(pooling)))

    @staticmethod
    async def _final(items: AsyncIterator[Any]):
        """The one item of a request that does not stream: its final output."""
        try:
            async for item in items:
                return item
        finally:
            await items.aclose()
        raise AssertionError("the engine loop ended a request without its output")

    def abort(self, request_id: str) -> None:
        """Aborts a request by id; unknown or finished ids are ignored. Thread-safe."""
        self._loop.abort(request_id)

    def stats(self) -> EngineSnapshot:
        return self._loop.snapshot()

    def shutdown(self) -> None:
        self._loop.shutdown()
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """Compiles the request's grammar into every replica's cache, off the event loop and the
        engine threads; ValueError when it is invalid or takes longer than grammar_timeout_s."""
        spec = params.structured_outputs
        engines = getattr(self._loop, "engines", None) or [self.engine]

        def compile_all():
            for engine in engines:
                engine.grammars().compile(spec)

        work = asyncio.wrap_future(self._grammar_pool.submit(compile_all))
        work.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, even after a timeout
        try:
            await asyncio.wait_for(asyncio.shield(work), self.grammar_timeout_s)
        except asyncio.TimeoutError:
            raise ValueError(f"structured_outputs {spec.kind} did not compile within "
                             f"{self.grammar_timeout_s:g} s; simplify it") from None

    async def _items(self, prompt_token_ids, params: SamplingParams | None, request_id: str | None,
                     prompt: str | None, *, stream: bool, pooling: Pooling | None = None,
                     lora: str | None = None) -> AsyncIterator[Any]:
        if pooling is None and not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if params is not None and params.structured_outputs is not None:
            await self._compile_grammar(params)
        running = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(item: Any) -> None:  # called on the engine loop's thread
            running.call_soon_threadsafe(queue.put_nowait, item)

        request_id = request_id or self._loop.new_request_id()
        done = self._loop.submit([Submission(request_id, list(prompt_token_ids), params, sink, prompt,
                                             0, stream, pooling, lora)])
        finished = False
        try:
            await asyncio.wrap_future(done)  # the request's ValueError, if it can never run
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if isinstance(item, FINAL_OUTPUTS):
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._loop.abort(request_id)
