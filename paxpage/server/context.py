"""What every route needs, built once per app: the engine, names, tokenizer helpers, metrics."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import Request

from paxpage.server.errors import APIError
from paxpage.server.logprobs import TokenStrings
from paxpage.server.metrics import ServerMetrics


@dataclasses.dataclass(eq=False)
class ServerContext:
    engine: Any  # paxpage.async_engine.AsyncEngine
    served_model_name: str
    metrics: ServerMetrics
    stall_timeout_s: float  # /health reports 503 when live requests make no progress this long

    def __post_init__(self):
        self.tokenizer = self.engine.model.tokenizer
        self.vocab_size = self.engine.model.config.vocab_size
        self.strings = TokenStrings(self.tokenizer)
        cfg = self.engine.config
        # The most tokens one sequence can ever hold: the context limit or the whole KV pool.
        self.token_budget = min(cfg.max_model_len, cfg.num_pages * cfg.page_size)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                                f"{self.served_model_name!r}", param="model", code="model_not_found")


def context(request: Request) -> ServerContext:
    return request.app.state.paxpage
