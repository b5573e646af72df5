"""A client that goes away has its request aborted within a step and its pages freed; /metrics
shows the server idle again (running / waiting 0, KV usage back to its idle value) in seconds,
long before the request's natural end."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.server.conftest import LONG_TOKENS, metrics, wait_idle

MAX_TOKENS = LONG_TOKENS  # ~1 ms a token: many seconds, unless aborted
LONG = {"prompt": [3, 1, 4, 1, 5], "max_tokens": MAX_TOKENS, "ignore_eos": True}


def _generated(client) -> float:
    return metrics(client)["paxpage_generation_tokens_total"]


def test_disconnect_mid_stream_aborts(tiny_client):
    idle = wait_idle(tiny_client)
    kv_idle = idle["paxpage_kv_cache_usage_perc"]
    before = _generated(tiny_client)
    with tiny_client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            assert next(l for l in lines if l.startswith("data: "))
        m = metrics(tiny_client)
        assert m["paxpage_num_requests_running"] == 1
        assert m["paxpage_kv_cache_usage_perc"] > kv_idle
    t0 = time.monotonic()
    after = wait_idle(tiny_client, kv_idle, timeout=5.0)
    assert time.monotonic() - t0 < 5.0
    assert after["paxpage_generation_tokens_total"] - before < MAX_TOKENS, "ran to its end: never aborted"
    time.sleep(0.3)  # nothing keeps generating for it
    assert _generated(tiny_client) == after["paxpage_generation_tokens_total"]


def test_disconnect_while_waiting_for_whole_answer_aborts(tiny_client):
    kv_idle = wait_idle(tiny_client)["paxpage_kv_cache_usage_perc"]
    before = _generated(tiny_client)
    with httpx.Client(base_url=str(tiny_client.base_url), headers=tiny_client.headers,
                      timeout=httpx.Timeout(1.0, connect=5.0)) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/completions", json=LONG)
    after = wait_idle(tiny_client, kv_idle, timeout=5.0)
    assert after["paxpage_generation_tokens_total"] - before < MAX_TOKENS, "ran to its end: never aborted"
