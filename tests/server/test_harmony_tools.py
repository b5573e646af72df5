"""gpt-oss tool calls (the `openai` tool parser with `--reasoning-parser gpt_oss`) on hand-written
harmony answers, as the model writes them after its prompt's `<|start|>assistant`: whole, and cut
into every possible pair of deltas and into single characters. The streamed reasoning, content
and tool-call deltas add up to the answer read whole, and no harmony tag is ever sent."""

from __future__ import annotations

import pytest

from paxpage.server.answer import AnswerStream
from paxpage.server.reasoning import reasoning_parser
from paxpage.server.tool_parsers import PARSERS, ParsedCall, choose
from paxpage.server.tools import ToolPlan, ToolRendering, read_answer

PROMPT = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"
CALL_W = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\", \"days\": 2}"
W = ParsedCall("get_weather", '{"city": "Paris", "days": 2}')
T = ParsedCall("get_time", "{}")
AFTER_TEXT = ("<|channel|>analysis<|message|>a<b<|end|><|start|>assistant<|channel|>commentary<|message|>Let me "
              "check.<|end|><|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json"
              "<|message|>{}<|call|>")

# (answer, reasoning, content, calls)
CASES = [
    (CALL_W + "<|call|>", "", None, [W]),
    ("<|channel|>analysis<|message|>Need the forecast.<|end|><|start|>assistant" + CALL_W + "<|call|>",
     "Need the forecast.", None, [W]),
    # two calls; the second names its recipient before the channel
    (CALL_W + "<|call|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>",
     "", None, [W, T]),
    (CALL_W + "<|call|>\n<|start|>assistant to=functions.get_time<|channel|>commentary<|message|>{}<|call|>",
     "", None, [W, T]),  # text between messages is not content
    (AFTER_TEXT, "a<b", "Let me check.", [T]),
    # arguments whose text holds harmony-like characters and braces in strings
    ('<|channel|>commentary to=functions.get_weather<|message|>{"city": "a<|b}", "days": 2}<|call|>', "",
     None, [ParsedCall("get_weather", '{"city": "a<|b}", "days": 2}')]),
    (CALL_W, "", None, [W]),  # cut off after whole arguments: still a call, as a missing close tag is elsewhere
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>",
     "x", "It is 4.", []),
    # malformed arguments: no calls, each call message's body stays content (as the reasoning parser alone gives)
    ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": <|call|>", "",
     '{"city":', []),
    ("<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>not json<|call|>", "", "not json", []),
]


def _plan(parallel: bool = True) -> ToolPlan:
    return ToolPlan(ToolRendering(PARSERS["openai"](), True), [], True, None, parallel)


def _whole(plan, text):
    reasoning, rest = reasoning_parser("gpt_oss").split(text, PROMPT, plan.harmony_calls)
    return (reasoning,) + read_answer(plan, rest)


def _streamed(plan, pieces):
    """(reasoning, content, {index: [id, name, arguments]}) as the chat route sends them."""
    reader = AnswerStream(plan, reasoning_parser("gpt_oss"), PROMPT)
    reasoning, content, merged = "", "", {}
    for k, piece in enumerate(pieces):
        thought, text = reader.feed(piece)
        deltas = reader.call_deltas()
        if k == len(pieces) - 1:
            more, rest, calls = reader.finish()
            thought, text = thought + more, text + rest
            deltas += reader.final_deltas(calls)
        reasoning, content = reasoning + thought, content + text
        for d in deltas:
            if "id" in d:
                assert d["index"] not in merged and d["type"] == "function"
                merged[d["index"]] = [d["id"], d["function"]["name"], ""]
            merged[d["index"]][2] += d["function"]["arguments"]
    return reasoning, content, merged


@pytest.mark.parametrize("text, reasoning, content, calls", CASES)
def test_whole_and_streamed_at_every_cut(text, reasoning, content, calls):
    plan = _plan()
    assert _whole(plan, text) == (reasoning, content, calls)
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        r, c, merged = _streamed(plan, pieces)
        assert (r, c) == (reasoning, content or ""), pieces
        assert "|>" not in c + r, pieces
        if calls or not merged:  # a malformed call may have sent its name before it failed, as elsewhere
            assert [(n, a) for _, n, a in merged.values()] == [(x.name, x.arguments) for x in calls], pieces
        assert len({i for i, _, _ in merged.values()}) == len(merged)


