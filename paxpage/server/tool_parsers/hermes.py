"""Hermes / Qwen2.5 / Qwen3: each call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
after optional content; several calls follow one another."""

from __future__ import annotations

import json
import re

from paxpage.server.tool_parsers.base import ParsedCall, ToolParser, any_call_schema, call_from_json
from paxpage.server.tool_parsers.partial import skip_space

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    token_markers = ("<tool_call>", "</tool_call>")
    format_hint = '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>'

    def parse(self, text):
        if "<tool_call>" not in text:
            return text, []
        calls = []
        for body in _CALL.findall(text):
            try:
                call = call_from_json(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = _CALL.sub("", text).strip()
        return content or None, calls

    def call_starts(self, text, memo=None):
        starts = []
        for m in re.finditer(re.escape("<tool_call>"), text):
            j = skip_space(text, m.end())
            if j < len(text) and text[j] == "{":
                starts.append(j)
        return starts

    def format_calls(self, calls):
        return "\n".join(f'<tool_call>\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n</tool_call>'
                         for c in calls)

    def grammar(self, functions, parallel, marker_ids=None):
        schema = json.dumps(any_call_schema(functions))
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        open_, close = self.marker("<tool_call>", marker_ids), self.marker("</tool_call>", marker_ids)
        return f'{start}\ncall: {open_} "\\n" body "\\n" {close}\nbody: %json {schema}\n'
