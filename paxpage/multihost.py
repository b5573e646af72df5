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

A lost process (paxpage/liveness.py watches every follower from process 0 and process 0 from
every follower) ends the run within seconds instead of leaving the others in a collective that
never completes: a follower that loses process 0 exits with status 1, saying so; process 0, on
losing a follower, fails its requests with a `ProcessLostError` naming that process (or, when its
step is stuck in a collective that cannot be interrupted, ends itself with that message), and
exits with status 1 rather than waiting for the lost one at jax.distributed's shutdown.

Limits: one engine per run (the followers mirror exactly one), so no data parallelism across
processes yet, and no precompile.
"""

from __future__ import annotations

import atexit
import inspect
import os
import pickle
import sys
import threading
import time

import jax
import numpy as np

ENV_VARS = ("PAXPAGE_COORDINATOR_ADDRESS", "PAXPAGE_NUM_PROCESSES", "PAXPAGE_PROCESS_ID")
_MIN_MESSAGE = 1 << 12  # message buffers are padded to powers of two from here: few compiles
DEFAULT_PEER_TIMEOUT_S = 5.0
_LIVENESS_KEY = "paxpage/liveness_address"
_NAME_WAIT_S = 2.0  # how long a failed collective waits for the watchdog to name the lost process


class ProcessLostError(RuntimeError):
    """A process of the multi-host run was lost; the run cannot go on without its devices."""


class _Watch:
    """This process's liveness watch and what it saw (one per process, like jax.distributed's)."""

    liveness = None  # paxpage.liveness.Liveness once initialize has joined the others
    num_processes = 1
    lost = threading.Event()
    message = ""


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, timeout_s: int = 120,
               peer_timeout_s: float | None = None) -> bool:
    """Joins this process to the others (reads the PAXPAGE_* variables for what is not given).
    Returns False, doing nothing, when no coordinator is named (one process).
    peer_timeout_s: a peer silent this long counts as lost (one whose process ended is lost at
    once); default DEFAULT_PEER_TIMEOUT_S."""
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
    if peer_timeout_s is None:
        peer_timeout_s = DEFAULT_PEER_TIMEOUT_S
    if isinstance(peer_timeout_s, bool) or not isinstance(peer_timeout_s, (int, float)) or not peer_timeout_s > 0:
        raise ValueError(f"peer timeout must be a number of seconds > 0, got {peer_timeout_s!r}")
    # Only the CPU backend reads this (its cross-process collectives); GPU / TPU bring their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {"initialization_timeout": timeout_s}
    if "heartbeat_timeout_seconds" in inspect.signature(jax.distributed.initialize).parameters:
        # jax's own heartbeat ends a process whose peer went silent, with a fatal log: a backstop
        # behind the liveness watch, which names the lost process first. It counts from the last
        # heartbeat received, which may be well before the peer went silent, so it stays far
        # behind the watch's own end (the peer timeout, then _NAME_WAIT_S + 1 s).
        kwargs["heartbeat_timeout_seconds"] = max(30, int(6 * peer_timeout_s))
    jax.distributed.initialize(coordinator_address, num_processes, process_id, **kwargs)
    _watch_peers(coordinator_address, num_processes, process_id, float(peer_timeout_s), timeout_s)
    return True


def _watch_peers(coordinator_address: str, num_processes: int, process_id: int, peer_timeout_s: float,
                 connect_timeout_s: float) -> None:
    from jax._src import distributed

    from paxpage.liveness import Liveness

    client = distributed.global_state.client  # jax.distributed's key-value store: the address goes through it
    _Watch.num_processes = num_processes
    if process_id == 0:
        _Watch.liveness = Liveness.leader(
            coordinator_address.rsplit(":", 1)[0], num_processes,
            lambda address: client.key_value_set(_LIVENESS_KEY, address),
            timeout_s=peer_timeout_s, connect_timeout_s=connect_timeout_s, on_lost=_leader_lost)
    else:
        address = client.blocking_key_value_get(_LIVENESS_KEY, int(connect_timeout_s * 1000))
        _Watch.liveness = Liveness.follower(process_id, address, timeout_s=peer_timeout_s,
                                            connect_timeout_s=connect_timeout_s, on_lost=_follower_lost)
    atexit.register(_exit_if_lost)  # after jax's own exit hook, so it runs before it


def _follower_lost(pid: int, reason: str) -> None:
    """A follower without process 0 can do nothing: it says so and exits."""
    _die(f"paxpage: process {pid} (the leader) was lost: {reason}; process "
         f"{_Watch.liveness.process_id} exits")


def _leader_lost(pid: int, reason: str) -> None:
    _Watch.message = (f"process {pid} of {_Watch.num_processes} was lost: {reason}. The run cannot go on "
                      "without its devices; the requests in flight have failed")
    _Watch.lost.set()
    print(f"paxpage: {_Watch.message}", file=sys.stderr, flush=True)
    # The step in flight fails (ProcessLostError) when its collective errors out, as one with a
    # dead peer does. One waiting on a peer that froze never returns: then end the process.
    threading.Thread(target=_abort_if_stuck, args=(_NAME_WAIT_S + 1.0,), daemon=True).start()


def _abort_if_stuck(grace_s: float) -> None:
    time.sleep(grace_s)
    from paxpage.engine_loop import live_loops

    if any(s.alive and (s.num_running or s.num_waiting) for s in (loop.snapshot() for loop in live_loops())):
        _die(f"paxpage: {_Watch.message}; a step is stuck in a collective with it, so process 0 exits")


def _die(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    try:
        sys.stdout.flush()
    finally:
        os._exit(1)


def _exit_if_lost() -> None:
    """At interpreter exit after a loss: jax.distributed's shutdown would wait for the lost
    process at its barrier (minutes), so leave at once, with status 1."""
    if _Watch.lost.is_set():
        _die(f"paxpage: exiting after a lost process ({_Watch.message})")


def check_peers() -> None:
    """Raises ProcessLostError once a peer of this process is lost."""
    if _Watch.lost.is_set():
        raise ProcessLostError(_Watch.message)


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
    leader = is_leader()
    if leader:
        check_peers()  # no collective with a process known to be gone
    try:
        return _broadcast_now(obj, leader)
    except Exception as exc:
        # a collective with a dead peer fails at once (its sockets closed): name the peer
        if _Watch.liveness is not None and _Watch.lost.wait(_NAME_WAIT_S):
            raise ProcessLostError(_Watch.message) from exc
        raise


def _broadcast_now(obj, leader: bool):
    from jax.experimental import multihost_utils

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

    def forward_pooled(self, batch, prev_rows=None, prev_tokens=None):
        _broadcast(("forward", batch, prev_rows, prev_tokens is not None))
        logits, pooled = self.inner.forward_pooled(batch, prev_rows, prev_tokens)
        return logits, _to_local(pooled)

    def sample(self, batch, logits, sampling, num_logprobs=0, num_prompt_logprobs=0, allowed=None,
               prev_rows=None, prev_tokens=None):
        # prev_rows / prev_tokens are the forward's (the engine passes both calls the same): the
        # followers keep theirs from the forward message
        _broadcast(("sample", sampling, num_logprobs, num_prompt_logprobs, allowed))
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
        """Process 0: releases the followers' `follow` loops (call once, after the last request).
        Nothing to release once a follower is lost."""
        if _Watch.lost.is_set():
            return
        if _Watch.liveness is not None:
            _Watch.liveness.close(goodbye=True)  # the followers' exits that follow are no loss
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
                prev_tokens = prev if has_prev else None
                if batch.pool_rows is None:
                    logits = self.inner.forward(batch, prev_rows, prev_tokens)
                else:  # an embedding step: the pooled rows are gathered as the leader's are
                    logits, pooled = self.inner.forward_pooled(batch, prev_rows, prev_tokens)
                    _to_local(pooled)
                pending = (batch, logits, prev_rows, prev_tokens)
            elif kind == "sample":
                _, sampling, num_logprobs, num_prompt_logprobs, allowed = message
                batch, logits, prev_rows, prev_tokens = pending
                _, _, prev = self._sample(batch, logits, sampling, num_logprobs, num_prompt_logprobs, allowed,
                                          prev_rows, prev_tokens)
                steps += 1
            else:  # pragma: no cover - the leader sends only the kinds above
                raise AssertionError(f"unknown lock-step message {kind!r}")
