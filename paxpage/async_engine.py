"""The asyncio front end: `AsyncEngine`, like vLLM's `AsyncLLM`.

    engine = paxpage.AsyncEngine(paxpage.load(), paxpage.EngineConfig(max_num_seqs=32))
    async for delta in engine.stream(token_ids, paxpage.SamplingParams(max_tokens=64)):
        print(delta.text, end="")
    out = await engine.generate(token_ids, params, request_id="a")   # the final RequestOutput

It owns one engine (and so one KV pool) driven by an `EngineLoop` thread; every request's
outputs come back through its own asyncio queue. Cancelling the awaiting task, or closing the
`stream` generator, aborts the request, and its pages are free before the next engine step.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Sequence

from paxpage.config import EngineConfig
from paxpage.data_parallel import make_engine, make_loop
from paxpage.engine_loop import (EngineDeadError, EngineOverloadedError, EngineSnapshot,
                                 Submission)
from paxpage.outputs import RequestOutput, StreamDelta
from paxpage.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError", "EngineOverloadedError", "EngineSnapshot"]


class AsyncEngine:
    def __init__(self, model, engine_config: EngineConfig | None = None, *,
                 max_waiting_requests: int | None = None):
        if engine_config is not None and not isinstance(engine_config, EngineConfig):
            raise TypeError(f"engine_config must be an EngineConfig, got {type(engine_config).__name__}")
        self.model = model
        # data_parallel_size > 1: one loop per replica behind a router (data_parallel.py), and
        # `engine` is replica 0 (config and eos ids are the same on every replica)
        params = getattr(model, "param_forms", model.params)  # a Model's: one weight copy for all its engines
        self._loop = make_loop(make_engine(model.config, params, model.tokenizer, engine_config),
                               max_waiting_requests=max_waiting_requests)
        self.engine = self._loop.engine
        self.config = self.engine.config
        self.eos_token_ids = self.engine.eos_token_ids

    @property
    def tokenizer(self):
        return self.model.tokenizer

    async def generate(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams, *,
                       request_id: str | None = None, prompt: str | None = None) -> RequestOutput:
        """The request's final output (all n completions, logprobs, metrics)."""
        items = self._items(prompt_token_ids, sampling_params, request_id, prompt, stream=False)
        try:
            async for item in items:
                return item
        finally:
            await items.aclose()
        raise AssertionError("the engine loop ended a request without its output")

    async def stream(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams, *,
                     request_id: str | None = None, prompt: str | None = None) -> AsyncIterator[StreamDelta]:
        """Text deltas as tokens are produced; each sample's last delta carries its finish_reason."""
        items = self._items(prompt_token_ids, sampling_params, request_id, prompt, stream=True)
        try:
            async for item in items:
                if isinstance(item, StreamDelta):
                    yield item
        finally:
            await items.aclose()

    def abort(self, request_id: str) -> None:
        """Aborts a request by id; unknown or finished ids are ignored. Thread-safe."""
        self._loop.abort(request_id)

    def stats(self) -> EngineSnapshot:
        return self._loop.snapshot()

    def shutdown(self) -> None:
        self._loop.shutdown()

    async def _items(self, prompt_token_ids, params: SamplingParams, request_id: str | None,
                     prompt: str | None, *, stream: bool) -> AsyncIterator[Any]:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        running = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(item: Any) -> None:  # called on the engine loop's thread
            running.call_soon_threadsafe(queue.put_nowait, item)

        request_id = request_id or self._loop.new_request_id()
        done = self._loop.submit([Submission(request_id, list(prompt_token_ids), params, sink, prompt,
                                             0, stream)])
        finished = False
        try:
            await asyncio.wrap_future(done)  # the request's ValueError, if it can never run
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if isinstance(item, RequestOutput):
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._loop.abort(request_id)
