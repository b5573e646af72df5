"""Requests built by a property-based fuzzer (schemathesis) from the server's own OpenAPI schema,
valid and invalid ones, against a live server on 127.0.0.1: none is a 500, none takes over 10 s,
every 4xx is OpenAI-shaped, and the server still answers a normal request afterwards.

A tiny random llama with a real BPE tokenizer and a chat template, and a small pool, so that the
most a valid request can ask (n, max_tokens) runs in well under the bound. The first request of
each new step shape compiles it (tens of seconds on a busy 2-core CPU): the seconds jax spends
compiling during a request (paxpage.compile_counter) do not count against its 10 s. CI runs a
bounded number of examples per route (FUZZ_EXAMPLES)."""

from __future__ import annotations

import time

import pytest

from paxpage import compile_counter
from tests.conftest import save_tiny_text_model
from tests.server.conftest import LiveServer

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

FUZZ_EXAMPLES = 25  # per route and mode
ROUTES = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize")
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    import paxpage
    from paxpage.async_engine import AsyncEngine
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny_chat")
    save_tiny_text_model(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    config = paxpage.EngineConfig(num_pages=64, page_size=8, max_num_seqs=4, max_num_batched_tokens=32,
                                  max_model_len=128)
    server = LiveServer(AsyncEngine(paxpage.load(path), config, restart_on_error=True),
                        served_model_name="tiny")
    yield server
    server.stop()


def _operations(server):
    schema = schemathesis.openapi.from_dict(server.app.openapi())
    ops = [result.ok() for result in schema.get_all_operations()]
    return {op.path: op for op in ops if op.method.upper() == "POST" and op.path in ROUTES}


def _check(response, elapsed: float, compiling: float) -> None:
    assert elapsed - compiling < 10.0, f"{elapsed:.1f} s ({compiling:.1f} s compiling) for {response.request.body!r:.300}"
    assert response.status_code < 500, f"{response.status_code} {response.text[:500]} for {response.request.body!r:.300}"
    if response.status_code >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], response.text


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("route", ROUTES)
def test_fuzzed_requests_never_500_or_hang(fuzz_server, route, mode):
    op = _operations(fuzz_server)[route]
    strategy = op.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case):
        t, compiled = time.monotonic(), compile_counter.compile_seconds()
        response = case.call(base_url=fuzz_server.base_url, timeout=300)
        _check(response, time.monotonic() - t, compile_counter.compile_seconds() - compiled)

    run()
    with fuzz_server.client() as c:  # still serving
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert c.get("/health").status_code == 200
