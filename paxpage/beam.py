"""Beam search inside the engine, with HF transformers' semantics (v5 vectorised `_beam_search`).

A beam request holds up to W live sequences (beams) that share their prefix pages: a beam that
several candidates continue is forked (`Scheduler.fork`, reference counts; the first write into a
shared page is copy-on-write), a beam nobody continues is finished and its pages return to the pool.
Every live beam is an ordinary row of the engine's batched step: its row samples greedily with the
top-K log-probs (K = max(2, 1 + number of EOS ids) * W), and this module, on the host, turns the
rows of one request into the next W beams. The prompt is prefilled once, as one sequence; the first
step forks it into W beams (HF starts with beam scores [0, -1e9, ...], which is the same thing).

One HF step (per request), with scores = cumulative log-probs in float32:
  1. candidates: the top K of beam_score + log_softmax(logits) over all W x V continuations;
  2. a candidate "hits" when its token is an EOS id or it reaches max_tokens;
  3. running beams: the best W candidates that do not hit;
  4. finished hypotheses: the hitting candidates among the best W candidates, scored
     sum_logprobs / num_generated ** length_penalty, merged with the kept ones, best W kept
     (none are added once all W slots are full and early_stopping is True, or once the early-stop
     heuristic says no running beam can improve on the worst kept one);
  5. the request is done when every candidate hits (max length), when all W slots are full and
     early_stopping is True, or when the heuristic says running beams cannot improve any more
     (early_stopping False: best running score / num_generated ** lp; "never": the same with
     max_tokens as the length when length_penalty > 0).

A beam step needs the logits of all the request's live beams from the same step. The scheduler
may schedule only some of them (max_num_seqs cut-off, a preempted beam being recomputed), so
`BeamCoordinator.hold_back` drops a request's sampling rows from a step unless all of its live
beams sample in it; held-back beams keep their uncomputed token and run in a later step.

Beam search ignores temperature, top_p, top_k, min_p and seed (it is deterministic, like HF with
do_sample=False); n must be 1, and penalties, min_tokens and stop strings are rejected (see
SamplingParams). Pure Python / numpy: no jax.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence as Seq
from typing import Any, Callable

import numpy as np

from paxpage.output_processor import prompt_logprobs_list
from paxpage.outputs import Completion, RequestOutput, StreamDelta
from paxpage.page_manager import cdiv
from paxpage.sampling import fields
from paxpage.sequence import Sequence

_NEG = np.float32(-1.0e9)  # HF's "impossible" score


@dataclasses.dataclass(frozen=True)
class Candidate:
    score: np.float32  # cumulative log-prob including this token
    parent: int  # index of the live beam it extends
    token: int
    logprob: float  # log-prob of this token alone


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    """A finished beam."""

    score: np.float32  # sum_logprobs / num_generated ** length_penalty
    token_ids: tuple[int, ...]  # generated tokens (EOS included when it ended on one)
    sum_logprobs: float
    finish_reason: str  # "stop" (EOS / stop token) or "length"
    stop_reason: int | None
    logprobs: tuple[dict[int, float], ...] | None = None


def top_candidates(beam_scores: Seq[float], top_ids: np.ndarray, top_logprobs: np.ndarray,
                   k: int) -> list[Candidate]:
    """The best k continuations of all beams, best first.

    beam_scores f32[m]; top_ids i32[m, L], top_logprobs f32[m, L]: each beam's L >= k most likely
    tokens (the global top k lies in the union of the per-beam top k). Ties keep beam-major order."""
    top_ids = np.asarray(top_ids)
    top_logprobs = np.asarray(top_logprobs, np.float32)
    m, width = top_ids.shape
    assert width >= k, f"need {k} log-probs per beam row, got {width}"
    total = np.asarray(beam_scores, np.float32)[:, None] + top_logprobs  # [m, L], f32 like HF
    order = np.argsort(-total.reshape(-1), kind="stable")[:k]
    return [Candidate(total.flat[j], int(j // width), int(top_ids.flat[j]), float(top_logprobs.flat[j]))
            for j in order]


class BeamSearch:
    """Host state of one beam request: live beam scores, finished hypotheses, stop flags."""

    def __init__(self, params, num_prompt_tokens: int, eos_token_ids: Seq[int], vocab_size: int,
                 config=None):
        self.params = params
        self.width = params.beam_width
        self.length_penalty = params.length_penalty
        self.early_stopping = params.early_stopping
        self.max_tokens = params.max_tokens
        eos = () if params.ignore_eos else tuple(eos_token_ids)
        self.eos = frozenset(eos) | frozenset(params.stop_token_ids)
        self.num_candidates = max(2, 1 + len(self.eos)) * self.width  # K, as in HF
        if self.num_candidates > vocab_size:
            raise ValueError(f"beam_width {self.width} needs {self.num_candidates} candidates per step; "
                             f"the vocabulary has {vocab_size} tokens")
        if config is not None:
            _check_fits(self.width, num_prompt_tokens + params.max_tokens, config)
        # Rows of live beams sample greedily (cheapest path: every per-row field neutral) and
        # report the top-K log-probs.
        self.row_params = params.replace(**fields.NEUTRAL, n=1,
                                         logprobs=max(self.num_candidates, params.logprobs or 0))
        self.scores: list[np.float32] = [np.float32(0.0)]  # per live beam, in `live` order
        self.beam_logprobs: list[list[dict[int, float]]] = [[]]  # per live beam, if params.logprobs
        self.num_cached_tokens = 0  # prefix-cache hit tokens of the prompt
        # the first beam's prompt logprobs (position -> entry), when asked; kept here because
        # that beam may be dropped before the request ends
        self.prompt_logprobs: dict[int, dict[int, float]] | None = None
        # this step's top ids / log-probs [m, L] of the live beams, for per-token logprobs
        self._row_top: tuple[np.ndarray, np.ndarray] | None = None
        self.finished: list[Hypothesis] = []  # best first, at most W
        self.improvable = True  # HF's is_early_stop_heuristic_unsatisfied
        self.done = False

    # ---- the pure HF step --------------------------------------------------------------------------
    def advance(self, outputs: Seq[Seq[int]], top_ids: np.ndarray, top_logprobs: np.ndarray
                ) -> list[Candidate]:
        """One beam step. outputs: generated tokens of each live beam (all the same length);
        top_ids / top_logprobs [m, L]: each beam row's most likely next tokens. Records finished
        hypotheses and returns the W running candidates (empty when the request is done)."""
        W, lp = self.width, self.length_penalty
        num_generated = len(outputs[0]) + 1  # after this step's token
        cands = top_candidates(self.scores, top_ids, top_logprobs, self.num_candidates)
        at_max = num_generated >= self.max_tokens
        hits = [at_max or c.token in self.eos for c in cands]

        # Running beams: the best W candidates that do not hit (hitting ones get -1e9).
        masked = [c.score + (_NEG if h else np.float32(0)) for c, h in zip(cands, hits)]
        running = sorted(range(len(cands)), key=lambda j: -masked[j])[:W]  # sorted() is stable

        # Finished: hitting candidates among the best W, unless the slots are closed.
        full = len(self.finished) == W and self.early_stopping is True
        if not full and self.improvable:
            denominator = np.float32(num_generated ** lp)
            new = [Hypothesis(cands[j].score / denominator,
                              tuple(outputs[cands[j].parent]) + (cands[j].token,),
                              float(cands[j].score),
                              "length" if cands[j].token not in self.eos else "stop",
                              cands[j].token if cands[j].token in self.eos else None,
                              self._logprobs_of(cands[j]))
                   for j in range(min(W, len(cands))) if hits[j]]
            # kept ones first: on a tie HF's topk over [kept, new] keeps the older
            self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:W]

        # Early-stop heuristic and the stopping rule, after HF's cur_len += 1.
        if self.early_stopping == "never" and lp > 0.0:
            best_length = self.max_tokens
        else:
            best_length = num_generated
        best_possible = masked[running[0]] / np.float32(best_length ** lp)
        worst = min(h.score for h in self.finished) if len(self.finished) == W else _NEG
        self.improvable = self.improvable and bool(best_possible > worst)
        all_full = len(self.finished) == W and self.early_stopping is True
        self.done = not self.improvable or all_full or all(hits)
        if self.done:
            return []
        assert not any(hits[j] for j in running), "K candidates always hold W that do not hit"
        return [cands[j] for j in running]

    def _logprobs_of(self, cand: Candidate) -> tuple[dict[int, float], ...] | None:
        if self.params.logprobs is None:
            return None
        return tuple(self.beam_logprobs[cand.parent]) + (self._entry(cand),)

    def _entry(self, cand: Candidate) -> dict[int, float]:
        entry = {cand.token: cand.logprob}
        if self._row_top is not None:
            ids, lps = self._row_top
            for t, v in zip(ids[cand.parent][:self.params.logprobs], lps[cand.parent][:self.params.logprobs]):
                entry.setdefault(int(t), float(v))
        return entry

    # ---- results -----------------------------------------------------------------------------------
    def completions(self, tokenizer, prompt_token_ids: Seq[int] = ()) -> list[Completion]:
        """The finished hypotheses, best first. Text is decoded with the prompt's last tokens as
        context, as the sampling path does (a first word's leading space depends on it)."""
        out = []
        for i, h in enumerate(self.finished):
            text = ""
            if tokenizer is not None:
                from paxpage.detokenizer import IncrementalDetokenizer

                detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, self.params.skip_special_tokens)
                for t in h.token_ids:
                    detok.add(t)
                detok.finish()
                text = detok.text
            out.append(Completion(i, text, list(h.token_ids), h.finish_reason, h.stop_reason,
                                  None if h.logprobs is None else list(h.logprobs), h.sum_logprobs,
                                  score=float(h.score)))
        return out


