"""Output processor: what happens to a request's tokens after the device picked them.

It owns the per-request host state (samples, incremental detokenizers, logprob dicts, timings),
checks stop conditions, and turns each step's tokens into per-request `StreamDelta`s and, at the
end, one `RequestOutput`. It knows nothing of the device or of scheduling: the engine hands it
the step's (request, sample, logits row) entries and the sampler's tokens, and it answers with the
deltas and with the sequences that must finish. Pure Python (no jax), like vLLM v1's
OutputProcessor.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence as Seq
from itertools import repeat
from typing import Any

from paxpage.detokenizer import FinalText, IncrementalDetokenizer, byte_level
from paxpage.outputs import Completion, RequestMetrics, RequestOutput, StreamDelta
from paxpage.sampling.params import SamplingParams
from paxpage.sequence import Sequence
from paxpage.structured_backend import accept


@dataclasses.dataclass(slots=True)  # slots: a step reads a few fields of every row's sample
class Sample:
    """Host state of one generated sequence of a request."""

    seq: Sequence
    seed: int
    detok: IncrementalDetokenizer | FinalText | None
    logprobs: list[dict[int, float]] | None  # one dict per output token, when asked
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: Any = None
    emitted_text: int = 0  # characters already streamed
    emitted_tokens: int = 0
    # prompt position p -> {prompt[p + 1]: logprob, top alternatives...}; only when asked
    prompt_logprobs: dict[int, dict[int, float]] | None = None
    # structured outputs: its llguidance matcher, advanced by each token it is given here
    matcher: Any = None
    grammar_refused: bool = False  # the matcher refused a token (only a masked-out one could be)
    # what may stop it, for a quick check before the full one: the tokens that stop it (EOS unless
    # ignored, stop_token_ids) and the outputs at which it ends by length (max_tokens or the
    # model's length)
    stop_ids: frozenset = frozenset()
    limit: int = 0


@dataclasses.dataclass(slots=True)
class Request:
    request_id: int
    index: int  # the caller's position for it (prompt index in a generate call)
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams  # the rows' params (beam search replaces the user's)
    samples: list[Sample]
    forked: bool = False  # True once the n samples exist
    beam: Any = None  # beam.BeamSearch; samples are then the live beams
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finished_time: float | None = None
    # False: no deltas (vLLM's FINAL_ONLY outputs); the request shows in a step's updates only
    # when it finishes, with an empty list, and its result is read with `output`
    stream: bool = True

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return len(self.samples) == self.params.n and all(s.finish_reason for s in self.samples)

    def metrics(self) -> RequestMetrics:
        return RequestMetrics(self.arrival_time, self.first_token_time, self.finished_time)


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: Seq[int], max_model_len: int):
        self.tokenizer = tokenizer
        # outputs read only at their end decode their tokens then, in one call (detokenizer.FinalText)
        self._final_text = tokenizer is not None and byte_level(tokenizer)
        self.eos_token_ids = tuple(eos_token_ids)
        self._eos = frozenset(self.eos_token_ids)
        self.max_model_len = max_model_len
        self._requests: dict[int, Request] = {}
        self._by_seq: dict[int, tuple[Request, Sample]] = {}

    # ---- registry -------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def get(self, request_id: int) -> Request | None:
        return self._requests.get(request_id)

    def live_requests(self) -> Iterable[Request]:
        return self._requests.values()

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def num_samples(self) -> int:
        """Samples registered under their sequence id (live ones, of live requests)."""
        return len(self._by_seq)

    def lookup(self, seq_id: int) -> tuple[Request, Sample]:
        return self._by_seq[seq_id]

    def new_sample(self, request: Request, seq: Sequence, seed: int, *, with_text: bool = True) -> Sample:
        """Registers a sample of `request` running as `seq`. Beam forks pass with_text=False: the
        beam module decodes finished hypotheses itself."""
        p = request.params
        detok = None
        if with_text and self.tokenizer is not None:
            if self._final_text and not request.stream and not p.stop:  # text read once it has ended
                detok = FinalText(self.tokenizer, p.skip_special_tokens)
            else:
                detok = IncrementalDetokenizer(self.tokenizer, request.prompt_ids, p.skip_special_tokens, p.stop,
                                               p.include_stop_str_in_output, p.min_tokens)
        sample = Sample(seq, seed, detok, [] if with_text and p.logprobs is not None else None,
                        stop_ids=frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self._eos),
                        limit=min(p.max_tokens, self.max_model_len - seq.num_prompt_tokens))
        if with_text and p.prompt_logprobs is not None and not request.samples:
            sample.prompt_logprobs = {}
            seq.use_prefix_cache = False  # cached prompt pages would skip their logprobs
        self._by_seq[seq.seq_id] = (request, sample)
        return sample

    def drop_sample(self, seq_id: int) -> None:
        self._by_seq.pop(seq_id, None)

    def remove(self, request_id: int) -> Request | None:
        """Forgets a request (finished or aborted) and its samples."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            if request.finished_time is None:
                request.finished_time = time.monotonic()
            for s in request.samples:
                self._by_seq.pop(s.seq.seq_id, None)
        return request

    # ---- one step's results ----------------------------------------------------------------------
    def record_prompt_logprobs(self, seq: Sequence, position: int, target_logprob: float,
                               top_ids: Seq[int], top_logprobs: Seq[float]) -> None:
        request, sample = self._by_seq[seq.seq_id]
        # a recompute after preemption overwrites
        sample.prompt_logprobs[position] = _entry(seq.prompt_token_ids[position + 1], float(target_logprob),
                                                  _as_list(top_ids), _as_list(top_logprobs),
                                                  request.params.prompt_logprobs)

    def process(self, rows: Seq[tuple[Request, Sample, int]], tokens: Seq[int], logprobs: Seq[float],
                top_ids=None, top_logprobs=None, *, pending: int | None = None,
                indices: Seq[int | None] | None = None
                ) -> tuple[list[tuple[Request, list[StreamDelta]]], list[tuple[Sequence, str]], int]:
        """Logprobs, text and stop checks for a step's tokens, every step kind's.

        rows: one (request, sample, logits row r) entry per new token (a request with n > 1 has
        an entry per sample; no beams); its token is tokens[r], its logprob logprobs[r], and for a
        sample that asked for logprobs its alternatives top_ids[r] / top_logprobs[r] ([R, L]
        arrays; None when no row asked for any). pending: each entry's sample ends in this
        placeholder (async scheduling), which its token replaces; None: the tokens are appended
        already. indices: a speculating step's entries may give one sample several tokens,
        consecutive and in order, each with its position among the sample's outputs (None: the
        sample's last token); a sample that stops at one of them has the later ones cut from its
        sequence, as if never generated.

        Returns each request's deltas (one per sample, a request's under one entry, in first-token
        order; a request with stream=False: only when it finishes, with none), the (sequence,
        reason) pairs to finish, and the number of tokens taken (a sample aborted while in flight
        or stopped earlier in the step takes none). The full stop check runs only where a stop
        may apply (`Sample.stop_ids`, `Sample.limit`, a stop string or a grammar)."""
        now, new_delta = time.monotonic(), StreamDelta.fast
        tops = None  # top_ids / top_logprobs as lists (one conversion), once a row needs them
        deltas: list[tuple[Request, list[StreamDelta]]] = []
        multi: dict[int, list[StreamDelta]] = {}  # n > 1: the deltas of each request's samples, one entry
        to_finish: list[tuple[Sequence, str]] = []
        num_taken = 0
        for (request, sample, row), index in zip(rows, indices if indices is not None else repeat(None)):
            if sample.finish_reason is not None:  # aborted while in flight, or stopped at an earlier token
                continue
            num_taken += 1
            token = tokens[row]
            out = sample.seq.output_token_ids
            if pending is not None:
                assert out[-1] == pending, sample.seq
                out[-1] = token
            num_out = len(out)
            if request.first_token_time is None:
                request.first_token_time = now
            logprob = logprobs[row]
            sample.cumulative_logprob += logprob
            if sample.logprobs is not None:
                if tops is None:  # (None: no row asked for alternatives, logprobs=0)
                    tops = ((top_ids.tolist(), top_logprobs.tolist()) if top_ids is not None
                            else ([[]] * len(tokens),) * 2)
                sample.logprobs.append(_entry(token, logprob, tops[0][row], tops[1][row], request.params.logprobs))
            detok, matcher = sample.detok, sample.matcher
            if detok is not None:
                detok.add(token)
            if matcher is not None and not sample.grammar_refused:
                sample.grammar_refused = not accept(matcher, token)
            if token in sample.stop_ids or num_out >= sample.limit or matcher is not None or index is not None \
                    or (detok is not None and detok.stopped_by is not None):
                reason, stop = self._stop(request.params, sample, token, index)
                if reason is not None:
                    sample.finish_reason, sample.stop_reason = reason, stop
                    to_finish.append((sample.seq, reason))
                    if index is not None:
                        del out[index + 1:]
                        num_out = index + 1
                    if detok is not None:
                        detok.finish()  # flush text held back as a possible stop-string start
                elif index is not None and index + 1 < num_out:
                    continue  # the sample's next token of this step follows: one delta for them all
            reason = sample.finish_reason
            if request.stream:  # what the sample produced since its last delta
                if detok is None:
                    text = ""
                else:
                    full = detok.text
                    text, sample.emitted_text = full[sample.emitted_text:], len(full)
                emitted, sample.emitted_tokens = sample.emitted_tokens, num_out
                new = (token,) if emitted == num_out - 1 else tuple(out[emitted:])
                single = request.params.n == 1
                entries = None if sample.logprobs is None else tuple(sample.logprobs[emitted:])
                delta = new_delta(request.index, text, new, reason, 0 if single else request.samples.index(sample),
                                  entries, sample.stop_reason if reason else None)
                if single:
                    deltas.append((request, [delta]))
                elif request.request_id in multi:
                    multi[request.request_id].append(delta)
                else:
                    multi[request.request_id] = [delta]
                    deltas.append((request, multi[request.request_id]))
            elif reason is not None and request.finished:
                deltas.append((request, []))
            if reason is not None and request.finished:
                self.remove(request.request_id)
        return deltas, to_finish, num_taken

    def _stop(self, p: SamplingParams, sample: Sample, token: int, index: int | None = None
              ) -> tuple[str | None, Any]:
        seq = sample.seq
        num_out = seq.num_output_tokens if index is None else index + 1  # outputs up to this token
        # A complete grammar allows nothing but EOS: stop now rather than spend a step on it.
        # min_tokens cannot hold it back (EOS is banned below it, so no token would be left).
        if sample.matcher is not None and (sample.grammar_refused or sample.matcher.is_stopped()):
            return "stop", token if token in self.eos_token_ids else None
        if num_out >= p.min_tokens:
            if token in sample.stop_ids:  # EOS unless ignored, stop_token_ids
                return "stop", token
            if sample.detok is not None and sample.detok.stopped_by is not None:
                return "stop", sample.detok.stopped_by
        if num_out >= sample.limit:  # max_tokens, or the model's length
            return "length", None
        return None, None

    def abort(self, request_id: int) -> tuple[Request | None, list[Sequence]]:
        """Marks a request's running samples aborted and forgets it; returns the request and the
        sequences the scheduler must drop."""
        request = self._requests.get(request_id)
        if request is None:
            return None, []
        running = [s for s in request.samples if s.finish_reason is None]
        for s in running:
            s.finish_reason = "abort"
        self.remove(request_id)
        return request, [s.seq for s in running]

    # ---- results ---------------------------------------------------------------------------------
    def output(self, request: Request) -> RequestOutput:
        completions = [
            Completion(i, s.detok.text if s.detok is not None else "", list(s.seq.output_token_ids),
                       s.finish_reason, s.stop_reason, s.logprobs, s.cumulative_logprob)
            for i, s in enumerate(request.samples)
        ]
        first = request.samples[0]
        return RequestOutput(request.index, request.prompt, request.prompt_ids, completions,
                             prompt_logprobs=prompt_logprobs_list(first.prompt_logprobs, len(request.prompt_ids)),
                             num_cached_tokens=first.seq.num_cached_tokens, metrics=request.metrics())


def prompt_logprobs_list(by_position: dict[int, dict[int, float]] | None, num_prompt_tokens: int
                         ) -> list[dict[int, float] | None] | None:
    """vLLM's layout of a sample's prompt logprobs: None for the first prompt token, then one
    entry per later token. None when they were not asked for."""
    if by_position is None:
        return None
    return [None] + [by_position.get(p) for p in range(num_prompt_tokens - 1)]


def _entry(token: int, logprob: float, top_ids: list[int], top_logprobs: list[float], k: int | None
           ) -> dict[int, float]:
    """{token: logprob} with the chosen token first, then up to k alternatives (Python ints and
    floats: the caller converts a step's arrays once)."""
    entry = {token: logprob}
    if k is not None and k < len(top_ids):
        top_ids, top_logprobs = top_ids[:k], top_logprobs[:k]
    entry.update(zip(top_ids, top_logprobs))  # (distinct ids: top-k's)
    entry[token] = logprob  # its own logprob, in first place (an existing key keeps its place)
    return entry


def _as_list(values) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)
