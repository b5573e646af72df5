"""/health follows the real engine loop: 503 once the loop has died (a fault injected into its
step) or while live requests make no progress; live and new requests then fail cleanly (an SSE
error event, 503), never hang."""

from __future__ import annotations

import json
import threading
import time

import pytest

PROMPT = [1, 2, 3, 4]


def test_dead_engine_loop(fresh_tiny_server):
    with fresh_tiny_server.client() as c:
        assert c.get("/health").status_code == 200
        with c.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True,
                                                       "stream": True}) as r:
            lines = r.iter_lines()
            assert next(l for l in lines if l.startswith("data: "))

            def boom():
                raise RuntimeError("injected fault")

            fresh_tiny_server.engine.engine.step = boom  # the loop's next step raises
            events = [l for l in lines if l.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[-2][len("data: "):])["error"]
        assert err["code"] == "engine_dead" and "injected fault" in err["message"]
        health = c.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        for stream in (False, True):
            r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": stream})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text


@pytest.mark.parametrize("fresh_tiny_server", [0.5], indirect=True)
def test_stalled_engine_loop(fresh_tiny_server):
    engine = fresh_tiny_server.engine.engine
    original = engine.step
    release = threading.Event()

    def stuck():
        release.wait(20)
        return original()

    with fresh_tiny_server.client() as c:
        assert c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200  # warm
        engine.step = stuck
        result = {}
        worker = threading.Thread(target=lambda: result.setdefault(
            "r", c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})), daemon=True)
        worker.start()
        try:
            deadline = time.monotonic() + 10
            while (health := c.get("/health")).status_code == 200:
                assert time.monotonic() < deadline, "a stuck step never showed in /health"
                time.sleep(0.1)
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_stalled"
        finally:
            engine.step = original
            release.set()
        worker.join(30)
        assert result["r"].status_code == 200
        assert c.get("/health").status_code == 200
