"""/v1/chat/completions on SmolLM2 through the real `openai` client: greedy text equals offline
`paxpage.generate`, streamed text equals the whole answer, n / seed / stop / logprobs (against HF
transformers on the same weights), SSE framing, and disconnects."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import paxpage
from tests.server.conftest import metrics, wait_idle

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def offline(smollm2, smol_config):
    """The library's own greedy answer: what the server must reproduce."""
    return paxpage.generate(smollm2, [MESSAGES], temperature=0, max_tokens=MAX_TOKENS,
                            engine_config=smol_config, use_tqdm=False)[0]


def test_greedy_chat_equals_offline_generate(smol_openai, offline):
    r = smol_openai.chat.completions.create(model="smollm2", messages=MESSAGES, temperature=0,
                                            max_completion_tokens=MAX_TOKENS)
    assert r.object == "chat.completion" and r.model == "smollm2" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == offline.text
    assert choice.finish_reason == offline.finish_reason
    assert r.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert r.usage.completion_tokens == len(offline.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_equals_non_stream(smol_openai, offline):
    chunks = list(smol_openai.chat.completions.create(
        model="smollm2", messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS,  # the deprecated name
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == offline.text
    assert [c.choices[0].finish_reason for c in with_choices[:-1]] == [None] * (len(with_choices) - 1)
    assert with_choices[-1].choices[0].finish_reason == offline.finish_reason
    usage_chunk = chunks[-1]  # one final chunk, no choices, the usage
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(offline.token_ids)
    assert usage_chunk.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    assert {c.id for c in chunks} == {chunks[0].id} and all(c.object == "chat.completion.chunk" for c in chunks)


def test_sse_framing(smol_client, offline):
    """Exactly OpenAI's framing: `data: {json}` events separated by blank lines, then [DONE]."""
    with smol_client.stream("POST", "/v1/chat/completions", json={
            "messages": MESSAGES, "temperature": 0, "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads[1:])
    assert offline.text.startswith(text) and text
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_n_and_seed(smol_openai):
    """n choices; a seed fixes every sample (the engine draws a fresh seed when none is given,
    so an ignored seed would not reproduce); another seed samples differently."""
    kw = dict(model="smollm2", messages=MESSAGES, n=2, temperature=1.0, top_p=0.9, max_tokens=8)
    first, second = (smol_openai.chat.completions.create(seed=1234, **kw) for _ in range(2))
    other = smol_openai.chat.completions.create(seed=99, **kw)
    assert [c.index for c in first.choices] == [0, 1]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in second.choices]
    assert texts != [c.message.content for c in other.choices]
    assert first.usage.completion_tokens == second.usage.completion_tokens


def test_stop_string_cuts_the_text(smol_openai, offline):
    words = offline.text.split()
    assert len(words) >= 3, offline.text
    stop = words[2]
    cut = offline.text.index(stop)
    assert cut > 0
    r = smol_openai.chat.completions.create(model="smollm2", messages=MESSAGES, temperature=0,
                                            max_tokens=MAX_TOKENS, stop=[stop, "never-matches-xyz"])
    assert r.choices[0].message.content == offline.text[:cut]
    assert r.choices[0].finish_reason == "stop"


def test_logprobs_match_hf(smol_openai, smollm2, hf_smollm2, offline):
    """Chosen tokens and their logprobs, and the top alternatives, against HF transformers'
    log-softmax over the same GGUF weights."""
    import torch

    k = 3
    r = smol_openai.chat.completions.create(model="smollm2", messages=MESSAGES, temperature=0,
                                            max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=k)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == offline.text  # the tokens below include EOS, the text does not
    ids = offline.prompt_token_ids + offline.token_ids
    with torch.no_grad():
        logits = hf_smollm2(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1).numpy()
    tok = smollm2.tokenizer
    start = len(offline.prompt_token_ids)
    assert len(content) == len(offline.token_ids)
    for i, (entry, token) in enumerate(zip(content, offline.token_ids)):
        row = ref[start - 1 + i]
        assert entry.token == tok.decode([token])
        assert entry.bytes == list(entry.token.encode())
        np.testing.assert_allclose(entry.logprob, row[token], atol=2e-3)
        top = np.argsort(-row)[:k]
        assert [t.token for t in entry.top_logprobs] == [tok.decode([int(t)]) for t in top]
        np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], row[top], atol=2e-3)


@pytest.mark.parametrize("body, param", [
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 100_000}, "messages"),  # prompt + max_tokens > max_model_len
])
def test_bad_chat_field_is_400_naming_it(smol_client, body, param):
    r = smol_client.post("/v1/chat/completions", json={"model": "smollm2", "messages": MESSAGES, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_chat_disconnect_mid_stream_aborts(smol_client):
    kv_idle = wait_idle(smol_client)["paxpage_kv_cache_usage_perc"]
    before = metrics(smol_client)["paxpage_generation_tokens_total"]
    with smol_client.stream("POST", "/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            assert next(l for l in lines if l.startswith("data: "))
        assert metrics(smol_client)["paxpage_num_requests_running"] == 1
    t0 = time.monotonic()
    after = wait_idle(smol_client, kv_idle, timeout=10.0)
    assert time.monotonic() - t0 < 10.0
    assert after["paxpage_generation_tokens_total"] - before < 400
