"""Draft-model proposals (speculative_method="draft"): a smaller paxpage model proposes, the
target verifies.

The draft keeps its K/V in a pool parallel to the target's (paxpage/speculative/draft_runner.py): the
same pages, addressed by the target's page tables, so it needs no page allocator and no
per-sequence state. Why not a pool of its own with its own pages: every page event of the
target (allocation, preemption, prefix-cache hits, copy-on-write, the rollback of rejected
drafts, sliding-window release) would need a twin in a second allocator, and a preempted or
prefix-cached sequence would need a separate draft prefill; sharing the page ids gets all of
them from the scheduler for the price of the draft's bytes per page, which the pool sizing
counts (EngineConfig.resolve).

What the engine calls, besides the Proposer protocol (paxpage/speculative/proposer.py), through
`pool_hooks()` (the PoolHooks protocol):
  on_step(batch, prev_rows, prev_tokens)  after dispatching each target step: the draft runs
      over the same StepBatch (prefills, decodes, verify rows), writing its K/V only, so its
      pool holds K/V for every token the target's does;
  on_copy_pages(copies)  the scheduler's copy-on-write pairs, applied to the draft's pool too.
`propose` then needs each sequence's page table (`SpecInput.page_table`) and runs k jitted
draft decode steps in one call: greedy requests get the draft's argmax, sampled ones a draw
from the draft's temperature / top-k / top-p / min-p distribution q, returned for rejection
sampling (left on device). Stale K/V past a sequence's length (rejected drafts) is never
read and is overwritten by the next step's fill, so on_verified / on_free have nothing to do.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from paxpage.speculative.draft_model import draft_page_bytes, validate_draft_model
from paxpage.speculative.draft_runner import DraftRow, DraftRunner
from paxpage.speculative.proposer import Proposals, SpecInput

__all__ = ["DraftProposer", "draft_page_bytes", "validate_draft_model"]


class DraftProposer:
    def __init__(self, config, target_model_cfg, target_tokenizer=None):
        """`config`: the engine's ResolvedConfig with num_pages set (the draft's pool matches it)."""
        if config.num_pages is None:
            raise ValueError("the draft model's pool follows the target's: size the target's pool first")
        if config.is_parallel:
            raise ValueError("speculative_method='draft' runs on one device; got tensor_parallel_size="
                             f"{config.tensor_parallel_size}, data_parallel_size={config.data_parallel_size}, "
                             f"mesh={config.mesh!r}")
        draft = config.draft_model
        validate_draft_model(draft, target_model_cfg, target_tokenizer)
        self.num_speculative_tokens = config.num_speculative_tokens
        # A Model's forms: the draft's cast / stacked copy is shared by every engine drafting with it.
        params = getattr(draft, "param_forms", draft.params)
        self.runner = DraftRunner(draft.config, params, config, config.num_speculative_tokens)

    # ------------------------------------------------------------------ Proposer
    def propose(self, inputs: Sequence[SpecInput]) -> Proposals:
        k = self.num_speculative_tokens
        if not inputs:
            return Proposals.empty(0, k)
        rows = [DraftRow(spec.token_ids[-1], spec.num_tokens - 1, spec.page_table,
                         None if spec.greedy else spec.params, spec.seed,
                         spec.num_tokens - spec.num_prompt_tokens)
                for spec in inputs]
        proposal = self.runner.propose(rows)
        num_rows = len(inputs)
        token_ids = np.asarray(jax.device_get(proposal.token_ids))[:num_rows]
        num_drafts = np.array([spec.max_drafts for spec in inputs], np.int32)
        dists = None if proposal.probs is None else proposal.probs[:num_rows]
        return Proposals(token_ids, num_drafts, dists)

    def on_verified(self, seq_id: int, num_tokens: int) -> None:
        pass  # K/V past a sequence's length is never read; the next fill overwrites it

    def on_free(self, seq_id: int) -> None:
        pass  # no per-sequence state: the scheduler frees the pages of both pools at once

    def pool_hooks(self) -> "DraftProposer":
        return self  # the draft's pool follows the target's: it hears of every step and page copy

    # ------------------------------------------------------------------ PoolHooks
    def on_step(self, batch, prev_rows=None, prev_tokens=None) -> None:
        """The target dispatched `batch`: write the draft's K/V of the same tokens."""
        self.runner.fill(batch, prev_rows, prev_tokens)

    def on_copy_pages(self, copies: Sequence[tuple[int, int]]) -> None:
        self.runner.copy_pages(copies)
