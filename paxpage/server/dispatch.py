"""Runs one HTTP request's prompts on the engine, watching the client.

Each prompt is one engine request (with its n samples). If the client disconnects while waiting
for a whole answer, or mid-stream, every engine request of that HTTP request is aborted: the
engine frees their pages within a step. Engine errors raised at submission become APIErrors
(400 for a request that can never be served, 503 + Retry-After when overloaded)."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, AsyncIterator

from fastapi import Request

from paxpage.async_engine import EngineDeadError, EngineOverloadedError, EngineStepError
from paxpage.server import sse
from paxpage.server.errors import APIError, error_body, logger
from paxpage.server.sampling import engine_error


class ClientGone(Exception):
    """The client closed its connection; nobody is left to answer."""


def api_error(e: Exception, prompt_param: str) -> APIError:
    if isinstance(e, EngineOverloadedError):
        retry = max(1, math.ceil(getattr(e, "retry_after", 1.0) or 1.0))
        return APIError(503, f"server overloaded: {e}", code="overloaded", headers={"Retry-After": str(retry)})
    if isinstance(e, EngineDeadError):
        return APIError(503, f"engine is not running: {e}", code="engine_dead")
    if isinstance(e, EngineStepError):
        logger.error("a failed engine step ended a request: %s", e)
        return APIError(500, str(e), code="engine_step_failed")
    if isinstance(e, (ValueError, TypeError)):
        return engine_error(e, prompt_param)
    logger.error("engine request failed", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}")


def error_event(e: Exception, prompt_param: str) -> bytes:
    """An error after the stream started: the status line is sent, so it goes in the stream."""
    err = api_error(e, prompt_param)
    return sse.event(error_body(err.status, err.message, err.param, err.code))


async def wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read already: the next ASGI
    message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # marks it retrieved: no "never retrieved" warning


async def generate_all(ctx, request: Request, prompts: list[tuple[list[int], str | None]], params,
                       request_id: str, prompt_param: str, lora: str | None = None) -> list[Any]:
    """Final RequestOutputs, one per prompt, in order (`lora`: the adapter they run, or None)."""
    def start(i: int, rid: str):
        return ctx.engine.generate(prompts[i][0], params, request_id=rid, prompt=prompts[i][1], lora=lora)

    outputs = await _all(ctx, request, len(prompts), request_id, prompt_param, start)
    for out in outputs:
        ctx.metrics.observe_output(out)
    return outputs


async def embed_all(ctx, request: Request, prompts: list[tuple[list[int], str | None]], pooling,
                    request_id: str) -> list[Any]:
    """EmbeddingOutputs, one per input, in order."""
    return await _all(ctx, request, len(prompts), request_id, "input",
                      lambda i, rid: ctx.engine.embed(prompts[i][0], pooling, request_id=rid))


async def _all(ctx, request: Request, num: int, request_id: str, prompt_param: str, start) -> list[Any]:
    """Runs `start(i, engine request id)` for each of num inputs at once; their results in order.
    The client going away (ClientGone) or any failure aborts the ones still running."""
    engine = ctx.engine
    ids = [f"{request_id}-{i}" for i in range(num)]
    tasks = [asyncio.ensure_future(start(i, rid)) for i, rid in enumerate(ids)]
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        pending = set(tasks)
        while pending:
            done, _ = await asyncio.wait(pending | {watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                raise ClientGone()
            for task in done:
                pending.discard(task)
                if task.exception() is not None:
                    raise api_error(task.exception(), prompt_param)
        outputs = [t.result() for t in tasks]
    finally:
        watcher.cancel()
        for task, rid in zip(tasks, ids):
            if not task.done():
                task.cancel()
                engine.abort(rid)
            task.add_done_callback(_retrieve)
    return outputs


class MergedStream:
    """One engine stream per prompt, merged: iterating yields (prompt_index, StreamDelta).

    `start()` waits until every prompt has produced its first delta (or failed), so submission
    errors become a proper HTTP status before any byte of the event stream is sent."""

    def __init__(self, ctx, prompts, params, request_id: str, prompt_param: str, lora: str | None = None):
        self._ctx, self._params, self._prompt_param, self._lora = ctx, params, prompt_param, lora
        self._ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._first = [asyncio.Event() for _ in prompts]
        self._errors: list[Exception | None] = [None] * len(prompts)
        self._tasks = [asyncio.ensure_future(self._pump(i, p, text)) for i, (p, text) in enumerate(prompts)]
        self._closed = False

    async def _pump(self, i: int, prompt_ids: list[int], text: str | None) -> None:
        arrival, first, longest = time.monotonic(), None, {}
        try:
            async for delta in self._ctx.engine.stream(prompt_ids, self._params, request_id=self._ids[i],
                                                       prompt=text, lora=self._lora):
                if first is None and delta.token_ids:
                    first = time.monotonic()
                longest[delta.sample] = longest.get(delta.sample, 0) + len(delta.token_ids)
                self._queue.put_nowait((i, delta))
                self._first[i].set()
            self._ctx.metrics.observe(arrival, first, time.monotonic(), max(longest.values(), default=0))
            self._queue.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the reader (CancelledError is not caught)
            self._errors[i] = e
            self._queue.put_nowait((i, e))
        finally:
            self._first[i].set()

    async def _all_first(self) -> None:
        # One task over the events, not a gather: a cancelled gather keeps its children's
        # CancelledError as an exception nobody retrieves.
        for event in self._first:
            await event.wait()

    async def start(self, request: Request) -> None:
        watcher = asyncio.ensure_future(wait_disconnect(request))
        ready = asyncio.ensure_future(self._all_first())
        try:
            done, _ = await asyncio.wait({watcher, ready}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self.close()
            raise
        finally:
            watcher.cancel()
            ready.cancel()
        if watcher in done and ready not in done:
            self.close()
            raise ClientGone()
        for e in self._errors:
            if e is not None:
                self.close()
                raise api_error(e, self._prompt_param)

    async def __aiter__(self) -> AsyncIterator[tuple[int, Any]]:
        remaining = len(self._tasks)
        while remaining:
            i, item = await self._queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item

    def close(self) -> None:
        """Aborts whatever is still running (idempotent, safe from any exit path)."""
        if self._closed:
            return
        self._closed = True
        for task, rid in zip(self._tasks, self._ids):
            if not task.done():
                task.cancel()
                self._ctx.engine.abort(rid)
            task.add_done_callback(_retrieve)
