"""The engine follows the model's generation config: it stops at its end ids and fills the
sampling fields a request leaves unset, as HF transformers' generate does with the same files."""

from __future__ import annotations

import json

import pytest

import paxpage
from paxpage import EngineConfig, SamplingParams
from tests.conftest import random_prompts, save_tiny_hf

PROMPTS = random_prompts(3, 128, [6, 11, 4], seed=21)
CONFIG = EngineConfig(page_size=8, num_pages=64, max_model_len=128, max_num_seqs=8)
# temperature 0.8 with top_k 1 samples greedily, so only HF's greedy decoding *with the
# repetition penalty* gives the default tokens.
DEFAULTS = {"temperature": 0.8, "top_k": 1, "repetition_penalty": 1.5}


def _hf_generate(hf, prompt, max_new_tokens):
    """HF generate as the model directory configures it (generation_config.json included)."""
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, pad_token_id=0,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(paxpage model, HF model) of a tiny llama without eos in config.json whose
    generation_config.json adds DEFAULTS and two end ids, one that greedy decoding reaches."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("gen_defaults")
    save_tiny_hf(path, "llama")
    gen_file = path / "generation_config.json"
    gen_file.write_text(json.dumps(DEFAULTS))
    greedy = _hf_generate(AutoModelForCausalLM.from_pretrained(path).eval(), PROMPTS[0], 12)
    stop = next(t for i, t in enumerate(greedy) if i >= 3 and t not in greedy[:i])
    unused = next(t for t in range(128) if all(t not in _ for _ in [greedy, *PROMPTS]))
    gen_file.write_text(json.dumps({**DEFAULTS, "eos_token_id": [unused, stop]}))
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    assert hf.generation_config.eos_token_id == [unused, stop]
    return paxpage.load(path), hf, stop


def test_stops_at_generation_config_eos_like_hf(model):
    model, hf, stop = model
    want = _hf_generate(hf, PROMPTS[0], 12)
    assert want[-1] == stop and len(want) < 12
    out = paxpage.generate(model, [PROMPTS[0]], max_tokens=12, engine_config=CONFIG, use_tqdm=False)[0]
    assert out.token_ids == want and out.finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_unset_fields_take_the_model_defaults(model):
    model, hf, _ = model
    engine = model.engine(CONFIG)
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4))
    p = engine.request(rid).params
    assert (p.temperature, p.top_k, p.repetition_penalty, p.top_p) == (0.8, 1, 1.5, 1.0)
    engine.abort(rid)
    # a field the caller set keeps its value, even when it equals SamplingParams' default
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4, temperature=1.0, repetition_penalty=1.0))
    p = engine.request(rid).params
    assert (p.temperature, p.top_k, p.repetition_penalty) == (1.0, 1, 1.0)
    engine.abort(rid)
    # beam search ignores sampling fields and rejects penalties: it takes no defaults
    engine.abort(engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4, beam_width=2)))

    outs = paxpage.generate(model, PROMPTS, max_tokens=10, seed=3, engine_config=CONFIG, use_tqdm=False)
    assert [o.token_ids for o in outs] == [_hf_generate(hf, p, 10) for p in PROMPTS]


def test_explicit_fields_override_the_defaults(model):
    model, hf, _ = model
    # temperature=0 given explicitly stays greedy (and takes the model's penalty)
    greedy = paxpage.generate(model, PROMPTS, max_tokens=10, temperature=0, engine_config=CONFIG,
                              use_tqdm=False)
    assert [o.token_ids for o in greedy] == [_hf_generate(hf, p, 10) for p in PROMPTS]
    # top_k=-1 at a high temperature really samples: the defaults did not pin it to greedy
    sampled = [paxpage.generate(model, PROMPTS[:1], max_tokens=10, top_k=-1, temperature=3.0, seed=s,
                                engine_config=CONFIG, use_tqdm=False)[0].token_ids for s in range(3)]
    assert any(s != greedy[0].token_ids for s in sampled)


def test_load_says_which_defaults_it_took(model, caplog):
    from paxpage.api import _announce_generation_config

    model, _, _ = model
    with caplog.at_level("INFO", logger="paxpage"):
        _announce_generation_config(model.config)
    assert "temperature=0.8, top_k=1, repetition_penalty=1.5" in caplog.text
    assert f"sequences end at token ids {list(model.config.end_token_ids)}" in caplog.text
