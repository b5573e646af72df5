"""The FastAPI app: OpenAI-compatible routes over one `AsyncEngine`."""

from __future__ import annotations

from fastapi import FastAPI

from paxpage.server import chat_routes, completion_routes, info_routes
from paxpage.server.auth import ApiKeyMiddleware
from paxpage.server.context import ServerContext
from paxpage.server.errors import install_error_handlers
from paxpage.server.metrics import ServerMetrics

DEFAULT_STALL_TIMEOUT_S = 300.0  # a first step on a slow CPU compiles for a minute or more


def build_app(engine, *, served_model_name: str, api_key: str | None = None,
              stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S) -> FastAPI:
    """engine: a started `paxpage.AsyncEngine`; the caller owns it (and shuts it down).
    api_key: when set, every route but /health needs `Authorization: Bearer <api_key>`."""
    if not served_model_name:
        raise ValueError("served_model_name must be a non-empty string")
    if api_key is not None and not api_key:
        raise ValueError("api_key must be None or a non-empty string")
    app = FastAPI(title="paxpage", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.paxpage = ServerContext(engine, served_model_name, ServerMetrics(engine), stall_timeout_s)
    install_error_handlers(app)
    for module in (chat_routes, completion_routes, info_routes):
        app.include_router(module.router)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    return app
