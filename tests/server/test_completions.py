"""/v1/completions on SmolLM2: prompts as text, lists and token ids (choice index =
prompt_index * n + sample), echo, integer logprobs with prompt logprobs against HF."""

from __future__ import annotations

import numpy as np
import pytest

import paxpage

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def offline(smollm2, smol_config):
    return paxpage.generate(smollm2, PROMPTS, temperature=0, max_tokens=MAX_TOKENS, engine_config=smol_config,
                            use_tqdm=False)


def test_list_of_prompts_with_n(smol_openai, offline):
    r = smol_openai.completions.create(model="smollm2", prompt=PROMPTS, n=2, temperature=0, max_tokens=MAX_TOKENS)
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [offline[0].text] * 2 + [offline[1].text] * 2
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in offline)
    assert r.usage.completion_tokens == 2 * sum(len(o.token_ids) for o in offline)


def test_token_id_prompts_equal_text_prompts(smol_openai, offline):
    ids = [o.prompt_token_ids for o in offline]
    one = smol_openai.completions.create(model="smollm2", prompt=ids[0], temperature=0, max_tokens=MAX_TOKENS)
    assert one.choices[0].text == offline[0].text
    both = smol_openai.completions.create(model="smollm2", prompt=ids, temperature=0, max_tokens=MAX_TOKENS,
                                          stream=True)
    texts = {0: "", 1: ""}
    finish = {}
    for chunk in both:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {0: offline[0].text, 1: offline[1].text}
    assert finish == {0: offline[0].finish_reason, 1: offline[1].finish_reason}


def test_echo_with_logprobs_match_hf(smol_openai, smollm2, hf_smollm2, offline):
    import torch

    k = 2
    r = smol_openai.completions.create(model="smollm2", prompt=PROMPTS[0], temperature=0, max_tokens=MAX_TOKENS,
                                       echo=True, logprobs=k)
    choice = r.choices[0]
    assert choice.text == PROMPTS[0] + offline[0].text
    ids = offline[0].prompt_token_ids + offline[0].token_ids
    tok = smollm2.tokenizer
    lp = choice.logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    with torch.no_grad():
        ref = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), -1).numpy()
    for p in range(1, len(ids)):
        np.testing.assert_allclose(lp.token_logprobs[p], ref[p - 1, ids[p]], atol=2e-3)
        top = np.argsort(-ref[p - 1])[:k]
        assert list(lp.top_logprobs[p]) == [tok.decode([int(t)]) for t in top]
        np.testing.assert_allclose(list(lp.top_logprobs[p].values()), ref[p - 1, top], atol=2e-3)


def test_echo_stream_starts_with_the_prompt(smol_openai, offline):
    chunks = list(smol_openai.completions.create(model="smollm2", prompt=PROMPTS[1], temperature=0,
                                                 max_tokens=MAX_TOKENS, echo=True, stream=True))
    assert chunks[0].choices[0].text == PROMPTS[1]
    assert "".join(c.choices[0].text for c in chunks) == PROMPTS[1] + offline[1].text
