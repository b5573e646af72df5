"""The steady decode step (paxpage/decode_batch.py): booked from arrays, it must do exactly what
the general step does. The reference is the same engine with the batch switched off (every
sequence scheduled one by one) on mixed workloads (joins, stops, stop strings, aborts,
preemptions, forks, logprobs, penalties, grammars, a sliding window): every step's deltas and
every final output equal, and the batch's arrays equal a rebuild from the sequences after every
step. The scheduler's side alone: test_batch_step.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import paxpage
from paxpage import EngineConfig, SamplingParams as SP
from paxpage.decode_batch import DecodeBatch
from paxpage.engine import LLMEngine
from paxpage.outputs import StreamDelta
from paxpage.engine_step import EngineStep
from tests.conftest import random_prompts, save_tiny_hf


def test_stream_delta_fast_equals_the_constructor():
    args = (3, "ab", (5, 6), "stop", 1, ({5: -0.5},), "b")
    fast, slow = StreamDelta.fast(*args), StreamDelta(*args)
    assert fast == slow and hash(StreamDelta.fast(3, "", (), None)) == hash(StreamDelta(3, "", (), None))
    assert repr(fast) == repr(slow) and dataclasses.asdict(fast) == dataclasses.asdict(slow)
    assert dataclasses.replace(fast, text="c") == dataclasses.replace(slow, text="c")
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.text = "x"


# ---------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def text_model(tiny_text_dir):
    model = paxpage.load(tiny_text_dir)
    yield model
    model.close()


def _check_batch(engine) -> int:
    """The in-flight decode batch's arrays against a rebuild from its sequences; 0 if none, 2 if
    it has a penalised row, 3 if it has a row of a request with n > 1, else 1."""
    step = engine._step.inflight
    batch = step.decode if step is not None else None
    if batch is None:
        return 0
    batch.check()
    tables = engine.runner.tables
    for i, seq in enumerate(batch.seqs):
        if seq.is_finished:
            continue
        assert batch.table_slots[i] == tables.slot(seq.seq_id)
        # entries a sliding window released are never read again, whatever they hold
        pages = np.asarray(seq.page_table, np.int32)
        held = pages >= 0
        np.testing.assert_array_equal(tables.table[batch.table_slots[i], :len(pages)][held], pages[held])
        request, sample = engine.outputs.lookup(seq.seq_id)
        assert engine._sampling.slot(seq.seq_id, request.params, sample.seed) == batch.sampling_slots[i]
        assert batch.limits[i] == min(request.params.max_tokens,
                                      engine.config.max_model_len - seq.num_prompt_tokens)
    if any(request.params.n > 1 for request, _, _ in batch.rows):
        return 3
    return 1 + any(request.params.repetition_penalty != 1.0 for request, _, _ in batch.rows)


def _run(model, fast: bool, prompts, params, joins, abort_at, stream: bool = True, num_pages: int = 54):
    """Steps an engine through the workload: requests join at their step, one is aborted.
    Returns every step's deltas and the final outputs."""
    config = EngineConfig(page_size=4, num_pages=num_pages, max_model_len=128, max_num_seqs=8,
                          max_num_batched_tokens=32, enable_prefix_caching=True)
    engine = LLMEngine(model.config, model.params, model.tokenizer, config)  # fresh: no cached prefix
    if not fast:
        engine.scheduler._batch_step = lambda batch: None  # every sequence one by one
    # decode batches checked, with a penalised row, with a row of a forked request, with a
    # prompt part way (a chunked prefill) behind its rows, with a row that follows a grammar
    ids, steps, finals, batches = {}, [], {}, [0, 0, 0, 0, 0]
    step = 0
    while step == 0 or engine.has_unfinished() or len(ids) < len(prompts):
        for i, at in enumerate(joins):
            if at == step:
                ids[engine.add_request(prompts[i], params[i], stream=stream)] = i
        if step == abort_at[0]:
            engine.abort(next(r for r, i in ids.items() if i == abort_at[1]))
        out = engine.step()
        steps.append([(ids[r.request_id], [dataclasses.asdict(d) for d in ds]) for r, ds in out])
        for request, _ in out:
            if request.finished:
                o = engine.output(request)
                finals[ids[request.request_id]] = [(c.text, c.token_ids, c.finish_reason, c.stop_reason,
                                                    c.logprobs, c.cumulative_logprob) for c in o.outputs]
        if fast:
            checked = _check_batch(engine)
            batches[0] += checked > 0
            batches[1] += checked == 2
            batches[2] += checked == 3
            batches[3] += checked > 0 and bool(engine._step.inflight.decode.prefilling)
            batches[4] += checked > 0 and bool(engine._step.inflight.decode.constrained)
            engine.scheduler.check_invariants()
        step += 1
        assert step < 400
    assert engine.scheduler.page_manager.num_free_pages == config.num_pages
    return steps, finals, engine.stats, batches, engine.scheduler.num_preemptions


