"""/health, /v1/models, /metrics names, /tokenize and /detokenize."""

from __future__ import annotations

import pytest

from tests.server.conftest import metrics

pytestmark = pytest.mark.slow

REQUIRED_METRICS = (
    "paxpage_num_requests_running", "paxpage_num_requests_waiting", "paxpage_kv_cache_usage_perc",
    "paxpage_prompt_tokens_total", "paxpage_generation_tokens_total", "paxpage_num_preemptions_total",
    "paxpage_time_to_first_token_seconds_count", "paxpage_time_per_output_token_seconds_count",
)


def test_health(smol_client):
    r = smol_client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_models(smol_openai, smol_server):
    (card,) = smol_openai.models.list().data
    assert card.id == "smollm2" and card.object == "model"
    assert card.model_dump()["max_model_len"] == smol_server.engine.config.max_model_len


def test_metrics_names_and_ranges(smol_client):
    m = metrics(smol_client)
    missing = [name for name in REQUIRED_METRICS if name not in m]
    assert not missing, sorted(m)
    assert 0.0 <= m["paxpage_kv_cache_usage_perc"] <= 1.0
    text = smol_client.get("/metrics").text
    assert "# TYPE paxpage_time_to_first_token_seconds histogram" in text
    assert "# TYPE paxpage_num_requests_running gauge" in text


def test_tokenize_detokenize_round_trip(smol_client, smollm2):
    text = "Paged attention, in JAX: héllo wörld!"
    r = smol_client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == smollm2.tokenizer.encode(text, add_special_tokens=False)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    back = smol_client.post("/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_tokenize_chat_uses_the_template(smol_client, smollm2):
    messages = [{"role": "user", "content": "Hi"}]
    r = smol_client.post("/tokenize", json={"messages": messages})
    expected = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert r.json()["tokens"] == smollm2.tokenizer.encode(expected, add_special_tokens=False)


def test_detokenize_bad_id_is_400(smol_client):
    r = smol_client.post("/detokenize", json={"tokens": [1, 10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
