"""Multi-host: one process per host joined by `jax.distributed` into one global mesh.

Process 0 owns the scheduler and the requests and runs the engine as usual. Every other
process builds the same engine (same model, same EngineConfig, hence the same mesh, shardings
and compiled steps) and then only follows: before each device call (a step, a page copy)
process 0 broadcasts that call's small host-built arguments (the StepBatch, sampling tensors,
page copies) with `jax.experimental.multihost_utils.broadcast_one_to_all`, and every process
makes the same call on its own shard, so all stay in lock-step and XLA's collectives meet.

Launch (one command per host; the same model files on each):

    paxpage generate --coordinator-address HOST0:1234 --num-processes 2 --process-id 0 \\
        --tensor-parallel-size 4 "prompt"          # on host 0: prints the outputs
    paxpage generate --coordinator-address HOST0:1234 --num-processes 2 --process-id 1 \\
        --tensor-parallel-size 4 "prompt"          # on host 1: follows, prints nothing

or set PAXPAGE_COORDINATOR_ADDRESS, PAXPAGE_NUM_PROCESSES, PAXPAGE_PROCESS_ID instead of the
flags. On CPU (tests, one machine) collectives go over gloo, which `initialize` selects.
Limits: one engine per run (the followers mirror exactly one), so no data parallelism across
processes yet, and no precompile.
"""

from __future__ import annotations

import os
import pickle

import jax
import numpy as np

ENV_VARS = ("PAXPAGE_COORDINATOR_ADDRESS", "PAXPAGE_NUM_PROCESSES", "PAXPAGE_PROCESS_ID")
_MIN_MESSAGE = 1 << 12  # message buffers are padded to powers of two from here: few compiles


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, timeout_s: int = 120) -> bool:
    """Joins this process to the others (reads the PAXPAGE_* variables for what is not given).
    Returns False, doing nothing, when no coordinator is named (one process)."""
    env = os.environ
    coordinator_address = coordinator_address or env.get(ENV_VARS[0])
    if not coordinator_address:
        return False
    num_processes = num_processes if num_processes is not None else _int_env(ENV_VARS[1])
    process_id = process_id if process_id is not None else _int_env(ENV_VARS[2])
    if num_processes is None or process_id is None:
        raise ValueError(f"coordinator address {coordinator_address!r} needs the number of processes and "
                         f"this process's id (flags or {ENV_VARS[1]} / {ENV_VARS[2]})")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process id {process_id} is outside 0..{num_processes - 1}")
    # Only the CPU backend reads this (its cross-process collectives); GPU / TPU bring their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               initialization_timeout=timeout_s)
    return True


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None


def is_leader() -> bool:
    return jax.process_index() == 0


# ---------------------------------------------------------------------------- the channel
def _broadcast(obj=None):
    """Process 0's picklable `obj` on every process (others pass None)."""
    from jax.experimental import multihost_utils

    leader = is_leader()
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if leader else b""
    size = multihost_utils.broadcast_one_to_all(np.array([len(data)], np.int64))
    n = int(size[0])
    width = max(_MIN_MESSAGE, 1 << (n - 1).bit_length())
    buf = np.zeros(width, np.uint8)
    if leader:
        buf[:n] = np.frombuffer(data, np.uint8)
    buf = multihost_utils.broadcast_one_to_all(buf)
    return obj if leader else pickle.loads(np.asarray(buf[:n]).tobytes())


def _to_local(tree):
    """Global arrays to arrays this process can read (what the engine fetches to the host).
    Every process calls it on the same arrays: a gather, if one is needed, is collective."""
    from jax.experimental import multihost_utils

    def local(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return x
        if x.is_fully_replicated:
            return x.addressable_data(0)
        return multihost_utils.process_allgather(x, tiled=True)
    return jax.tree.map(local, tree)


class LockstepRunner:
    """A ModelRunner whose device calls process 0 broadcasts to the followers first. Everything
    else (packing, page tables, shapes) is the wrapped runner's."""

    def __init__(self, runner):
        self.inner = runner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, batch, prev_rows=None, prev_tokens=None):
        _broadcast(("forward", batch, prev_rows, prev_tokens is not None))
        return self.inner.forward(batch, prev_rows, prev_tokens)

    def sample(self, batch, logits, sampling, num_logprobs=0, num_prompt_logprobs=0, allowed=None,
               prev_rows=None, prev_tokens=None):
        _broadcast(("sample", sampling, num_logprobs, num_prompt_logprobs, allowed, prev_rows,
                    prev_tokens is not None))
        return self._sample(batch, logits, sampling, num_logprobs, num_prompt_logprobs, allowed, prev_rows,
                            prev_tokens)

    def _sample(self, batch, logits, sampling, num_logprobs, num_prompt_logprobs, allowed, prev_rows, prev_tokens):
        out, prompt, next_tokens = self.inner.sample(batch, logits, sampling, num_logprobs,
                                                     num_prompt_logprobs, allowed, prev_rows, prev_tokens)
        return _to_local(out), _to_local(prompt), next_tokens

    def launch(self, batch, sampling, num_logprobs=0, num_prompt_logprobs=0, prev_rows=None, prev_tokens=None,
               allowed=None):
        logits = self.forward(batch, prev_rows, prev_tokens)
        return self.sample(batch, logits, sampling, num_logprobs, num_prompt_logprobs, allowed, prev_rows,
                           prev_tokens)

    def run(self, batch, sampling, num_logprobs=0, num_prompt_logprobs=0):
        return jax.device_get(self.launch(batch, sampling, num_logprobs, num_prompt_logprobs)[:2])

    def copy_pages(self, copies) -> None:
        if copies:
            _broadcast(("copy", list(copies)))
            self.inner.copy_pages(copies)

    def precompile(self, sampling_for_rows, num_mask_words: int = 0) -> int:
        raise ValueError("precompile is not supported across processes yet; leave precompile=False")

    def stop_followers(self) -> None:
        """Process 0: releases the followers' `follow` loops (call once, after the last request)."""
        _broadcast(("stop",))

    def follow(self) -> int:
        """Processes > 0: makes process 0's device calls until it stops them; returns the number
        of steps followed."""
        assert not is_leader(), "process 0 leads; it does not follow"
        steps, prev, pending = 0, None, None
        while True:
            message = _broadcast()
            kind = message[0]
            if kind == "stop":
                return steps
            if kind == "copy":
                self.inner.copy_pages(message[1])
            elif kind == "forward":  # the engine may dispatch the sampler later (structured outputs)
                _, batch, prev_rows, has_prev = message
                pending = (batch, self.inner.forward(batch, prev_rows, prev if has_prev else None))
            elif kind == "sample":
                _, sampling, num_logprobs, num_prompt_logprobs, allowed, prev_rows, has_prev = message
                batch, logits = pending
                _, _, prev = self._sample(batch, logits, sampling, num_logprobs, num_prompt_logprobs, allowed,
                                          prev_rows, prev if has_prev else None)
                steps += 1
            else:  # pragma: no cover - the leader sends only the kinds above
                raise AssertionError(f"unknown lock-step message {kind!r}")
