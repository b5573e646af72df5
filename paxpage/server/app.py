"""The FastAPI app: OpenAI-compatible routes over one `AsyncEngine`."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from paxpage.embedding import Pooling

from paxpage.server import chat_routes, completion_routes, embedding_routes, info_routes, responses_routes
from paxpage.server.auth import OPEN_PATHS, ApiKeyMiddleware
from paxpage.server.context import ServerContext
from paxpage.server.errors import install_error_handlers
from paxpage.server.limits import BodyLimitMiddleware, RequestLimits
from paxpage.server.metrics import ServerMetrics
from paxpage.server.response_store import ResponseStore

DEFAULT_STALL_TIMEOUT_S = 300.0  # a first step on a slow CPU compiles for a minute or more


def build_app(engine, *, served_model_name: str, api_key: str | None = None,
              stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, max_stored_responses: int = 1000,
              limits: RequestLimits | None = None, metrics_need_key: bool = True,
              cors_origins: list[str] | None = None, pooling: str = "last") -> FastAPI:
    """engine: a started `paxpage.AsyncEngine`; the caller owns it (and shuts it down).
    api_key: when set, every route but /health (and /metrics when not metrics_need_key) needs
    `Authorization: Bearer <api_key>`. limits: the request body's size (limits.py).
    tool_call_parser: a name in server.tool_parsers.PARSERS; None picks one from the chat template.
    reasoning_parser: a name in server.reasoning.PARSERS; None: the answer is not split.
    max_stored_responses: /v1/responses answers kept for previous_response_id (the oldest go first).
    cors_origins: origins browsers may call from (CORS); None or empty: no CORS headers at all.
    pooling: how /v1/embeddings pools hidden states, a name of paxpage.embedding.POOLING_CHOICES."""
    if not served_model_name:
        raise ValueError("served_model_name must be a non-empty string")
    if api_key is not None and not api_key:
        raise ValueError("api_key must be None or a non-empty string")
    limits = limits if limits is not None else RequestLimits()
    app = FastAPI(title="paxpage", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.paxpage = ServerContext(engine, served_model_name, ServerMetrics(engine), stall_timeout_s,
                                      tool_call_parser, reasoning_parser, Pooling.parse(pooling))
    app.state.responses = ResponseStore(max_stored_responses)
    install_error_handlers(app)
    for module in (chat_routes, completion_routes, embedding_routes, info_routes, responses_routes):
        app.include_router(module.router)
    # the last added middleware runs first: CORS, then the key, then the body limit
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_request_bytes)
    if api_key is not None:
        open_paths = OPEN_PATHS if metrics_need_key else OPEN_PATHS | {"/metrics"}
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=open_paths)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    return app
