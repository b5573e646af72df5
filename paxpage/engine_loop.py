"""One engine loop, many callers.

An `EngineLoop` is the single owner of one `LLMEngine`: a background thread that applies the
callers' commands (add, abort) between steps, steps while any of its requests is live, and
sleeps when none is. Every request has its own output channel (a `sink` callable the loop
calls from its thread), so callers never see each other's outputs, and a caller that goes away
only has to `abort` its ids: their pages are freed before the next step.

Sinks receive, in order: `StreamDelta`s (when the request streams), then exactly one final
item: the request's `RequestOutput` (`EmbeddingOutput` for an embedding request), or an
exception (`EngineStepError` when a step failed under it, `EngineDeadError` when the loop died).

A step that raises (a device fault, out of memory) fails every request then live with an
`EngineStepError` naming the failure. With `restart_on_error`, the loop then rebuilds its engine
(`LLMEngine.rebuilt`: same weights and compiled steps, an empty KV pool) and goes on serving;
at most `max_restarts_per_minute` times in any minute, after which it stays down and says why.
Requests that finished before the failure were delivered already and are not touched.
The sync API (api.py), the asyncio front end (async_engine.py) and the HTTP server are all
clients of this loop.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import threading
import time
import traceback
import weakref
from concurrent.futures import Future
from typing import Any, Callable

from paxpage import process_tuning
from paxpage.embedding import EmbeddingOutput, Pooling
from paxpage.engine import LLMEngine
from paxpage.outputs import RequestOutput, StreamDelta
from paxpage.sampling.params import SamplingParams

Sink = Callable[[Any], None]
log = logging.getLogger("paxpage")
_LOOPS: "weakref.WeakSet[EngineLoop]" = weakref.WeakSet()  # shut down at interpreter exit
FINAL_OUTPUTS = (RequestOutput, EmbeddingOutput)  # what a request's last item is, unless an error


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error (or was shut down); no request can run on it."""


class EngineStepError(RuntimeError):
    """An engine step failed while this request was live; the request ended with it."""


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
    pooling: Pooling | None = None  # set: an embedding request (`params` unused, stream False)
    lora: str | None = None  # a loaded LoRA adapter's name; None: the base model


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
    recovering: str | None = None  # the failure the engine is being rebuilt after, while it is
    num_restarts: int = 0  # engine rebuilds after failed steps, since the loop started
    # requests, since the loop started: received = finished + aborted + failed + live ones
    num_received: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_failed: int = 0


@dataclasses.dataclass
class _Live:
    submission: Submission
    engine_id: int


