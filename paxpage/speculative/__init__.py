"""Speculative decoding (EngineConfig.speculative_method): proposers and acceptance.

  proposer.py  the interface: SpecInput (what a proposer is given), Proposals (what it
               returns), the Proposer protocol and its hooks; read its docstring first
  ngram.py     prompt-lookup proposals (speculative_method="ngram")
  verify.py    acceptance on device: greedy prefix match and exact rejection sampling
  draft.py     a smaller draft model with its own KV pool (speculative_method="draft"),
               built on the same interface

`make_proposer(config)` builds the proposer an engine's config asks for.
"""

from __future__ import annotations

import numpy as np

from paxpage.speculative.proposer import PoolHooks, Proposals, Proposer, SpecInput

__all__ = ["PoolHooks", "Proposals", "Proposer", "SpecInput", "draft_rows", "make_proposer"]


def make_proposer(config, target_model_cfg=None, target_tokenizer=None) -> Proposer | None:
    """The proposer for `config` (an EngineConfig or ResolvedConfig), None without speculation.
    `target_model_cfg` / `target_tokenizer`: the target's (a draft model checks its vocabulary;
    its pool follows the target's, so "draft" needs the ResolvedConfig with num_pages set)."""
    method = config.speculative_method
    if method is None:
        return None
    if method == "ngram":
        from paxpage.speculative.ngram import NgramProposer

        return NgramProposer(config.num_speculative_tokens, config.ngram_min, config.ngram_max)
    assert method == "draft", method
    from paxpage.speculative.draft import DraftProposer  # imported lazily: only the draft method needs it

    return DraftProposer(config, target_model_cfg, target_tokenizer)


def draft_rows(rows, row_drafts, draft_dists, num_rows: int):
    """i32[R] draft token per logits row (-1: none) and, from a proposer with distributions,
    f32[R, V] q per row (device), for verify.py. rows: a step's (request, sample, first logits
    row) entries, row_drafts their drafts; draft_dists: ({seq_id: proposal row}, f32[B, k, V])
    from the proposer, or None."""
    draft_ids = np.full(num_rows, -1, np.int32)
    source = np.full(num_rows, -1, np.int64)  # flat (proposal row, j) of each row's q
    index, dists = draft_dists or ({}, None)
    for (_, sample, row), drafts in zip(rows, row_drafts):
        draft_ids[row:row + len(drafts)] = drafts
        if dists is not None and drafts:
            r = index[sample.seq.seq_id]
            source[row:row + len(drafts)] = r * dists.shape[1] + np.arange(len(drafts))
    if dists is None:
        return draft_ids, None
    import jax.numpy as jnp

    flat = jnp.asarray(dists, jnp.float32).reshape(-1, dists.shape[-1])
    q = jnp.take(flat, jnp.asarray(np.maximum(source, 0)), axis=0)
    return draft_ids, q
