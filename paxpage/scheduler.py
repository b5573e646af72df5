"""Continuous-batching scheduler with a vLLM-v1 style token budget. Pure Python (no jax).

One engine iteration:
    out = scheduler.schedule()          # which sequences run, how many tokens each, CoW copies
    ... device: run out.copies, then the step over out.scheduled, sample a token for each row with samples=True
    scheduler.update(out, {seq_id: token})   # advance num_computed_tokens, cache full pages, append tokens
    ... engine: scheduler.finish(seq, "stop" | "length") for sequences that are done

Parallel sampling (n > 1): when a prompt's last chunk samples n tokens from one logits row, the engine passes
the first to update(), then for each other token t: child = parent.clone(); child.output_token_ids[-1] = t;
scheduler.fork(parent, child). The children share the prompt's pages; the partial last page is copied on write.

Decisions (see tests/engine/test_scheduler.py):
- Order: RUNNING sequences first, in admission order (forked children sit right after their parent's group),
  then WAITING ones in FIFO order (head-of-line blocking: admission stops at the first that does not fit).
- Token budget: each scheduled sequence costs its new tokens (decode 1). With chunked prefill (default) an
  unfinished prefill gets min(remaining, budget left). Without it a prefill runs whole or waits; the config then
  requires max_num_batched_tokens >= max_model_len, so any admissible sequence fits one step alone.
- At most max_num_seqs sequences are scheduled per step; admission also stops at max_num_seqs running.
- Prefill rows (`max_prefill_rows` set): the runner lays a chunk of q > 1 tokens out as cdiv(q, prefill_row_len)
  rows of prefill_row_len tokens, and a step holds at most max_prefill_rows of them, so the step shapes stay
  few (each short prompt is its own row). A chunk is cut to the rows left; a running prefill that gets no row
  waits for the next step (decodes behind it still run); admission stops at the first prompt that gets none.
- Preemption (recompute): when a running sequence cannot get its pages, the most recently admitted running
  sequence (the last in order, possibly itself) is preempted: pages freed (cached full pages stay evictable),
  num_computed_tokens = 0, tokens kept, put at the FRONT of the waiting queue. A step that preempted admits
  nothing. Preempting one member of a fork group is fine: each sequence keeps its own tokens and is recomputed
  alone (sharing with the group is lost, correctness is not).
- contiguous allocation (memory baseline): admission reserves pages for max_model_len tokens at once.
- Sliding window (`sliding_window` W set: every layer of the model sees only its last W keys; paged
  allocation only): after each step a sequence's pages wholly before the window of its next token are
  released (PageManager.release_outside_window), so it holds at most cdiv(W - 1 + chunk, page_size) + 1
  pages, and a sequence fits the pool when that bound does, however long it is.
- Speculative decoding: schedule(drafts={seq_id: draft tokens}) runs a decoding sequence with drafts as one
  row of 1 + d tokens (its last token, then the drafts), pages allocated for all of them. Drafts are cut to the
  token budget and dropped when their pages do not fit (a draft never preempts anything). update() then gets
  the accepted tokens of that row (a list: accepted drafts + one target token): num_computed_tokens counts the
  last token and the accepted drafts only, and pages wholly past it, which hold only rejected K/V, are freed
  (rollback). K/V of rejected positions in a kept page lies past the sequence's length, is never read and is
  overwritten next step; such a page is not full-and-computed, so the prefix cache never registers it.
- Progress: if nothing was scheduled or preempted while work remains, that is a bug -> RuntimeError.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping, Sequence as Seq

from paxpage.page_manager import PageManager, cdiv
from paxpage.scheduler_types import BatchRows, ScheduledSeq, SchedulerConfig, SchedulerOutput, SchedulerStats
from paxpage.sequence import Sequence, SequenceStatus

__all__ = ["BatchRows", "Scheduler", "ScheduledSeq", "SchedulerConfig", "SchedulerOutput", "SchedulerStats"]

class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.page_manager = PageManager(config.num_pages, config.page_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0
        self._live: dict[int, Sequence] = {}  # seq_id -> waiting or running sequence
        # ids of running sequences whose last page, not full, a fork shares and that have not
        # written since: their next write copies it (the batch's step looks at them, as at the
        # sequences whose next token starts a page)
        self._shared_tails: set[int] = set()
        self._arrivals = itertools.count()
        self._reserve_tokens = config.max_model_len if config.allocation == "contiguous" else 0
        # LoRA (paxpage/lora_slots.py): a sequence with an adapter is admitted only once its
        # adapter holds a slot of the device slab; it keeps the slot until it finishes.
        self.lora_slots = None

    # ---- queries ------------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def get(self, seq_id: int) -> Sequence | None:
        return self._live.get(seq_id)

    def stats(self) -> SchedulerStats:
        pm, ps = self.page_manager, self.config.page_size
        # A sequence's pages hold its computed tokens past the released ones (its table covers
        # them, and released entries are its first ones); a shared page counts once, so the
        # tokens its other holders count are taken off (PageManager.num_excess_tokens): O(1) per
        # sequence, not O(pages).
        total = sum(max(0, seq.num_computed_tokens - seq.num_released_pages * ps) for seq in self.running)
        total -= pm.num_excess_tokens
        used = pm.num_used_pages
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            prefix_hit_rate=pm.hit_rate,
            kv_utilization=total / (used * ps) if used else 0.0,
            num_used_pages=used,
            num_free_pages=pm.num_free_pages,
            num_cached_pages=pm.num_cached_pages,
        )

    # ---- requests -----------------------------------------------------------------------------------
    def _check_fits(self, seq: Sequence) -> None:
        cfg = self.config
        total = seq.num_prompt_tokens + seq.max_tokens
        if total > cfg.max_model_len:
            raise ValueError(
                f"sequence {seq.seq_id}: prompt has {seq.num_prompt_tokens} tokens + max_tokens {seq.max_tokens} "
                f"= {total}; max_model_len is {cfg.max_model_len}"
            )
        pages = cfg.max_held_pages(total)
        if pages > cfg.num_pages:
            raise ValueError(
                f"sequence {seq.seq_id}: {total} tokens need {pages} pages of {cfg.page_size}; "
                f"the cache has {cfg.num_pages} pages"
            )
        if seq.num_output_tokens > seq.max_tokens:
            raise ValueError(
                f"sequence {seq.seq_id} has {seq.num_output_tokens} output tokens; max_tokens is {seq.max_tokens}"
            )

    def _check_fresh(self, seq: Sequence) -> None:
        if seq.seq_id in self._live:
            raise ValueError(f"seq_id {seq.seq_id} is already scheduled")
        if seq.status is not SequenceStatus.WAITING or seq.page_table or seq.num_computed_tokens:
            raise ValueError(f"{seq} is not fresh (WAITING, no pages, nothing computed)")

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (FIFO). ValueError at once if it can never fit."""
        self._check_fresh(seq)
        self._check_fits(seq)
        seq.arrival = next(self._arrivals)
        self.waiting.append(seq)
        self._live[seq.seq_id] = seq

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child (fresh, e.g. parent.clone() with its own last token) shares parent's pages and computed tokens
        and joins parent's queue right after parent's group. Call it after update(), not between schedule()
        and update(). child.token_ids must equal parent's over parent's computed tokens."""
        if self._live.get(parent.seq_id) is not parent:
            raise ValueError(f"fork parent {parent.seq_id} is not waiting or running")
        self._check_fresh(child)
        self._check_fits(child)
        nc = parent.num_computed_tokens
        if child.num_tokens <= nc or child.token_ids[:nc] != parent.token_ids[:nc]:
            raise ValueError(
                f"fork child {child.seq_id} ({child.num_tokens} tokens) must extend parent {parent.seq_id}'s "
                f"{nc} computed tokens by at least one token"
            )
        child.group_id = parent.group_id
        child.lora = parent.lora
        if parent.lora_slot >= 0:
            child.lora_slot = parent.lora_slot
            self.lora_slots.retain(child.lora_slot)
        child.arrival = next(self._arrivals)
        queue = self.running if parent.status is SequenceStatus.RUNNING else self.waiting
        idx = queue.index(parent) + 1
        while idx < len(queue) and queue[idx].group_id == parent.group_id:
            idx += 1
        if parent.status is SequenceStatus.RUNNING:
            self.page_manager.fork(parent, child)
            if parent.num_computed_tokens % self.config.page_size:
                self._shared_tails.update((parent.seq_id, child.seq_id))
            child.status = SequenceStatus.RUNNING
        queue.insert(idx, child)
        self._live[child.seq_id] = child

    def finish(self, seq: Sequence, reason: str) -> None:
        """Engine decided seq is done: free its pages, FINISHED."""
        if self._live.get(seq.seq_id) is not seq:
            raise ValueError(f"sequence {seq.seq_id} is not waiting or running ({seq.status.name})")
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.page_manager.release(seq)
        if seq.lora_slot >= 0:
            self.lora_slots.release(seq.lora_slot)
            seq.lora_slot = -1
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._live[seq.seq_id]
        self._shared_tails.discard(seq.seq_id)

    def abort(self, seq_id: int) -> Sequence | None:
        """Finish a waiting or running sequence with reason "abort"; None if unknown or already finished."""
        seq = self._live.get(seq_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def abort_group(self, group_id: int) -> list[Sequence]:
        seqs = [s for s in self._live.values() if s.group_id == group_id]
        for seq in seqs:
            self.finish(seq, "abort")
        return seqs

    # ---- the step -----------------------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        self._shared_tails.discard(seq.seq_id)
        self.running.remove(seq)
        self.page_manager.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _chunk(self, q: int, budget: int, rows_left: int) -> int:
        """How many of a sequence's q uncomputed tokens run this step: cut to the token budget
        left (without chunked prefill a prefill that does not fit runs whole later) and to the
        prefill rows left (a decode, q = 1, takes none). 0: it waits for a later step."""
        cfg = self.config
        if q > budget:
            if not cfg.enable_chunked_prefill:
                return 0
            q = budget
        if q == 1 or cfg.max_prefill_rows is None:
            return q
        return min(q, rows_left * cfg.prefill_row_len)

    def _rows(self, q: int) -> int:
        return cdiv(q, self.config.prefill_row_len) if q > 1 else 0

    def schedule(self, drafts: Mapping[int, Seq[int]] | None = None, batch: BatchRows | None = None
                 ) -> SchedulerOutput:
        """The step: which sequences run and how many tokens each, the copies, the preempted.

        drafts: speculative decoding's draft tokens per decoding seq_id (see the module docstring).
        batch: the rows of the persistent batch the step in flight left (decode_batch.py). When
        they can go on as they are (`_batch_step`), they are scheduled in bulk, a few Python
        operations per row, and listed as the output's `decodes`; every other sequence, or all
        of them when the rows cannot go on, is scheduled one by one. The step is the same
        either way."""
        if batch is not None and not drafts:
            step = self._batch_step(batch)
            if step is not None:
                return step
        cfg, pm = self.config, self.page_manager
        drafts = drafts or {}
        budget = cfg.max_num_batched_tokens
        rows_left = cfg.max_prefill_rows or 0  # only read when max_prefill_rows is set
        scheduled: list[ScheduledSeq] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []

        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < cfg.max_num_seqs:
            seq = self.running[i]
            q = seq.num_uncomputed_tokens
            assert q >= 1, f"running {seq} has nothing to compute; update() must append its sampled token"
            if q == 1 and not (drafts and drafts.get(seq.seq_id)) and pm.writes_in_place(seq):
                # a decode whose token fits a page it owns: no allocation, no copy, no prefill row
                scheduled.append(ScheduledSeq(seq, 1, seq.num_computed_tokens, True))
                budget -= 1
                i += 1
                continue
            draft = tuple(drafts.get(seq.seq_id, ()))[:budget - 1] if q == 1 else ()
            if draft and cfg.max_prefill_rows is not None and self._rows(1 + len(draft)) > rows_left:
                draft = ()  # a verify row is a prefill row and none is left: a plain decode
            if draft and pm.can_allocate(pm.num_pages_to_write(seq, 1 + len(draft))):
                copies += pm.prepare_write(seq, 1 + len(draft))
                scheduled.append(ScheduledSeq(seq, 1 + len(draft), seq.num_computed_tokens, True, draft))
                budget -= 1 + len(draft)
                rows_left -= self._rows(1 + len(draft))
                i += 1
                continue
            q = self._chunk(q, budget, rows_left)
            if q == 0:
                i += 1  # continues in a later step
                continue
            while not pm.can_allocate(pm.num_pages_to_write(seq, q)):
                victim = self.running[-1]  # most recently admitted; index >= i, so not yet scheduled
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # preempted itself: it was the last running sequence
            copies += pm.prepare_write(seq, q)
            scheduled.append(ScheduledSeq(seq, q, seq.num_computed_tokens, q == seq.num_uncomputed_tokens))
            budget -= q
            rows_left -= self._rows(q)
            i += 1

        if not preempted:
            self._admit(budget, rows_left, scheduled, copies)

        if not scheduled and not preempted and self.has_unfinished():
            raise RuntimeError(f"scheduler made no progress: {self._describe()}")
        if self._shared_tails:  # each scheduled one has written its own page now
            self._shared_tails.difference_update(s.seq.seq_id for s in scheduled)
        num_tokens = sum(s.num_new_tokens for s in scheduled)
        return SchedulerOutput(scheduled, copies, preempted, num_tokens)

    def _admit(self, budget: int, rows_left: int, scheduled: list[ScheduledSeq], copies: list[tuple[int, int]]
               ) -> None:
        """Admits waiting sequences in FIFO order while the token budget, the prefill rows, the
        pages and the LoRA slots allow, appending each one's first chunk to `scheduled` (and its
        page writes to `copies`)."""
        cfg, pm = self.config, self.page_manager
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            hits = pm.match_prefix(seq)
            num_hit = len(hits) * cfg.page_size
            q = seq.num_tokens - num_hit
            q = self._chunk(q, budget, rows_left)
            if q == 0:
                break
            num_new = max(0, pm.num_pages_for(max(num_hit + q, self._reserve_tokens)) - len(hits))
            if not pm.can_allocate(pm.num_revived(hits) + num_new):
                break
            if seq.lora is not None and seq.lora_slot < 0:
                slot = self.lora_slots.acquire(seq.lora)
                if slot is None:  # every slot runs another adapter: wait for one to be released
                    break
                seq.lora_slot = slot
            self.waiting.popleft()
            pm.acquire_prefix(seq, hits)
            copies += pm.prepare_write(seq, q, self._reserve_tokens)  # own fresh pages: never copies
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, q, num_hit, q == seq.num_uncomputed_tokens))
            budget -= q
            rows_left -= self._rows(q)

    def update(self, output: SchedulerOutput, sampled_tokens: Mapping[int, int | Seq[int]],
               decode_token: int | None = None) -> None:
        """After the device step: advance num_computed_tokens, cache newly full pages, and append the sampled
        token of every scheduled sequence with samples=True (sampled_tokens[seq_id]; a row that carried
        drafts gets a list: its accepted drafts, then the target's token). The batch's rows
        (`output.decodes`, from a batch step) each computed one token and get `decode_token`
        (async scheduling's placeholder), in O(1) per row. Sequences finished or aborted since the
        step was scheduled are skipped. Validates everything before changing anything."""
        if output.decodes and decode_token is None:
            raise ValueError(f"{len(output.decodes)} batch rows decoded and no decode_token was given")
        sampling = {s.seq.seq_id for s in output.scheduled if s.samples}
        unexpected = sorted(set(sampled_tokens) - sampling)
        if unexpected:
            raise ValueError(f"sampled tokens for seq_ids {unexpected}, which did not sample this step")
        live = [s for s in output.scheduled if self._live.get(s.seq.seq_id) is s.seq]
        for s in live:
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens != s.start:
                raise ValueError(f"stale output for {seq} (start {s.start}); update() called twice?")
            if s.samples and seq.seq_id not in sampled_tokens:
                raise ValueError(f"no sampled token for seq_id {seq.seq_id}")
            if s.draft_token_ids:
                tokens = sampled_tokens[seq.seq_id]
                if not 1 <= len(tokens) <= 1 + len(s.draft_token_ids) or \
                        list(tokens[:-1]) != list(s.draft_token_ids[:len(tokens) - 1]):
                    raise ValueError(f"seq_id {seq.seq_id}: tokens {tokens} are no accepted prefix of its drafts "
                                     f"{s.draft_token_ids} plus one token")
                if seq.num_output_tokens + len(tokens) > seq.max_tokens:
                    raise ValueError(f"sequence {seq.seq_id}: {len(tokens)} more tokens pass max_tokens {seq.max_tokens}")
            elif s.samples and seq.num_output_tokens >= seq.max_tokens:
                raise ValueError(
                    f"sequence {seq.seq_id} already has {seq.num_output_tokens} output tokens; max_tokens is "
                    f"{seq.max_tokens}; finish() it"
                )
        if output.decodes:  # ahead of the scheduled ones in the running queue
            self._update_decodes(output.decodes, decode_token)
        pm, releases = self.page_manager, self.config.releases_pages
        for s in live:
            seq = s.seq
            if s.draft_token_ids:  # the last token and the accepted drafts have their K/V now
                tokens = sampled_tokens[seq.seq_id]
                seq.num_computed_tokens += len(tokens)
                seq.output_token_ids.extend(int(t) for t in tokens)
                if self.config.allocation == "paged":  # rollback: pages holding only rejected K/V
                    self.page_manager.truncate(seq, seq.num_computed_tokens)
            else:
                seq.num_computed_tokens += s.num_new_tokens
                if s.samples:
                    seq.append_token(sampled_tokens[seq.seq_id])
            if pm.enable_prefix_caching:
                pm.cache_full_pages(seq)
            if releases:
                pm.release_outside_window(seq, self.config.sliding_window)

    def _update_decodes(self, seqs: Seq[Sequence], token: int) -> None:
        """update()'s work for the batch's rows, in the same order: a page that just filled is
        cached; with window release, pages that left the window of the next token are freed."""
        live, pm = self._live, self.page_manager
        caches, ps = pm.enable_prefix_caching, self.config.page_size
        window = self.config.sliding_window if self.config.releases_pages else None
        for seq in seqs:
            if live.get(seq.seq_id) is not seq:
                continue
            seq.num_computed_tokens += 1
            seq.output_token_ids.append(token)
            if caches and seq.num_computed_tokens % ps == 0:  # a page just filled
                pm.cache_full_pages(seq)
            if window is not None:
                pm.release_outside_window(seq, window)

    # ---- the persistent batch's rows, in bulk ------------------------------------------------------------
    def _batch_step(self, batch: BatchRows) -> SchedulerOutput | None:
        """The step `schedule` makes, for the persistent batch's rows in O(1) Python per row that
        needs no page: when the running queue is exactly `batch.seqs` (same objects, same order),
        each decoding one token, then `batch.prefilling` (sequences part way through their
        prompts), and the pages all of them need are free, it gives each row the page it writes
        (in queue order, as the one-by-one pass would), the prefilling ones their next chunks,
        then admits waiting sequences with the tokens left. Returns the step as a
        SchedulerOutput whose `decodes` are `batch.seqs` (`grown`: the indices of those whose
        table changed) and whose `scheduled` are the chunks of the prefilling and the admitted
        sequences, in queue order. Returns None, changing nothing, when the step would preempt,
        and when the first waiting sequence, or one the step might admit after it, is one
        `batch.admits` refuses; `schedule` then takes every sequence one by one.

        `batch.aligned`: the indices of the rows whose next token starts a page (num_computed_tokens
        a multiple of page_size); the caller tracks positions in arrays. Every other row writes
        into the page it wrote last step, which it alone holds, but for a fork's parent and
        children before their first write (their shared last page is copied), which the
        scheduler knows; so only those are looked at."""
        cfg, pm = self.config, self.page_manager
        seqs, aligned, admits, prefilling = batch
        n = len(seqs)
        if n + len(prefilling) != len(self.running) or n > cfg.max_num_batched_tokens or n > cfg.max_num_seqs \
                or self.running[:n] != seqs or self.running[n:] != list(prefilling):
            return None  # (Sequence compares by identity)
        if self.waiting and (admits is None or not admits(self.waiting[0])):
            return None
        check = aligned
        if self._shared_tails:  # only in the step after a fork
            shared = self._shared_tails
            check = sorted(set(aligned).union(i for i, seq in enumerate(seqs) if seq.seq_id in shared))
        grow = [i for i in check if not pm.writes_in_place(seqs[i])]
        budget, rows_left = cfg.max_num_batched_tokens - n, cfg.max_prefill_rows or 0
        chunks = []  # (sequence, tokens) of the prefilling ones, as the one-by-one pass takes them
        for seq in prefilling:
            if budget <= 0 or n + len(chunks) >= cfg.max_num_seqs:
                break
            q = self._chunk(seq.num_uncomputed_tokens, budget, rows_left)
            if q == 0:
                continue  # continues in a later step
            chunks.append((seq, q))
            budget -= q
            rows_left -= self._rows(q)
        # Admission takes at most one waiting sequence per seat and per token left, in order:
        # each of those must be one the batch's step may admit, or every sequence goes one by one.
        seats = min(len(self.waiting), cfg.max_num_seqs - len(self.running), budget)
        if seats > 1 and not all(admits(seq) for seq in itertools.islice(self.waiting, 1, seats)):
            return None
        need = sum(pm.num_pages_to_write(seqs[i], 1) for i in grow)
        if need + sum(pm.num_pages_to_write(seq, q) for seq, q in chunks) > pm.num_free_pages:
            return None  # the step preempts
        copies: list[tuple[int, int]] = []
        for i in grow:
            copies += pm.prepare_write(seqs[i], 1)
        scheduled: list[ScheduledSeq] = []
        for seq, q in chunks:
            copies += pm.prepare_write(seq, q)
            scheduled.append(ScheduledSeq(seq, q, seq.num_computed_tokens, q == seq.num_uncomputed_tokens))
        if self.waiting:
            self._admit(budget, rows_left, scheduled, copies)
        self._shared_tails.clear()  # every running sequence has its write now
        return SchedulerOutput(scheduled, copies, [], n + sum(s.num_new_tokens for s in scheduled), seqs, grow)

    # ---- invariants ---------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if queues, sequence states or page accounting are inconsistent."""
        pm = self.page_manager
        seqs = self.running + list(self.waiting)
        pm.check_invariants(seqs)
        ids = [s.seq_id for s in seqs]
        _check(len(set(ids)) == len(ids) and set(ids) == set(self._live), f"queues {ids} vs live {sorted(self._live)}")
        for seq in self.waiting:
            _check(seq.status is SequenceStatus.WAITING, f"{seq} in waiting queue")
            _check(not seq.page_table and seq.num_computed_tokens == 0, f"waiting {seq} holds pages")
        for seq in self.running:
            _check(seq.status is SequenceStatus.RUNNING, f"{seq} in running queue")
            _check(0 <= seq.num_computed_tokens < seq.num_tokens, f"running {seq} has nothing to compute")
            _check(len(seq.page_table) <= self.config.max_pages_per_seq, f"{seq} holds too many pages")
        for seq in seqs:
            _check(seq.num_output_tokens <= seq.max_tokens, f"{seq} is past max_tokens {seq.max_tokens}")

    def _describe(self) -> str:
        pm = self.page_manager
        return (
            f"running={self.running} waiting={list(self.waiting)} free_pages={pm.num_free_pages}/{pm.num_pages} "
            f"config={self.config}"
        )


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise AssertionError(msg)