class EngineLoop:
    def __init__(self, engine: LLMEngine, *, max_waiting_requests: int | None = None,
                 restart_on_error: bool = False, max_restarts_per_minute: int = 3):
        if max_waiting_requests is not None and (not isinstance(max_waiting_requests, int)
                                                 or max_waiting_requests < 1):
            raise ValueError(f"max_waiting_requests must be a positive int or None, got {max_waiting_requests!r}")
        if isinstance(max_restarts_per_minute, bool) or not isinstance(max_restarts_per_minute, int) \
                or max_restarts_per_minute < 0:
            raise ValueError(f"max_restarts_per_minute must be an int >= 0, got {max_restarts_per_minute!r}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.restart_on_error = bool(restart_on_error)
        self.max_restarts_per_minute = max_restarts_per_minute
        self._restarts: list[float] = []  # monotonic times of the rebuilds in the last minute
        self._num_restarts = 0
        self._recovering: str | None = None
        self._requests = {"received": 0, "finished": 0, "aborted": 0, "failed": 0}  # loop thread
        self._totals = {"prompt_tokens": 0, "generation_tokens": 0, "num_preemptions": 0, "num_steps": 0}
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
            seconds_since_progress=time.monotonic() - self._last_progress if busy else 0.0,
            recovering=self._recovering, num_restarts=self._num_restarts,
            num_received=counts["received"], num_finished=counts["finished"],
            num_aborted=counts["aborted"], num_failed=counts["failed"])

    def _publish(self) -> None:
        """On the loop thread: O(1) counters for `snapshot`, replaced as one dict."""
        engine, scheduler = self.engine, self.engine.scheduler
        totals = self._totals  # of the engines that failed before this one
        self._counts = {
            "num_live": len(self._live), "num_running": scheduler.num_running,
            "num_waiting": scheduler.num_waiting,
            "kv_cache_usage": scheduler.page_manager.num_used_pages / engine.config.num_pages,
            "prompt_tokens": totals["prompt_tokens"] + engine.stats.prompt_tokens,
            "generation_tokens": totals["generation_tokens"] + engine.stats.generated_tokens,
            "num_preemptions": totals["num_preemptions"] + scheduler.num_preemptions,
            "num_steps": totals["num_steps"] + engine.stats.steps,
            **self._requests,
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
                    try:
                        self._step()
                    except Exception as exc:  # noqa: BLE001 - fail the live requests, maybe rebuild
                        self._recover(exc)
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
                if sub.pooling is not None:
                    engine_id = self.engine.add_embedding(sub.prompt_token_ids, sub.pooling, index=sub.index)
                else:
                    engine_id = self.engine.add_request(sub.prompt_token_ids, sub.params, index=sub.index,
                                                        prompt=sub.prompt, stream=sub.stream, lora=sub.lora)
                self._live[sub.request_id] = _Live(sub, engine_id)
                self._by_engine_id[engine_id] = sub.request_id
                added.append(sub)
                self._requests["received"] += 1
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
            self._requests["aborted"] += 1
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
                self._requests["finished"] += 1
                self._send(sub, self.engine.output(request))

    def _recover(self, exc: Exception) -> None:
        """A step raised. Restarts off: `exc` stops the loop. On: every live request ends with an
        EngineStepError naming `exc`, then the engine is rebuilt, unless that would pass
        max_restarts_per_minute: then the loop stops, saying so."""
        if not self.restart_on_error:
            raise exc  # the loop stops; its live requests get EngineDeadError
        reason = f"{type(exc).__name__}: {exc}"
        failure = EngineStepError(f"the engine step failed: {reason}")
        failure.__cause__ = exc
        live, self._live, self._by_engine_id = self._live, {}, {}
        self._requests["failed"] += len(live)
        for item in live.values():
            self._send(item.submission, failure)
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < 60.0]
        if len(self._restarts) >= self.max_restarts_per_minute:
            raise EngineDeadError(f"the engine step failed ({reason}) after {len(self._restarts)} restarts in "
                                  f"the last minute; max_restarts_per_minute is {self.max_restarts_per_minute}, "
                                  "so the engine stays down") from exc
        log.error("paxpage: engine step failed (%s); rebuilding the engine", reason, exc_info=exc)
        self._recovering = reason
        old = self.engine
        for name in self._totals:
            self._totals[name] = self._counts[name]
        try:
            self.engine = old.rebuilt()
            del old
            # The failed engine and its step's buffers, before the next step allocates: the
            # failure's frames (logged above) hold the engine too, and a frozen start-up heap
            # may hold it (collect_everything reaches it).
            traceback.clear_frames(exc.__traceback__)
            process_tuning.collect_everything()
        finally:
            self._recovering = None
        self._restarts.append(now)
        self._num_restarts += 1
        self._last_progress = time.monotonic()

    def _send(self, sub: Submission, item: Any) -> None:
        try:
            sub.sink(item)
        except Exception:  # noqa: BLE001 - a broken channel (closed event loop) aborts its request
            if not isinstance(item, (*FINAL_OUTPUTS, BaseException)):
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
        self._requests["failed"] += len(self._live)
        for request_id in list(self._live):
            sub = self._live[request_id].submission
            try:
                self._drop(request_id)
            except Exception:  # noqa: BLE001 - the engine may be broken; the callers must still hear
                pass
            self._send(sub, error)


def live_loops() -> list[EngineLoop]:
    """The loops of this process that have not been garbage-collected."""
    return list(_LOOPS)


@atexit.register
def _shutdown_all() -> None:
    for loop in list(_LOOPS):
        loop.shutdown(timeout=5.0)
