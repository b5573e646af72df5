"""Process settings for processes paxpage owns (the CLI and the benchmark scripts): glibc malloc,
and the garbage collector's start-up heap.

By default glibc serves every allocation above M_MMAP_THRESHOLD (128 KiB, raised dynamically up
to 32 MiB) with its own mmap and unmaps it on free, and gives freed memory at the top of the heap
back to the OS once more than M_TRIM_THRESHOLD (128 KiB) is free there. XLA on CPU allocates a
step's large buffers afresh each step (the logits of 256 rows of a 49152-token vocabulary are
48 MiB of f32), so each step page-faults and zeroes that memory again: `x * 2` on such an array
took ~49 ms against 3-8 ms once freed memory stayed in the process.

`tune_malloc` sets both thresholds to 2 GiB - 1 (mallopt takes an int), so large buffers come
from the heap and freed ones are reused. The cost: the process keeps its peak heap (RSS does not
fall after a burst of large arrays).

The thresholds hold for the main arena only. A thread that finds the main arena busy gets an arena
of its own, built from 64 MiB heaps; an allocation that fits no heap of it starts a new heap, and
a heap left empty by a free is unmapped at once, whatever the thresholds. XLA's CPU threads
allocate a step's outputs in such arenas, so a 48 MiB logits buffer mapped and page-faulted a
fresh heap every few steps (strace: 16 mmap / munmap pairs of 128 MiB in 100 steps of 256 rows).
`tune_malloc` therefore also sets M_ARENA_MAX to 1: every thread allocates from the main arena (small
blocks still come from each thread's lock-free tcache). Measured alone (decode loop, tiny model,
three alternated runs each): 256 x 128 rows 18.2-20.7 -> 15.7-16.0 ms/step, 256 x 1536 sampled
27.3-29.9 -> 25.1-25.9 ms/step (scripts/bench_malloc.py compares the settings end to end).

It is applied only where paxpage owns the process (`paxpage generate / serve / bench`, the
benchmark scripts run as scripts), never on import of the library: a program that imports
paxpage keeps its own allocator settings. It does nothing when the environment already sets a
MALLOC_* variable or a glibc.malloc tunable (the user chose: e.g. MALLOC_PERTURB_=0, glibc's
default, keeps glibc's thresholds), or when the C library is not glibc.

`freeze_startup_heap` is for a long-lived process once its engine is built (`paxpage serve`
before it listens, the benchmark scripts before they measure): Python's cyclic collector runs
a full collection whenever the objects that survived into its oldest generation since the last
one reach a quarter of those there, and a full collection walks every tracked object, the
start-up heap included (jax, the model's Python side, the tokenizer): ~0.13 s for the ~212,000
objects of a SmolLM2 engine, and a 0.96 s step was seen in a benchmark process holding several
engines (2-core AMD EPYC). Requests' state (token lists, logprob entries, deltas) reaches that
generation as it runs, so a server stalls every stream for that long now and then. Frozen
(`gc.freeze`, after one collection), the start-up heap is never walked again: a full collection
then costs what the live requests hold. vLLM's engine core does the same after start-up.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import sys
from typing import Any, Mapping

log = logging.getLogger("paxpage")

# mallopt parameter numbers (glibc <malloc.h>).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
THRESHOLD_BYTES = 2**31 - 1  # the largest value mallopt's int parameter holds
SETTINGS = {M_MMAP_THRESHOLD: THRESHOLD_BYTES, M_TRIM_THRESHOLD: THRESHOLD_BYTES, M_ARENA_MAX: 1}


def user_malloc_settings(environ: Mapping[str, str]) -> list[str]:
    """The malloc settings the environment already makes (names of variables, sorted)."""
    names = [k for k in environ if k.startswith("MALLOC_")]
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        names.append("GLIBC_TUNABLES")
    return sorted(names)


def _glibc() -> Any | None:
    """The process's C library when it is glibc (it has mallopt and gnu_get_libc_version)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (musl and others lack it)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def tune_malloc(environ: Mapping[str, str] | None = None, libc: Any | None = None) -> dict[int, int]:
    """Raises glibc's mmap and trim thresholds and keeps one arena (see the module doc) unless the
    environment sets malloc options itself. Returns {mallopt parameter: value} for each setting applied ({}: none).
    `environ` defaults to os.environ; `libc` to the process's glibc (tests pass a stand-in)."""
    environ = os.environ if environ is None else environ
    own = user_malloc_settings(environ)
    if own:
        log.debug("paxpage: malloc left as set by %s", ", ".join(own))
        return {}
    libc = _glibc() if libc is None else libc
    if libc is None:
        log.debug("paxpage: malloc thresholds not set (the C library is not glibc)")
        return {}
    applied = {param: value for param, value in SETTINGS.items() if libc.mallopt(param, value) == 1}
    log.debug("paxpage: malloc mmap / trim thresholds set to %d bytes and one arena (%d of %d accepted), so "
              "large freed buffers are reused instead of returned to the OS", THRESHOLD_BYTES, len(applied),
              len(SETTINGS))
    return applied


def freeze_startup_heap() -> int:
    """Collects once, then moves every object alive to the collector's permanent generation
    (gc.freeze), so later collections never walk them (see the module doc). Returns how many
    objects are frozen. Objects frozen stay in memory while a reference cycle holds them; call
    it once the engine is built, not per request."""
    gc.collect()
    gc.freeze()
    count = gc.get_freeze_count()
    log.debug("paxpage: %d start-up objects frozen out of the garbage collector's walks", count)
    return count


def collect_everything() -> None:
    """A full collection that also reaches the objects `freeze_startup_heap` froze (an engine
    dropped after start-up, e.g. rebuilt after a failed step, is among them): thawed for it,
    and what is left frozen again."""
    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()
