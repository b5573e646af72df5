"""The engine's side of speculative decoding: when a step speculates, what each sequence is
proposed, and what the proposer hears of the target's steps.

`SpeculationCoordinator` wraps the engine's `Proposer` (proposer.py). Each step it decides
whether to speculate at all (few enough sequences run: past `speculative_max_batch`, verifying
k + 1 tokens per sequence costs more than the accepted drafts save), gathers the decoding
sequences that may speculate (no beams, grammars, forks still to come, nor a last token still
in flight), asks the proposer for drafts within each one's length room, and keeps the draft
distributions the verifier needs (verify.py). It passes on page copies and dispatched steps to a
proposer with a pool of its own (draft.py) and tells the proposer of verified and freed
sequences. Pure Python on the host.
"""

from __future__ import annotations

from typing import Callable

from paxpage.sampling.params import GREEDY_TEMPERATURE
from paxpage.speculative import draft_rows
from paxpage.speculative.proposer import Proposer, SpecInput


class SpeculationCoordinator:
    def __init__(self, proposer: Proposer, max_batch: int, max_model_len: int, pending_token: int):
        self.proposer = proposer
        self.max_batch = max_batch  # a step speculates only while at most this many sequences run
        self.max_model_len = max_model_len
        self.pending_token = pending_token  # an in-flight token's placeholder
        # a draft model's K/V pool follows the target's (draft.py): every step and page copy
        self.pool_hooks = proposer.pool_hooks()
        self._draft_dists = None  # this step's Proposals.draft_dists, when the proposer gives them

    def active(self, num_running: int) -> bool:
        """Whether a step of `num_running` sequences speculates."""
        return 0 < num_running <= self.max_batch

    def propose(self, running, lookup: Callable, is_embedding: Callable[[int], bool]
                ) -> dict[int, tuple[int, ...]] | None:
        """Drafts by seq_id for this step's decoding sequences, or None. `running`: the
        scheduler's running queue; `lookup(seq_id)`: its (request, sample); `is_embedding(group
        id)`: whether the sequence is an embedding request's."""
        self._draft_dists = None
        if not self.active(len(running)):
            return None
        k = self.proposer.num_speculative_tokens
        inputs = []
        for seq in running:
            if seq.num_uncomputed_tokens != 1 or seq.last_token_id == self.pending_token \
                    or is_embedding(seq.group_id):
                continue
            request, sample = lookup(seq.seq_id)
            if request.beam is not None or sample.matcher is not None or sample.finish_reason is not None \
                    or not request.forked:
                continue
            # one more token than the accepted drafts comes from the target
            room = min(k, request.params.max_tokens - seq.num_output_tokens - 1,
                       self.max_model_len - seq.num_tokens - 1)
            if room >= 1:
                inputs.append(SpecInput(seq.seq_id, seq.token_ids, seq.num_prompt_tokens, room,
                                        request.params.temperature <= GREEDY_TEMPERATURE,
                                        request.params, sample.seed, seq.page_table))
        if not inputs:
            return None
        proposals = self.proposer.propose(inputs)
        drafts = {}
        for r, spec in enumerate(inputs):
            n = int(proposals.num_drafts[r])
            assert 0 <= n <= spec.max_drafts, (n, spec.max_drafts)
            if n:
                drafts[spec.seq_id] = tuple(int(t) for t in proposals.token_ids[r, :n])
        if proposals.draft_dists is not None:
            self._draft_dists = ({spec.seq_id: r for r, spec in enumerate(inputs)}, proposals.draft_dists)
        return drafts

    def draft_rows(self, rows, row_drafts, num_rows: int):
        """The verifier's inputs for a speculating step: i32[R] draft token per logits row and
        the drafts' distributions (speculative.draft_rows)."""
        return draft_rows(rows, row_drafts, self._draft_dists, num_rows)

    # ---- what the proposer hears of the target
    def on_copy_pages(self, copies) -> None:
        if self.pool_hooks is not None:
            self.pool_hooks.on_copy_pages(copies)

    def on_step(self, batch, prev_rows, prev_tokens) -> None:
        if self.pool_hooks is not None:
            self.pool_hooks.on_step(batch, prev_rows, prev_tokens)

    def on_verified(self, seq_id: int, num_tokens: int) -> None:
        self.proposer.on_verified(seq_id, num_tokens)

    def on_free(self, seq_id: int) -> None:
        self.proposer.on_free(seq_id)
