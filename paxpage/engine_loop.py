"""One engine loop, many callers.

An `EngineLoop` is the single owner of one `LLMEngine`: a background thread that applies the
callers' commands (add, abort) between steps, steps while any of its requests is live, and
sleeps when none is. Every request has its own output channel (a `sink` callable the loop
calls from its thread), so callers never see each other's outputs, and a caller that goes away
only has to `abort` its ids: their pages are freed before the next step.

Sinks receive, in order: `StreamDelta`s (when the request streams), then exactly one final
item: the request's `RequestOutput`, or an exception (`EngineDeadError` when the loop died).
The sync API (api.py), the asyncio front end (async_engine.py) and the HTTP server are all
clients of this loop.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable

from paxpage.engine import LLMEngine
from paxpage.outputs import RequestOutput, StreamDelta
from paxpage.sampling_params import SamplingParams

Sink = Callable[[Any], None]
_LOOPS: "weakref.WeakSet[EngineLoop]" = weakref.WeakSet()  # shut down at interpreter exit


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error (or was shut down); no request can run on it."""


class EngineOverloadedError(RuntimeError):
    """More requests are waiting than the loop accepts (`max_waiting_requests`)."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


@dataclasses.dataclass(frozen=True)
class Submission:
    """One request for the loop. `request_id` is the caller's name for it (unique in the loop)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: Sink
    prompt: str | None = None
    index: int = 0  # reported back as the outputs' `index`
    stream: bool = True  # False: the sink gets only the final output


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """A point-in-time view of the loop, cheap to take from any thread."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # used pages / all pages, 0..1
    prompt_tokens: int  # totals since the engine was built
    generation_tokens: int
    num_preemptions: int
    num_steps: int
    alive: bool
    error: str | None
    seconds_since_progress: float  # 0 while idle (no live request)


@dataclasses.dataclass
class _Live:
    submission: Submission
    engine_id: int


class EngineLoop:
    def __init__(self, engine: LLMEngine, *, max_waiting_requests: int | None = None):
        if max_waiting_requests is not None and (not isinstance(max_waiting_requests, int)
                                                 or max_waiting_requests < 1):
            raise ValueError(f"max_waiting_requests must be a positive int or None, got {max_waiting_requests!r}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, Any]] = []  # guarded by _cv
        self._num_pending_adds = 0  # submissions in the inbox, guarded by _cv
        self._stopping = False
        self._error: BaseException | None = None
        self._live: dict[str, _Live] = {}  # owned by the loop thread
        self._by_engine_id: dict[int, str] = {}
        self._last_progress = time.monotonic()
        self._ids = itertools.count()
        self._publish()
        self._thread = threading.Thread(target=self._run, name="paxpage-engine-loop", daemon=True)
        self._thread.start()
        _LOOPS.add(self)

    # ---- callers (any thread) --------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def submit(self, submissions: list[Submission]) -> Future:
        """Queues requests, all or none. The future resolves once the loop has added them, or
        fails with the first one's ValueError (the others are then not run)."""
        done: Future = Future()
        with self._cv:
            self._check_alive()
            if self.max_waiting_requests is not None:
                waiting = self.engine.scheduler.num_waiting + self._num_pending_adds
                if waiting + len(submissions) > self.max_waiting_requests:
                    raise EngineOverloadedError(
                        f"{waiting} requests are waiting; max_waiting_requests is {self.max_waiting_requests}")
            self._inbox.append(("add", (submissions, done)))
            self._num_pending_adds += len(submissions)
            self._cv.notify()
        return done

    def abort(self, request_ids) -> None:
        """Aborts requests by id (one id or several); unknown or finished ids are ignored.
        Their pages are free before the loop's next step."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._cv:
            if self._thread.is_alive():
                self._inbox.append(("abort", ids))
                self._cv.notify()

    def snapshot(self) -> EngineSnapshot:
        """The counters as the loop thread last published them (after each step, add and abort),
        so no caller reads the engine's state while the loop changes it."""
        counts = self._counts
        busy = counts["num_live"] > 0
        return EngineSnapshot(
            num_running=counts["num_running"], num_waiting=counts["num_waiting"] + self._num_pending_adds,
            kv_cache_usage=counts["kv_cache_usage"], prompt_tokens=counts["prompt_tokens"],
            generation_tokens=counts["generation_tokens"], num_preemptions=counts["num_preemptions"],
            num_steps=counts["num_steps"], alive=self.alive,
            error=None if self._error is None else repr(self._error),
            seconds_since_progress=time.monotonic() - self._last_progress if busy else 0.0)

    def _publish(self) -> None:
        """On the loop thread: O(1) counters for `snapshot`, replaced as one dict."""
        engine, scheduler = self.engine, self.engine.scheduler
        self._counts = {
            "num_live": len(self._live), "num_running": scheduler.num_running,
            "num_waiting": scheduler.num_waiting,
            "kv_cache_usage": scheduler.page_manager.num_used_pages / engine.config.num_pages,
            "prompt_tokens": engine.stats.prompt_tokens, "generation_tokens": engine.stats.generated_tokens,
            "num_preemptions": scheduler.num_preemptions, "num_steps": engine.stats.steps,
        }

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self._stopping

    @property
    def idle(self) -> bool:
        with self._cv:
            return not self._live and not self._inbox

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stops the loop: live requests end with EngineDeadError. Safe to call twice."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop died: {self._error!r}") from self._error
        if self._stopping or not self._thread.is_alive():
            raise EngineDeadError("the engine loop was shut down")

    # ---- the loop thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._inbox and not self._live and not self._stopping:
                        self._cv.wait()
                    if self._stopping:
                        break
                    commands, self._inbox = self._inbox, []
                for kind, payload in commands:
                    self._add(*payload) if kind == "add" else self._abort(payload)
                if commands:
                    self._publish()
                if self._live:
                    self._step()
                    self._publish()
        except BaseException as exc:  # noqa: BLE001 - every live caller must hear of it
            self._error = exc
        finally:
            self._close()

    def _add(self, submissions: list[Submission], done: Future) -> None:
        added: list[Submission] = []
        try:
            if not done.set_running_or_notify_cancel():
                return  # the caller gave up before the loop got to it
            for sub in submissions:
                if sub.request_id in self._live:
                    raise ValueError(f"request_id {sub.request_id!r} is already running")
                engine_id = self.engine.add_request(sub.prompt_token_ids, sub.params, index=sub.index,
                                                    prompt=sub.prompt, stream=sub.stream)
                self._live[sub.request_id] = _Live(sub, engine_id)
                self._by_engine_id[engine_id] = sub.request_id
                added.append(sub)
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            for sub in added:
                self._drop(sub.request_id)
            done.set_exception(exc)
        else:
            done.set_result([s.request_id for s in added])
            self._last_progress = time.monotonic()
        finally:
            with self._cv:
                self._num_pending_adds -= len(submissions)

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            live = self._live.get(request_id)
            if live is None:
                continue
            request = self.engine.request(live.engine_id)
            self._drop(request_id)
            if request is None:
                continue
            output = self.engine.output(request)
            if live.submission.stream:  # each aborted sample's stream ends with its reason
                for c in output.outputs:
                    if c.finish_reason == "abort":
                        self._send(live.submission, StreamDelta(output.index, "", (), "abort", c.index))
            self._send(live.submission, output)

    def _drop(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is not None:
            self._by_engine_id.pop(live.engine_id, None)
            self.engine.abort(live.engine_id)

    def _step(self) -> None:
        updates = self.engine.step()
        self._last_progress = time.monotonic()
        for request, deltas in updates:
            request_id = self._by_engine_id.get(request.request_id)
            if request_id is None:  # a request someone added to the engine directly
                continue
            sub = self._live[request_id].submission
            if sub.stream:
                for delta in deltas:
                    self._send(sub, delta)
                if request_id not in self._live:  # its channel broke: _send dropped it
                    continue
            if request.finished:
                self._live.pop(request_id)
                self._by_engine_id.pop(request.request_id)
                self._send(sub, self.engine.output(request))

    def _send(self, sub: Submission, item: Any) -> None:
        try:
            sub.sink(item)
        except Exception:  # noqa: BLE001 - a broken channel (closed event loop) aborts its request
            if not isinstance(item, (RequestOutput, BaseException)):
                self._drop(sub.request_id)

    def _close(self) -> None:
        with self._cv:
            self._stopping = True
            commands, self._inbox = self._inbox, []
        error = EngineDeadError("the engine loop was shut down" if self._error is None
                                else f"the engine loop died: {self._error!r}")
        if self._error is not None:
            error.__cause__ = self._error
        for kind, payload in commands:
            if kind == "add" and payload[1].set_running_or_notify_cancel():
                payload[1].set_exception(error)
        for request_id in list(self._live):
            sub = self._live[request_id].submission
            try:
                self._drop(request_id)
            except Exception:  # noqa: BLE001 - the engine may be broken; the callers must still hear
                pass
            self._send(sub, error)


@atexit.register
def _shutdown_all() -> None:
    for loop in list(_LOOPS):
        loop.shutdown(timeout=5.0)
