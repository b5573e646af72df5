"""glibc malloc thresholds (paxpage/process_tuning.py): set where paxpage owns the process, left
alone when the user's environment sets malloc options. mallopt's effect shows only in timings
(scripts/bench_malloc.py), so these check the decision and the calls made. The start-up heap's
freeze: in a child process, what the collector still walks afterwards."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from paxpage import process_tuning
from paxpage.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 2**31 - 1
# M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_ARENA_MAX (glibc <malloc.h>), in the order tune_malloc sets them
ALL = [(-3, LIMIT), (-1, LIMIT), (-8, 1)]


class FakeLibc:
    def __init__(self, accept: bool = True):
        self.calls: list[tuple[int, int]] = []
        self.accept = accept

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return int(self.accept)


@pytest.mark.parametrize("environ,tuned", [
    ({}, True),
    ({"PATH": "/bin", "GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=2048"}, True),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, False),
    ({"MALLOC_ARENA_MAX": "2"}, False),  # any malloc option of the user's: all left alone
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, False),
])
def test_decision_and_calls(environ, tuned):
    libc = FakeLibc()
    applied = process_tuning.tune_malloc(environ, libc=libc)
    assert libc.calls == (ALL if tuned else [])
    assert applied == (dict(ALL) if tuned else {})


def test_refused_settings_are_not_reported():
    assert process_tuning.tune_malloc({}, libc=FakeLibc(accept=False)) == {}


def _child(env_extra: dict[str, str]) -> str:
    """What tune_malloc returns in a fresh interpreter with the given environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.update(env_extra)
    code = "from paxpage.process_tuning import tune_malloc; print(sorted(tune_malloc().items()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_subprocess_sets_thresholds_unless_the_user_did():
    assert _child({}) == str(sorted(ALL))  # glibc accepted all three
    assert _child({"MALLOC_MMAP_THRESHOLD_": "4000000000", "MALLOC_TRIM_THRESHOLD_": "4000000000"}) == "[]"


def test_freeze_startup_heap_collects_then_freezes():
    # In a child (a frozen object stays frozen for the process's life): start-up garbage in a
    # reference cycle is collected, not frozen; a live start-up object is no longer among those
    # the collector walks; one made afterwards is.
    code = (
        "import gc, weakref\n"
        "from paxpage import process_tuning\n"
        "class Node: pass\n"
        "garbage = Node(); garbage.self = garbage; dead = weakref.ref(garbage); del garbage\n"
        "live = Node(); live.self = live\n"
        "count = process_tuning.freeze_startup_heap()\n"
        "later = Node()\n"
        "walked = gc.get_objects()\n"
        "print(dead() is None, count > 0, any(o is live for o in walked), any(o is later for o in walked))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True)
    assert out.stdout.split() == ["True", "True", "False", "True"]


@pytest.mark.parametrize("argv,tuned", [
    (["cache", "info"], False),
    (["generate", "hi", "--max-tokens", "0"], True),  # fails after tuning, before any load
])
def test_cli_tunes_commands_that_own_the_process(monkeypatch, tmp_path, argv, tuned):
    from paxpage import xla_cache

    monkeypatch.setenv("PAXPAGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(xla_cache, "enable", lambda directory=None: None)
    calls = []
    monkeypatch.setattr(process_tuning, "tune_malloc", lambda: calls.append(1) or {})
    main(argv)
    assert calls == ([1] if tuned else [])


_RECOVERY_CHILD = """
import gc, sys, threading, time, weakref
import paxpage
from paxpage.engine_loop import EngineLoop, Submission
from paxpage.process_tuning import freeze_startup_heap

model = paxpage.load(sys.argv[1])
config = paxpage.EngineConfig(num_pages=64, max_num_seqs=2, max_model_len=128)
engine = paxpage.LLMEngine(model.config, model.param_forms, model.tokenizer, config)  # held by the loop alone
loop = EngineLoop(engine, restart_on_error=True)
done = threading.Event()
params = paxpage.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
loop.submit([Submission("warm", [1, 2, 3], params, lambda item: None, stream=False)]).result(60)
freeze_startup_heap()  # the engine is part of the frozen heap now, as under paxpage serve
old = weakref.ref(engine)
def boom():
    raise RuntimeError("injected")
engine.step = boom
del engine
loop.submit([Submission("failing", [1, 2, 3], params, lambda item: done.set(), stream=False)]).result(60)
assert done.wait(60)
while loop.snapshot().recovering is not None or loop.snapshot().num_restarts < 1:
    time.sleep(0.01)
print(old() is None, gc.get_freeze_count() > 0)
loop.shutdown()
"""


def test_rebuild_after_a_failed_step_frees_the_frozen_engine(tiny_llama_dir):
    # Under a frozen start-up heap (paxpage serve), the engine a failed step leaves behind sits in
    # it, held in reference cycles: the rebuild's collection thaws the heap for it, then
    # freezes what is left again.
    out = subprocess.run([sys.executable, "-c", _RECOVERY_CHILD, str(tiny_llama_dir)], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["True", "True"]
