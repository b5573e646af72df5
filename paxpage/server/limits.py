"""What one request may ask of the server, so that no single request can stall or kill it.

- The body: at most `max_request_bytes` (413, answered before the body is read when Content-Length
  says so, else as soon as the streamed bytes pass the limit). `BodyLimitMiddleware` reads the
  body in full (bounded) before any route sees it.
- Fields whose cost grows with their size on every engine step or at submission: stop strings
  (count and length), stop_token_ids, and a structured-output spec (its JSON text). 400 naming
  the field and the limit.

Limits derived from the engine (n, beam_width, max_tokens, logprobs against the vocabulary) are
the engine's own checks at submission (`LLMEngine.add_request`), turned into 400s by dispatch.
Malformed bodies (invalid UTF-8, JSON nested deeper than Python's parser allows) are 400s from
errors.py."""

from __future__ import annotations

import dataclasses
import json

from paxpage.server.errors import bad_request, error_body

DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # a 32k-token prompt as token ids is ~0.2 MB; batches of them fit
MAX_STOP_STRINGS = 64  # each is matched against every new token's text tail
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_STRUCTURED_BYTES = 256 << 10  # the spec's JSON text; its grammar compiles at submission


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def __post_init__(self):
        if isinstance(self.max_request_bytes, bool) or not isinstance(self.max_request_bytes, int) \
                or self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be a positive int, got {self.max_request_bytes!r}")


def check_sampling_fields(req) -> None:
    """400 for a stop list or a structured-output spec past the limits above."""
    stop = req.stop
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if len(stop) > MAX_STOP_STRINGS:
            raise bad_request(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
        for s in stop:
            if len(s) > MAX_STOP_STRING_CHARS:
                raise bad_request(f"stop contains a string of {len(s)} characters; at most "
                                  f"{MAX_STOP_STRING_CHARS} are allowed", "stop")
    if req.stop_token_ids is not None and len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"stop_token_ids has {len(req.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} "
                          "are allowed", "stop_token_ids")
    for field in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                  "structured_outputs"):
        value = getattr(req, field)
        if value is None:
            continue
        if hasattr(value, "model_dump"):
            value = value.model_dump(by_alias=True)
        size = len(value.encode()) if isinstance(value, str) else len(json.dumps(value).encode())
        if size > MAX_STRUCTURED_BYTES:
            raise bad_request(f"{field} is {size} bytes of JSON; at most {MAX_STRUCTURED_BYTES} are allowed",
                              field)


class BodyLimitMiddleware:
    """ASGI middleware: reads each request's body (at most `max_bytes`) before the app runs, and
    answers 413 past the limit without reading on. The app then receives the body as one message;
    later `receive` calls (the disconnect watch) go to the server."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                return await _reply(send, 400, f"Content-Length {declared[:40]!r} is not an integer")
            if length > self.max_bytes:
                return await _reply(send, 413, self._too_large(f"{length} bytes"))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # nobody is left to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await _reply(send, 413, self._too_large(f"more than {self.max_bytes} bytes"))
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _too_large(self, what: str) -> str:
        return f"request body is {what}; this server accepts at most {self.max_bytes} bytes"


async def _reply(send, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message, code="request_too_large" if status == 413 else None)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
