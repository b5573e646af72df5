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
