"""Every error of the HTTP API is OpenAI-shaped, names the field, and never hangs or 500s.
Tiny random model (token-id prompts); the values are checked before any generation."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.conftest import LONG_TOKENS, TINY_KEY, TINY_MAX_LEN, TINY_PAGE_SIZE, TINY_PAGES, metrics

PROMPT = [1, 2, 3, 4]


def _assert_error(r: httpx.Response, status: int, param: str | None = None, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
        assert param.split(".")[0] in err["message"] or any(w in err["message"] for w in words), err
    for w in words:
        assert w in err["message"], err
    return err


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.5),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("n", 0),
    ("max_tokens", 0),
    ("top_k", -2),
    ("min_p", 1.5),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0),
    ("seed", -1),
    ("min_tokens", 99),  # more than max_tokens
    ("stop", [""]),
    ("stop_token_ids", [-1]),
    ("logprobs", 21),
    ("n", "two"),  # wrong type: pydantic
    ("temperature", "hot"),
    ("stream", "yes"),
])
def test_bad_completion_field_is_400_naming_it(tiny_client, field, value):
    r = tiny_client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4,
                                                  field: value})
    _assert_error(r, 400, field)


def test_chat_without_template_is_400(tiny_client):
    r = tiny_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    _assert_error(r, 400, "messages", "chat template")


def test_stream_options_without_stream_is_400(tiny_client):
    r = tiny_client.post("/v1/completions", json={"prompt": PROMPT, "stream_options": {"include_usage": True}})
    _assert_error(r, 400, "stream_options")


@pytest.mark.parametrize("prompt", [[], "", [[1, 2], []]])
def test_empty_prompt_is_400(tiny_client, prompt):
    r = tiny_client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    _assert_error(r, 400, "prompt", "empty")


def test_text_prompt_without_tokenizer_is_400(tiny_client):
    _assert_error(tiny_client.post("/v1/completions", json={"prompt": "hello"}), 400, "prompt")


def test_token_outside_vocabulary_is_400(tiny_client):
    _assert_error(tiny_client.post("/v1/completions", json={"prompt": [1, 128]}), 400, "prompt", "128")


def test_prompt_longer_than_max_model_len_is_400(tiny_client):
    prompt = [5] * (TINY_MAX_LEN + 1)
    err = _assert_error(tiny_client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}),
                        400, "prompt")
    assert str(TINY_MAX_LEN) in err["message"], err


@pytest.mark.parametrize("stream", [False, True])
def test_request_that_never_fits_the_pool_is_400_while_others_go_on(tiny_client, stream):
    pool_tokens = TINY_PAGES * TINY_PAGE_SIZE
    assert pool_tokens < TINY_MAX_LEN  # it passes the max_model_len check, only the pool refuses it
    with tiny_client.stream("POST", "/v1/completions",
                            json={"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}) as live:
        assert live.status_code == 200
        lines = live.iter_lines()
        assert next(l for l in lines if l.startswith("data: "))  # the live request is generating
        t0 = time.monotonic()
        r = tiny_client.post("/v1/completions", json={"prompt": [7] * (pool_tokens - 8), "max_tokens": 16,
                                                      "stream": stream})
        assert time.monotonic() - t0 < 10  # refused at once, not queued behind the live one
        err = _assert_error(r, 400, "prompt")
        assert str(TINY_PAGES) in err["message"], err
        # the live stream carries on to its natural end
        chunks = [l for l in lines if l.startswith("data: ")]
    assert chunks[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in chunks[-2]


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"5": 10}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "temprature": 0.5}, "temprature"),  # a typo is no default
    ("/v1/completions", {"prompt": PROMPT, "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": PROMPT, "stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "modalities": ["audio"]},
     "modalities"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]},
     "messages"),
    ("/tokenize", {"prompt": "x", "return_offsets": True}, "return_offsets"),
])
def test_unsupported_field_is_400_naming_it(tiny_client, path, body, field):
    err = _assert_error(tiny_client.post(path, json=body), 400, field, "unsupported")
    assert err["code"] == "invalid_value"


def test_openai_client_sees_400_naming_an_unknown_field(tiny_server):
    import openai

    with openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key=TINY_KEY, max_retries=0) as client:
        for call, body in ((client.completions.create, {"prompt": PROMPT}),
                           (client.chat.completions.create, {"messages": [{"role": "user", "content": "x"}]}),
                           (client.embeddings.create, {"input": PROMPT})):
            with pytest.raises(openai.BadRequestError) as e:
                call(model="tiny", **body, extra_body={"temprature": 0.5})
            assert e.value.body["param"] == "temprature" and "unsupported" in e.value.body["message"]


def test_only_the_listed_openai_fields_are_accepted_and_ignored(tiny_client):
    from paxpage.server.protocol import IGNORED_FIELDS

    assert set(IGNORED_FIELDS) == {"request", "message"}
    assert set(IGNORED_FIELDS["request"]) == {"user", "store", "metadata", "service_tier", "prompt_cache_key",
                                              "safety_identifier"}
    assert set(IGNORED_FIELDS["message"]) == {"refusal", "annotations"}
    extras = {"user": "u-1", "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
              "prompt_cache_key": "c", "safety_identifier": "s"}
    r = tiny_client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **extras})
    assert r.status_code == 200, r.text
    message = {"role": "assistant", "content": "x", "refusal": None, "annotations": []}
    # validation passes; the tiny model then lacks a chat template
    r = tiny_client.post("/v1/chat/completions", json={"messages": [message], **extras})
    _assert_error(r, 400, "messages", "chat template")


def test_unknown_model_is_404(tiny_client):
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        err = _assert_error(tiny_client.post(path, json={"model": "gpt-4o", **body}), 404, "model", "gpt-4o")
        assert err["code"] == "model_not_found"


def test_unknown_route_is_404_json(tiny_client):
    _assert_error(tiny_client.get("/v1/nothing"), 404)


def test_malformed_json_is_400(tiny_client):
    r = tiny_client.post("/v1/completions", content=b'{"prompt": [1, 2', headers={"content-type": "application/json"})
    _assert_error(r, 400, None, "JSON")
    r = tiny_client.post("/v1/chat/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    _assert_error(r, 400)


def test_api_key_is_required_except_for_health(tiny_server):
    with tiny_server.client() as anonymous:
        assert anonymous.get("/health").status_code == 200
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/detokenize")):
            r = anonymous.request(method, path, json={"prompt": PROMPT})
            err = _assert_error(r, 401)
            assert err["code"] == "invalid_api_key"
            r = anonymous.request(method, path, json={"prompt": PROMPT}, headers={"Authorization": "Bearer wrong"})
            _assert_error(r, 401)
        r = anonymous.get("/v1/models", headers={"Authorization": f"Bearer {TINY_KEY}"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"


def test_openai_client_sees_401_without_key(tiny_server):
    import openai

    with openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="wrong", timeout=30, max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()


def test_overload_is_503_with_retry_after(tiny_client):
    """max_num_seqs=1, max_waiting_requests=1: one runs, one waits, the next is refused at once."""
    long = {"prompt": PROMPT, "max_tokens": LONG_TOKENS, "ignore_eos": True}
    with tiny_client.stream("POST", "/v1/completions", json={**long, "stream": True}) as running:
        lines = running.iter_lines()
        assert next(l for l in lines if l.startswith("data: "))
        waiting_result = {}

        def waiter():  # blocks in the queue; its client gives up after a while (and is aborted)
            try:
                with httpx.Client(base_url=str(tiny_client.base_url), headers=tiny_client.headers,
                                  timeout=httpx.Timeout(4.0, connect=5.0)) as c:
                    waiting_result["r"] = c.post("/v1/completions", json=long)
            except httpx.TimeoutException as e:
                waiting_result["r"] = e

        thread = threading.Thread(target=waiter, daemon=True)
        thread.start()
        deadline = time.monotonic() + 3
        while metrics(tiny_client)["paxpage_num_requests_waiting"] < 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.02)
        t0 = time.monotonic()
        r = tiny_client.post("/v1/completions", json=long)
        assert time.monotonic() - t0 < 5
        err = _assert_error(r, 503)
        assert float(r.headers["Retry-After"]) >= 1, r.headers
        assert err["code"] == "overloaded"
        # the running one is unaffected
        assert next(l for l in lines if l.startswith("data: "))
        thread.join(timeout=15)
        assert not thread.is_alive()
        assert isinstance(waiting_result["r"], httpx.TimeoutException) or waiting_result["r"].status_code == 200
