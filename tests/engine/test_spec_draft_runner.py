"""The draft model of draft-model speculation, alone: a truncated copy of a tiny random llama
(models/truncate.py) proposes what HF transformers' own truncated model (the same checkpoint
loaded with fewer layers) generates, reading K/V its pool got from a target-shaped prefill."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.conftest import hf_greedy

K = 5  # proposed tokens per row


@pytest.fixture(scope="module")
def models(tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    import paxpage

    target = paxpage.load(tiny_llama_dir)
    hf_draft = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, num_hidden_layers=1, dtype=torch.float32)
    return target, target.truncated(1), hf_draft.eval()


def _runner(target, draft):
    from paxpage.config import EngineConfig
    from paxpage.speculative.draft_runner import DraftRunner

    cfg = EngineConfig(num_pages=40, page_size=4, max_model_len=64).resolve(target.config)
    return DraftRunner(draft.config, draft.params, cfg, K)


def _prefill(runner, rows):
    """The draft's K/V of each (prompt, pages) but its last token, as the target's step writes it."""
    from paxpage.packing import RowPlan

    batch, *_ = runner.runner.packer.pack([RowPlan(p, pages, 0, len(p) - 1, 0) for p, pages in rows])
    runner.fill(batch)


def test_truncate_keeps_first_layers(models):
    import jax

    import paxpage

    target, draft, _ = models
    assert draft.config.num_layers == 1 and target.config.num_layers == 2
    assert sorted(draft.params) == ["embed_tokens", "layers_0", "lm_head", "norm"]
    # the target holds its layers stacked (paxpage.load): the draft's layer is the first one, cut out
    assert all(x is y for x, y in zip(jax.tree.leaves(draft.params["embed_tokens"]),
                                      jax.tree.leaves(target.params["embed_tokens"])))
    want = jax.tree.map(np.asarray, target.per_layer_params()["layers_0"])
    jax.tree.map(np.testing.assert_array_equal, draft.per_layer_params()["layers_0"], want)
    per_layer = target.per_layer_params()
    cut = paxpage.Model(target.config, per_layer, target.tokenizer).truncated(1)
    assert cut.params["layers_0"] is per_layer["layers_0"]  # from per-layer params: shared, not copied
    assert draft.tokenizer is target.tokenizer
    with pytest.raises(ValueError, match="num_layers must be in 1..2"):
        target.truncated(3)
    with pytest.raises(ValueError, match="num_layers must be in 1..2"):
        target.truncated(0)


def test_greedy_proposals_match_hf_truncated_model(models):
    """Rows of different lengths on permuted pages, proposals crossing page boundaries into
    pages the rows do not have yet."""
    from paxpage.speculative.draft_runner import DraftRow

    target, draft, hf_draft = models
    runner = _runner(target, draft)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, n).tolist() for n in (7, 12, 3)]
    # Pages for the prompts only, as before the scheduler books the drafts: proposals past
    # them run in the draft's scratch pages.
    tables = [[31, 2], [5, 29, 11], [14]]
    _prefill(runner, list(zip(prompts, tables)))
    proposal = runner.propose([DraftRow(p[-1], len(p) - 1, t) for p, t in zip(prompts, tables)])
    assert proposal.probs is None
    got = np.asarray(proposal.token_ids)
    assert got.shape == (4, K)  # 3 rows padded to a bucket
    for i, prompt in enumerate(prompts):
        assert got[i].tolist() == hf_greedy(hf_draft, prompt, K), i
    # The proposals' K/V landed in the pool: proposing again from the 3rd token on continues
    # the same sequence without refilling.
    p = prompts[0] + got[0, :2].tolist()
    again = runner.propose([DraftRow(p[-1], len(p) - 1, tables[0])], num_steps=2)
    assert np.asarray(again.token_ids)[0].tolist() == got[0, 2:4].tolist()


def test_sampled_rows_return_their_distribution(models):
    """q of a sampled row's first proposal is softmax(HF logits / T); every drawn token has q > 0;
    a greedy row in the same batch keeps its argmax and a one-hot q."""
    import torch

    from paxpage.speculative.draft_runner import DraftRow
    from paxpage.sampling.params import SamplingParams

    target, draft, hf_draft = models
    runner = _runner(target, draft)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 128, n).tolist() for n in (9, 6)]
    tables = [[4, 19, 33], [21, 1]]
    _prefill(runner, list(zip(prompts, tables)))
    params = SamplingParams(temperature=0.7, max_tokens=8)
    proposal = runner.propose([DraftRow(prompts[0][-1], 8, tables[0], params, seed=3, step=0),
                               DraftRow(prompts[1][-1], 5, tables[1])])
    tokens, q = np.asarray(proposal.token_ids), np.asarray(proposal.probs)
    assert q.shape == (2, K, 128)
    np.testing.assert_allclose(q[:2].sum(-1), 1.0, atol=1e-5)
    with torch.no_grad():
        logits = hf_draft(torch.tensor([prompts[0]])).logits[0, -1].double()
    want = torch.softmax(logits / 0.7, -1).numpy()
    np.testing.assert_allclose(q[0, 0], want, atol=2e-5)
    assert np.all(q[0, np.arange(K), tokens[0]] > 0)
    assert tokens[1].tolist() == hf_greedy(hf_draft, prompts[1], K)
    np.testing.assert_array_equal(q[1], np.eye(128)[tokens[1]])


def test_incompatible_draft_is_rejected(models):
    from paxpage.speculative.draft_model import check_compatible

    target, draft, _ = models
    other = dataclasses.replace(draft.config, vocab_size=64)
    with pytest.raises(ValueError, match="64 tokens; the target's has 128"):
        check_compatible(target.config, None, other, None)
    check_compatible(target.config, None, draft.config, None)


def test_proposer_on_target_steps_and_pool_sizing(models):
    """DraftProposer through the engine's calls: on_step with the target runner's own batch, then
    propose from SpecInputs; a kv_cache_bytes budget pays for both pools' bytes per page."""
    from paxpage.config import EngineConfig
    from paxpage.packing import RowPlan
    from paxpage.runner import ModelRunner
    from paxpage.speculative import make_proposer
    from paxpage.speculative.proposer import SpecInput

    target, draft, hf_draft = models
    t, d = target.config, draft.config
    per_page = 2 * 4 * 4 * (t.num_layers * t.num_kv_heads * t.head_dim + d.num_layers * d.num_kv_heads * d.head_dim)
    config = EngineConfig(page_size=4, max_model_len=64, kv_cache_bytes=per_page * 30 + 5, max_num_seqs=4,
                          speculative_method="draft", num_speculative_tokens=K, draft_model=draft)
    cfg = config.resolve(t)
    assert (cfg.num_pages, cfg.page_bytes) == (30, per_page)
    target_runner = ModelRunner(t, target.params, cfg)
    proposer = make_proposer(cfg, t, target.tokenizer)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 128, n).tolist() for n in (10, 5)]
    tables = [[12, 3, 25], [7, 29]]
    batch, *_ = target_runner.packer.pack([RowPlan(p, pages, 0, len(p) - 1, 0) for p, pages in zip(prompts, tables)])
    target_runner.forward(batch)
    proposer.on_step(batch)
    inputs = [SpecInput(seq_id=i, token_ids=p, num_prompt_tokens=len(p), max_drafts=K - i, greedy=True,
                        page_table=pages) for i, (p, pages) in enumerate(zip(prompts, tables))]
    out = proposer.propose(inputs)
    assert out.draft_dists is None and out.num_drafts.tolist() == [K, K - 1]
    for i, p in enumerate(prompts):
        assert out.drafts(i) == hf_greedy(hf_draft, p, K)[:K - i], i
    with pytest.raises(TypeError, match="draft_model must be a paxpage Model"):
        EngineConfig(speculative_method="draft", draft_model="tiny").resolve(t)


