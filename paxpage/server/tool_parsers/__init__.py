"""Tool-call parsers, one per model family's text format, and the choice of one for a model.

`choose(chat_template, name)`: the parser `name` (`--tool-call-parser`), else the one the
template's own markers name; a template that renders no tools gets the Hermes format, described
to the model in a system message (server/tools.py)."""

from __future__ import annotations

from paxpage.server.tool_parsers.base import ParsedCall, ToolParser
from paxpage.server.tool_parsers.harmony import HarmonyParser
from paxpage.server.tool_parsers.hermes import HermesParser
from paxpage.server.tool_parsers.llama3_json import Llama3JsonParser
from paxpage.server.tool_parsers.mistral import MistralParser

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser,
                                                                HarmonyParser)}

__all__ = ["PARSERS", "ParsedCall", "ToolParser", "choose", "template_renders_tools"]


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def choose(chat_template: str | None, name: str | None = None) -> ToolParser | None:
    """None when the template renders tools in a format no parser here reads (then requests
    with tools need `--tool-call-parser`)."""
    if name is not None:
        if name not in PARSERS:
            raise ValueError(f"--tool-call-parser {name!r} is not one of {sorted(PARSERS)}")
        return PARSERS[name]()
    template = chat_template or ""
    if "<|channel|>" in template and ("to=functions" in template or "<|call|>" in template):  # gpt-oss (harmony)
        return HarmonyParser()
    if "<tool_call>" in template:
        return HermesParser()
    if "[TOOL_CALLS]" in template:
        return MistralParser()
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "tools" in template):
        return Llama3JsonParser()
    if not template_renders_tools(template):
        return HermesParser()
    return None
