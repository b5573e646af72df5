"""Request body of POST /v1/responses (OpenAI's Responses API), and its translation into the
chat request the chat routes already serve (template, tools, sampling)."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import Field, StrictBool, ValidationError

from paxpage.server.errors import bad_request
from paxpage.server.protocol import IGNORED_FIELDS, ChatCompletionRequest, _Body, _RequestBody

_ITEM_LABELS = ("id", "status")  # what an output item sent back carries besides its content


class InputText(_Body):
    ignored_fields = ("annotations", "logprobs")
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Body):
    ignored_fields = _ITEM_LABELS
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[InputText]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Body):
    ignored_fields = _ITEM_LABELS
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Body):
    ignored_fields = _ITEM_LABELS
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(_Body):
    """A reasoning item sent back: accepted, not rendered (chat templates drop past reasoning)."""

    ignored_fields = ("id", "status", "summary", "content", "encrypted_content")
    type: Literal["reasoning"]


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str


class ResponsesRequest(_RequestBody):
    ignored_fields = tuple(f for f in IGNORED_FIELDS["request"] if f != "store")
    model: str | None = None
    input: Union[str, list[InputItem]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionChoice, None] = None
    parallel_tool_calls: StrictBool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: StrictBool = False
    previous_response_id: str | None = None
    store: StrictBool = True  # False: the answer is not kept for previous_response_id


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The request's input as chat messages; consecutive function calls join one assistant turn."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict] = []
    for item in req.input:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out


def chat_request(req: ResponsesRequest, history: list[dict], new: list[dict]) -> ChatCompletionRequest:
    """The chat request that generates this response: instructions, history, then the new input."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history + new
    body = {"messages": messages, "parallel_tool_calls": req.parallel_tool_calls, "stream": req.stream}
    for name in ("temperature", "top_p"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in req.tools]
    if isinstance(req.tool_choice, FunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise bad_request(f"input cannot be rendered as a conversation: {e.errors()[0].get('msg')}", "input") from None