def test_arguments_stream_as_they_grow():
    """Fed one character at a time, a call's arguments go out in many fragments, after its name."""
    plan = _plan()
    reader = AnswerStream(plan, reasoning_parser("gpt_oss"), PROMPT)
    fragments = []
    for ch in CASES[0][0]:
        reader.feed(ch)
        fragments += [d["function"] for d in reader.call_deltas()]
    assert fragments[0] == {"name": "get_weather", "arguments": ""}
    assert len(fragments) > 10 and "".join(f["arguments"] for f in fragments) == W.arguments


def test_one_call_when_not_parallel():
    text = CASES[2][0]  # two calls
    plan = _plan(parallel=False)
    assert _whole(plan, text) == ("", None, [W])
    _, _, merged = _streamed(plan, list(text))
    assert [(n, a) for _, n, a in merged.values()] == [(W.name, W.arguments)]


def test_without_tools_the_call_stays_content():
    """tool_choice "none" (or no tools): the call message is content, as the reasoning parser gives it."""
    plan = ToolPlan(ToolRendering(PARSERS["openai"](), True), [], False, None, True)
    assert _whole(plan, CASES[0][0]) == ("", W.arguments, [])


def test_parse_reserialises_and_format_calls_reads_back():
    parser = PARSERS["openai"]()
    text = '<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|> {"city":"Paris","days":2} <|call|>'
    assert parser.parse(text) == (None, [W])
    assert parser.read(text) == (None, [ParsedCall("get_weather", '{"city":"Paris","days":2}')])
    assert parser.parse("It is sunny.") == ("It is sunny.", [])
    assert parser.parse(parser.format_calls([W, T])) == (None, [W, T])


def test_chosen_by_name_and_from_a_harmony_template():
    assert choose(None, "openai").name == "openai"
    template = "{{ '<|start|>assistant<|channel|>commentary to=functions.' + name }}{% if tools %}{% endif %}"
    assert choose(template).name == "openai"


@pytest.fixture(scope="module")
def harmony_client(tmp_path_factory):
    """A tiny random model (Qwen2.5's template: the harmony tags are plain text to its tokenizer)
    served with --reasoning-parser gpt_oss --tool-call-parser openai."""
    import openai

    import paxpage
    from paxpage.async_engine import AsyncEngine
    from tests.server.conftest import LiveServer
    from tests.server.test_tools import save_family_model

    path = tmp_path_factory.mktemp("tiny_harmony")
    save_family_model(path, "qwen2.5")
    engine = AsyncEngine(paxpage.load(path), paxpage.EngineConfig(num_pages=128, page_size=16, max_num_seqs=1,
                                                                  max_model_len=2048))
    server = LiveServer(engine, served_model_name="tiny", reasoning_parser="gpt_oss", tool_call_parser="openai")
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=180.0, max_retries=0) as c:
        yield c
    server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_server_answers_harmony_calls_as_tool_calls(harmony_client, stream):
    from tests.server.test_tools import TOOLS

    text = AFTER_TEXT  # analysis, a commentary preamble, a call
    body = dict(model="tiny", messages=[{"role": "user", "content": "The time?"}], tools=TOOLS,
                max_completion_tokens=200, extra_body={"guided_choice": [text]})
    if not stream:
        choice = harmony_client.chat.completions.create(**body).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert (choice.message.reasoning_content, choice.message.content) == ("a<b", "Let me check.")
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("get_time", "{}")]
        return
    reasoning, content, calls, reasons = "", "", {}, []
    for chunk in harmony_client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                name, args = calls.get(d.index, ("", ""))
                calls[d.index] = (name + (d.function.name or ""), args + (d.function.arguments or ""))
            reasons.append(c.finish_reason)
    assert (reasoning, content, reasons[-1]) == ("a<b", "Let me check.", "tool_calls")
    assert list(calls.values()) == [("get_time", "{}")]
