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

from paxpage.spec.proposer import PoolHooks, Proposals, Proposer, SpecInput

__all__ = ["PoolHooks", "Proposals", "Proposer", "SpecInput", "make_proposer"]


def make_proposer(config, target_model_cfg=None, target_tokenizer=None) -> Proposer | None:
    """The proposer for `config` (an EngineConfig or ResolvedConfig), None without speculation.
    `target_model_cfg` / `target_tokenizer`: the target's (a draft model checks its vocabulary;
    its pool follows the target's, so "draft" needs the ResolvedConfig with num_pages set)."""
    method = config.speculative_method
    if method is None:
        return None
    if method == "ngram":
        from paxpage.spec.ngram import NgramProposer

        return NgramProposer(config.num_speculative_tokens, config.ngram_min, config.ngram_max)
    assert method == "draft", method
    from paxpage.spec.draft import DraftProposer  # imported lazily: only the draft method needs it

    return DraftProposer(config, target_model_cfg, target_tokenizer)
