"""gpt-oss (OpenAI's harmony format): a call is a message addressed to a function,
`<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`
(the recipient may also stand before the channel: `<|start|>assistant to=functions.NAME<|channel|>...`);
its body is the arguments. Several calls follow one another; other messages are content.

It reads what `--reasoning-parser gpt_oss` leaves of the answer: that parser takes the analysis
messages as reasoning and the bodies of the others as content, but passes each message addressed
to a function on whole, header and end tag included, always opened with `<|start|>` (the answer's
first header has none: the prompt wrote it). Without that parser the raw answer is read alike, and
a call that is its first message is not seen."""

from __future__ import annotations

import json
import re

from paxpage.server.tool_parsers.base import COMPACT_JSON, ParsedCall, ToolParser
from paxpage.server.tool_parsers.partial import PartialCall

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
ENDS = ("<|call|>", "<|end|>", "<|return|>")  # a message's end
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


def recipient(header: str) -> str | None:
    """The function a message's header addresses (`to=functions.NAME`), else None."""
    m = _RECIPIENT.search(header)
    return m.group(1) if m else None


def _hold(text: str) -> int:
    """Length of the end of `text` that may still become an end tag."""
    return max((k for tag in ENDS for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


def _call_messages(text: str) -> list[tuple[int, int, str, str, bool]]:
    """(start, end, function name, body, closed) of each call message in `text`; a call cut off
    by the end of the text runs to it (its body then without a partial end tag)."""
    out, i = [], text.find(START)
    while i >= 0:
        h = text.find(MESSAGE, i)
        if h < 0:
            break  # a header still being written
        name = recipient(text[i + len(START):h])
        nxt = text.find(START, i + len(START))
        if name is None or 0 <= nxt < h:  # not a call, or a header cut short by the next one
            i = nxt
            continue
        body_at = h + len(MESSAGE)
        ends = [(k, tag) for k, tag in ((text.find(t, body_at), t) for t in ENDS) if k >= 0]
        if ends:
            k, tag = min(ends)
            out.append((i, k + len(tag), name, text[body_at:k], True))
            i = text.find(START, k + len(tag))
        else:
            body = text[body_at:]
            out.append((i, len(text), name, body[:len(body) - _hold(body)], False))
            break
    return out


def _arguments(body: str) -> str | None:
    """The body as a call's arguments: the model's text of a JSON object, else None."""
    body = body.strip()
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return body if isinstance(value, dict) else None


class HarmonyParser(ToolParser):
    name = "openai"
    markers = (START,)
    harmony = True
    token_markers = (START, CHANNEL, CONSTRAIN, MESSAGE, "<|call|>")
    format_hint = (f"{START}assistant to=functions.<function name>{CHANNEL}commentary {CONSTRAIN}json{MESSAGE}"
                   "<arguments as a JSON object><|call|>")

    def read(self, text):
        messages = _call_messages(text)
        if not messages:
            return text, []
        calls, kept, at = [], [], 0
        for start, end, name, body, _ in messages:
            arguments = _arguments(body)
            if arguments is None:  # malformed: the answer is content, each call message as its body
                return "".join(_as_body(text, messages)).strip() or None, []
            calls.append(ParsedCall(name, arguments))
            kept.append(text[at:start])
            at = end
        kept.append(text[at:])
        return "".join(kept).strip() or None, calls

    def parse(self, text):
        content, calls = self.read(text)
        return content, [ParsedCall(c.name, json.dumps(json.loads(c.arguments), ensure_ascii=False)) for c in calls]

    def partial_calls(self, text, memo=None):
        out = []
        for _, _, name, body, closed in _call_messages(text):
            arguments = body.strip()
            out.append(PartialCall(name, arguments if arguments.startswith("{") else None, closed))
        return out

    def format_calls(self, calls):
        return "".join(f"{START}assistant to=functions.{c.name}{CHANNEL}commentary {CONSTRAIN}json{MESSAGE}"
                       f"{c.arguments}<|call|>" for c in calls)

    def grammar(self, functions, parallel, marker_ids=None):
        """The first call opens with its channel (the prompt ends in `<|start|>assistant`), the
        next ones with a header of their own."""
        m = {t: self.marker(t, marker_ids) for t in self.token_markers}
        lines, alternatives = [], []
        for k, (name, parameters) in enumerate(functions):
            if parameters is None:  # OpenAI: no parameters means a function without arguments
                parameters = {"type": "object", "properties": {}, "additionalProperties": False}
            head = json.dumps(f"commentary to=functions.{name} ")
            lines.append(f"call_{k}: {m[CHANNEL]} {head} {m[CONSTRAIN]} \"json\" {m[MESSAGE]} args_{k} {m['<|call|>']}")
            lines.append(f"args_{k}: %json {json.dumps({'x-guidance': COMPACT_JSON, **parameters})}")
            alternatives.append(f"call_{k}")
        start = f'start: call ({m[START]} "assistant" call)*' if parallel else "start: call"
        return "\n".join([start, "call: " + " | ".join(alternatives), *lines]) + "\n"


def _as_body(text: str, messages) -> list[str]:
    """`text` with each call message's header and end tag taken out."""
    out, at = [], 0
    for start, end, _, body, _ in messages:
        out += [text[at:start], body]
        at = end
    return out + [text[at:]]
