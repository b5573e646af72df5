"""What the scheduler is configured with and what one of its steps gives the engine: the
configuration (`SchedulerConfig`), the persistent batch's rows a step may start from
(`BatchRows`), a sequence's share of a step (`ScheduledSeq`), the step (`SchedulerOutput`) and
the queues' figures (`SchedulerStats`). Pure Python (no jax); the policy that fills them is
scheduler.py's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence as Seq
from typing import NamedTuple

from paxpage.page_manager import cdiv
from paxpage.sequence import Sequence

_POSITIVE_FIELDS = ("num_pages", "page_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    num_pages: int  # P: KV pages in the pool
    page_size: int  # tokens per page
    max_num_seqs: int  # max sequences scheduled in one step (batch rows)
    max_num_batched_tokens: int  # token budget of one step
    max_model_len: int  # max prompt + output tokens of one sequence
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = True
    allocation: str = "paged"  # "paged" | "contiguous" (reserve max_model_len tokens at admission)
    # W when every model layer attends only to its last W keys: pages before it are released.
    sliding_window: int | None = None
    # Prefill rows per step (None: no limit); a chunk of q > 1 tokens takes cdiv(q, prefill_row_len).
    max_prefill_rows: int | None = None
    prefill_row_len: int = 1

    def __post_init__(self):
        for name in _POSITIVE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} is {value!r}; must be an int >= 1")
        rows = self.max_prefill_rows
        if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 1):
            raise ValueError(f"max_prefill_rows is {rows!r}; must be None or an int >= 1")
        if not isinstance(self.prefill_row_len, int) or self.prefill_row_len < 1:
            raise ValueError(f"prefill_row_len is {self.prefill_row_len!r}; must be an int >= 1")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window is {self.sliding_window!r}; must be None or an int >= 1")
        if self.allocation not in ("paged", "contiguous"):
            raise ValueError(f"allocation is {self.allocation!r}; must be 'paged' or 'contiguous'")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens is {self.max_num_batched_tokens}; without chunked prefill it must be "
                f">= max_model_len ({self.max_model_len}) so every sequence can be prefilled in one step"
            )
        if self.allocation == "contiguous" and self.num_pages < self.max_pages_per_seq:
            raise ValueError(
                f"num_pages is {self.num_pages}; contiguous allocation needs >= {self.max_pages_per_seq} "
                f"(max_model_len {self.max_model_len} / page_size {self.page_size})"
            )

    @property
    def max_pages_per_seq(self) -> int:
        """Width of a page table: no sequence ever holds more pages."""
        return cdiv(self.max_model_len, self.page_size)

    @property
    def releases_pages(self) -> bool:
        return self.sliding_window is not None and self.allocation == "paged"

    def max_held_pages(self, num_tokens: int) -> int:
        """Most pages a sequence of num_tokens tokens holds at once: with window release, the
        window before a step's first token plus the step's chunk (and one for misalignment)."""
        pages = cdiv(num_tokens, self.page_size)
        if self.releases_pages:
            pages = min(pages, cdiv(self.sliding_window - 1 + self.max_num_batched_tokens, self.page_size) + 1)
        return pages


class BatchRows(NamedTuple):
    """The persistent batch's rows (decode_batch.py) as `Scheduler.schedule` takes them."""

    seqs: list[Sequence]  # the rows' sequences, each decoding one token, in the running queue's order
    aligned: Seq[int]  # indices of those whose next token starts a page (the only ones that may need one)
    admits: Callable[[Sequence], bool] | None = None  # whether a waiting sequence may join (None: none may)
    prefilling: Seq[Sequence] = ()  # the sequences behind the rows in the queue, part way through their prompts


class ScheduledSeq(NamedTuple):  # immutable; a NamedTuple builds ~5x faster than a frozen dataclass
    seq: Sequence
    num_new_tokens: int  # q_len: tokens computed this step, positions [start, start + num_new_tokens)
    start: int  # seq.num_computed_tokens before this step
    samples: bool  # this chunk reaches the end of seq's tokens: sample the next token from its last row
    # speculative decoding: draft tokens computed after seq's last token (positions num_tokens ...)
    draft_token_ids: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclasses.dataclass
class SchedulerOutput:
    """A step's changes: what runs, what is copied, what was preempted. A step that continues the
    persistent batch (`Scheduler.schedule` with its `BatchRows`) lists its rows apart, as
    `decodes`, by reference: each computes and samples one token, and `scheduled` then holds only
    the chunks behind them."""

    scheduled: list[ScheduledSeq]
    copies: list[tuple[int, int]]  # CoW (src_page, dst_page), to run on device BEFORE the step, in order
    preempted: list[Sequence]
    num_batched_tokens: int
    decodes: Seq[Sequence] = ()  # the batch's rows, ahead of `scheduled` in the running queue
    grown: list[int] = dataclasses.field(default_factory=list)  # indices of `decodes` given a page

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_hit_rate: float  # hit tokens / looked-up tokens over all admissions
    kv_utilization: float  # computed tokens held / (used pages * page_size); shared pages counted once
    num_used_pages: int
    num_free_pages: int  # free + evictable cached
    num_cached_pages: int  # registered in the prefix cache