def _workload():
    """Eight long-running requests that stop in several ways while the others keep decoding,
    then late ones that join, fork, ask for logprobs or penalties, and one abort."""
    prompts = random_prompts(11, 320, [5, 9, 3, 14, 7, 11, 6, 4, 8, 10, 5], seed=3)
    kinds = [
        SP(temperature=0, max_tokens=60, ignore_eos=True),
        SP(temperature=0.8, top_p=0.9, seed=1, max_tokens=50),
        SP(temperature=0.8, seed=2, max_tokens=70, stop_token_ids=list(range(3, 320, 37))),
        SP(temperature=1.0, seed=4, max_tokens=70, stop=["1"], ignore_eos=True),
        SP(temperature=0.9, seed=5, max_tokens=40, min_tokens=6, stop_token_ids=list(range(5, 320, 53))),
        SP(temperature=0, max_tokens=45, ignore_eos=True),
        SP(temperature=1.0, seed=6, max_tokens=55, ignore_eos=True),
        SP(temperature=0, max_tokens=36, ignore_eos=True),
        SP(temperature=1.0, seed=7, n=2, max_tokens=12, ignore_eos=True),  # forks
        SP(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True),  # per-token logprobs
        SP(temperature=0.7, seed=8, repetition_penalty=1.2, max_tokens=30),  # penalised, in flight
    ]
    joins = [0, 0, 0, 0, 0, 0, 0, 0, 44, 56, 60]
    return prompts, kinds, joins, (20, 1)  # at step 20, abort prompt 1


@pytest.mark.extended
def test_fast_path_equals_general_path_on_a_mixed_workload(text_model, monkeypatch):
    prompts, params, joins, abort = _workload()
    general = _run(text_model, False, prompts, params, joins, abort)
    compactions = []  # steady steps whose batch dropped rows that finished or were aborted
    compacted = DecodeBatch.compacted
    monkeypatch.setattr(DecodeBatch, "compacted", lambda self, keep: compactions.append(keep) or compacted(self, keep))
    fast = _run(text_model, True, prompts, params, joins, abort)
    assert fast[0] == general[0]  # every step's deltas
    assert fast[1] == general[1]
    assert sorted(fast[1]) == [i for i in range(len(prompts)) if i != 1]
    stats = fast[2]
    assert stats.decode_batch_steps > 10 and general[2].decode_batch_steps == 0
    assert fast[3][0] > 10 and fast[3][1] > 3  # decode batches checked against a rebuild (penalised too)
    assert fast[3][2] > 3  # ... and with the rows of a request's n = 2 samples
    assert len(compactions) > 3  # rows finished, aborted or stopped under the steady step
    assert stats.joined_rows >= 2  # the late plain requests joined a step of the batch
    assert stats.steps == general[2].steps and stats.generated_tokens == general[2].generated_tokens
    assert fast[4] > 0  # preemptions happened

    # stream=False (what generate() asks for): no deltas; a request shows in a step's updates
    # once, in the step it finishes; its output is the streamed run's, on the steady decode step
    # and on the general one
    for streamed, fast_path in ((fast, True), (general, False)):
        quiet = _run(text_model, fast_path, prompts, params, joins, abort, stream=False)
        assert quiet[1] == streamed[1]
        assert all(deltas == [] for step in quiet[0] for _, deltas in step)
        assert sorted(i for step in quiet[0] for i, _ in step) == sorted(quiet[1])  # once each, at its end
        assert quiet[2].generated_tokens == streamed[2].generated_tokens and quiet[2].steps == streamed[2].steps


