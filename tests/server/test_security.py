"""Security basics: the API key guards /metrics too (unless opted out) and is compared in constant
time; CORS headers only when origins are given; a `model` field never reaches the filesystem.
In-process apps (starlette's TestClient) over the shared tiny engine: nothing here generates."""

from __future__ import annotations

import hmac

import pytest
from starlette.testclient import TestClient

from paxpage.server import auth
from tests.server.conftest import TINY_KEY

ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def tiny_engine(tiny_server):
    return tiny_server.engine


def _client(engine, **kw) -> TestClient:
    from paxpage.server import build_app

    return TestClient(build_app(engine, served_model_name="tiny", **kw))


def test_metrics_need_the_key_unless_opted_out(tiny_engine):
    with _client(tiny_engine, api_key=TINY_KEY) as c:
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"Authorization": f"Bearer {TINY_KEY}"}).status_code == 200
        assert c.get("/health").status_code == 200
    with _client(tiny_engine, api_key=TINY_KEY, metrics_need_key=False) as c:
        assert c.get("/metrics").status_code == 200
        assert c.get("/v1/models").status_code == 401


@pytest.mark.parametrize("given", ["", "Bearer", f"Bearer {TINY_KEY[:-1]}", f"Bearer {TINY_KEY}x",
                                   f"bearer {TINY_KEY}", TINY_KEY])
def test_near_miss_keys_are_401(tiny_engine, given):
    with _client(tiny_engine, api_key=TINY_KEY) as c:
        r = c.get("/v1/models", headers={"Authorization": given})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_key_comparison_is_constant_time(tiny_engine, monkeypatch):
    """Every comparison goes through hmac.compare_digest (no early exit on the first wrong byte)."""
    calls, real = [], hmac.compare_digest

    def recording(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", recording)
    with _client(tiny_engine, api_key=TINY_KEY) as c:
        c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        c.get("/v1/models", headers={"Authorization": f"Bearer {TINY_KEY}"})
    assert calls == [(b"Bearer wrong", f"Bearer {TINY_KEY}".encode())] + [(f"Bearer {TINY_KEY}".encode(),) * 2]


def test_cors_is_off_unless_asked(tiny_engine):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    with _client(tiny_engine) as c:
        r = c.get("/v1/models", headers={"Origin": ORIGIN})
        assert "access-control-allow-origin" not in r.headers
        r = c.options("/v1/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers
    with _client(tiny_engine, cors_origins=[ORIGIN]) as c:
        r = c.get("/v1/models", headers={"Origin": ORIGIN})
        assert r.headers["access-control-allow-origin"] == ORIGIN
        r = c.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        r = c.get("/v1/models", headers={"Origin": "https://elsewhere.example"})
        assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("model", ["/etc/passwd", "../../../../etc/hostname", "file:///etc/passwd",
                                   "~/.ssh/id_rsa", "tiny/../../etc/passwd"])
def test_model_field_never_reaches_the_filesystem(tiny_engine, model, monkeypatch):
    import builtins
    import os

    opened = []
    real_open, real_stat = builtins.open, os.stat
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: (opened.append(f), real_open(f, *a, **k))[1])
    monkeypatch.setattr(os, "stat", lambda f, *a, **k: (opened.append(f), real_stat(f, *a, **k))[1])
    with _client(tiny_engine) as c:
        for route, body in (("/v1/completions", {"prompt": [1, 2], "max_tokens": 1}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                            ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            r = c.post(route, json={**body, "model": model})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
            assert "root:" not in r.text
    assert not [f for f in opened if "etc" in str(f) or "ssh" in str(f)], opened
