"""A step that fails mid-traffic (an injected fault, an out-of-memory error that also took the
donated KV pool with it): every request then live ends with an error naming the failure (an SSE
error event, or a 500), /health answers 503 while the engine is rebuilt, later requests are
served with the same tokens as before, and past max_restarts_per_minute the engine stays down
and says so. Tiny random model (token-id prompts)."""

from __future__ import annotations

import json
import threading
import time

import jax
import pytest

from tests.server.conftest import LiveServer, metrics

PROMPT = [5, 6, 7, 8]
LONG = {"prompt": [1, 2, 3, 4], "max_tokens": 4000, "ignore_eos": True}
GREEDY = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def restarting_server(tiny_model):
    import paxpage
    from paxpage.async_engine import AsyncEngine

    engine = AsyncEngine(tiny_model, paxpage.EngineConfig(num_pages=256, max_num_seqs=4, max_model_len=8192),
                         restart_on_error=True, max_restarts_per_minute=2)
    server = LiveServer(engine, served_model_name="tiny")
    yield server
    server.stop()


def _wait(predicate, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return value


def _inject(server, error: Exception, *, when_running: int = 1, slow_rebuild: float = 0.0,
            lose_pool: bool = False) -> None:
    """The running engine's first step with `when_running` sequences running raises `error`
    (first deleting the KV pool, as a failed donated step leaves it); its rebuild takes
    slow_rebuild seconds longer."""
    engine = server.engine.engine
    step, rebuilt = engine.step, engine.rebuilt

    def boom():
        if engine.scheduler.num_running < when_running:
            return step()
        if lose_pool:
            jax.tree.map(lambda x: x.delete(), engine.runner.kv_cache)
        raise error

    def slow():
        time.sleep(slow_rebuild)
        return rebuilt()

    engine.rebuilt = slow
    engine.step = boom


def test_failed_step_fails_live_requests_and_the_engine_comes_back(restarting_server):
    server = restarting_server
    with server.client() as c:
        before = c.post("/v1/completions", json=GREEDY)
        assert before.status_code == 200, before.text
        _inject(server, RuntimeError("injected fault"), when_running=2, slow_rebuild=1.0)
        whole = {}
        worker = threading.Thread(target=lambda: whole.setdefault("r", c.post("/v1/completions", json=LONG)),
                                  daemon=True)
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            worker.start()  # the step that runs both raises
            health = _wait(lambda: (h := c.get("/health")).status_code == 503 and h, "no 503 while rebuilding",
                           timeout=120)  # the two-row step may compile first
            assert health.json()["error"]["code"] == "engine_recovering"
            assert "injected fault" in health.json()["error"]["message"]
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[-2][len("data: "):])["error"]
        assert err["code"] == "engine_step_failed" and "injected fault" in err["message"], err
        worker.join(30)
        assert whole["r"].status_code == 500, whole["r"].text
        assert "injected fault" in whole["r"].json()["error"]["message"]
        _wait(lambda: c.get("/health").status_code == 200, "the engine did not come back")
        after = c.post("/v1/completions", json=GREEDY)
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
        m = metrics(c)
        assert m["paxpage_engine_restarts_total"] == 1
        assert m["paxpage_requests_failed_total"] == 2 and m["paxpage_requests_finished_total"] == 2, m
        assert m["paxpage_requests_received_total"] == 4
        assert m["paxpage_generation_tokens_total"] >= 24  # the first engine's tokens are kept


def test_out_of_memory_is_recovered_then_the_restart_limit_holds(restarting_server):
    server = restarting_server
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 20615843020 bytes")
    with server.client() as c:
        reference = c.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]
        for attempt in range(2):  # max_restarts_per_minute=2: both are rebuilt
            _inject(server, oom, lose_pool=True)
            r = c.post("/v1/completions", json=GREEDY)
            assert r.status_code == 500 and "Out of memory" in r.json()["error"]["message"], r.text
            _wait(lambda: c.get("/health").status_code == 200, "the engine did not come back")
            r = c.post("/v1/completions", json=GREEDY)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference, r.text
        _inject(server, oom)
        r = c.post("/v1/completions", json=GREEDY)
        assert r.status_code == 500, r.text
        health = _wait(lambda: (h := c.get("/health")).status_code == 503 and h, "no 503 once down")
        err = health.json()["error"]
        assert err["code"] == "engine_dead" and "max_restarts_per_minute is 2" in err["message"], err
        r = c.post("/v1/completions", json=GREEDY)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