def test_sampled_drafts_are_drawn_from_q(models):
    """Rejection sampling is exact only if each draft is a draw from the q it reports: 1024 first
    drafts (one prefix, 1024 seeds) against q by a chi-square test (cells with expected count
    >= 5, the rest pooled; threshold p = 1e-4 by the Wilson-Hilferty approximation). Seeds are
    fixed, so the test is deterministic."""
    from paxpage.speculative.draft_runner import DraftRow
    from paxpage.sampling.params import SamplingParams

    target, draft, _ = models
    runner = _runner(target, draft)
    prompt, table = [3, 77, 12, 90, 41, 8], [6, 13]
    _prefill(runner, [(prompt, table)])
    params = SamplingParams(temperature=1.3, top_k=40, max_tokens=8)
    counts, q = np.zeros(128), None
    for call in range(16):
        rows = [DraftRow(prompt[-1], len(prompt) - 1, table, params, seed=call * 64 + i) for i in range(64)]
        proposal = runner.propose(rows, num_steps=1)
        np.add.at(counts, np.asarray(proposal.token_ids)[:, 0], 1)
        q = np.asarray(proposal.probs)[0, 0]
    assert np.count_nonzero(q) == 40  # top_k kept 40 tokens
    expected = q * counts.sum()
    big = expected >= 5
    observed_cells = np.append(counts[big], counts[~big].sum())
    expected_cells = np.append(expected[big], expected[~big].sum())
    chi2 = np.sum((observed_cells - expected_cells) ** 2 / np.maximum(expected_cells, 1e-9))
    df = len(observed_cells) - 1
    z = 3.72  # one-sided p = 1e-4
    critical = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
    assert df >= 5 and chi2 < critical, (chi2, critical, df)
    assert counts[q == 0].sum() == 0
