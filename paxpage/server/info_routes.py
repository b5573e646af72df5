"""GET /health, /v1/models, /metrics; POST /tokenize, /detokenize (vLLM's shapes)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from paxpage.server import metrics as metrics_lib
from paxpage.server.context import context
from paxpage.server.errors import bad_request, error_body
from paxpage.server.prompts import chat_text
from paxpage.server.protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter()
_STARTED = int(time.time())


@router.get("/health")
async def health(request: Request):
    """200 while the engine loop is alive and, when it has work, making progress."""
    ctx = context(request)
    s = ctx.engine.stats()
    if not s.alive:
        return JSONResponse(error_body(503, f"engine loop died: {s.error}", code="engine_dead"), status_code=503)
    if s.recovering is not None:
        return JSONResponse(error_body(503, f"engine is being rebuilt after a failed step: {s.recovering}",
                                       code="engine_recovering"), status_code=503, headers={"Retry-After": "1"})
    if s.seconds_since_progress > ctx.stall_timeout_s:
        return JSONResponse(error_body(503, f"engine made no progress for {s.seconds_since_progress:.0f} s "
                                            f"(limit {ctx.stall_timeout_s:.0f} s)", code="engine_stalled"),
                            status_code=503)
    return {"status": "ok"}


@router.get("/v1/models")
async def models(request: Request):
    ctx = context(request)
    card = {"id": ctx.served_model_name, "object": "model", "created": _STARTED, "owned_by": "paxpage",
            "root": ctx.served_model_name, "parent": None, "max_model_len": ctx.engine.config.max_model_len}
    adapters = [dict(card, id=name, root=ctx.loras[name].source, parent=ctx.served_model_name)
                for name in ctx.adapters]
    return {"object": "list", "data": [card, *adapters]}


@router.get("/metrics")
async def metrics(request: Request):
    return Response(context(request).metrics.exposition(), media_type=metrics_lib.CONTENT_TYPE)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    ctx = context(request)
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    if ctx.tokenizer is None:
        raise bad_request("this model has no tokenizer", "prompt")
    if body.messages is not None:
        text = chat_text(ctx.tokenizer, body.messages, body.add_generation_prompt, rendering=ctx.tools)
        tokens = ctx.tokenizer.encode(text, add_special_tokens=False)
    else:
        tokens = ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return {"count": len(tokens), "max_model_len": ctx.engine.config.max_model_len, "tokens": list(tokens)}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    ctx = context(request)
    ctx.check_model(body.model)
    if ctx.tokenizer is None:
        raise bad_request("this model has no tokenizer", "tokens")
    bad = [t for t in body.tokens if not 0 <= t < ctx.vocab_size]
    if bad:
        raise bad_request(f"tokens contains {bad[0]}, outside the vocabulary [0, {ctx.vocab_size})", "tokens")
    return {"prompt": ctx.tokenizer.decode(body.tokens)}