def _check_fits(width: int, num_tokens: int, config) -> None:
    """A beam step needs all W beams in one step, and W unshared beams must fit in the pool
    (the worst case, e.g. after preemptions), else the request could wait forever."""
    if width > config.max_num_seqs:
        raise ValueError(f"beam_width is {width}; max_num_seqs is {config.max_num_seqs}")
    if width > config.max_num_batched_tokens:
        raise ValueError(f"beam_width is {width}; max_num_batched_tokens is {config.max_num_batched_tokens}")
    pages = width * cdiv(num_tokens, config.page_size)
    if pages > config.num_pages:
        raise ValueError(f"beam_width {width} x {num_tokens} tokens needs up to {pages} pages of "
                         f"{config.page_size}; the cache has {config.num_pages} pages")


class BeamCoordinator:
    """The engine's beam-search hooks, called from `LLMEngine.step`:
    hold_back(sched) after scheduling, select(rows, result, sampled) before `Scheduler.update`,
    apply() after it (forks, dropped beams, finished requests).

    It sees the engine through three narrow handles: the scheduler (fork, finish, counts), the
    output processor (live requests, registering and dropping samples) and a factory of new
    sequences."""

    def __init__(self, scheduler, outputs, new_sequence: Callable[[list[int], int, int], Sequence]):
        self.scheduler = scheduler
        self.outputs = outputs  # output_processor.OutputProcessor
        self.new_sequence = new_sequence  # (prompt ids, max_tokens, request id) -> Sequence
        self._pending: list[tuple[Any, list[Candidate], list[Any]]] = []
        self._stalled_at: tuple | None = None
        self.num_held_back = 0  # beam rows dropped from a step because a sibling did not sample

    def _beam_requests(self):
        return [r for r in self.outputs.live_requests() if r.beam is not None]

    def hold_back(self, sched) -> bool:
        """Drops the sampling rows of beam requests whose live beams do not all sample this step.
        Returns True if nothing is left to run. Raises if that repeats without any change."""
        requests = self._beam_requests()
        if not requests:
            return False
        sampling = {it.seq.seq_id for it in sched.scheduled if it.samples}
        drop = set()
        for request in requests:
            ids = {s.seq.seq_id for s in request.samples}
            if ids & sampling and not ids <= sampling:
                drop |= ids
        if drop:
            self.num_held_back += sum(1 for it in sched.scheduled if it.samples and it.seq.seq_id in drop)
            sched.scheduled = [it for it in sched.scheduled if not (it.samples and it.seq.seq_id in drop)]
        if sched.scheduled or sched.preempted:
            self._stalled_at = None
            return not sched.scheduled
        s = self.scheduler
        state = (s.num_running, s.num_waiting, s.page_manager.num_free_pages)
        if state == self._stalled_at:
            raise RuntimeError(f"beam search stalled: no request can run all its beams in one step "
                               f"(running {s.num_running}, waiting {s.num_waiting}, free pages "
                               f"{s.page_manager.num_free_pages}); raise num_pages or max_num_seqs")
        self._stalled_at = state
        return True

    def select(self, rows: list[tuple[Any, Any, int]], result, sampled: dict[int, int]) -> None:
        """rows: (request, sample, logits row) of every beam row this step. Runs each request's
        beam step and puts the token each live beam keeps into `sampled`."""
        by_request: dict[int, list[tuple[Any, int]]] = {}
        requests = {}
        for request, sample, row in rows:
            by_request.setdefault(request.request_id, []).append((sample, row))
            requests[request.request_id] = request
        for request_id, members in by_request.items():
            request = requests[request_id]
            beam = request.beam
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            live = request.samples  # the live beams
            rows_of = dict((id(s), r) for s, r in members)
            assert len(members) == len(live) and all(id(s) in rows_of for s in live), \
                "hold_back lets a beam request sample all its live beams or none"
            if len(live) == 1 and not live[0].seq.num_output_tokens:
                beam.num_cached_tokens = live[0].seq.num_cached_tokens
                beam.prompt_logprobs = live[0].prompt_logprobs
            idx = [rows_of[id(s)] for s in live]
            ids, lps = result.top_ids[idx], result.top_logprobs[idx]
            beam._row_top = (ids, lps)
            running = beam.advance([s.seq.output_token_ids for s in live], ids, lps)
            # Each live beam appends one token in update(): the first candidate continuing it,
            # else (dropped, or the request is done) its best token; extra candidates fork after.
            taken = set()
            for cand in running:
                if cand.parent not in taken:
                    taken.add(cand.parent)
                    sampled[live[cand.parent].seq.seq_id] = cand.token
            for i, s in enumerate(live):
                if i not in taken:
                    sampled[s.seq.seq_id] = int(ids[i, 0])
            self._pending.append((request, running, list(live)))

    def apply(self, tokenizer) -> list[tuple[Any, list[StreamDelta]]]:
        """After Scheduler.update: fork, drop and finish beams; returns the final deltas of
        requests that finished."""
        deltas = []
        for request, running, parents in self._pending:
            beam = request.beam
            live, scores, histories, continued = [], [], [], set()
            for cand in running:
                parent = parents[cand.parent]
                history = beam.beam_logprobs[cand.parent] if beam.params.logprobs is not None else None
                if cand.parent not in continued:
                    continued.add(cand.parent)
                    sample = parent  # its update() token is this candidate's
                else:
                    sample = self._fork(request, parent, cand.token)
                live.append(sample)
                scores.append(cand.score)
                histories.append(history + [beam._entry(cand)] if history is not None else [])
            for i, parent in enumerate(parents):
                if i not in continued:
                    self.scheduler.finish(parent.seq, "beam_dropped" if not beam.done else "beam_done")
                    self.outputs.drop_sample(parent.seq.seq_id)
            beam.scores, beam.beam_logprobs = scores, histories
            beam._row_top = None
            request.samples = live
            if beam.done:
                self.outputs.remove(request.request_id)
                deltas.append((request, [StreamDelta(request.index, c.text, tuple(c.token_ids),
                                                     c.finish_reason, c.index,
                                                     None if c.logprobs is None else tuple(c.logprobs),
                                                     c.stop_reason)
                                         for c in beam.completions(tokenizer, request.prompt_ids)]))
        self._pending = []
        return deltas

    def _fork(self, request, parent, token: int):
        """A new beam: parent's tokens before this step plus `token`, sharing parent's pages."""
        seq = self.new_sequence(parent.seq.prompt_token_ids, parent.seq.max_tokens, parent.seq.group_id)
        seq.output_token_ids = parent.seq.output_token_ids[:-1] + [int(token)]
        self.scheduler.fork(parent.seq, seq)
        return self.outputs.new_sample(request, seq, parent.seed, with_text=False)

    def output(self, request, tokenizer) -> RequestOutput:
        beam = request.beam
        return RequestOutput(request.index, request.prompt, request.prompt_ids,
                             beam.completions(tokenizer, request.prompt_ids),
                             prompt_logprobs=prompt_logprobs_list(beam.prompt_logprobs, len(request.prompt_ids)),
                             num_cached_tokens=beam.num_cached_tokens, metrics=request.metrics())
