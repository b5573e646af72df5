"""Request bodies of the OpenAI-compatible routes (pydantic), with vLLM's extra sampling fields.

Only types and shapes are checked here; value ranges are `paxpage.SamplingParams`'s job (see
sampling.py), so one place owns each rule. A field no model declares is a 400 naming it (pydantic
extra="forbid"): a client that asks for something paxpage does not do is told so, never answered
as if it had been done. The one exception is `IGNORED_FIELDS`: OpenAI fields that only label or
bill a request and do not change what is generated; they are accepted and dropped."""

from __future__ import annotations

from typing import ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

# Accepted and ignored, per body kind: request metadata (user, store, metadata, service_tier,
# prompt_cache_key, safety_identifier) and, in messages, what an assistant turn returned by the
# API carries when a client sends it back (refusal, annotations).
IGNORED_FIELDS: dict[str, tuple[str, ...]] = {
    "request": ("user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"),
    "message": ("refusal", "annotations"),
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ignored_fields: ClassVar[tuple[str, ...]] = ()  # from IGNORED_FIELDS: dropped before validation

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data):
        if isinstance(data, dict) and cls.ignored_fields:
            data = {k: v for k, v in data.items() if k not in cls.ignored_fields}
        return data


class _RequestBody(_Body):
    ignored_fields = IGNORED_FIELDS["request"]


class StreamOptions(_Body):
    include_usage: StrictBool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_RequestBody):
    """Fields shared by chat and completions; None means "the default"."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # structured outputs: OpenAI's response_format, vLLM's guided_* fields and structured_outputs
    # ({"json" | "json_schema" | "json_object" | "regex" | "choice" | "grammar": ...}); one at most
    response_format: ResponseFormat | None = None
    guided_json: Union[dict, str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    ignored_fields = IGNORED_FIELDS["message"]
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: which call this result answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; None means no arguments
    strict: bool | None = None  # arguments follow the schema: always so for "required" / named choices


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: StrictBool = True
    max_completion_tokens: int | None = None
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


# A str, a list of str, a list of token ids, or a list of token-id lists.
PromptField = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptField
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False


class EmbeddingRequest(_RequestBody):
    model: str | None = None
    input: PromptField
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # refused: no model paxpage serves was trained to be truncated


class TokenizeRequest(_RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_RequestBody):
    model: str | None = None
    tokens: list[int]
