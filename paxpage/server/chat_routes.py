"""POST /v1/chat/completions: the chat template, whole answers and SSE chunks."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request, Response

from paxpage.server import sse
from paxpage.server.context import context
from paxpage.server.dispatch import ClientGone, MergedStream, error_event, generate_all
from paxpage.server.logprobs import chat_logprobs
from paxpage.server.prompts import encode_chat
from paxpage.server.protocol import ChatCompletionRequest
from paxpage.server.sampling import chat_sampling_params

router = APIRouter()


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    ctx = context(request)
    ctx.check_model(body.model)
    prompt_ids, prompt_text = encode_chat(ctx.tokenizer, body.messages)
    params = chat_sampling_params(body, prompt_len=len(prompt_ids), token_budget=ctx.token_budget)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    head = {"id": request_id, "created": created, "model": ctx.served_model_name}
    k = params.logprobs if body.logprobs else None
    try:
        if body.stream:
            stream = MergedStream(ctx, [(prompt_ids, prompt_text)], params, request_id, "messages")
            await stream.start(request)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse.response(_chunks(ctx, stream, head, params.n, k, len(prompt_ids), include_usage))
        (out,) = await generate_all(ctx, request, [(prompt_ids, prompt_text)], params, request_id, "messages")
    except ClientGone:
        return Response(status_code=499)
    choices = [{
        "index": c.index,
        "message": {"role": "assistant", "content": c.text, "refusal": None},
        "logprobs": chat_logprobs(c.logprobs, c.token_ids, k, ctx.strings) if k is not None else None,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    } for c in out.outputs]
    return {**head, "object": "chat.completion", "choices": choices,
            "usage": usage(len(prompt_ids), sum(len(c.token_ids) for c in out.outputs))}


async def _chunks(ctx, stream: MergedStream, head: dict, n: int, k: int | None, prompt_tokens: int,
                  include_usage: bool):
    head = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}
    completion_tokens = 0
    try:
        for i in range(n):  # the role comes first, once per choice
            yield sse.event({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}], **extra})
        async for _, delta in stream:
            completion_tokens += len(delta.token_ids)
            entries = getattr(delta, "logprobs", None)
            lp = chat_logprobs(entries, delta.token_ids, k, ctx.strings) if k is not None and entries else None
            if not delta.text and delta.finish_reason is None and lp is None:
                continue  # tokens whose text is held back (a possible stop string, a partial character)
            choice = {"index": delta.sample, "delta": {"content": delta.text} if delta.text else {},
                      "logprobs": lp, "finish_reason": delta.finish_reason}
            if delta.finish_reason is not None:
                choice["stop_reason"] = getattr(delta, "stop_reason", None)
            yield sse.event({**head, "choices": [choice], **extra})
        if include_usage:
            yield sse.event({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    except Exception as e:  # noqa: BLE001 - reported to the client in the stream
        yield error_event(e, "messages")
    finally:
        stream.close()
    yield sse.DONE
