"""What every route needs, built once per app: the engine, names, tokenizer helpers, metrics."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import Request

from paxpage.embedding import Pooling
from paxpage.server.errors import APIError
from paxpage.server.logprobs import TokenStrings
from paxpage.server.metrics import ServerMetrics
from paxpage.server.reasoning import reasoning_parser
from paxpage.server.tools import rendering_for


@dataclasses.dataclass(eq=False)
class ServerContext:
    engine: Any  # paxpage.async_engine.AsyncEngine
    served_model_name: str
    metrics: ServerMetrics
    stall_timeout_s: float  # /health reports 503 when live requests make no progress this long
    tool_call_parser: str | None = None  # None: chosen from the chat template (server/tool_parsers)
    reasoning_parser: str | None = None  # a name in server/reasoning.py; None: no reasoning split
    pooling: Pooling = Pooling()  # how /v1/embeddings pools the hidden states

    def __post_init__(self):
        self.tokenizer = self.engine.model.tokenizer
        self.vocab_size = self.engine.model.config.vocab_size
        self.strings = TokenStrings(self.tokenizer)
        self.tools = rendering_for(self.tokenizer, self.tool_call_parser)
        self.reasoning = reasoning_parser(self.reasoning_parser)
        cfg = self.engine.config
        # The most tokens one sequence can ever hold: the context limit or the whole KV pool.
        self.token_budget = min(cfg.max_model_len, cfg.num_pages * cfg.page_size)

    @property
    def loras(self) -> dict:
        """The model's LoRA adapters by name (models the clients may name beside the base)."""
        return getattr(self.engine.model, "loras", {})

    @property
    def adapters(self) -> list[str]:
        return sorted(self.loras)

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names, None for the base model (or no model);
        404 (as vLLM) for any other name."""
        if model is None or model == self.served_model_name:
            return None
        if model in self.loras:
            return model
        raise APIError(404, f"model {model!r} does not exist; this server serves "
                            f"{[self.served_model_name, *self.adapters]}", param="model", code="model_not_found")

    def model_name(self, model: str | None) -> str:
        """The `model` an answer reports: the adapter's name, else the base model's."""
        return model if self.check_model(model) is not None else self.served_model_name


def context(request: Request) -> ServerContext:
    return request.app.state.paxpage
