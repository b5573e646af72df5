"""Structured outputs on the default model (SmolLM2-135M-Instruct) at temperature 1.0: every seeded
sample parses and validates against its JSON schema (checked with `json` and `jsonschema`), a
choice request returns one of the choices, a regex request's output passes `re.fullmatch`."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import paxpage
from paxpage import SamplingParams as SP

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "artist", "doctor", "teacher"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "skills"],
    "additionalProperties": False,
}


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.extended
def test_json_schema_samples_all_validate(smollm2):
    params = [SP(temperature=1.0, seed=seed, max_tokens=160, structured_outputs={"json_schema": PERSON})
              for seed in range(20)]
    outs = paxpage.chat(smollm2, [_chat("Describe a person as a JSON object.")] * 20, sampling_params=params,
                        use_tqdm=False)
    texts = set()
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)
        texts.add(o.text)
    assert len(texts) > 10  # seeded samples, not one answer repeated


def test_choice_and_regex(smollm2):
    choices = ["positive", "negative", "neutral"]
    date = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    chats = [_chat("Is this review positive or negative? 'I loved the food.'")] * 6 + \
            [_chat("When did the first person land on the Moon? Answer with a date.")] * 6
    params = [SP(temperature=1.0, seed=s, max_tokens=8, structured_outputs={"choice": choices}) for s in range(6)] + \
             [SP(temperature=1.0, seed=s, max_tokens=16, structured_outputs={"regex": date}) for s in range(6)]
    outs = paxpage.chat(smollm2, chats, sampling_params=params, use_tqdm=False)
    for o in outs[:6]:
        assert o.text in choices and o.finish_reason == "stop"
    for o in outs[6:]:
        assert re.fullmatch(date, o.text) and o.finish_reason == "stop", o.text