def test_structured_rows_decode_on_the_batch_as_on_the_general_step(text_model):
    # Requests that follow a grammar (a regex, any JSON object; one joins late, one with n = 2
    # samples) decode beside plain ones: every step's deltas and every output equal the general
    # step's, and the batch, structured rows and all, carries most steps.
    prompts = random_prompts(7, 320, [5, 9, 3, 12, 7, 6, 8], seed=6)
    params = [SP(temperature=0, max_tokens=50, ignore_eos=True),
              SP(temperature=0.8, seed=1, max_tokens=45, structured_outputs={"regex": "[a-d]{20,40}"}),
              SP(temperature=0, max_tokens=40, structured_outputs={"json_object": True}),
              SP(temperature=0.9, seed=2, max_tokens=55, ignore_eos=True),
              SP(temperature=0.7, seed=3, max_tokens=30, structured_outputs={"regex": "(ab|cd)+x?"}),
              SP(temperature=1.0, seed=4, n=2, max_tokens=25, structured_outputs={"regex": "[0-9]{10,30}"}),
              SP(temperature=0, max_tokens=20, stop=["1"], structured_outputs={"regex": "[0-9a-f]{5,25}"})]
    joins, no_abort = [0, 0, 0, 0, 10, 16, 22], (-1, 0)
    general = _run(text_model, False, prompts, params, joins, no_abort)
    fast = _run(text_model, True, prompts, params, joins, no_abort)
    assert fast[0] == general[0] and fast[1] == general[1]
    assert sorted(fast[1]) == list(range(len(prompts)))
    assert general[2].decode_batch_steps == 0 and fast[2].decode_batch_steps > fast[2].steps // 2
    assert fast[3][4] > 20  # in-flight batches holding structured rows
    assert fast[2].joined_rows >= 2  # the late ones with n = 1 joined a step of the batch
    text = fast[1][1][0][0]  # the regex held: 20-40 of a-d
    assert 20 <= len(text) <= 40 and set(text) <= set("abcd"), text


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory):
    """A tiny random Mistral whose every layer sees its last 8 keys: the scheduler frees each
    sequence's pages wholly before that window as it decodes."""
    path = tmp_path_factory.mktemp("tiny_mistral_window")
    save_tiny_hf(path, "mistral", sliding_window=8)
    model = paxpage.load(path)
    yield model
    model.close()


def test_windowed_model_decodes_on_the_batch_as_on_the_general_step(windowed_model):
    # Rows decode far past the window (pages released under the batch's steps), requests join,
    # fork and carry penalties, one is aborted: every step's deltas and every output equal the
    # general step's, and the batch carries most steps.
    prompts = random_prompts(7, 128, [5, 19, 3, 30, 11, 7, 9], seed=4)
    params = [SP(temperature=0, max_tokens=60, ignore_eos=True),
              SP(temperature=0.8, seed=1, max_tokens=50, ignore_eos=True),
              SP(temperature=0, max_tokens=45, ignore_eos=True),
              SP(temperature=0.9, seed=2, max_tokens=70, stop_token_ids=list(range(3, 128, 29))),
              SP(temperature=0.7, seed=3, repetition_penalty=1.2, max_tokens=40, ignore_eos=True),
              SP(temperature=1.0, seed=4, n=2, max_tokens=30, ignore_eos=True),
              SP(temperature=0, max_tokens=25, logprobs=2, ignore_eos=True)]
    joins, abort = [0, 0, 0, 0, 12, 20, 33], (40, 1)
    general = _run(windowed_model, False, prompts, params, joins, abort)
    fast = _run(windowed_model, True, prompts, params, joins, abort)
    assert fast[0] == general[0] and fast[1] == general[1]
    assert sorted(fast[1]) == [i for i in range(len(prompts)) if i != 1]
    assert general[2].decode_batch_steps == 0 and fast[2].decode_batch_steps > fast[2].steps // 2
    assert fast[2].joined_rows >= 2 and fast[3][0] > 20


