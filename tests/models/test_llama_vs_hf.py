"""The functional model and the whole engine against HF transformers on tiny random configs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import paxpage
from tests.conftest import hf_greedy, random_prompts, save_tiny_hf


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_match_hf(tmp_path, kind):
    extra = {}
    if kind == "llama":
        extra = dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    hf = save_tiny_hf(tmp_path, kind, **extra)
    model = paxpage.load(tmp_path)
    prompts = random_prompts(3, 128, [5, 17, 40], seed=1)
    outs = paxpage.generate(model, prompts, max_tokens=12, temperature=0, ignore_eos=True,
                            page_size=8, num_pages=64, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 12)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_logits_match_hf(tmp_path, kind):
    """Logprobs of the first generated token equal HF's log-softmax (f32, tiny model: 1e-4)."""
    hf = save_tiny_hf(tmp_path, kind)
    model = paxpage.load(tmp_path)
    prompt = random_prompts(1, 128, [23], seed=3)[0]
    out = paxpage.generate(model, [prompt], max_tokens=1, temperature=0, logprobs=5, ignore_eos=True,
                           page_size=4, num_pages=32, use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], -1).numpy()
    entry = out.outputs[0].logprobs[0]
    for token, logprob in entry.items():
        np.testing.assert_allclose(logprob, ref[token], atol=1e-4)
    assert set(entry) == set(np.argsort(-ref)[:5].tolist())


@pytest.mark.parametrize("prompt_len", [1, 7, 8, 9])
def test_page_boundaries(tiny_llama_dir, prompt_len):
    """Prompt lengths 1, page_size-1, page_size, page_size+1; generation crosses several pages."""
    hf = paxpage_hf = None
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    model = paxpage.load(tiny_llama_dir)
    prompt = random_prompts(1, 128, [prompt_len], seed=prompt_len)[0]
    out = paxpage.generate(model, [prompt], max_tokens=30, temperature=0, ignore_eos=True,
                           page_size=8, num_pages=16, use_tqdm=False)[0]
    assert out.token_ids == hf_greedy(hf, prompt, 30)
    assert out.finish_reason == "length"


def test_batched_equals_alone_and_pages_return(tiny_llama_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    model = paxpage.load(tiny_llama_dir)
    lengths = [1, 3, 8, 9, 16, 33, 70, 5]
    prompts = random_prompts(len(lengths), 128, lengths, seed=7)
    config = paxpage.EngineConfig(page_size=8, num_pages=128, max_num_batched_tokens=64,
                                  prefill_row_len=16)
    outs = paxpage.generate(model, prompts, max_tokens=20, temperature=0, ignore_eos=True,
                            engine_config=config, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 20)
    engine = model.engine(config)
    assert engine.runner.scanned  # the CPU default: layers under a scan (models/layer_stack.py)
    assert engine.scheduler.page_manager.num_free_pages == config.num_pages
