"""Tool-call parsers, host side: each family's text read back into calls (hand-written model
outputs in the formats the families' chat templates teach), malformed calls left as content,
format_calls read back by parse, the streaming hold-back, the choice from a template, and the
constraint grammar accepting what parse reads (llguidance, no model)."""

from __future__ import annotations

import json
import pathlib

import pytest

from paxpage.server.tool_parsers import PARSERS, ParsedCall, choose

TEMPLATES = pathlib.Path(__file__).parent / "chat_templates"
W = ParsedCall("get_weather", '{"city": "Paris", "days": 2}')
T = ParsedCall("get_time", "{}")


@pytest.mark.parametrize("name, text, content, calls", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me check.",
     [W, T]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 2}"}',
     None, [W]),  # arguments as JSON text; a missing close tag at the end of the answer
    ("hermes", "It is sunny.", "It is sunny.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>', None, None),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', None, [W]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                    '{"name": "get_time", "parameters": {}}', None, [W, T]),
    ("llama3_json", 'The answer is {"name": "x"}', 'The answer is {"name": "x"}', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"', None, None),
    ("llama3_json", '{"city": "Paris"}', None, None),  # JSON, but no call
    ("mistral", 'Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                '{"name": "get_time", "arguments": {}}]', "Checking.", [W, T]),
    ("mistral", "[TOOL_CALLS][{\"name\": \"get_time\", \"arguments\": {}", None, None),
    ("mistral", "No tools needed.", "No tools needed.", []),
])
def test_parse(name, text, content, calls):
    parsed_content, parsed_calls = PARSERS[name]().parse(text)
    if calls is None:  # malformed: everything stays content
        assert (parsed_content, parsed_calls) == (text, [])
    else:
        assert (parsed_content, parsed_calls) == (content, calls)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_format_calls_reads_back_and_the_grammar_accepts_it(name):
    from llguidance import LLMatcher

    parser = PARSERS[name]()
    for calls in ([W], [W, T]):
        text = parser.format_calls(calls)
        assert parser.parse(text) == (None, calls)
    functions = [("get_weather", {"type": "object", "properties": {"city": {"type": "string"},
                                                                   "days": {"type": "integer"}},
                                  "required": ["city"]}), ("get_time", None)]
    for parallel in (False, True):
        grammar = LLMatcher.grammar_from_lark(parser.grammar(functions, parallel))
        assert LLMatcher.validate_grammar(grammar) == ""


@pytest.mark.parametrize("name, pieces, streamed", [
    # content flows; a possible marker's first characters are held until they are known
    ("hermes", ["Let me ", "check.<tool", "_call>\n{", '"name"'], ["Let me ", "check.", "", ""]),
    ("hermes", ["a <to", "p> b"], ["a ", "<top> b"]),
    ("mistral", ["Sure [TOOL", "_CALLS] [", "{}"], ["Sure ", "", ""]),
    ("llama3_json", [" ", "{\"na", "me\""], ["", "", ""]),  # a call is the whole answer: nothing leaks
    ("llama3_json", ["Hel", "lo {"], ["Hel", "lo {"]),
    ("openai", ["Let me check.<|st", "art|>assistant to=functions.x"], ["Let me check.", ""]),
])
def test_streaming_holds_back_only_what_may_be_a_call(name, pieces, streamed):
    from paxpage.server.tools import ToolCallStream, ToolPlan, ToolRendering

    plan = ToolPlan(ToolRendering(PARSERS[name](), True), [], True, None, True)
    reader = ToolCallStream(plan)
    assert [reader.feed(p) for p in pieces] == streamed


def test_choose_from_template():
    assert choose((TEMPLATES / "qwen2.5.jinja").read_text()).name == "hermes"
    assert choose((TEMPLATES / "llama3.1.jinja").read_text()).name == "llama3_json"
    assert choose((TEMPLATES / "mistral-v0.3.jinja").read_text()).name == "mistral"
    assert choose("{% for m in messages %}{{ m.content }}{% endfor %}").name == "hermes"  # no tools: described
    assert choose("{% if tools %}{{ tools | tojson }}{% endif %}") is None  # an unknown tool format
    assert choose("{{ x }}", "mistral").name == "mistral"
    with pytest.raises(ValueError, match="--tool-call-parser 'pythonic' is not one of"):
        choose(None, "pythonic")


def test_mistral_ids_fit_its_template():
    ids = {PARSERS["mistral"]().new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert json.dumps(PARSERS["hermes"]().new_call_id()).startswith('"call_')


@pytest.mark.parametrize("name, text", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 2}"}'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "C:\\\\", "days":2}}; '
                    '{"parameters": {}, "name": "get_time"}'),  # an escaped backslash before a quote
    ("mistral", 'Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}, '
                '{"name": "get_time", "arguments": {}}]'),
])
def test_streamed_calls_grow_with_the_text_and_add_up_to_the_whole_answer(name, text):
    """Fed one character at a time: each call's id and name come once, before its arguments,
    whose fragments follow the text (an argument object in several pieces, a JSON-text
    arguments string only at the end); the deltas add up to the calls of the whole answer."""
    from paxpage.server.tools import ToolCallStream, ToolPlan, ToolRendering, read_answer

    plan = ToolPlan(ToolRendering(PARSERS[name](), True), [], True, None, True)
    reader = ToolCallStream(plan)
    steps = []
    for ch in text:
        reader.feed(ch)
        steps.append(reader.call_deltas())
    _, calls = reader.finish()
    steps.append(reader.final_deltas(calls))
    merged: dict[int, list[str]] = {}
    for deltas in steps:
        for d in deltas:
            if "id" in d:
                assert d["index"] not in merged and d["function"]["arguments"] == ""
                merged[d["index"]] = [d["id"], d["function"]["name"], ""]
            merged[d["index"]][2] += d["function"]["arguments"]
    whole = read_answer(plan, text)[1]
    assert [(n, a) for _, n, a in merged.values()] == [(c.name, c.arguments) for c in whole]
    assert whole and all(json.loads(c.arguments) for c in whole if c.name == "get_weather")
    pieces = sum(1 for deltas in steps for d in deltas if d["index"] == 0 and d["function"]["arguments"])
    assert pieces == (1 if "\\\"city" in text else len(whole[0].arguments))
