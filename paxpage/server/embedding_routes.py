"""POST /v1/embeddings: one vector per input (a str, a list of str, token ids or a list of id
lists), pooled from the decoder's last-layer hidden states as `--pooling` says
(paxpage/embedding.py). The inputs run in the engine's steps beside generating requests."""

from __future__ import annotations

import base64
import uuid

import numpy as np
from fastapi import APIRouter, Request, Response

from paxpage.server.context import context
from paxpage.server.dispatch import ClientGone, embed_all
from paxpage.server.errors import bad_request
from paxpage.server.prompts import encode_completion_prompts
from paxpage.server.protocol import EmbeddingRequest

router = APIRouter()


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """"float": the list itself; "base64": its little-endian float32 bytes, base64 (as OpenAI sends)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    ctx = context(request)
    ctx.check_model(body.model)
    if body.dimensions is not None:
        raise bad_request(f"dimensions is {body.dimensions}; this model's embeddings cannot be truncated "
                          f"(it was not trained for it): leave dimensions unset to get all "
                          f"{ctx.engine.model.config.hidden_size}", "dimensions")
    prompts = encode_completion_prompts(ctx.tokenizer, body.input, ctx.vocab_size, "input")
    try:
        outputs = await embed_all(ctx, request, prompts, ctx.pooling, f"embd-{uuid.uuid4().hex}")
    except ClientGone:
        return Response(status_code=499)
    data = [{"object": "embedding", "index": i, "embedding": encode_embedding(out.embedding, body.encoding_format)}
            for i, out in enumerate(outputs)]
    num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return {"object": "list", "data": data, "model": ctx.served_model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
