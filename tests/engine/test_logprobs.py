"""Sample and prompt logprobs against HF transformers' log-softmax on the same tiny model."""

from __future__ import annotations

import numpy as np
import torch
import transformers

import paxpage
from tests.conftest import random_prompts


def _hf_logprobs(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1).numpy()  # [S, V]


def test_prompt_logprobs_match_hf_across_chunks(tiny_llama_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    model = paxpage.load(tiny_llama_dir)
    prompt = random_prompts(1, 128, [37], seed=5)[0]
    # A 16-token step budget prefills the 37-token prompt in three chunks.
    out = paxpage.generate(model, [prompt], max_tokens=3, temperature=0, prompt_logprobs=3,
                           logprobs=2, ignore_eos=True, page_size=8, num_pages=32,
                           max_num_batched_tokens=16, prefill_row_len=8, use_tqdm=False)[0]
    ref = _hf_logprobs(hf, prompt + out.token_ids)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p]
        assert prompt[p] in entry
        assert len(entry) >= 3
        for token, lp in entry.items():
            np.testing.assert_allclose(lp, ref[p - 1, token], atol=1e-4)
        top3 = set(np.argsort(-ref[p - 1])[:3].tolist())
        assert top3 <= set(entry)
    for i, entry in enumerate(out.outputs[0].logprobs):
        token = out.token_ids[i]
        np.testing.assert_allclose(entry[token], ref[len(prompt) + i - 1, token], atol=1e-4)


def test_prompt_logprobs_complete_despite_prefix_cache(tiny_llama_dir):
    model = paxpage.load(tiny_llama_dir)
    prompt = random_prompts(1, 128, [30], seed=9)[0]
    kwargs = dict(max_tokens=2, temperature=0, ignore_eos=True, page_size=8, num_pages=32,
                  enable_prefix_caching=True, use_tqdm=False)
    paxpage.generate(model, [prompt], **kwargs)  # fills the prefix cache
    again = paxpage.generate(model, [prompt], prompt_logprobs=1, **kwargs)[0]
    assert all(entry is not None for entry in again.prompt_logprobs[1:])
