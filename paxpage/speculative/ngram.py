"""N-gram (prompt lookup) proposals: the sequence proposes its own continuation.

For each sequence, the last n tokens (n from ngram_max down to ngram_min) are looked up among
its earlier tokens (prompt + output); at the most recent earlier occurrence, the up to k tokens
that followed it are the drafts. Input-grounded generation (repeat, edit, summarise a passage)
copies long runs of its prompt, so these drafts are often right, and they cost no model call.
Deterministic: q is one-hot on each draft (`Proposals.draft_dists` None).

Cost: one vectorised compare of the sequence against its suffix per n tried, O(len * n) numpy
work per sequence and step, with no state kept between steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from paxpage.speculative.proposer import Proposals, SpecInput


def lookup(tokens: np.ndarray, ngram_min: int, ngram_max: int, k: int) -> np.ndarray:
    """Drafts for one sequence: tokens i32[L] -> i32[<= k] (empty when no n-gram recurs).

    The longest n in [ngram_min, ngram_max] whose suffix occurs earlier wins; among its
    occurrences the most recent one, whose continuation is the likeliest to repeat."""
    length = tokens.shape[0]
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        # earlier windows only: start positions 0 .. length - n - 1 (the suffix itself excluded)
        windows = sliding_window_view(tokens[:length - 1], n)  # [length - n, n]
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k]
    return tokens[:0]


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, ngram_min: int, ngram_max: int):
        assert 1 <= ngram_min <= ngram_max and num_speculative_tokens >= 1
        self.num_speculative_tokens = num_speculative_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, inputs: Sequence[SpecInput]) -> Proposals:
        k = self.num_speculative_tokens
        out = Proposals.empty(len(inputs), k)
        for r, spec in enumerate(inputs):
            tokens = np.asarray(spec.token_ids, np.int32)
            drafts = lookup(tokens, self.ngram_min, self.ngram_max, min(k, spec.max_drafts))
            out.token_ids[r, :drafts.shape[0]] = drafts
            out.num_drafts[r] = drafts.shape[0]
        return out

    def on_verified(self, seq_id: int, num_tokens: int) -> None:
        pass  # no per-sequence state

    def on_free(self, seq_id: int) -> None:
        pass

    def pool_hooks(self) -> None:
        return None  # drafts come from the tokens alone: no K/V to keep
