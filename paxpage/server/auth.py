"""`--api-key`: every route but /health demands `Authorization: Bearer KEY` (401 otherwise);
/metrics too, unless the server opts it out (`--metrics-without-key`). The key is compared in
constant time (`hmac.compare_digest`), so response timing does not reveal how much of it matched.

A plain ASGI middleware (not BaseHTTPMiddleware), so streaming responses and disconnect
messages pass through untouched."""

from __future__ import annotations

import hmac
import json

from paxpage.server.errors import error_body

OPEN_PATHS = frozenset({"/health"})


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str, open_paths: frozenset[str] = OPEN_PATHS):
        self.app = app
        self.open_paths = open_paths
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            return await self.app(scope, receive, send)
        body = json.dumps(error_body(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                     code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
