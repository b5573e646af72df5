"""POST /v1/chat/completions: the chat template, whole answers and SSE chunks; with a reasoning
parser the `<think>` text is split off first (server/reasoning.py), then tool calls are read out
of the rest (server/tools.py)."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request, Response

from paxpage.server import sse
from paxpage.server.answer import AnswerStream
from paxpage.server.context import context
from paxpage.server.dispatch import ClientGone, MergedStream, error_event, generate_all
from paxpage.server.logprobs import chat_logprobs
from paxpage.server.prompts import encode_chat
from paxpage.server.reasoning import keep_reasoning_tags
from paxpage.server.protocol import ChatCompletionRequest
from paxpage.server.sampling import chat_sampling_params
from paxpage.server.tools import (ToolPlan, apply_to_params, finish_reason, plan_tools,
                                  read_answer, tool_call_dicts)

router = APIRouter()


def split_reasoning(ctx, text: str, prompt_text: str | None, plan: ToolPlan) -> tuple[str, str]:
    """(reasoning, the rest) of a whole answer; without a reasoning parser all of it is the rest."""
    if ctx.reasoning is None:
        return "", text
    return ctx.reasoning.split(text, prompt_text, plan.harmony_calls)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    ctx = context(request)
    lora = ctx.check_model(body.model)
    plan = plan_tools(body, ctx.tools)
    prompt_ids, prompt_text = encode_chat(ctx.tokenizer, body.messages, plan)
    params = chat_sampling_params(body, prompt_len=len(prompt_ids), token_budget=ctx.token_budget)
    params = keep_reasoning_tags(ctx.reasoning, apply_to_params(plan, params))
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    head = {"id": request_id, "created": created, "model": ctx.model_name(body.model)}
    k = params.logprobs if body.logprobs else None
    try:
        if body.stream:
            stream = MergedStream(ctx, [(prompt_ids, prompt_text)], params, request_id, "messages", lora)
            await stream.start(request)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse.response(_chunks(ctx, stream, head, params.n, k, len(prompt_ids), include_usage, plan,
                                        prompt_text))
        (out,) = await generate_all(ctx, request, [(prompt_ids, prompt_text)], params, request_id, "messages",
                                    lora)
    except ClientGone:
        return Response(status_code=499)
    choices = []
    for c in out.outputs:
        reasoning, text = split_reasoning(ctx, c.text, prompt_text, plan)
        content, calls = read_answer(plan, text)
        message = {"role": "assistant", "content": content, "refusal": None}
        if ctx.reasoning is not None:
            message["reasoning_content"] = reasoning or None
            message["content"] = content or None
        if calls:
            message["tool_calls"] = tool_call_dicts(plan, calls)
        choices.append({
            "index": c.index, "message": message,
            "logprobs": chat_logprobs(c.logprobs, c.token_ids, k, ctx.strings) if k is not None else None,
            "finish_reason": finish_reason(c.finish_reason, calls),
            "stop_reason": c.stop_reason,
        })
    return {**head, "object": "chat.completion", "choices": choices,
            "usage": usage(len(prompt_ids), sum(len(c.token_ids) for c in out.outputs))}


async def _chunks(ctx, stream: MergedStream, head: dict, n: int, k: int | None, prompt_tokens: int,
                  include_usage: bool, plan: ToolPlan, prompt_text: str | None):
    head = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}
    completion_tokens = 0
    readers = [AnswerStream(plan, ctx.reasoning, prompt_text) for _ in range(n)]
    try:
        for i in range(n):  # the role comes first, once per choice
            yield sse.event({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}], **extra})
        async for _, delta in stream:
            completion_tokens += len(delta.token_ids)
            entries = getattr(delta, "logprobs", None)
            lp = chat_logprobs(entries, delta.token_ids, k, ctx.strings) if k is not None and entries else None
            text, reason = delta.text, delta.finish_reason
            # the reasoning first; content until a tool call may begin; then the calls as they grow
            reader = readers[delta.sample]
            thought, text = reader.feed(text)
            calls, tool_deltas = [], reader.call_deltas()
            if reason is not None:
                more, rest, calls = reader.finish()
                thought, text = thought + more, text + rest
                tool_deltas += reader.final_deltas(calls)
            if thought:
                yield sse.event({**head, "choices": [{"index": delta.sample, "delta": {"reasoning_content": thought},
                                                      "logprobs": None, "finish_reason": None}], **extra})
            if tool_deltas:
                if text:
                    yield sse.event({**head, "choices": [{"index": delta.sample, "delta": {"content": text},
                                                          "logprobs": lp, "finish_reason": None}], **extra})
                    text, lp = "", None
                yield sse.event({**head, "choices": [{"index": delta.sample, "delta": {"tool_calls": tool_deltas},
                                                      "logprobs": None, "finish_reason": None}], **extra})
            reason = finish_reason(reason, calls)
            if not text and reason is None and lp is None:
                continue  # tokens whose text is held back (a possible stop string, a partial character)
            choice = {"index": delta.sample, "delta": {"content": text} if text else {},
                      "logprobs": lp, "finish_reason": reason}
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
