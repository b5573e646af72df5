"""Counts XLA backend compilations through jax's monitoring events.

One process-wide listener (jax offers no per-function hook) feeds a counter that the
engine and benchmarks read before and after warm-up: any compile in the steady state
means a shape escaped its bucket.
"""

from __future__ import annotations

import threading

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"
# Per-function phases (jax passes fun_name with each): tracing to a jaxpr, lowering to MLIR, and the
# backend compile (which includes a persistent-cache read when the cache is on).
_PHASES = {"/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower", _EVENT: "compile"}
# jax's persistent compilation cache: an executable read from disk (no backend compile), or
# a lookup that found nothing (the compile that follows is counted above).
_CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}
_lock = threading.Lock()
_count = 0
_seconds = 0.0
_cache = {"hits": 0, "misses": 0}
_installed = False
# fun_name -> {"trace": [count, seconds], "lower": [...], "compile": [...], "hits": [count, 0]}
_by_function: dict[str, dict[str, list]] = {}
_local = threading.local()  # a cache hit is reported just before its function's compile event


def _listener(event: str, duration: float, *args, fun_name: str = "?", **kwargs) -> None:
    global _count, _seconds
    phase = _PHASES.get(event)
    if phase is None:
        return
    name = str(fun_name)
    if name.startswith("jit(") and name.endswith(")"):  # lowering and compile say jit(f), tracing f
        name = name[4:-1]
    with _lock:
        row = _by_function.setdefault(name, {})
        entry = row.setdefault(phase, [0, 0.0])
        entry[0] += 1
        entry[1] += duration
        if event == _EVENT:
            _count += 1
            _seconds += duration
            if getattr(_local, "hit", False):
                _local.hit = False
                row.setdefault("hits", [0, 0.0])[0] += 1


def _cache_listener(event: str, *args, **kwargs) -> None:
    kind = _CACHE_EVENTS.get(event)
    if kind is not None:
        with _lock:
            _cache[kind] += 1
        _local.hit = kind == "hits"


def install() -> None:
    """Registers the listeners once; later calls do nothing."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    jax.monitoring.register_event_duration_secs_listener(_listener)
    jax.monitoring.register_event_listener(_cache_listener)


def compiles() -> int:
    """Backend compilations seen since `install()`."""
    return _count


def compile_seconds() -> float:
    return _seconds


def cache_hits() -> int:
    """Executables read from jax's persistent compilation cache since `install()`."""
    return _cache["hits"]


def cache_misses() -> int:
    """Persistent-cache lookups that found nothing since `install()` (0 while the cache is off)."""
    return _cache["misses"]


def by_function() -> dict[str, dict[str, tuple[int, float]]]:
    """A copy of the per-function figures since `install()`: fun_name -> phase -> (count,
    seconds), phases "trace", "lower", "compile" (backend compile or persistent-cache read) and
    "hits" (how many of the compiles were persistent-cache reads)."""
    with _lock:
        return {name: {phase: (int(c), float(s)) for phase, (c, s) in row.items()}
                for name, row in _by_function.items()}


def diff(after: dict, before: dict) -> dict[str, dict[str, tuple[int, float]]]:
    """`by_function()` figures of what happened between two snapshots."""
    out = {}
    for name, row in after.items():
        old = before.get(name, {})
        delta = {p: (c - old.get(p, (0, 0.0))[0], s - old.get(p, (0, 0.0))[1]) for p, (c, s) in row.items()}
        delta = {p: v for p, v in delta.items() if v[0]}
        if delta:
            out[name] = delta
    return out


def format_table(rows: dict[str, dict[str, tuple[int, float]]]) -> str:
    """One line per function, most seconds first: counts and seconds of each phase."""
    def total(row):
        return sum(s for p, (c, s) in row.items() if p != "hits")

    lines = [f"{'function':<40} {'traces':>12} {'lowerings':>12} {'compiles':>12} {'cache hits':>10}"]
    for name, row in sorted(rows.items(), key=lambda kv: -total(kv[1])):
        cells = [f"{row.get(p, (0, 0.0))[0]:>4} {row.get(p, (0, 0.0))[1]:>6.1f}s" for p in ("trace", "lower", "compile")]
        lines.append(f"{name[:40]:<40} " + " ".join(cells) + f" {row.get('hits', (0, 0.0))[0]:>10}")
    sums = [(sum(r.get(p, (0, 0.0))[0] for r in rows.values()), sum(r.get(p, (0, 0.0))[1] for r in rows.values()))
            for p in ("trace", "lower", "compile")]
    lines.append(f"{'total':<40} " + " ".join(f"{c:>4} {s:>6.1f}s" for c, s in sums)
                 + f" {sum(r.get('hits', (0, 0.0))[0] for r in rows.values()):>10}")
    return "\n".join(lines)
