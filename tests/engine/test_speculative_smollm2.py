"""Speculative decoding on the real model: an input-grounded prompt (repeat a passage) greedy with
n-gram proposals equals HF transformers' greedy continuation on the same weights, and most drafts
are accepted."""

import pytest

import paxpage
from paxpage import EngineConfig
from tests.conftest import hf_greedy

pytestmark = pytest.mark.slow

PASSAGE = ("The river town of Elmsford was built on trade. Barges carried grain downstream to the coast, "
           "and merchants returned with salt, cloth and news from the capital.")


def test_grounded_greedy_equals_hf_and_accepts_most_drafts(smollm2, hf_smollm2):
    chat = [{"role": "user", "content": f"Repeat the following passage exactly:\n\n{PASSAGE}"}]
    text = smollm2.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt = list(smollm2.tokenizer.encode(text, add_special_tokens=False))
    config = EngineConfig(speculative_method="ngram", num_speculative_tokens=8, max_model_len=512)
    # 32 tokens: the repeated passage, before the model's first end-of-turn (hf_greedy's
    # min_new_tokens masks EOS, so the two would part there)
    out = paxpage.generate(smollm2, [prompt], max_tokens=32, temperature=0, ignore_eos=True,
                           engine_config=config, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == hf_greedy(hf_smollm2, prompt, 32)
    stats = smollm2.engine(config).stats
    assert stats.spec_steps > 0 and stats.acceptance_rate >= 0.5, vars(stats)
    assert stats.steps < 32 * 0.6  # fewer than 0.6 target steps per generated token
