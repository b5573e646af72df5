"""Text-level behaviour on the real model: stop strings across tokens, streaming, chats."""

from __future__ import annotations

import pytest

import paxpage

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_stop_string_split_across_tokens(smollm2):
    full = paxpage.generate(smollm2, [CHAT], max_tokens=20, temperature=0, use_tqdm=False)[0]
    assert full.text.startswith("The capital of France is Paris")
    tok = smollm2.tokenizer
    pieces = [tok.decode([t]) for t in full.token_ids]
    assert " is" in pieces and " Paris" in pieces  # so "is Par" spans two tokens
    out = paxpage.generate(smollm2, [CHAT], max_tokens=20, temperature=0, stop=["is Par"],
                           use_tqdm=False)[0]
    assert out.text == "The capital of France "
    assert out.finish_reason == "stop" and out.stop_reason == "is Par"
    kept = paxpage.generate(smollm2, [CHAT], max_tokens=20, temperature=0, stop=["is Par"],
                            include_stop_str_in_output=True, use_tqdm=False)[0]
    assert kept.text == "The capital of France is Par"


def test_stream_deltas_concatenate_to_generate(smollm2):
    prompts = [CHAT, "Once upon a time", [{"role": "user", "content": "Say hello in Japanese."}]]
    kw = dict(max_tokens=24, temperature=0.7, seed=3)
    whole = paxpage.generate(smollm2, prompts, use_tqdm=False, **kw)
    texts, finish = ["", "", ""], [None, None, None]
    for delta in paxpage.stream(smollm2, prompts, **kw):
        assert finish[delta.index] is None, "no delta after the final one"
        texts[delta.index] += delta.text
        finish[delta.index] = delta.finish_reason
    assert texts == [o.text for o in whole]
    assert finish == [o.finish_reason for o in whole]
    assert "\ufffd" not in "".join(texts)


def test_cli_prints_answer(smollm2, capsys):
    from paxpage.cli import main

    assert main(["generate", "What is the capital of France?", "--max-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out
    (finish,) = [line for line in out.splitlines() if line.startswith("[")]
    want = smollm2.tokenizer.encode(" The capital of France is Paris.", add_special_tokens=False)
    assert finish == f"[stop, {len(want) + 1} tokens]"  # the answer, then <|im_end|>
    assert main(["generate", "What is the capital of France?", "--max-tokens", "12", "--stream"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out and finish in out.splitlines()  # streaming ends with the same line


def test_chat_answers_with_the_chat_template(smollm2):
    """chat == generate on the token ids of transformers' own apply_chat_template, one output per
    conversation."""
    ids = list(smollm2.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)["input_ids"])
    kw = dict(max_tokens=12, temperature=0, use_tqdm=False)
    (want,) = paxpage.generate(smollm2, [ids], **kw)
    (one,) = paxpage.chat(smollm2, CHAT, **kw)
    both = paxpage.chat(smollm2, [CHAT, [{"role": "user", "content": "Say hello in French."}]], **kw)
    assert one.token_ids == want.token_ids == both[0].token_ids
    assert one.text.startswith("The capital of France is Paris")
    assert len(both) == 2 and both[1].text
