"""Maps an OpenAI / vLLM request body onto `paxpage.SamplingParams`.

SamplingParams validates every value itself; its ValueError / TypeError messages start with the
field's name, which is translated back to the name the client used (`max_completion_tokens`,
`top_logprobs`, ...) so the 400 names the field the client can fix."""

from __future__ import annotations

import dataclasses

from paxpage.sampling.params import SamplingParams
from paxpage.structured import StructuredOutputs
from paxpage.server.errors import APIError, bad_request
from paxpage.server.limits import check_sampling_fields
from paxpage.server.protocol import ChatCompletionRequest, CompletionRequest

# A request field named as a SamplingParams field means the same in both APIs and is copied when
# given (None: the default). The others are mapped below: max_tokens and logprobs differ between
# chat and completions, prompt_logprobs comes from echo, structured outputs come in several forms.
_BY_HAND = frozenset({"max_tokens", "logprobs", "prompt_logprobs", "structured_outputs"})
_SAME_NAME = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name not in _BY_HAND
                   and f.name in ChatCompletionRequest.model_fields and f.name in CompletionRequest.model_fields)
# The SamplingParams fields a request sets: an error naming one is a 400 naming the client's field.
_SAMPLING_FIELDS = frozenset(_SAME_NAME) | {"max_tokens", "logprobs", "prompt_logprobs"}


def _common(req) -> dict:
    check_sampling_fields(req)
    kw = {name: getattr(req, name) for name in _SAME_NAME if getattr(req, name) is not None}
    structured = _structured(req)
    if structured is not None:
        kw["structured_outputs"] = structured
    return kw


_GUIDED = (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))


def _structured(req) -> StructuredOutputs | None:
    """response_format, guided_* or structured_outputs -> StructuredOutputs; a bad spec is a 400
    naming the field it came from."""
    given: list[tuple[str, dict]] = []  # (request field, StructuredOutputs kwargs)
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema", "response_format")
        given.append(("response_format", {"json_schema": fmt.json_schema.schema_}))
    for field, kind in _GUIDED:
        if getattr(req, field) is not None:
            given.append((field, {kind: getattr(req, field)}))
    if req.structured_outputs is not None:
        spec = dict(req.structured_outputs)
        if "json" in spec:  # vLLM's name for the schema
            spec["json_schema"] = spec.pop("json")
        given.append(("structured_outputs", spec))
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"give one structured output constraint, got {[f for f, _ in given]}", given[1][0])
    field, spec = given[0]
    try:
        return StructuredOutputs.coerce(spec)
    except (ValueError, TypeError) as e:
        raise bad_request(f"{field}: {e}", field) from None


def _build(kwargs: dict, api_names: dict[str, str]) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        message = str(e)
        field = message.split(" ", 1)[0]
        param = api_names.get(field, field) if field in _SAMPLING_FIELDS else None
        if param is not None and param != field:
            message = f"{param} (sampling field {field}): {message}"
        raise bad_request(message, param) from None


def check_stream_options(req) -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def chat_sampling_params(req: ChatCompletionRequest, *, prompt_len: int, token_budget: int) -> SamplingParams:
    """token_budget: the most tokens one sequence can hold (min of max_model_len and the KV pool).
    Without max_(completion_)tokens the answer may fill what the budget leaves after the prompt."""
    check_stream_options(req)
    kw = _common(req)
    names = {}
    if req.max_completion_tokens is not None:
        kw["max_tokens"], names["max_tokens"] = req.max_completion_tokens, "max_completion_tokens"
    elif req.max_tokens is not None:
        kw["max_tokens"] = req.max_tokens
    else:
        room = token_budget - prompt_len
        if room < 1:
            raise bad_request(f"prompt has {prompt_len} tokens; the server holds at most {token_budget} "
                              "tokens per sequence (max_model_len and KV cache)", "messages")
        kw["max_tokens"] = room
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    if req.logprobs:
        kw["logprobs"] = req.top_logprobs or 0
        names["logprobs"] = "top_logprobs"
    return _build(kw, names)


def completion_sampling_params(req: CompletionRequest) -> SamplingParams:
    check_stream_options(req)
    kw = _common(req)
    if req.max_tokens is not None:
        kw["max_tokens"] = req.max_tokens
    if req.logprobs is not None:
        kw["logprobs"] = req.logprobs
        if req.echo:
            if req.stream:
                raise bad_request("echo with logprobs is not supported when streaming", "echo")
            kw["prompt_logprobs"] = req.logprobs
    return _build(kw, {"prompt_logprobs": "logprobs"})


def engine_error(e: Exception, prompt_param: str) -> APIError:
    """A ValueError from the engine at submission (prompt too long, can never fit, bad ids)."""
    message = str(e)
    field = message.split(" ", 1)[0]
    if field in ("n", "beam_width", "max_tokens", "stop_token_ids", "logprobs", "prompt_logprobs",
                 "structured_outputs"):
        return bad_request(message, field)
    if prompt_param not in message:
        message = f"{prompt_param} cannot be served: {message}"
    return bad_request(message, prompt_param)
