"""Counts XLA backend compilations through jax's monitoring events.

One process-wide listener (jax offers no per-function hook) feeds a counter that the
engine and benchmarks read before and after warm-up: any compile in the steady state
means a shape escaped its bucket.
"""

from __future__ import annotations

import threading

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"
# jax's persistent compilation cache: an executable read from disk (no backend compile), or
# a lookup that found nothing (the compile that follows is counted above).
_CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}
_lock = threading.Lock()
_count = 0
_seconds = 0.0
_cache = {"hits": 0, "misses": 0}
_installed = False


def _listener(event: str, duration: float, *args, **kwargs) -> None:
    global _count, _seconds
    if event == _EVENT:
        with _lock:
            _count += 1
            _seconds += duration


def _cache_listener(event: str, *args, **kwargs) -> None:
    kind = _CACHE_EVENTS.get(event)
    if kind is not None:
        with _lock:
            _cache[kind] += 1


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
