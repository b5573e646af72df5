"""Smaller decode shapes compiled in the background before a shrinking batch needs them.

Without precompile a step shape compiles the first time a step has it. A batch that shrinks as
its sequences finish (256 decode rows, then 190, then 120) meets a smaller decode-row bucket at
each step down and, with it, a new sampler row count: every running stream waits for both
compiles (~0.1 s for a tiny model on CPU, seconds for a real one). So once a decode-only step of
Bd rows has run, a worker thread compiles the next LOOKAHEAD decode-only shapes below it, the
nearest first, and the sampler at their row counts in each form the engine has called it in; a
batch shrinking through them queues the next ones. A step that meets a shape the worker is
compiling waits for it; one still queued compiles in the foreground, as before. A batch that
drops several buckets at once (most of its requests ending together) may meet shapes nobody
compiled yet: those compile in the step.

Every step keeps its own bucketed shape: which executable runs it never depends on timing, so
a request's logits are the same however far the worker has got (docs/determinism.md). Shapes
with prefill rows, and batches that grow, compile when first met.

Axis legend: Bd decode rows, Bp prefill rows, R logits rows.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Callable, Hashable, Iterable, Sequence

log = logging.getLogger("paxpage")

Shape = tuple[int, int, int]  # (Bd, Bp, R) of a step with the usual prefill row width, no prompt logprobs
# Smaller decode shapes compiled ahead of a decode step's: a batch shrinks through them one at a
# time, so two keep one compiled beyond the next while that one runs, and compiling every smaller
# shape (11 below 256 rows) would spend CPU on sizes a batch may never reach.
LOOKAHEAD = 2


class AheadCall:
    """A device call (a jitted function, or the executable cache's wrapper of one) that runs the
    executables compiled ahead of time for the keys they were added under, and the call itself
    for any other key. `key(*args)` names what picks the executable from the call's arguments
    (their shapes, dtypes and static values), cheaply: it runs on every call, which does the
    same work whether or not an executable was added. `static_argnums`: arguments not passed to
    an executable."""

    def __init__(self, call: Callable, key: Callable[..., Hashable], static_argnums: Sequence[int] = ()):
        self.call, self.key, self.static_argnums = call, key, tuple(static_argnums)
        self.executables: dict[Hashable, Callable] = {}

    def add(self, args, compiled) -> None:
        """Runs `compiled` (a jax.stages.Compiled of these arguments) for calls with their key."""
        self.executables[self.key(*args)] = compiled

    def __getattr__(self, name):  # the wrapped call's own methods (the executable cache's `prepare`)
        call = self.__dict__.get("call")
        if call is None:
            raise AttributeError(name)
        return getattr(call, name)

    def __call__(self, *args):
        key = self.key(*args)
        executable = self.executables.get(key)
        if executable is None:
            return self.call(*args)
        dynamic = args if not self.static_argnums else [a for i, a in enumerate(args) if i not in self.static_argnums]
        try:
            return executable(*dynamic)
        except TypeError as e:
            # Arguments the key did not tell apart (a dtype it assumed): checked before anything
            # runs or is donated, so the call itself can take them.
            log.warning("paxpage: an executable compiled ahead does not take these arguments (%s); "
                        "compiling them as usual", e)
            del self.executables[key]
            return self.call(*args)


class AheadCompiler:
    """Which step shapes have an executable, and a worker thread that compiles smaller decode
    shapes before they are needed.

    `jobs(dec, pre, rows)` returns the compiles that make a shape ready (the step, the sampler at
    R rows in its forms), each a thunk that compiles and registers one executable;
    `smaller(dec)` lists the decode-only shapes a batch of `dec` decode rows can shrink to, the
    nearest first."""

    def __init__(self, jobs: Callable[[int, int, int], list[Callable[[], None]]],
                 smaller: Callable[[int], Iterable[Shape]]):
        self._jobs, self._smaller = jobs, smaller
        self.ready: set[Shape] = set()
        self._ran: set[Shape] = set()  # shapes a step has run (saw)
        self._claimed: set[Shape] = set()  # queued, compiling, compiled or left to the foreground
        self._queue: list[Shape] = []
        self._compiling: tuple[Shape, threading.Event] | None = None
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self.compiled = 0  # shapes made ready by the worker
        _LIVE.add(self)

    def saw(self, dec: int, pre: int, rows: int) -> None:
        """A step of this shape has run, so its executable exists; after a decode-only one, the
        next LOOKAHEAD smaller decode shapes are queued for the worker."""
        shape = (dec, pre, rows)
        if shape in self._ran:
            return
        self._ran.add(shape)
        self.ready.add(shape)
        with self._lock:
            self._claimed.add(shape)
            if pre == 0:
                for smaller in list(self._smaller(dec))[:LOOKAHEAD]:
                    if smaller not in self._claimed and smaller not in self.ready:
                        self._claimed.add(smaller)
                        self._queue.append(smaller)
            if self._queue and self._worker is None and not _closing:
                self._worker = threading.Thread(target=self._work, name="paxpage-ahead-compile", daemon=True)
                self._worker.start()

    def before(self, dec: int, pre: int, rows: int) -> None:
        """Called before a step of this shape dispatches: if the worker is compiling it, waits
        for that; if it is still queued, takes it off the queue (the step compiles it)."""
        shape = (dec, pre, rows)
        if shape in self.ready:
            return
        with self._lock:
            if shape in self._queue:
                self._queue.remove(shape)
            compiling = self._compiling
        if compiling is not None and compiling[0] == shape:
            compiling[1].wait()

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue or _closing:
                    self._worker = None
                    return
                shape = self._queue.pop(0)
                done = threading.Event()
                self._compiling = (shape, done)
            t = time.perf_counter()
            try:
                for job in self._jobs(*shape):
                    job()
            except Exception as e:  # the foreground compiles it when a step meets it
                log.warning("paxpage: background compile of step shape %s failed (%s: %s)", shape,
                            type(e).__name__, e)
            else:
                self.ready.add(shape)
                self.compiled += 1
                log.debug("paxpage: step shape %s compiled in the background in %.2f s", shape,
                          time.perf_counter() - t)
            finally:
                with self._lock:
                    self._compiling = None
                done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the worker has nothing left to compile (or `timeout` seconds passed);
        True if it is idle."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                worker = self._worker
            if worker is None:
                return True
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            worker.join(remaining)


_LIVE: "weakref.WeakSet[AheadCompiler]" = weakref.WeakSet()
_closing = False


@atexit.register
def _finish() -> None:
    """At exit: no new compiles start, and the one running ends before the interpreter does (a
    daemon thread inside XLA's compile while Python finalises can crash the exit)."""
    global _closing
    _closing = True
    for compiler in list(_LIVE):
        compiler.wait(timeout=60)
