"""POST /v1/completions: prompts as text or token ids, several per request; choice index =
prompt_index * n + sample. `echo` prepends the prompt; with `logprobs` it also reports the
prompt tokens' logprobs (the first prompt token has none)."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request, Response

from paxpage.server import sse
from paxpage.server.chat_routes import usage
from paxpage.server.context import context
from paxpage.server.dispatch import ClientGone, MergedStream, error_event, generate_all
from paxpage.server.logprobs import completion_logprobs, merge_completion_logprobs
from paxpage.server.prompts import encode_completion_prompts
from paxpage.server.protocol import CompletionRequest
from paxpage.server.sampling import completion_sampling_params

router = APIRouter()


def _prompt_text(ctx, ids: list[int], text: str | None) -> str:
    if text is not None:
        return text
    return ctx.tokenizer.decode(ids) if ctx.tokenizer is not None else ""


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    ctx = context(request)
    lora = ctx.check_model(body.model)
    prompts = encode_completion_prompts(ctx.tokenizer, body.prompt, ctx.vocab_size)
    params = completion_sampling_params(body)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    head = {"id": request_id, "created": int(time.time()), "model": ctx.model_name(body.model)}
    echoes = [_prompt_text(ctx, ids, text) if body.echo else "" for ids, text in prompts]
    try:
        if body.stream:
            stream = MergedStream(ctx, prompts, params, request_id, "prompt", lora)
            await stream.start(request)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            prompt_tokens = sum(len(ids) for ids, _ in prompts)
            return sse.response(_chunks(ctx, stream, head, params.n, body.logprobs, echoes, prompt_tokens,
                                        include_usage))
        outputs = await generate_all(ctx, request, prompts, params, request_id, "prompt", lora)
    except ClientGone:
        return Response(status_code=499)
    k = body.logprobs
    choices = []
    for p, out in enumerate(outputs):
        for c in out.outputs:
            lp = None
            if k is not None:
                prompt_lp, offset = None, len(echoes[p])
                if body.echo:  # the prompt's tokens come first; offsets run on over both
                    entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
                    prompt_lp = completion_logprobs(out.prompt_token_ids, entries, k, ctx.strings)
                    offset = sum(len(t) for t in prompt_lp["tokens"])
                lp = merge_completion_logprobs(
                    prompt_lp, completion_logprobs(c.token_ids, c.logprobs, k, ctx.strings, text_offset=offset))
            choices.append({"index": p * params.n + c.index, "text": echoes[p] + c.text, "logprobs": lp,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    choices.sort(key=lambda c: c["index"])
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    completion_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    return {**head, "object": "text_completion", "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens)}


async def _chunks(ctx, stream: MergedStream, head: dict, n: int, k: int | None, echoes: list[str],
                  prompt_tokens: int, include_usage: bool):
    head = {**head, "object": "text_completion"}
    extra = {"usage": None} if include_usage else {}
    completion_tokens = 0
    offsets: dict[int, int] = {}  # choice index -> logprobs text_offset of its next token
    try:
        for p, echo in enumerate(echoes):
            for s in range(n):
                offsets[p * n + s] = len(echo)
                if echo:
                    yield sse.event({**head, "choices": [{"index": p * n + s, "text": echo, "logprobs": None,
                                                          "finish_reason": None}], **extra})
        async for p, delta in stream:
            completion_tokens += len(delta.token_ids)
            index = p * n + delta.sample
            entries = getattr(delta, "logprobs", None)
            lp = None
            if k is not None and entries:
                lp = completion_logprobs(delta.token_ids, entries, k, ctx.strings,
                                         text_offset=offsets.get(index, 0))
            # as in the whole answer: offsets advance by each token's own text
            offsets[index] = offsets.get(index, 0) + sum(len(ctx.strings.get(t)) for t in delta.token_ids)
            if not delta.text and delta.finish_reason is None and not delta.token_ids:
                continue  # a token-id-only model still streams a chunk per step: progress is visible
            choice = {"index": index, "text": delta.text, "logprobs": lp, "finish_reason": delta.finish_reason}
            if delta.finish_reason is not None:
                choice["stop_reason"] = getattr(delta, "stop_reason", None)
            yield sse.event({**head, "choices": [choice], **extra})
        if include_usage:
            yield sse.event({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    except Exception as e:  # noqa: BLE001 - reported to the client in the stream
        yield error_event(e, "prompt")
    finally:
        stream.close()
    yield sse.DONE
