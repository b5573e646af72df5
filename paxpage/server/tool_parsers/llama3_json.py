"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}`
(optionally after `<|python_tag|>`), several separated by "; "."""

from __future__ import annotations

import json

from paxpage.server.tool_parsers.base import (ToolParser, any_call_schema, call_from_json,
                                              decode_json_values)
from paxpage.server.tool_parsers.partial import objects_after, skip_space

_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("{", _TAG)
    anywhere = False
    format_hint = '{"name": <function name>, "parameters": <arguments as a JSON object>}'
    arguments_keys = ("parameters", "arguments")

    def parse(self, text):
        body = text.strip()
        if body.startswith(_TAG):
            body = body[len(_TAG):]
        if not body.lstrip().startswith("{"):
            return text, []
        values = decode_json_values(body, ";")
        calls = [call_from_json(v, ("parameters", "arguments")) for v in values or ()]
        if not calls or None in calls:
            return text, []
        return None, calls

    def call_starts(self, text, memo=None):
        j = skip_space(text, 0)
        if text.startswith(_TAG, j):
            j += len(_TAG)
        return objects_after(text, j, ";", memo)

    def format_calls(self, calls):
        return "; ".join(f'{{"name": {json.dumps(c.name)}, "parameters": {c.arguments}}}' for c in calls)

    def grammar(self, functions, parallel, marker_ids=None):
        schema = json.dumps(any_call_schema(functions, "parameters"))
        start = 'start: body ("; " body)*' if parallel else "start: body"
        return f"{start}\nbody: %json {schema}\n"
