"""Reasoning split and /v1/responses over HTTP with the real `openai` client, on one tiny random
model with Qwen2.5's chat template served with --reasoning-parser qwen3 (one server for the module).

The answers are forced by structured outputs (chat) or by tool_choice "required" (responses), so
the checks are exact; the openai package's own types parsing our bodies and events is the test
of their shape."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.server.conftest import LiveServer
from tests.server.test_tools import TOOLS, WEATHER, save_family_model

FORCED = "<think>Paris is in France.</think>\n\nParis"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    import openai

    import paxpage
    from paxpage.async_engine import AsyncEngine

    path = tmp_path_factory.mktemp("tiny_qwen_reasoning")
    save_family_model(path, "qwen2.5")
    engine = AsyncEngine(paxpage.load(path), paxpage.EngineConfig(num_pages=128, page_size=16, max_num_seqs=1,
                                                                  max_model_len=2048))
    server = LiveServer(engine, served_model_name="tiny", reasoning_parser="qwen3", max_stored_responses=2)
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=180.0, max_retries=0) as c:
        yield c
    server.stop()


def test_chat_reasoning_split_streamed_and_not(client):
    body = dict(model="tiny", messages=[{"role": "user", "content": "Capital of France?"}],
                max_completion_tokens=60, extra_body={"guided_choice": [FORCED]})
    message = client.chat.completions.create(**body).choices[0].message
    assert (message.reasoning_content, message.content) == ("Paris is in France.", "Paris")
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content) == ("Paris is in France.", "Paris")


def test_responses_text_and_stream(client):
    from openai.types.responses import Response

    r = client.responses.create(model="tiny", input="Hello", instructions="Answer briefly.", max_output_tokens=4,
                                temperature=0.0)
    assert isinstance(r, Response) and r.id.startswith("resp_") and r.instructions == "Answer briefly."
    assert [o.type for o in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    assert r.usage.output_tokens <= 4 and r.status in ("completed", "incomplete")
    events = list(client.responses.create(model="tiny", input=[{"role": "user", "content": "Hello"}],
                                          instructions="Answer briefly.", max_output_tokens=4, temperature=0.0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{r.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == r.output_text  # greedy: the same answer as unstreamed


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_call_and_follow_up(client, stream):
    import openai

    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    body = dict(model="tiny", input="Weather in Oslo?", tools=tools, tool_choice="required",
                parallel_tool_calls=False, temperature=1.0, max_output_tokens=80)
    if stream:
        events = list(client.responses.create(**body, stream=True))
        assert events[-1].type == "response.completed"
        r = events[-1].response
        args = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [e.arguments for e in args] == [r.output[-1].arguments]
    else:
        r = client.responses.create(**body)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name in ("get_weather", "get_time") and calls[0].call_id
    if calls[0].name == "get_weather":
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    follow = client.responses.create(model="tiny", previous_response_id=r.id, max_output_tokens=2, tools=tools,
                                     tool_choice="none", input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "rain, 8 C"}])
    # the follow-up's prompt is the first prompt, its answer and the tool result
    assert follow.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
    assert client.responses.retrieve(follow.id).id == follow.id
    with pytest.raises(openai.BadRequestError) as e:  # two kept: the third answer pushes out the first
        client.responses.create(model="tiny", input="x", max_output_tokens=1)
        client.responses.create(model="tiny", input="y", previous_response_id=r.id, max_output_tokens=1)
    assert e.value.body["param"] == "previous_response_id"


def test_responses_unknown_fields_are_400(client):
    import openai

    for extra in ({"frobnicate": 1}, {"input": [{"role": "user", "content": "hi", "colour": "red"}]}):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="tiny", input="hi", max_output_tokens=1, extra_body=extra)
        assert "unsupported field" in e.value.body["message"], e.value.body
