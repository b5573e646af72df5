"""What every tool-call parser shares: the parsed call, JSON scanning, the constraint grammar's
shape and the streaming hold-back.

A parser knows one model family's way of writing function calls in text: how to read them back
(`parse`), how to write them (`format_calls`, for assistant turns the template cannot render
itself), what the model is told when the template has no tool support (`format_hint`), and the
Lark grammar that forces a call (`grammar`) for tool_choice "required" or a named function."""

from __future__ import annotations

import dataclasses
import json
import secrets
import string

from paxpage.server.tool_parsers.partial import PartialCall, read_call


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


def call_from_json(obj, arguments_key: str | tuple[str, ...] = "arguments") -> ParsedCall | None:
    """{"name": str, <arguments_key>: object or its JSON text} -> ParsedCall, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    keys = (arguments_key,) if isinstance(arguments_key, str) else arguments_key
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def decode_json_values(text: str, separators: str) -> list | None:
    """The JSON values of `text`, one after another, separated by characters in `separators` (and
    whitespace); None when anything else is in between or a value does not parse."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (values and text[i] in separators)):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)


def call_schema(name: str, parameters: dict | None, arguments_key: str = "arguments") -> dict:
    """The JSON schema of one call of function `name` in a parser's {"name", arguments} form."""
    if parameters is None:  # OpenAI: no parameters means a function without arguments
        parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    return {"type": "object", "properties": {"name": {"const": name}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False}


# JSON as the families' templates write it (", " and ": ", no line breaks): a grammar that lets
# whitespace run free lets a weak model spend its whole budget on it.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def any_call_schema(functions: list[tuple[str, dict | None]], arguments_key: str = "arguments",
                    array: bool | None = None) -> dict:
    """The schema of one call of any of `functions`; with array=False / True, of a JSON list of
    one / one or more such calls. Whitespace is fixed (COMPACT_JSON)."""
    schemas = [call_schema(n, p, arguments_key) for n, p in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if array is not None:
        schema = {"type": "array", "items": schema, "minItems": 1, **({} if array else {"maxItems": 1})}
    return {"x-guidance": COMPACT_JSON, **schema}


class ToolParser:
    """One family's tool-call text format. Subclasses set the class attributes and `parse`."""

    name: str = ""
    markers: tuple[str, ...] = ()  # text that begins a call
    anywhere: bool = True  # markers may follow content (else a call is the whole output)
    token_markers: tuple[str, ...] = ()  # grammar markers that tokenizers may have as added tokens
    format_hint: str = ""  # how one call is written, for the system prompt of a template without tools
    arguments_keys: tuple[str, ...] = ("arguments",)  # the call object's key(s) for the arguments
    harmony: bool = False  # calls are harmony messages, which the gpt_oss reasoning parser passes on whole

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls); a malformed call leaves the whole text as content. Arguments come
        re-serialised (json.dumps); `read` keeps the model's own text of them."""
        raise NotImplementedError

    def call_starts(self, text: str, memo: dict | None = None) -> list[int]:
        """Where each call object ("{") begun so far starts, in text that starts where the
        first call's marker (or, for a parser whose call is the whole answer, the answer) does.
        memo: partial.value_end's, kept by a stream between calls on its growing text."""
        raise NotImplementedError

    def partial_calls(self, text: str, memo: dict | None = None) -> list[PartialCall]:
        """The calls begun so far in `text` (as call_starts takes it), each as far as it goes."""
        return [read_call(text, i, self.arguments_keys, memo) for i in self.call_starts(text, memo)]

    def read(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """`parse`, with each call's arguments as the model wrote them where they were an
        object (what streaming sends, fragment by fragment), else re-serialised."""
        content, calls = self.parse(text)
        if not calls:
            return content, calls
        at, _ = self.content_end(text)
        partial = self.partial_calls(text[at:])
        if len(partial) != len(calls):
            return content, calls
        kept = []
        for call, p in zip(calls, partial):
            if p.name == call.name and p.arguments_done and json.loads(p.arguments) == json.loads(call.arguments):
                call = ParsedCall(call.name, p.arguments)
            kept.append(call)
        return content, kept

    def format_calls(self, calls: list[ParsedCall]) -> str:
        raise NotImplementedError

    def grammar(self, functions: list[tuple[str, dict | None]], parallel: bool,
                marker_ids: dict[str, int] | None = None) -> str:
        """Lark (llguidance) for one call, or several if parallel. marker_ids: the markers that
        are single added tokens of this tokenizer, by id (the grammar names the token itself)."""
        raise NotImplementedError

    @staticmethod
    def marker(text: str, marker_ids: dict[str, int] | None) -> str:
        """A marker as a Lark expression: its token, or its text."""
        if marker_ids and text in marker_ids:
            return f"<[{marker_ids[text]}]>"
        return json.dumps(text)

    def new_call_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    def content_end(self, text: str) -> tuple[int, bool]:
        """(how much of `text` is certainly content, whether a call has begun): a streamed
        answer sends content up to there and holds back what may still become a marker."""
        if not self.anywhere:
            head = text.lstrip()
            if any(m.startswith(head) or head.startswith(m) for m in self.markers):
                return 0, bool(head) and any(head.startswith(m) for m in self.markers)
            return len(text), False
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        if found:
            return min(found), True
        hold = max((k for m in self.markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
        return len(text) - hold, False


def mistral_call_id() -> str:
    """Mistral's templates accept only 9-character alphanumeric ids."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))
