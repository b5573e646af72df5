"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.

Routes raise `APIError`; the handlers installed here turn it, FastAPI's validation errors
(malformed JSON, wrong types) and anything unexpected into that shape, so a client never sees
FastAPI's default 422 body or an HTML 500."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("paxpage.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.code), status_code=err.status,
                        headers=err.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None  # the top-level field of the body
    unknown = [".".join(str(p) for p in e["loc"] if p != "body")
               for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:  # named first: the client sent something this server would otherwise not do
        return (f"unsupported field(s) {unknown}: paxpage does not implement them for this route",
                unknown[0].split(".")[0])
    parts = []
    for e in errors[:3]:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {e.get('msg')} (got {e.get('input')!r:.80})" if "input" in e
                     else f"{where}: {e.get('msg')}")
    return "invalid request: " + "; ".join(parts), param


def _body_parse_message(exc: StarletteHTTPException) -> str | None:
    """FastAPI's "error parsing the body" 400, said precisely: the parser's own error is its cause."""
    cause = exc.__cause__
    if exc.status_code != 400 or cause is None:
        return None
    if isinstance(cause, UnicodeDecodeError):
        return f"request body is not valid UTF-8: byte {cause.start} ({cause.object[cause.start:cause.start + 1]!r})"
    if isinstance(cause, RecursionError):
        return "request body nests JSON arrays / objects too deeply to parse"
    return None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        body_error = _body_parse_message(exc)
        if body_error is not None:
            return error_response(bad_request(body_error))
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(error_body(exc.status_code, str(exc.detail), None, code),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error serving %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))
