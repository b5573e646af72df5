"""Mistral (v3 tokenizer, e.g. Mistral-7B-Instruct-v0.3, Mistral-Nemo): content, then
`[TOOL_CALLS]` (a special token) and a JSON list of {"name": ..., "arguments": {...}}; ids are 9
alphanumerics, as the template requires."""

from __future__ import annotations

import json

from paxpage.server.tool_parsers.base import (ToolParser, any_call_schema, call_from_json, decode_json_values,
                                              mistral_call_id)
from paxpage.server.tool_parsers.partial import objects_after, skip_space

_MARKER = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    name = "mistral"
    markers = (_MARKER,)
    token_markers = (_MARKER,)
    format_hint = _MARKER + '[{"name": <function name>, "arguments": <arguments as a JSON object>}]'

    def parse(self, text):
        at = text.find(_MARKER)
        if at < 0:
            return text, []
        values = decode_json_values(text[at + len(_MARKER):], "")
        if not values or not all(isinstance(v, list) for v in values):
            return text, []
        calls = [call_from_json(item) for v in values for item in v]
        if not calls or None in calls:
            return text, []
        return text[:at].strip() or None, calls

    def call_starts(self, text, memo=None):
        at = text.find(_MARKER)
        j = skip_space(text, at + len(_MARKER)) if at >= 0 else len(text)
        return objects_after(text, j + 1, ",", memo) if j < len(text) and text[j] == "[" else []

    def format_calls(self, calls):
        return _MARKER + json.dumps([{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls])

    def grammar(self, functions, parallel, marker_ids=None):
        schema = any_call_schema(functions, array=parallel)
        return f"start: {self.marker(_MARKER, marker_ids)} body\nbody: %json {json.dumps(schema)}\n"

    def new_call_id(self):
        return mistral_call_id()
