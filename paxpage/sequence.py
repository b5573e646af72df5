"""Host-side state of one generated sequence. Pure Python (no jax).

vLLM-v1 accounting: a sequence has `num_tokens` (prompt + outputs) and `num_computed_tokens` (tokens whose
K/V already sit in the paged cache). Each step computes the next `num_tokens - num_computed_tokens` tokens, or a
chunk of them; a decode step is the one-token case. After a preemption (recompute) `num_computed_tokens` is 0
and the whole prompt + outputs is prefilled again; the tokens themselves are never lost.

Token ids are append-only, with one exception: the LAST token, while it has no K/V yet
(num_computed_tokens < num_tokens), may be replaced, e.g. a forked child's sampled token. Prefix-cache keys never
cover the last token, so this keeps `page_keys` valid.
"""

from __future__ import annotations

import enum
import itertools
from typing import Any

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # queued; holds no pages, num_computed_tokens == 0
    RUNNING = enum.auto()  # admitted; owns page_table
    FINISHED = enum.auto()  # finished or aborted; holds no pages


class Sequence:
    """One sequence. The scheduler owns the lifecycle fields; the engine reads them and appends tokens via
    `Scheduler.update`."""

    # Slots: the steady decode step reads and writes a few fields of every running sequence, and
    # the device's step has pushed them out of the caches by then (fewer cache lines per sequence).
    __slots__ = ("seq_id", "group_id", "prompt_token_ids", "output_token_ids", "max_tokens", "sampling_params",
                 "status", "num_computed_tokens", "page_table", "num_released_pages", "arrival",
                 "num_preemptions", "num_cached_tokens", "use_prefix_cache", "finish_reason", "page_keys",
                 "num_pages_cache_checked", "lora", "lora_slot")

    def __init__(
        self,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        seq_id: int | None = None,
        group_id: int | None = None,
        sampling_params: Any = None,
    ):
        if len(prompt_token_ids) < 1:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; need at least 1")
        if max_tokens < 1:
            raise ValueError(f"max_tokens is {max_tokens}; need at least 1")
        self.seq_id: int = next(_seq_ids) if seq_id is None else seq_id
        # request id: children forked from one parent share it (parallel sampling, beam search)
        self.group_id: int = self.seq_id if group_id is None else group_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.max_tokens: int = max_tokens  # max new tokens; prompt + max_tokens bounds the KV footprint
        self.sampling_params: Any = sampling_params  # opaque to the scheduler, carried by clone()
        self.status: SequenceStatus = SequenceStatus.WAITING
        self.num_computed_tokens: int = 0
        self.page_table: list[int] = []  # logical page i -> physical page id (RELEASED = -1: outside the window)
        self.num_released_pages: int = 0  # leading table entries released by the sliding window
        self.arrival: int = -1  # set by Scheduler.add/fork: FIFO order key of the waiting queue
        self.num_preemptions: int = 0
        self.num_cached_tokens: int = 0  # prefix-cache hit tokens at the last admission
        # False: never reuse cached pages (prompt logprobs must score every prompt token).
        self.use_prefix_cache: bool = True
        self.finish_reason: str | None = None
        # prefix-cache bookkeeping (PageManager): chained keys of full pages, and how many of this
        # sequence's leading pages cache_full_pages() has already looked at.
        self.page_keys: list[int] = []
        self.num_pages_cache_checked: int = 0
        # LoRA: the adapter the sequence runs (opaque here, hashable; None: the base model) and
        # its slot in the device slab while the sequence holds one (-1: none; paxpage/lora_slots.py).
        self.lora: Any = None
        self.lora_slot: int = -1

    @property
    def prefix_root(self) -> Any:
        """The parent key of the first page's prefix-cache key: sequences of different adapters
        never share cached pages (their K/V differ)."""
        return None if self.lora is None else ("lora", self.lora)

    # ---- tokens -------------------------------------------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def tokens(self) -> "TokenView":
        """Prompt + output tokens, read by index or slice without concatenating the lists."""
        return TokenView(self)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(int(token_id))

    def page_tokens(self, index: int, page_size: int) -> tuple[int, ...]:
        """Token ids stored in logical page `index` (may be partial at the end)."""
        lo, hi = index * page_size, (index + 1) * page_size
        n_prompt = len(self.prompt_token_ids)
        if hi <= n_prompt:
            return tuple(self.prompt_token_ids[lo:hi])
        if lo >= n_prompt:
            return tuple(self.output_token_ids[lo - n_prompt : hi - n_prompt])
        return tuple(self.prompt_token_ids[lo:]) + tuple(self.output_token_ids[: hi - n_prompt])

    def clone(self, *, seq_id: int | None = None) -> Sequence:
        """A fresh WAITING copy with the same tokens, max_tokens, group and sampling params, holding no pages.
        Pass it to `Scheduler.fork(parent, child)` to share the parent's KV pages."""
        child = Sequence(
            self.prompt_token_ids,
            self.max_tokens,
            seq_id=seq_id,
            group_id=self.group_id,
            sampling_params=self.sampling_params,
        )
        child.output_token_ids = list(self.output_token_ids)
        child.lora = self.lora
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, group={self.group_id}, {self.status.name}, "
            f"tokens={self.num_prompt_tokens}+{self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"pages={self.page_table})"
        )


class TokenView:
    """A read-only view of a sequence's prompt + output tokens: `view[i]` and `view[lo:hi]` cost
    O(1) and O(hi - lo), where `seq.token_ids` copies every token."""

    __slots__ = ("_seq",)

    def __init__(self, seq: Sequence):
        self._seq = seq

    def __len__(self) -> int:
        return self._seq.num_tokens

    def __getitem__(self, key):
        prompt, output = self._seq.prompt_token_ids, self._seq.output_token_ids
        n = len(prompt)
        if isinstance(key, slice):
            lo, hi, step = key.indices(n + len(output))
            if step != 1:
                return self._seq.token_ids[key]
            if hi <= n:
                return prompt[lo:hi]
            if lo >= n:
                return output[lo - n:hi - n]
            return prompt[lo:] + output[:hi - n]
        if key < 0:
            key += n + len(output)
        return prompt[key] if key < n else output[key - n]
