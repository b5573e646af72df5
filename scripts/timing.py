"""Timing helper the benchmark scripts share."""

from __future__ import annotations

import time

import numpy as np


def median_seconds(fn, iters: int) -> float:
    """Median seconds of fn() (which must block until its work is done) after one warm-up
    call, which also pays for any compilation."""
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def interleaved_medians(fns: dict, iters: int) -> dict:
    """Median seconds of each blocking callable, timed round-robin after one warm-up call
    each, so slow drifts in machine load hit every variant alike."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: float(np.median(v)) for name, v in times.items()}
