"""Multi-host faults on one machine: two processes on 127.0.0.1 joined by jax.distributed (gloo),
TP = 2 across them; one is killed while process 0 streams a request. The other must not hang in
a collective: a lost follower gives process 0's request an error naming process 1, a lost
leader makes the follower exit with status 1, each within 10 s of the kill. A follower that
freezes (SIGSTOP: its sockets stay open, as when a host hangs) is found by its silence, and
process 0, stuck in a collective with it, exits naming it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.parallel.helpers import ROOT, device_env
from tests.parallel.test_multihost import _free_port

START_DEADLINE_S = 120  # both processes up and process 0's first tokens out (a loaded machine is slow)
DETECT_S = 10


PEER_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def xla_cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("mh_fault_xla"))


def _start_pair(model_dir, cache, tmp_path):
    address = f"127.0.0.1:{_free_port()}"
    # stdout carries only the main thread's lines (tokens, the error); stderr the watchdog's
    # messages and tracebacks, which another thread may write while a line is half written
    outs = [open(tmp_path / f"out{i}.txt", "w+") for i in range(2)]
    errs = [open(tmp_path / f"err{i}.txt", "w+") for i in range(2)]
    args = [str(model_dir), cache, str(PEER_TIMEOUT_S)]
    procs = [subprocess.Popen([sys.executable, "-u", "-m", "tests.parallel.mh_fault_worker", address, str(i), *args],
                              cwd=ROOT, env=device_env(1), stdout=outs[i], stderr=errs[i], text=True)
             for i in range(2)]
    deadline = time.monotonic() + START_DEADLINE_S
    while "token 2\n" not in (tmp_path / "out0.txt").read_text():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            _kill(procs)
            raise AssertionError("process 0 streamed no tokens:\n" + _log(tmp_path, 0) + "\n" + _log(tmp_path, 1))
        time.sleep(0.05)
    return procs


def _log(tmp_path, i: int) -> str:
    """The last of process i's stdout, then of its stderr."""
    return ((tmp_path / f"out{i}.txt").read_text()[-3000:] + "\n--- stderr ---\n"
            + (tmp_path / f"err{i}.txt").read_text()[-3000:])


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _exit_after_kill(procs, victim: int, sig=signal.SIGKILL) -> tuple[int, float]:
    os.kill(procs[victim].pid, sig)
    t0 = time.monotonic()
    other = procs[1 - victim]
    try:
        rc = other.wait(timeout=DETECT_S + 20)  # the bound is asserted below; this only ends a hang
    finally:
        _kill(procs)
    return rc, time.monotonic() - t0


def test_lost_follower_fails_the_leaders_request_naming_it(tiny_llama_dir, xla_cache_dir, tmp_path):
    procs = _start_pair(tiny_llama_dir, xla_cache_dir, tmp_path)
    rc, seconds = _exit_after_kill(procs, victim=1)
    out, log = (tmp_path / "out0.txt").read_text(), _log(tmp_path, 0)
    assert seconds < DETECT_S, f"process 0 took {seconds:.1f} s to end after process 1 was killed\n{log}"
    assert rc == 1, log
    errors = [json.loads(line)["error"] for line in out.splitlines() if line.startswith('{"error"')]
    assert errors, f"the request in flight got no error\n{log}"
    assert "ProcessLostError" in errors[0] and "process 1 of 2 was lost" in errors[0], errors[0]


def test_frozen_follower_ends_the_leader_naming_it(tiny_llama_dir, xla_cache_dir, tmp_path):
    procs = _start_pair(tiny_llama_dir, xla_cache_dir, tmp_path)
    rc, seconds = _exit_after_kill(procs, victim=1, sig=signal.SIGSTOP)
    log = _log(tmp_path, 0)
    assert seconds < DETECT_S, f"process 0 took {seconds:.1f} s to end after process 1 froze\n{log}"
    assert rc == 1, log
    assert "paxpage: process 1 of 2 was lost: nothing came from it for" in (tmp_path / "err0.txt").read_text(), log


def test_lost_leader_ends_the_follower(tiny_llama_dir, xla_cache_dir, tmp_path):
    procs = _start_pair(tiny_llama_dir, xla_cache_dir, tmp_path)
    rc, seconds = _exit_after_kill(procs, victim=0)
    err, log = (tmp_path / "err1.txt").read_text(), _log(tmp_path, 1)
    assert seconds < DETECT_S, f"process 1 took {seconds:.1f} s to end after process 0 was killed\n{log}"
    assert rc != 0, log
    # its own exit (status 1, the lost process named), unless jax's fatal error came first
    assert rc == 1 and "paxpage: process 0 (the leader) was lost" in err or rc == -signal.SIGABRT, log