def test_steady_step_keeps_its_batch_as_requests_end_and_takes_logprobs_and_forks(text_model, monkeypatch):
    # Requests of different lengths finish at different steps; one takes per-token logprobs, one
    # forks two samples: the steady step drops the finished rows and runs the others, with the
    # general step's outputs.
    prompts = random_prompts(5, 320, [5, 9, 3, 7, 6], seed=5)
    params = [SP(temperature=0, max_tokens=9, ignore_eos=True),
              SP(temperature=0.8, seed=1, max_tokens=14, ignore_eos=True),
              SP(temperature=0, max_tokens=11, logprobs=2, ignore_eos=True),
              SP(temperature=1.0, seed=2, n=2, max_tokens=16, ignore_eos=True),
              SP(temperature=0.9, seed=3, max_tokens=20, stop_token_ids=list(range(5, 320, 41)))]
    joins, no_abort = [0] * 5, (-1, 0)
    general = _run(text_model, False, prompts, params, joins, no_abort)
    compactions = []
    compacted = DecodeBatch.compacted
    monkeypatch.setattr(DecodeBatch, "compacted", lambda self, keep: compactions.append(keep) or compacted(self, keep))
    fast = _run(text_model, True, prompts, params, joins, no_abort)
    assert fast[0] == general[0] and fast[1] == general[1]
    assert sorted(fast[1]) == list(range(5))
    assert len(compactions) >= 3 and fast[2].decode_batch_steps >= 10
    assert fast[3][2] >= 5  # batches holding the n = 2 request's rows (and the logprobs row)
    assert len(fast[1][2][0][4]) == 11  # the logprobs request: an entry per token


def test_requests_that_arrive_during_decode_join_the_steady_batch(text_model):
    # Requests arrive, one a step, while others decode and finish at different steps: fresh
    # prompts, one sharing an earlier prompt's pages (a prefix-cache hit), one with max_tokens 1
    # (done when its prompt runs), one with logprobs, one longer than a step's token budget (its
    # chunks run beside the batch's rows), and n = 2 (forks on the batch's step). Each step's deltas
    # and every output equal the general step's.
    prompts = random_prompts(11, 320, [6, 9, 5, 7, 8, 4, 40, 6, 5, 7, 6], seed=7)
    prompts[4] = prompts[0][:4] + prompts[4]  # shares prompt 0's first page
    sampled = [dict(temperature=0.8, seed=i) for i in range(11)]
    limits = [30, 5, 7, 9, 12, 1, 8, 6, 11, 4, 10]
    params = [SP(max_tokens=limit, ignore_eos=True, **kind) for limit, kind in zip(limits, sampled)]
    params[2] = SP(temperature=0, max_tokens=7, logprobs=2, ignore_eos=True)
    params[7] = SP(temperature=1.0, seed=5, n=2, max_tokens=6, ignore_eos=True)
    joins, no_abort = [0, 0, 0, 3, 4, 5, 6, 7, 8, 9, 10], (-1, 0)
    general = _run(text_model, False, prompts, params, joins, no_abort)
    fast = _run(text_model, True, prompts, params, joins, no_abort)
    assert fast[0] == general[0] and fast[1] == general[1]
    assert sorted(fast[1]) == list(range(11))
    assert fast[2].joined_rows >= 5 and general[2].joined_rows == 0
    assert fast[3][3] >= 1  # the long prompt's chunks ran beside the batch's rows
    assert fast[2].steps == general[2].steps


def test_requests_with_n_samples_fork_on_the_steady_batch(text_model):
    # Requests with n = 2 and 3 arrive while others decode: each prompt runs on the batch's
    # step, forks its children there with pending tokens (one with max_tokens 1: its samples
    # end at once), and all of them decode on as rows of the batch. Every step after the first
    # is the batch's, and each step's deltas and every output equal the general step's.
    prompts = random_prompts(6, 320, [6, 9, 5, 7, 8, 4], seed=13)
    params = [SP(temperature=0.8, seed=1, max_tokens=20, ignore_eos=True),
              SP(temperature=0, max_tokens=16, ignore_eos=True),
              SP(temperature=1.0, seed=2, n=2, max_tokens=8, ignore_eos=True),
              SP(temperature=0.9, seed=3, n=3, max_tokens=6, logprobs=2, stop_token_ids=list(range(7, 320, 29))),
              SP(temperature=0.7, seed=4, n=2, max_tokens=1),
              SP(temperature=1.0, seed=5, n=2, max_tokens=7, repetition_penalty=1.2, ignore_eos=True)]
    # at most max_num_seqs (8) sequences at once, and no preemption: nothing else leaves the batch
    joins, no_abort = [0, 0, 2, 3, 4, 12], (-1, 0)
    general = _run(text_model, False, prompts, params, joins, no_abort, num_pages=96)
    fast = _run(text_model, True, prompts, params, joins, no_abort, num_pages=96)
    assert fast[0] == general[0] and fast[1] == general[1]
    assert [len(fast[1][i]) for i in range(6)] == [1, 1, 2, 3, 2, 2]
    assert fast[4] == 0
    assert fast[2].steps == general[2].steps
    assert fast[2].decode_batch_steps == fast[2].steps - 1  # the first step is the only general one
    assert fast[3][2] >= 5  # batches holding forked samples' rows, checked against their sequences


