"""Streamed completions equal whole ones, logprobs included (tiny model, token-id prompts)."""

from __future__ import annotations

import json


def _events(client, body):
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [l for l in r.iter_lines() if l.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(l[len("data: "):]) for l in lines[:-1]]


def test_stream_logprobs_equal_non_stream(fresh_tiny_server):
    with fresh_tiny_server.client() as client:
        _check(client)


def _check(client):
    body = {"prompt": [[5, 6, 7], [9, 8]], "max_tokens": 7, "temperature": 0, "logprobs": 3,
            "stream_options": None}
    whole = client.post("/v1/completions", json=body).json()
    events = _events(client, {**body, "stream_options": {"include_usage": True}})
    for choice in whole["choices"]:
        parts = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == choice["index"]]
        merged = {key: sum((p["logprobs"][key] for p in parts if p["logprobs"]), []) for key in choice["logprobs"]}
        assert merged == choice["logprobs"]
        assert len(merged["tokens"]) == 7 and all(len(t) <= 3 for t in merged["top_logprobs"])
        assert [p["finish_reason"] for p in parts][-1] == choice["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
