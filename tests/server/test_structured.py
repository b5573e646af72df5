"""Structured outputs over HTTP on SmolLM2: OpenAI's response_format (json_object, json_schema)
through the real `openai` client, streamed too, vLLM's guided_* / structured_outputs fields on
chat and completions, and OpenAI-shaped 400s for bad specs. Outputs are checked with `json`,
`jsonschema` and `re`, independently of the grammar engine."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Give me a colour and a number as JSON."}]
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "number": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["colour", "number"], "additionalProperties": False}


def test_response_format_json_schema_and_stream(smol_openai):
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    r = smol_openai.chat.completions.create(model="smollm2", messages=MESSAGES, temperature=1.0, seed=3,
                                            max_completion_tokens=60, n=2, response_format=fmt)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    chunks = smol_openai.chat.completions.create(model="smollm2", messages=MESSAGES, temperature=1.0, seed=4,
                                                 max_completion_tokens=60, response_format=fmt, stream=True)
    text, reasons = "", []
    for chunk in chunks:
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_response_format_json_object(smol_openai):
    r = smol_openai.chat.completions.create(model="smollm2", messages=MESSAGES, temperature=0,
                                            max_completion_tokens=48, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # an object may run past the budget; what exists is a JSON object's beginning
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_guided_fields_on_chat_and_completions(smol_client):
    body = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 8, "temperature": 1.0, "seed": 1}
    r = smol_client.post("/v1/chat/completions", json={**body, "guided_choice": ["alpha", "beta"]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("alpha", "beta")
    r = smol_client.post("/v1/completions", json={"model": "smollm2", "prompt": "The year was", "max_tokens": 8,
                                                  "guided_regex": "19[0-9]{2}", "n": 2, "seed": 5})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert re.fullmatch("19[0-9]{2}", choice["text"]) and choice["finish_reason"] == "stop"
    r = smol_client.post("/v1/chat/completions", json={**body, "structured_outputs": {"json": SCHEMA},
                                                       "max_tokens": 60})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SCHEMA)


DATE_QUESTIONS = ["What is today's date?", "Give me a date in the future.",
                  "When did the first person land on the Moon? Answer with a date."]


def test_regex_digits_are_ascii_by_default(smol_client):
    """Greedy on SmolLM2, Unicode `\\d` answers the first two questions with U+1FBF8 "segmented
    digits"; the default (ASCII) classes give 0-9 through both request fields."""
    date = r"\d{4}-\d{2}-\d{2}"
    for i, question in enumerate(DATE_QUESTIONS):
        field = {"guided_regex": date} if i % 2 else {"structured_outputs": {"regex": date}}
        r = smol_client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 16, **field})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        assert re.fullmatch("[0-9]{4}-[0-9]{2}-[0-9]{2}", text), text
    r = smol_client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": DATE_QUESTIONS[0]}], "temperature": 0, "max_tokens": 24,
        "structured_outputs": {"regex": date, "unicode_regex": True}})
    assert r.status_code == 200, r.text
    assert not re.fullmatch("[0-9]{4}-[0-9]{2}-[0-9]{2}", r.json()["choices"][0]["message"]["content"])


def test_regex_digits_are_ascii_through_the_openai_client(smol_openai):
    """The first question above, as the openai client sends vLLM's extra field."""
    r = smol_openai.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": DATE_QUESTIONS[0]}], temperature=0, max_tokens=16,
        extra_body={"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}})
    assert re.fullmatch("[0-9]{4}-[0-9]{2}-[0-9]{2}", r.choices[0].message.content), r.choices[0].message.content


@pytest.mark.parametrize("extra, param, words", [
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "json_schema is invalid"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
    ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "one structured output constraint"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar", "nothing_here"),
])
def test_invalid_specs_are_openai_400s(smol_client, extra, param, words):
    r = smol_client.post("/v1/chat/completions", json={"model": "smollm2", "messages": MESSAGES, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]
