"""A scheduled step's rows, as the packer and the sampler take them: the logits-row plan.

`plan_step` turns the scheduler's output into one `RowPlan` per scheduled sequence (packing.py
lays them out) and, per sampling entry (request, sample, first logits row), the logits rows it
draws from: one for a plain row, n for a request forking its samples (row i draws with seed +
i), 1 + drafts for a verify row (its j-th logits row sees its first j drafts as outputs, for
penalties and min_tokens). Each logits row gets its sampling slot (sampling/batch.py), seed
offset and output-token count. An embedding request's chunk has no logits row; its last chunks
may pool hidden states. Pure Python on the host.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from paxpage.launched import PENDING_TOKEN
from paxpage.packing import RowPlan


@dataclasses.dataclass
class StepPlan:
    plans: list[RowPlan]  # one per scheduled sequence, in the scheduler's order
    rows: list  # (request, sample, first logits row) per sampling entry
    counts: list[int]  # logits rows of each entry
    drafts: list[tuple[int, ...]]  # each entry's drafts (() for none)
    slots: np.ndarray  # i64[R] sampling slot per logits row
    offsets: np.ndarray  # i64[R] seed offset per logits row
    steps: np.ndarray  # i64[R] output tokens each logits row has seen
    num_logprobs: int  # the widest top-logprobs any entry asks for (not bucketed)
    pooling: list  # (embedding request, chunk start, last chunk, pooled row)

    def __post_init__(self):
        self._first_rows = [row for _, _, row in self.rows]

    def row_tokens(self, r: int):
        """(prompt, outputs) that logits row r sees, for its penalties."""
        k = bisect.bisect_right(self._first_rows, r) - 1
        request, sample, first = self.rows[k]
        out, i = sample.seq.output_token_ids, r - first
        drafts = self.drafts[k]
        return request.prompt_ids, (out + list(drafts[:i]) if drafts and i else out)


def plan_step(sched, lookup, embeds: dict, sampling, inflight_rows: dict[int, int]) -> StepPlan:
    """The rows of `sched` (a SchedulerOutput). `lookup(seq_id)`: a sequence's (request, sample);
    `embeds`: live embedding requests by request id; `sampling`: the SamplingBatch whose slots
    the rows take; `inflight_rows`: seq_id -> logits row of the step in flight, for sequences
    whose last token it is still computing."""
    plans, rows, counts, row_drafts = [], [], [], []
    slots, offsets, steps = [], [], []
    num_logprobs = 0
    pooling = []
    for item in sched.scheduled:
        seq = item.seq
        embed = embeds.get(seq.group_id)
        if embed is not None:  # an embedding's chunk: no logits row, maybe a pooled row
            row = len(pooling) if embed.pools(item.start, item.end) else -1
            plans.append(RowPlan(seq.tokens, seq.page_table, item.start, item.num_new_tokens, 0, 0,
                                 seq.seq_id, seq.num_preemptions, pool_row=row,
                                 pool_from=embed.pooling.first_pooled(len(embed.prompt_ids))))
            if row >= 0:
                pooling.append((embed, item.start, item.end == seq.num_prompt_tokens, row))
            continue
        request, sample = lookup(seq.seq_id)
        drafts = item.draft_token_ids
        if drafts:  # verify row: its last token and drafts, a logits row at each
            num_samples = 1 + len(drafts)
            plans.append(RowPlan(seq.token_ids + list(drafts), seq.page_table, item.start,
                                 item.num_new_tokens, num_samples, 0, seq.seq_id,
                                 seq.num_preemptions, num_drafts=len(drafts), lora_slot=seq.lora_slot))
        else:
            fork_now = item.samples and not request.forked
            wants_prompt = sample.prompt_logprobs is not None and item.start < seq.num_prompt_tokens
            pending = item.num_new_tokens == 1 and seq.last_token_id == PENDING_TOKEN
            num_samples = (request.params.n if fork_now else 1) if item.samples else 0
            plans.append(RowPlan(seq.tokens, seq.page_table, item.start, item.num_new_tokens, num_samples,
                                 seq.num_prompt_tokens if wants_prompt else 0, seq.seq_id,
                                 seq.num_preemptions, inflight_rows[seq.seq_id] if pending else -1,
                                 lora_slot=seq.lora_slot))
        if not num_samples:
            continue
        rows.append((request, sample, len(slots)))
        counts.append(num_samples)
        row_drafts.append(drafts)
        num_logprobs = max(num_logprobs, request.params.logprobs or 0)
        slot = sampling.slot(seq.seq_id, request.params, sample.seed)
        num_out = seq.num_output_tokens
        if num_samples == 1:
            slots.append(slot)
            offsets.append(0)
            steps.append(num_out)
        else:
            slots += [slot] * num_samples
            offsets += [0] * num_samples if drafts else range(num_samples)
            steps += range(num_out, num_out + num_samples) if drafts else [num_out] * num_samples
    as_array = lambda values: np.asarray(values, np.int64)  # noqa: E731
    return StepPlan(plans, rows, counts, row_drafts, as_array(slots), as_array(offsets), as_array(steps),
                    num_logprobs, pooling)
