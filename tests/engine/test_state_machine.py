"""Random interleavings of add / schedule / update / fork / abort / finish against a simulated device.

The fake device stores, for every (page, offset) it writes, the token prefix that position's K/V would depend
on. Before each step it checks that every position a sequence attends to (< start) holds that sequence's own
prefix, so a wrong copy-on-write, prefix-cache hit, fork or eviction shows up as a K/V mismatch. After every
rule the scheduler's invariants hold and no sequence has lost a token.
"""

import random

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from paxpage.page_manager import cdiv
from paxpage.scheduler import Scheduler, SchedulerConfig
from paxpage.sequence import Sequence, SequenceStatus

VOCAB = st.integers(0, 2)  # tiny vocabulary: prompts share prefixes often
MAX_LIVE = 12
PICK = st.integers(0, 2**16)  # index into a current list, modulo its length


def fake_sample(seq: Sequence) -> int:
    return hash((seq.seq_id, seq.num_tokens)) % 3


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.integers(1, 4),
        extra_pages=st.integers(-2, 8),
        max_num_seqs=st.integers(1, 4),
        budget=st.integers(1, 12),
        max_model_len=st.integers(2, 16),
        prefix=st.booleans(),
        chunked=st.booleans(),
        contiguous=st.booleans(),
    )
    def setup(self, page_size, extra_pages, max_num_seqs, budget, max_model_len, prefix, chunked, contiguous):
        # around one max-length sequence's worth of pages: small pools force preemption and eviction
        num_pages = max(1, cdiv(max_model_len, page_size) + extra_pages)
        if not chunked:
            budget = max(budget, max_model_len)
        if contiguous:
            num_pages = max(num_pages, cdiv(max_model_len, page_size))
        self.s = Scheduler(
            SchedulerConfig(
                num_pages=num_pages,
                page_size=page_size,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=max_model_len,
                enable_prefix_caching=prefix,
                enable_chunked_prefill=chunked,
                allocation="contiguous" if contiguous else "paged",
            )
        )
        self.kv: dict[int, dict[int, tuple[int, ...]]] = {}  # page -> offset -> token prefix of that K/V
        self.expected: dict[int, list[int]] = {}  # seq_id -> tokens it must have
        self.all_seqs: list[Sequence] = []
        self.prompts: list[list[int]] = []
        self.pending = None  # output scheduled and run on the device, not yet update()d
        self.next_id = 0

    # ---- helpers ------------------------------------------------------------------------------------
    def live(self) -> list[Sequence]:
        return self.s.running + list(self.s.waiting)

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def try_add(self, prompt: list[int], max_tokens: int) -> None:
        seq = Sequence(prompt, max_tokens, seq_id=self.new_id())
        cfg = self.s.config
        total = len(prompt) + max_tokens
        if total <= cfg.max_model_len and cdiv(total, cfg.page_size) <= cfg.num_pages:
            self.s.add(seq)
            self.expected[seq.seq_id] = list(prompt)
            self.all_seqs.append(seq)
            self.prompts.append(prompt)
        else:
            with pytest.raises(ValueError, match=str(total)):
                self.s.add(seq)
            assert self.s.get(seq.seq_id) is None

    # ---- rules --------------------------------------------------------------------------------------
    @rule(prompt=st.lists(VOCAB, min_size=1, max_size=10), max_tokens=st.integers(1, 5))
    def add(self, prompt, max_tokens):
        if len(self.live()) < MAX_LIVE:
            self.try_add(prompt, max_tokens)

    @rule(pick=PICK, cut=PICK, extra=st.lists(VOCAB, max_size=4), max_tokens=st.integers(1, 4))
    def add_shared_prefix(self, pick, cut, extra, max_tokens):
        if not self.prompts or len(self.live()) >= MAX_LIVE:
            return
        base = self.prompts[pick % len(self.prompts)]
        self.try_add(base[: 1 + cut % len(base)] + extra, max_tokens)

    @rule(num_steps=st.integers(1, 4))
    def steps(self, num_steps):
        """Engine iterations; the last one stays pending so abort/finish can land between schedule and update."""
        for _ in range(num_steps):
            self.flush()
            self.schedule()

    @rule()
    def flush(self):
        if self.pending is not None:
            self.update()

    def schedule(self):
        cfg, ps = self.s.config, self.s.config.page_size
        before = {s.seq_id: s.num_computed_tokens for s in self.live()}
        out = self.s.schedule()
        ids = [x.seq.seq_id for x in out.scheduled]
        assert len(set(ids)) == len(ids) <= cfg.max_num_seqs
        assert out.num_batched_tokens == sum(x.num_new_tokens for x in out.scheduled) <= cfg.max_num_batched_tokens
        for x in out.scheduled:
            seq = x.seq
            assert x.num_new_tokens >= 1 and x.end <= seq.num_tokens
            assert x.samples == (x.end == seq.num_tokens)
            assert x.start == seq.num_computed_tokens
            assert len(seq.page_table) * ps >= x.end
            if seq.seq_id in before and seq not in out.preempted and x.start != before[seq.seq_id]:
                assert before[seq.seq_id] == 0 and seq.num_cached_tokens == x.start  # admitted with hits
        for seq in out.preempted:
            assert seq.status is SequenceStatus.WAITING and seq.seq_id not in ids
        # device: CoW copies first (all reads before writes), then attention reads, then the K/V writes
        dsts = [d for _, d in out.copies]
        assert len(set(dsts)) == len(dsts)
        self.kv.update({d: dict(self.kv.get(src, {})) for src, d in out.copies})
        for x in out.scheduled:
            toks = x.seq.token_ids
            for pos in range(x.start):
                page = x.seq.page_table[pos // ps]
                got = self.kv.get(page, {}).get(pos % ps)
                assert got == tuple(toks[: pos + 1]), f"{x.seq} position {pos} page {page}: K/V of {got}"
        for x in out.scheduled:
            toks = x.seq.token_ids
            for pos in range(x.start, x.end):
                self.kv.setdefault(x.seq.page_table[pos // ps], {})[pos % ps] = tuple(toks[: pos + 1])
        for name, happened in (
            ("preemption", out.preempted),
            ("cow copy", out.copies),
            ("prefix hit", [x for x in out.scheduled if x.start and x.start == x.seq.num_cached_tokens]),
            ("chunked prefill", [x for x in out.scheduled if not x.samples]),
        ):
            if happened and currently_in_test_context():
                event(name)
        self.pending = out

    def update(self):
        out, self.pending = self.pending, None
        sampled = {x.seq.seq_id: fake_sample(x.seq) for x in out.scheduled if x.samples}
        was_live = {x.seq.seq_id for x in out.scheduled if self.s.get(x.seq.seq_id) is x.seq}
        self.s.update(out, sampled)
        for x in out.scheduled:
            seq = x.seq
            if seq.seq_id not in was_live:
                continue
            if x.samples:
                self.expected[seq.seq_id].append(sampled[seq.seq_id])
            if seq.num_output_tokens == seq.max_tokens:
                self.s.finish(seq, "length")

    @rule(pick=PICK, diverge=st.booleans())
    def fork(self, pick, diverge):
        self.flush()  # the fork contract: after update(), not between schedule() and update()
        if not self.live() or len(self.live()) >= MAX_LIVE:
            return
        parents = self.s.running or self.live()  # running parents exercise copy-on-write
        parent = parents[pick % len(parents)]
        child = parent.clone(seq_id=self.new_id())
        if diverge and child.output_token_ids:  # last token is uncomputed: another sample may replace it
            child.output_token_ids[-1] = (child.output_token_ids[-1] + 1) % 3
        self.s.fork(parent, child)
        assert child.group_id == parent.group_id and child.status is parent.status
        self.expected[child.seq_id] = child.token_ids
        self.all_seqs.append(child)

    @rule(pick=PICK)
    def abort(self, pick):
        ids = [s.seq_id for s in self.live()] + [10_000]
        seq_id = ids[pick % len(ids)]
        seq = self.s.abort(seq_id)
        if seq_id == 10_000:
            assert seq is None
        else:
            assert (seq.status, seq.finish_reason, seq.page_table) == (SequenceStatus.FINISHED, "abort", [])

    @rule(pick=PICK)
    def finish(self, pick):
        if not self.live():
            return
        seq = self.live()[pick % len(self.live())]
        self.s.finish(seq, "stop")
        assert seq.status is SequenceStatus.FINISHED and seq.page_table == []

    # ---- checks -------------------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "s"):
            return
        self.s.check_invariants()
        for seq in self.live():
            assert seq.token_ids == self.expected[seq.seq_id], f"{seq} lost tokens"
        # KV utilisation (the scheduler counts it per sequence while no page is shared) equals
        # the count over pages: each held page's computed tokens once, shared or not
        ps, fill = self.s.config.page_size, {}
        for seq in self.s.running:
            for i, page in enumerate(seq.page_table):
                fill[page] = max(fill.get(page, 0), min(ps, max(0, seq.num_computed_tokens - i * ps)))
        used = self.s.page_manager.num_used_pages
        assert self.s.stats().kv_utilization == (sum(fill.values()) / (used * ps) if used else 0.0)

    def teardown(self):
        if not hasattr(self, "s"):
            return
        for _ in range(5_000):
            if self.pending is not None:
                self.update()
            if not self.s.has_unfinished():
                break
            self.schedule()
            self.s.check_invariants()
        else:
            raise AssertionError(f"not done after 5000 steps: {self.s._describe()}")
        pm = self.s.page_manager
        pm.check_invariants([])
        assert pm.num_used_pages == 0 and pm.num_free_pages == pm.num_pages
        assert pm.num_evictable_pages == pm.num_cached_pages  # what is left cached is evictable
        for seq in self.all_seqs:
            assert seq.status is SequenceStatus.FINISHED and seq.page_table == []
            assert seq.token_ids == self.expected[seq.seq_id]
            if seq.finish_reason == "length":
                assert seq.num_output_tokens == seq.max_tokens


@pytest.mark.parametrize("seed", range(60))
def test_long_random_runs(seed):
    """Depth the shrinking machine below rarely reaches: 600 weighted random rules per run, same checks."""
    rng = random.Random(seed)
    m = SchedulerMachine()
    m.setup(
        page_size=rng.randint(1, 4),
        extra_pages=rng.randint(-2, 8),
        max_num_seqs=rng.randint(1, 4),
        budget=rng.randint(1, 12),
        max_model_len=rng.randint(2, 16),
        prefix=rng.random() < 0.5,
        chunked=rng.random() < 0.7,
        contiguous=rng.random() < 0.2,
    )
    vocab = lambda n: [rng.randint(0, 2) for _ in range(n)]  # noqa: E731
    pick = lambda: rng.randint(0, 2**16)  # noqa: E731
    ops = [
        (5, lambda: m.add(vocab(rng.randint(1, 10)), rng.randint(1, 5))),
        (4, lambda: m.add_shared_prefix(pick(), pick(), vocab(rng.randint(0, 4)), rng.randint(1, 4))),
        (10, lambda: m.steps(rng.randint(1, 4))),
        (1, m.flush),
        (2, lambda: m.fork(pick(), rng.random() < 0.5)),
        (1, lambda: m.abort(pick())),
        (1, lambda: m.finish(pick())),
    ]
    weights = [w for w, _ in ops]
    for _ in range(600):
        rng.choices(ops, weights)[0][1]()
        m.consistent()
    m.teardown()


# Runs after the random runs above, which fail fast; shrinking a failure here can take minutes.
SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_scheduler_state_machine = SchedulerMachine.TestCase
