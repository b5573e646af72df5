"""Opt-in persistent XLA compilation cache for command-line runs.

A CPU run of the default model spends most of a short run compiling its step shapes;
jax can keep compiled executables on disk so the next run reuses them (measured with the
CLI on the 2-core dev machine: 23 s cold, 10 s warm). jax's cache is process-wide
configuration, so the library never sets it on its own: the CLI and benchmark scripts call
`enable()`, and a cache the user configured already is left alone.
"""

from __future__ import annotations

import os

import jax


def enable(directory: str | None = None) -> str | None:
    """Points jax's persistent compilation cache at `directory` (default: paxpage's cache
    dir + /xla). Returns the directory in use, or None if it could not be enabled."""
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    if directory is None:
        from models.loading import cache_dir

        directory = os.path.join(cache_dir(), "xla")
    try:
        os.makedirs(directory, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", directory)
        # Every executable, however quick to compile: the sampler variants and small helpers are
        # each < 0.5 s but dozens of them, and a warm start should compile nothing.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    except (OSError, AttributeError):
        return None
    return directory


def enable_unless_executable_cache(config, multi_process: bool = False) -> str | None:
    """`enable()`, except for a single-device engine with an executable cache (exec_cache.py),
    which keeps its steps itself: an executable that jax's cache served is not stored there
    (it does not serialise again intact), so with both on, the executable cache would never
    fill for shapes jax's cache already holds."""
    single = (config.tensor_parallel_size == 1 and config.data_parallel_size == 1 and config.mesh is None
              and not multi_process)
    if config.executable_cache_dir is not None and single:
        return None
    return enable()
