"""No single request can stall or kill the server: oversized bodies (413, answered at once),
malformed bytes, and fields past what the engine can hold are OpenAI-shaped 4xx, and the server
answers a normal request afterwards. Tiny random model (token-id prompts)."""

from __future__ import annotations

import json
import socket
import time

import pytest

from paxpage.server import limits
from tests.server.conftest import TINY_KEY, TINY_PAGES
from tests.server.test_errors import PROMPT, _assert_error

AUTH = f"Authorization: Bearer {TINY_KEY}\r\n"


def _normal_request_works(client) -> None:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["text"]) >= 0


def _raw(base_url: str, head: str, body: bytes = b"", timeout: float = 10.0) -> tuple[int, dict, float]:
    """Sends a raw HTTP request (maybe a body shorter than its Content-Length); returns status,
    the JSON body and the seconds the answer took."""
    host, port = base_url.removeprefix("http://").split(":")
    t = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head.encode() + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head_bytes, payload = data.split(b"\r\n\r\n", 1)
    return int(head_bytes.split()[1]), json.loads(payload), time.monotonic() - t


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_declared_huge_body_is_413_before_it_is_sent(tiny_server):
    """100 MB announced, none of it sent: the answer comes at once, not after reading the body."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Type: application/json\r\n"
            f"Content-Length: {100 << 20}\r\n\r\n")
    status, body, seconds = _raw(tiny_server.base_url, head)
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    assert str(limits.DEFAULT_MAX_REQUEST_BYTES) in body["error"]["message"]
    assert seconds < 5


def test_streamed_huge_body_is_413(tiny_client):
    """Chunked (no Content-Length): counted as it arrives, refused once past the limit."""
    def chunks():
        piece = b" " * (1 << 20)
        for _ in range(100):
            yield piece

    t = time.monotonic()
    r = tiny_client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    _assert_error(r, 413, None, "at most")
    assert time.monotonic() - t < 10
    _normal_request_works(tiny_client)


def test_sent_huge_body_is_413(tiny_client):
    t = time.monotonic()
    r = tiny_client.post("/v1/completions", content=b" " * (100 << 20),
                         headers={"Content-Type": "application/json"})
    _assert_error(r, 413, None, "at most")
    assert time.monotonic() - t < 10
    _normal_request_works(tiny_client)


def test_invalid_utf8_is_400(tiny_client):
    r = tiny_client.post("/v1/completions", content=b'{"prompt": "\xff\xfe", "max_tokens": 2}',
                         headers={"Content-Type": "application/json"})
    _assert_error(r, 400, None, "UTF-8")


def test_deeply_nested_json_is_400(tiny_client):
    depth = 100_000
    r = tiny_client.post("/v1/completions", content=b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}",
                         headers={"Content-Type": "application/json"})
    _assert_error(r, 400, None, "deep")
    _normal_request_works(tiny_client)


@pytest.mark.parametrize("stream", [False, True])
def test_n_past_the_engine_is_400_naming_the_limit(tiny_client, stream):
    """n = 10^6 once took the engine down allocating its samples; now the engine refuses it."""
    r = tiny_client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "n": 1_000_000,
                                                  "stream": stream})
    err = _assert_error(r, 400, "n", "1000000", "512")  # min(max_num_batched_tokens 512, num_pages)
    assert str(TINY_PAGES) in err["message"]
    _normal_request_works(tiny_client)


@pytest.mark.parametrize("field, value, param, words", [
    ("max_tokens", 10 ** 9, "prompt", ("max_tokens", "max_model_len")),
    ("logprobs", 10 ** 6, "logprobs", ()),
    ("stop", [f"s{i}" for i in range(10_000)], "stop", ("10000", str(limits.MAX_STOP_STRINGS))),
    ("stop", ["x" * 5000], "stop", ("5000", str(limits.MAX_STOP_STRING_CHARS))),
    ("stop_token_ids", list(range(5000)), "stop_token_ids", (str(limits.MAX_STOP_TOKEN_IDS),)),
    ("guided_json", {"type": "object", "description": "d" * (1 << 20)}, "guided_json",
     (str(limits.MAX_STRUCTURED_BYTES),)),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "big", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(40_000)}}}},
     "response_format", (str(limits.MAX_STRUCTURED_BYTES),)),
])
def test_fields_past_their_limits_are_400(tiny_client, field, value, param, words):
    t = time.monotonic()
    r = tiny_client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, field: value})
    _assert_error(r, 400, param, *words)
    assert time.monotonic() - t < 10


def test_stop_strings_at_the_limit_are_served(tiny_client):
    r = tiny_client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2,
                                                  "stop": ["x" * limits.MAX_STOP_STRING_CHARS] * limits.MAX_STOP_STRINGS})
    assert r.status_code == 200, r.text


def test_request_limits_validate():
    with pytest.raises(ValueError, match="max_request_bytes must be a positive int, got 0"):
        limits.RequestLimits(max_request_bytes=0)
