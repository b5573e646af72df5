"""Counts XLA backend compilations through jax's monitoring events.

One process-wide listener (jax offers no per-function hook) feeds a counter that the
engine and benchmarks read before and after warm-up: any compile in the steady state
means a shape escaped its bucket.
"""

from __future__ import annotations

import threading

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_seconds = 0.0
_installed = False


def _listener(event: str, duration: float, *args, **kwargs) -> None:
    global _count, _seconds
    if event == _EVENT:
        with _lock:
            _count += 1
            _seconds += duration


def install() -> None:
    """Registers the listener once; later calls do nothing."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    jax.monitoring.register_event_duration_secs_listener(_listener)


def compiles() -> int:
    """Backend compilations seen since `install()`."""
    return _count


def compile_seconds() -> float:
    return _seconds
