"""POST /v1/responses (OpenAI's Responses API) and GET /v1/responses/{id}.

A response is generated as a chat completion is (template, tools, reasoning split, sampling);
what differs is the shape: `output` items (reasoning, a message of output_text, function_call
items) and, streamed, the Responses event stream with sequence numbers. Answers are kept in a
bounded store (server/response_store.py) so `previous_response_id` continues a conversation."""

from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request, Response

from paxpage.server.answer import AnswerStream
from paxpage.server.chat_routes import split_reasoning
from paxpage.server.context import context
from paxpage.server.dispatch import ClientGone, MergedStream, api_error, generate_all
from paxpage.server.errors import APIError, bad_request, error_body
from paxpage.server.prompts import encode_chat
from paxpage.server.reasoning import keep_reasoning_tags
from paxpage.server.protocol import ChatMessage
from paxpage.server.responses_protocol import ResponsesRequest, chat_request, input_messages
from paxpage.server.sampling import chat_sampling_params
from paxpage.server.sse import response as sse_response
from paxpage.server.tools import apply_to_params, plan_tools, read_answer, tool_call_dicts

router = APIRouter()


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _event(kind: str, seq: int, **fields) -> bytes:
    body = {"type": kind, "sequence_number": seq, **fields}
    return (f"event: {kind}\ndata: ".encode() + json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
            + b"\n\n")


def _renamed(err: APIError) -> APIError:
    """A chat field name in an error becomes the Responses name the client sent."""
    if err.param == "max_completion_tokens":
        err.param, err.message = "max_output_tokens", err.message.replace("max_completion_tokens", "max_output_tokens")
    elif err.param == "messages":
        err.param = "input"
    return err


class _Turn:
    """One request, prepared: the prompt, sampling, tools, and the response object's fixed part."""

    def __init__(self, ctx, req: ResponsesRequest, store):
        self.lora = ctx.check_model(req.model)
        history = []
        if req.previous_response_id is not None:
            entry = store.get(req.previous_response_id)
            if entry is None:
                raise bad_request(f"previous_response_id {req.previous_response_id!r} is not stored here (the server "
                                  f"keeps the last {store.max_entries} responses, in memory)", "previous_response_id")
            history = entry[1]
        self.history, self.new = history, input_messages(req)
        try:
            chat = chat_request(req, history, self.new)
            self.plan = plan_tools(chat, ctx.tools)
            self.prompt_ids, self.prompt_text = encode_chat(ctx.tokenizer, chat.messages, self.plan)
            params = chat_sampling_params(chat, prompt_len=len(self.prompt_ids), token_budget=ctx.token_budget)
            self.params = keep_reasoning_tags(ctx.reasoning, apply_to_params(self.plan, params))
        except APIError as e:
            raise _renamed(e) from None
        self.id, self.req, self.ctx, self.store = _id("resp"), req, ctx, store
        self.head = {"id": self.id, "object": "response", "created_at": int(time.time()), "model": ctx.model_name(req.model),
                     "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                     "temperature": req.temperature, "top_p": req.top_p, "previous_response_id": req.previous_response_id,
                     "parallel_tool_calls": req.parallel_tool_calls,
                     "tool_choice": req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump")
                     else (req.tool_choice or "auto"),
                     "tools": [t.model_dump() for t in req.tools or ()], "text": {"format": {"type": "text"}},
                     "truncation": "disabled", "metadata": {}, "error": None, "incomplete_details": None}

    def response(self, status: str, output: list[dict], output_tokens: int | None = None) -> dict:
        body = {**self.head, "status": status, "output": output}
        if output_tokens is not None:
            n = len(self.prompt_ids)
            body["usage"] = {"input_tokens": n, "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": n + output_tokens}
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        return body

    def finished(self, finish_reason: str | None, output: list[dict], content: str, calls: list[dict],
                 output_tokens: int) -> dict:
        status = "incomplete" if finish_reason == "length" else "completed"
        body = self.response(status, output, output_tokens)
        if self.req.store:
            answer = {"role": "assistant", "content": content or None}
            if calls:
                answer["tool_calls"] = calls
            ChatMessage.model_validate(answer)  # the stored turn renders like any client's
            self.store.put(body, self.history + self.new + [answer])
        return body


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": _id("rs"), "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: dict) -> dict:
    f = call["function"]
    return {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": f["name"],
            "arguments": f["arguments"], "status": "completed"}


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    ctx = context(request)
    turn = _Turn(ctx, body, request.app.state.responses)
    try:
        if body.stream:
            stream = MergedStream(ctx, [(turn.prompt_ids, turn.prompt_text)], turn.params, turn.id, "input",
                                  turn.lora)
            await stream.start(request)
            return sse_response(_events(turn, stream))
        (out,) = await generate_all(ctx, request, [(turn.prompt_ids, turn.prompt_text)], turn.params, turn.id, "input",
                                    turn.lora)
    except ClientGone:
        return Response(status_code=499)
    c = out.outputs[0]
    reasoning, text = split_reasoning(ctx, c.text, turn.prompt_text, turn.plan)
    content, parsed = read_answer(turn.plan, text)
    calls = tool_call_dicts(turn.plan, parsed) if parsed else []
    output = ([_reasoning_item(reasoning)] if reasoning else []) + \
        ([_message_item(_id("msg"), content or "")] if content or not calls else []) + [_call_item(tc) for tc in calls]
    return turn.finished(c.finish_reason, output, content or "", calls, len(c.token_ids))


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    entry = request.app.state.responses.get(response_id)
    if entry is None:
        raise APIError(404, f"response {response_id!r} is not stored here", param="response_id", code="not_found")
    return entry[0]


