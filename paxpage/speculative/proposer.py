"""The proposer interface of speculative decoding: what a proposer is given, what it returns,
and the hooks the engine calls. Pure Python + numpy (no jax needed to implement one).

How a speculative step flows (engine.py, `LLMEngine.step`):
  1. Before scheduling, the engine picks the sequences that may speculate this step: running,
     decoding (exactly one uncomputed token: the last sampled one), every token known on the
     host (no async placeholder), not a beam, no structured outputs, and the step is small
     enough (adaptive: `EngineConfig.speculative_max_batch`). For them it calls
         proposer.propose([SpecInput, ...]) -> Proposals
     once per step, with all of them in one batch.
  2. The scheduler schedules each such sequence as one row of q_len = 1 + num_drafts (its last
     token and the drafts), allocating pages for all of them like prefill tokens (it may cut the
     drafts when the token budget or the pool is short; it never preempts for a draft).
  3. The target model runs the step; every draft position gets a logits row. Acceptance
     (paxpage/speculative/verify.py) keeps the longest accepted prefix and adds one token from the
     target (a correction at the first rejection, or a bonus when all were accepted).
  4. The scheduler rolls back: num_computed_tokens counts only the last token and the accepted
     drafts, pages wholly past it are freed. K/V written at rejected positions stays in pages
     the sequence keeps, but lies past its length (attention reads only kv_len keys) and is
     overwritten by the next step; prefix caching registers only full, computed pages, so a page
     holding rejected K/V is never cached.
  5. The engine then calls `proposer.on_verified(seq_id, num_tokens)` for each sequence that
     speculated, and `proposer.on_free(seq_id)` whenever a sequence leaves the engine.

Contract of `propose` (R = len(inputs), k = num_speculative_tokens):
  * `Proposals.token_ids` i32[R, k]: row r holds input r's drafts in its first
    `num_drafts[r]` entries (anything after is ignored); `num_drafts` i32[R] with
    0 <= num_drafts[r] <= inputs[r].max_drafts <= k. A row with 0 drafts decodes normally.
  * `draft_dists`: None when the drafts are deterministic (n-gram: q is one-hot on the draft,
    so a sampled row accepts draft x with probability p(x) and on rejection draws from p with x
    removed). Otherwise f32[R, k, V] (numpy, or a jax array left on device): the distribution q
    each draft was drawn from (drafts must be drawn from it). Acceptance reads q(x) and the
    residual norm(max(p - q, 0)) from it, so the output distribution is exactly the target's.
  * Greedy requests (`SpecInput.greedy`) accept the longest prefix where draft == the target's
    argmax, whatever q is: a draft model should propose its own argmax for them.
  * propose must not mutate the inputs. It may keep private per-sequence state keyed by seq_id
    (a draft model's own KV pages and how far they are computed).

State a draft model keeps (its own KV): `on_verified(seq_id, num_tokens)` says the sequence's
tokens are final up to `num_tokens` (prompt + outputs, including the new correction/bonus
token, which has no K/V in the target yet); anything the proposer computed for positions
>= num_tokens - 1 from rejected drafts must be dropped (its "computed" count cut back to at most
num_tokens - 1). Tokens are append-only otherwise, except that a sequence that finished
mid-accept (a stop inside the accepted drafts) is cut and then freed. A sequence can be
preempted and recomputed by the target; this is not signalled: its token ids do not change,
so a proposer's own state for it stays valid. Forked samples (n > 1) arrive as new seq_ids
whose tokens share the parent's prompt.

Axis legend: R speculating sequences this step, k num_speculative_tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class SpecInput:
    """One sequence that may speculate this step."""

    seq_id: int
    token_ids: Sequence[int]  # prompt + output tokens, all known (read by index and slice)
    num_prompt_tokens: int
    max_drafts: int  # 1 <= max_drafts <= k: fewer when max_tokens / max_model_len are near
    greedy: bool  # the request samples greedily (temperature 0)
    params: Any = None  # the request's SamplingParams (a draft model may sample with them)
    seed: int = 0  # the request sample's seed (for a proposer that samples)
    # The sequence's pages before this step's scheduling (a draft model addresses its own K/V
    # pool with the target's page ids: paxpage/speculative/draft.py)
    page_table: Sequence[int] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class Proposals:
    token_ids: np.ndarray  # i32[R, k] drafts, valid in each row's first num_drafts entries
    num_drafts: np.ndarray  # i32[R]
    draft_dists: Any = None  # f32[R, k, V] q of each draft (numpy or device); None: one-hot

    def __post_init__(self):
        assert self.token_ids.ndim == 2 and self.num_drafts.shape == (self.token_ids.shape[0],), \
            (self.token_ids.shape, self.num_drafts.shape)

    @classmethod
    def empty(cls, num_rows: int, k: int) -> "Proposals":
        return cls(np.zeros((num_rows, k), np.int32), np.zeros(num_rows, np.int32))

    def drafts(self, row: int) -> list[int]:
        return [int(t) for t in self.token_ids[row, :self.num_drafts[row]]]


class Proposer(Protocol):
    """What the engine needs from a proposer (n-gram: paxpage/speculative/ngram.py)."""

    num_speculative_tokens: int  # k

    def propose(self, inputs: Sequence[SpecInput]) -> Proposals:
        """Drafts for every input, in order (see the module docstring for the contract)."""

    def on_verified(self, seq_id: int, num_tokens: int) -> None:
        """The sequence's tokens are final up to num_tokens after this step's acceptance."""

    def on_free(self, seq_id: int) -> None:
        """The sequence left the engine (finished or aborted): drop its state."""

    def pool_hooks(self) -> "PoolHooks | None":
        """The proposer's hooks into the target's K/V pool, or None when it keeps no K/V of its
        own (n-gram). A draft model returns them (paxpage/speculative/draft.py)."""


class PoolHooks(Protocol):
    """What a proposer keeping a K/V pool parallel to the target's needs to hear of each step.
    The engine calls these only through `Proposer.pool_hooks()`."""

    def on_step(self, batch, prev_rows=None, prev_tokens=None) -> None:
        """After each target step is dispatched, with the same StepBatch and async-scheduling
        arguments as ModelRunner.forward."""

    def on_copy_pages(self, copies: Sequence[tuple[int, int]]) -> None:
        """The scheduler's copy-on-write (src, dst) page pairs, when the target's pool copies them."""
