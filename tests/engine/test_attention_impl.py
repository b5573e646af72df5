"""The engine gives the same greedy tokens with the Pallas kernels (interpret mode) as with XLA,
across prefill, chunked prefill (prompts longer than the step budget) and decode."""

from __future__ import annotations

import paxpage
from tests.conftest import random_prompts


def test_pallas_interpret_matches_xla(tiny_llama_dir):
    model = paxpage.load(tiny_llama_dir)
    prompts = random_prompts(3, 128, [3, 21, 45], seed=11)
    common = dict(max_tokens=6, temperature=0, ignore_eos=True, use_tqdm=False, page_size=8,
                  num_pages=32, max_num_batched_tokens=16, prefill_row_len=8)
    xla = paxpage.generate(model, prompts, attention_impl="xla", **common)
    pallas = paxpage.generate(model, prompts, attention_impl="pallas-interpret", **common)
    assert [o.token_ids for o in pallas] == [o.token_ids for o in xla]
