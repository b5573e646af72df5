"""LoRA adapters over HTTP: the OpenAI `model` field picks the adapter, /v1/models lists them,
an unknown model is an OpenAI-shaped 404, streams and structured outputs run the adapter too;
the serve flags."""

from __future__ import annotations

import argparse
import copy
import json

import pytest

import paxpage
from tests.engine.test_lora import _greedy, _save_adapter
from tests.server.conftest import LiveServer

CONFIG = dict(max_loras=1, max_lora_rank=8, num_pages=64, page_size=8, max_num_seqs=4, max_num_batched_tokens=64,
              prefill_row_len=16)
PROMPT = [17, 40, 99, 5, 230, 61, 8]
BODY = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
DIGITS = "[0-9]+"  # structured: only all-digit tokens, and the end once there is one


def _digit_greedy(hf, tokenizer, ids, n):
    """Greedy tokens of `hf` under DIGITS, masked here from the vocabulary: tokens whose text is
    all digits, and EOS after the first."""
    import torch

    digits = [t for t in range(len(tokenizer)) if (s := tokenizer.decode([t])) and s.isdigit() and s.isascii()]
    out = []
    with torch.no_grad():
        for step in range(n):
            logits = hf(torch.tensor([ids + out])).logits[0, -1]
            allowed = digits + ([tokenizer.eos_token_id] if step else [])
            best = allowed[int(torch.argmax(logits[allowed]))]
            if best == tokenizer.eos_token_id:
                break
            out.append(best)
    return out


@pytest.fixture(scope="module")
def lora_server(tiny_text_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from paxpage.async_engine import AsyncEngine

    model = paxpage.load(tiny_text_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_text_dir)
    root = tmp_path_factory.mktemp("served_loras")
    # the references: greedy tokens of the base and of each PEFT adapter merged into it, free and
    # under DIGITS
    references = {None: _greedy(base, PROMPT, 6)}
    digits = {None: _digit_greedy(base, model.tokenizer, PROMPT, 6)}
    for name, rank, rslora, targets, seed in (("ad-a", 4, False, ["q_proj", "v_proj"], 1),
                                              ("ad-b", 8, True, ["o_proj", "down_proj"], 2)):
        merged = _save_adapter(copy.deepcopy(base), root / name, rank, 8, rslora, targets, seed).merge_and_unload()
        references[name] = _greedy(merged, PROMPT, 6)
        digits[name] = _digit_greedy(merged, model.tokenizer, PROMPT, 6)
    model.load_lora("ad-a", root / "ad-a")
    model.load_lora("ad-b", root / "ad-b")
    # one slot for two adapters: requests for both swap it
    server = LiveServer(AsyncEngine(model, paxpage.EngineConfig(**CONFIG)), served_model_name="tiny-text")
    yield server, {name: model.tokenizer.decode(tokens) for name, tokens in references.items()}, \
        {name: model.tokenizer.decode(tokens) for name, tokens in digits.items()}
    server.stop()


def test_model_field_selects_the_adapter(lora_server):
    server, want, _ = lora_server
    texts = {}
    with server.client() as client:
        for name in ("ad-a", "tiny-text", "ad-b", None):
            body = dict(BODY, model=name) if name else BODY
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == (name or "tiny-text")
            texts[name] = r.json()["choices"][0]["text"]
        chat = client.post("/v1/chat/completions", json={"model": "ad-b", "max_tokens": 3, "temperature": 0,
                                                          "messages": [{"role": "user", "content": "yes"}]})
        assert chat.status_code in (200, 400), chat.text  # the tiny tokenizer may lack a chat template
        with client.stream("POST", "/v1/completions", json=dict(BODY, model="ad-a", stream=True)) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == texts["ad-a"]
    assert texts["tiny-text"] == texts[None] == want[None]
    assert texts["ad-a"] == want["ad-a"] and texts["ad-b"] == want["ad-b"]
    assert len(set(want.values())) == 3


def test_models_lists_base_and_adapters_and_unknown_is_404(lora_server):
    server, *_ = lora_server
    with server.client() as client:
        listed = client.get("/v1/models").json()["data"]
        r = client.post("/v1/completions", json=dict(BODY, model="ad-c"))
    assert [m["id"] for m in listed] == ["tiny-text", "ad-a", "ad-b"]
    assert [m["parent"] for m in listed] == [None, "tiny-text", "tiny-text"]
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model" and "'ad-c'" in error["message"]
    assert "ad-a" in error["message"]


def test_structured_outputs_run_the_adapter(lora_server):
    server, _, want = lora_server
    texts = {}
    with server.client() as client:
        for name in ("ad-a", None, "ad-b"):
            body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "structured_outputs": {"regex": DIGITS}}
            r = client.post("/v1/completions", json=dict(body, model=name) if name else body)
            assert r.status_code == 200, r.text
            texts[name] = r.json()["choices"][0]["text"]
    assert texts == want
    assert len(set(want.values())) == 3  # each adapter changes the constrained answer


def test_serve_flags():
    from paxpage.server.cli import add_serve_parser, engine_config_from_args, lora_modules

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--lora-modules", "a=/x", "b=/y", "--max-lora-rank", "32"])
    assert lora_modules(args.lora_modules) == {"a": "/x", "b": "/y"}
    config = engine_config_from_args(args)
    assert (config.max_loras, config.max_lora_rank) == (2, 32)
    args = parser.parse_args(["serve", "--lora-modules", "a=/x", "--max-loras", "4"])
    assert engine_config_from_args(args).max_loras == 4
    with pytest.raises(ValueError, match="NAME=PATH entries, got 'a'"):
        lora_modules(["a"])
    with pytest.raises(ValueError, match="names 'a' twice"):
        lora_modules(["a=/x", "a=/y"])