async def _events(turn: _Turn, stream: MergedStream):
    ctx, seq = turn.ctx, 0
    reader = AnswerStream(turn.plan, ctx.reasoning, turn.prompt_text)
    output, thought, text, msg_id, tokens, reason = [], "", "", None, 0, None

    def emit(kind, **fields):
        nonlocal seq
        seq += 1
        return _event(kind, seq - 1, **fields)

    def add_item(item, done_item=None):
        output.append(done_item or item)
        yield emit("response.output_item.added", output_index=len(output) - 1, item=item)

    def open_message():
        nonlocal msg_id, thought
        if thought:  # the reasoning is whole once the answer's text begins
            item = _reasoning_item(thought)
            yield from add_item(item)
            yield emit("response.output_item.done", output_index=len(output) - 1, item=item)
            thought = ""
        msg_id = _id("msg")
        yield from add_item(_message_item(msg_id, None, "in_progress"))
        yield emit("response.content_part.added", item_id=msg_id, output_index=len(output) - 1, content_index=0,
                   part=_text_part(""))

    try:
        yield emit("response.created", response=turn.response("in_progress", []))
        yield emit("response.in_progress", response=turn.response("in_progress", []))
        async for _, delta in stream:
            tokens += len(delta.token_ids)
            reason, calls = delta.finish_reason, []
            more, piece = reader.feed(delta.text)
            thought += more
            if reason is not None:
                more, rest, parsed = reader.finish()
                thought, piece = thought + more, piece + rest
                calls = tool_call_dicts(turn.plan, parsed)
            if piece:
                if msg_id is None:
                    for b in open_message():
                        yield b
                text += piece
                yield emit("response.output_text.delta", item_id=msg_id, output_index=len(output) - 1,
                           content_index=0, delta=piece, logprobs=[])
            if reason is None:
                continue
            if msg_id is None and (thought or not calls):
                for b in open_message():
                    yield b
            if msg_id is not None:
                i = len(output) - 1
                yield emit("response.output_text.done", item_id=msg_id, output_index=i, content_index=0, text=text,
                           logprobs=[])
                yield emit("response.content_part.done", item_id=msg_id, output_index=i, content_index=0,
                           part=_text_part(text))
                output[i] = _message_item(msg_id, text)
                yield emit("response.output_item.done", output_index=i, item=output[i])
            for tc in calls:
                item = _call_item(tc)
                for b in add_item({**item, "status": "in_progress", "arguments": ""}, item):
                    yield b
                i = len(output) - 1
                yield emit("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                           delta=item["arguments"])
                yield emit("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                           name=item["name"], arguments=item["arguments"])
                yield emit("response.output_item.done", output_index=i, item=item)
            final = turn.finished(reason, output, text, calls, tokens)
            kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
            yield emit(kind, response=final)
    except Exception as e:  # noqa: BLE001 - reported to the client in the stream
        err = api_error(e, "input")
        yield emit("error", **error_body(err.status, err.message, err.param, err.code))
    finally:
        stream.close()