def test_sequences_resumed_after_a_preemption_rejoin_the_steady_batch(text_model, monkeypatch):
    # A pool of 24 pages for 8 sequences that grow to 7-9 pages each: sequences are preempted
    # (on the general step) and resumed; the resumed ones are admitted by the steady step and
    # rejoin its batch. Each step's deltas and every output equal the general step's.
    prompts = random_prompts(8, 320, [9, 5, 12, 7, 10, 6, 8, 11], seed=9)
    params = [SP(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True) for i in range(8)]
    params[3] = SP(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True)
    joins, no_abort = [0] * 8, (-1, 0)
    general = _run(text_model, False, prompts, params, joins, no_abort, num_pages=24)
    rejoined = []  # resumed sequences the steady step admitted
    joins_batch = EngineStep.joins

    def recording(self, seq):
        ok = joins_batch(self, seq)
        if ok and seq.num_preemptions:
            rejoined.append(seq.seq_id)
        return ok

    monkeypatch.setattr(EngineStep, "joins", recording)
    fast = _run(text_model, True, prompts, params, joins, no_abort, num_pages=24)
    assert fast[0] == general[0] and fast[1] == general[1]
    assert sorted(fast[1]) == list(range(8))
    assert general[4] > 0 and fast[4] == general[4]  # preemptions happened, the same ones
    assert len(rejoined) >= 2
    assert fast[2].joined_rows >= 2 and fast[2].steps == general[2].steps


def _python_work_per_step(model, context: int, steps: int = 16) -> tuple[float, float]:
    """Python bytecodes and calls per steady decode step of 6 rows at `context` tokens, half of
    them streamed: a count of the host's work that, unlike its time, the machine's load and the
    device's threads do not change."""
    import sys

    config = EngineConfig(page_size=8, num_pages=6 * 32, max_model_len=256, max_num_seqs=6,
                          max_num_batched_tokens=2048)
    engine = LLMEngine(model.config, model.params, model.tokenizer, config)
    params = SP(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(6, 320, [context] * 6, seed=context)):
        engine.add_request(prompt, params, stream=i % 2 == 0)
    while engine.stats.decode_batch_steps < 2:
        engine.step()
    counts = {"opcode": 0, "call": 0}

    def trace(frame, event, arg):
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        if event in counts:
            counts[event] += 1
        return trace

    before = engine.stats.decode_batch_steps
    sys.settrace(trace)
    try:
        for _ in range(steps):
            engine.step()
    finally:
        sys.settrace(None)
    assert engine.stats.decode_batch_steps == before + steps  # every one the steady step
    return counts["opcode"] / steps, counts["call"] / steps


def test_steady_step_python_work_does_not_grow_with_context(text_model):
    # 16 steps: every row crosses two page boundaries at either context (pages of 8, contexts
    # 9 and 201 alike mod 8). A step touches O(1) data per row: no loop over a row's tokens or
    # pages. Its CPU time still differs (cache misses under the device's load), its work must not.
    short_ops, short_calls = _python_work_per_step(text_model, 9)
    long_ops, long_calls = _python_work_per_step(text_model, 201)
    assert short_ops > 500
    assert long_ops / short_ops < 1.02, (short_ops, long_ops)
    assert long_calls / short_calls < 1.02, (short_calls, long_calls)
