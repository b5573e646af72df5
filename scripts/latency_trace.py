"""Timing hooks inside a paxpage server, for scripts/latency_breakdown.py.

    python scripts/latency_trace.py TRACE.json serve --model M --port P ...

installs the hooks, runs `paxpage serve` in this process, and when the server stops (SIGINT)
writes what they recorded to TRACE.json. Every time is `time.perf_counter()`, which on Linux
is CLOCK_MONOTONIC: the same clock in the load generator's process, so a token can be followed
from the device step to the client.

What is recorded (wrapping methods of the engine's classes; no engine code changes):
  steps    one entry per engine-loop iteration that stepped (`EngineLoop._step`): begin and
           end, and the seconds of each phase in it, exclusive of nested phases:
               schedule      Scheduler.schedule
               pack          Packer.pack, sampling tensors, DecodeBatch.build
               dispatch      ModelRunner.forward / sample / copy_pages (enqueueing device work)
               device_wait   fetch: waiting for the device's tokens (what the host could not overlap)
               detokenise    IncrementalDetokenizer.add
               outputs       the rest of the output processor (stop checks, deltas)
               engine_other  the rest of LLMEngine.step (booking, queues)
               loop_send     the rest of the loop's step: handing deltas to the request channels
           and the packed batch: decode rows real / padded, token slots real / padded
  adds     loop request id -> when the loop added it to the engine
  sends    loop request id -> when each stream delta was handed to its channel (loop thread)
  yields   loop request id -> when the event loop took each delta off its queue
  events   response id -> when each SSE event was formatted
  compiles (end time, seconds, function) of every XLA backend compile (a new step shape met
           under load compiles inside `dispatch`)
"""

from __future__ import annotations

import collections
import inspect
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LOOP_THREAD = "paxpage-engine-loop"


class Trace:
    def __init__(self):
        self.steps: list[dict] = []
        self.adds: dict[str, float] = {}
        self.sends = collections.defaultdict(list)
        self.yields = collections.defaultdict(list)
        self.events = collections.defaultdict(list)
        self.compiles: list[tuple[float, float, str]] = []
        self._frames: list[list] | None = None  # the open phases of the current step (loop thread)
        self._step: dict | None = None

    # ---- phases, exclusive of nested ones -------------------------------------------------------
    def phase(self, name: str, fn):
        trace = self

        def timed(*args, **kwargs):
            frames = trace._frames
            if frames is None or threading.current_thread().name != LOOP_THREAD:
                return fn(*args, **kwargs)
            frame = [time.perf_counter(), 0.0]  # start, seconds spent in nested phases
            frames.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - frame[0]
                frames.pop()
                phases = trace._step["phases"]
                phases[name] = phases.get(name, 0.0) + seconds - frame[1]
                if frames:
                    frames[-1][1] += seconds
        return timed

    def loop_step(self, fn):
        """EngineLoop._step: one entry in `steps`; its own exclusive time is `loop_send`."""
        trace = self

        def step(loop):
            trace._step = {"begin": time.perf_counter(), "phases": {}, "batch": None}
            trace._frames = []
            try:
                return trace.phase("loop_send", fn)(loop)
            finally:
                trace._step["end"] = time.perf_counter()
                trace.steps.append(trace._step)
                trace._frames = None
        return step

    def packed(self, fn):
        """Packer.pack: also notes the step's real and padded sizes."""
        trace = self

        def pack(*args, **kwargs):
            out = fn(*args, **kwargs)
            if trace._step is not None and threading.current_thread().name == LOOP_THREAD:
                import numpy as np

                b = out[0]
                trace._step["batch"] = {
                    "decode_rows": int(np.count_nonzero(b.dec_kv_lens)), "decode_row_slots": len(b.dec_kv_lens),
                    "tokens": int(np.count_nonzero(b.slot_mapping >= 0)), "token_slots": len(b.token_ids)}
            return out
        return pack


def _patch(cls, name: str, wrap) -> None:
    raw = inspect.getattr_static(cls, name)
    if isinstance(raw, classmethod):
        setattr(cls, name, classmethod(wrap(raw.__func__)))
    elif isinstance(raw, staticmethod):
        setattr(cls, name, staticmethod(wrap(raw.__func__)))
    else:
        setattr(cls, name, wrap(raw))


def install() -> Trace:
    from paxpage import async_engine, engine, engine_loop, outputs
    from paxpage.decode_batch import DecodeBatch
    from paxpage.detokenizer import IncrementalDetokenizer
    from paxpage.output_processor import OutputProcessor
    from paxpage.packing import Packer
    from paxpage.runner import ModelRunner
    from paxpage.sampling.tensors import SamplingTensors
    from paxpage.sampling.batch import SamplingBatch
    from paxpage.scheduler import Scheduler
    from paxpage.server import sse

    trace = Trace()
    for cls, names, phase in (
            (Scheduler, ("schedule",), "schedule"),
            (SamplingBatch, ("tensors",), "pack"), (SamplingTensors, ("build",), "pack"),
            (DecodeBatch, ("build",), "pack"),
            (ModelRunner, ("forward", "sample", "copy_pages"), "dispatch"),
            (IncrementalDetokenizer, ("add",), "detokenise"),
            (OutputProcessor, ("process",), "outputs"),
            (engine.LLMEngine, ("step",), "engine_other")):
        for name in names:
            _patch(cls, name, lambda fn, phase=phase: trace.phase(phase, fn))
    _patch(Packer, "pack", lambda fn: trace.phase("pack", trace.packed(fn)))
    from paxpage import booking, launched

    wait = trace.phase("device_wait", launched.fetch)
    booking.fetch = wait  # every step reads its tokens through launched.fetch, in booking.py
    _patch(engine_loop.EngineLoop, "_step", trace.loop_step)

    add, send = engine_loop.EngineLoop._add, engine_loop.EngineLoop._send

    def _add(loop, submissions, done):
        now = time.perf_counter()
        for sub in submissions:
            trace.adds[sub.request_id] = now
        return add(loop, submissions, done)

    def _send(loop, sub, item):
        if isinstance(item, outputs.StreamDelta):
            trace.sends[sub.request_id].append(time.perf_counter())
        return send(loop, sub, item)

    engine_loop.EngineLoop._add, engine_loop.EngineLoop._send = _add, _send

    stream = async_engine.AsyncEngine.stream

    async def timed_stream(self, *args, request_id=None, **kwargs):
        async for delta in stream(self, *args, request_id=request_id, **kwargs):
            trace.yields[request_id].append(time.perf_counter())
            yield delta

    async_engine.AsyncEngine.stream = timed_stream
    event = sse.event

    def timed_event(obj):
        out = event(obj)
        if obj.get("choices"):
            trace.events[obj.get("id")].append(time.perf_counter())
        return out

    sse.event = timed_event

    import jax

    def compiled(event, duration, *args, fun_name="?", **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            trace.compiles.append((time.perf_counter(), float(duration), str(fun_name)))

    jax.monitoring.register_event_duration_secs_listener(compiled)
    return trace


def dump(trace: Trace, path: str) -> None:
    data = {"steps": trace.steps, "adds": trace.adds, "sends": dict(trace.sends), "yields": dict(trace.yields),
            "events": dict(trace.events), "compiles": trace.compiles}
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def main(argv: list[str]) -> int:
    from paxpage.cli import main as cli_main

    trace = install()
    try:
        return cli_main(argv[1:])
    finally:
        dump(trace, argv[0])


if __name__ == "__main__":
    from paxpage.process_tuning import tune_malloc

    tune_malloc()
    sys.exit(main(sys.argv[1:]))
