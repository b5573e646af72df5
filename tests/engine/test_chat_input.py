"""`paxpage.chat` input checks: what is one conversation, what is a list of them, and the messages
naming what is wrong. Checked before any model is touched, so no model is loaded here; the answers
themselves are checked on the real model in test_text_e2e.py."""

from __future__ import annotations

import pytest

import paxpage
from paxpage import api

USER = {"role": "user", "content": "hi"}


@pytest.fixture
def generate_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(api, "generate", lambda model, prompts, **kw: calls.append((prompts, kw)) or [])
    return calls


def test_one_conversation_or_a_list(generate_calls):
    system = {"role": "system", "content": "Be brief."}
    paxpage.chat("model", [system, USER])
    paxpage.chat("model", ([USER], (system, USER)), max_tokens=3, use_tqdm=False)
    (one, kw1), (two, kw2) = generate_calls
    assert one == [[system, USER]]
    assert two == [[USER], [system, USER]]
    assert kw1 == dict(sampling_params=None, engine_config=None, lora=None, use_tqdm=True)
    assert kw2 == dict(sampling_params=None, engine_config=None, lora=None, use_tqdm=False, max_tokens=3)


@pytest.mark.parametrize("messages,error,match", [
    ("What is the capital of France?", TypeError, "got str"),
    (USER, TypeError, "got dict"),
    ([], ValueError, "no conversations"),
    ([[]], ValueError, "conversation 0 has no messages"),
    ([[USER], "hi"], TypeError, "conversation 1 must be a list of message dicts, got str"),
    ([[USER, "hi"]], TypeError, "conversation 0 message 1 must be a dict"),
    ([[USER], [{"role": "user"}]], ValueError, r"conversation 1 message 0 lacks \['content'\]"),
    ([{"content": "hi"}], ValueError, r"message 0 lacks \['role'\]"),
    ([{"role": 1, "content": "hi"}], TypeError, "role must be a str, got int"),
])
def test_bad_input_is_named(generate_calls, messages, error, match):
    with pytest.raises(error, match=match):
        paxpage.chat("model", messages)
    assert generate_calls == []
