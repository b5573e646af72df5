"""What users get back: one result per prompt, and streamed deltas."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Completion:
    """One generated sequence (one of `n` samples, or one kept beam)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"; None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob}, chosen first
    cumulative_logprob: float = 0.0
    score: float | None = None  # beam search: cumulative_logprob / num_tokens ** length_penalty


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """When a request arrived, produced its first token and finished (`time.monotonic()` seconds)."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclasses.dataclass
class RequestOutput:
    """The result for one prompt. `.text`, `.token_ids`, `.finish_reason` are the first
    (or, for beam search, the best) completion's; `.outputs` holds all of them."""

    index: int  # the prompt's position in the input list
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[Completion]
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self):
        return self.outputs[0].stop_reason

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.outputs)


@dataclasses.dataclass(frozen=True, slots=True)
class StreamDelta:
    """One streamed piece of a request's text."""

    index: int  # the prompt's position
    text: str  # new text since the last delta of this (index, sample)
    token_ids: tuple[int, ...]  # new tokens
    finish_reason: str | None  # None until the request's last delta for this sample
    sample: int = 0  # which of the n samples
    # one {token_id: logprob} per new token (chosen token first, then the top alternatives);
    # None unless the request asked for logprobs
    logprobs: tuple[dict[int, float], ...] | None = None
    stop_reason: str | int | None = None  # with the last delta: the stop string or token that matched

    # StreamDelta.fast(index, text, token_ids, finish_reason, sample=0, logprobs=None,
    # stop_reason=None): set below the class


def _fast_constructor(cls):
    """`cls.fast`: the constructor's result in ~60% of its time (the engine makes one delta per
    streamed request per step). A frozen dataclass's __init__ goes through object.__setattr__
    per field; this sets the slots through their descriptors directly. Slots, not a __dict__:
    88 bytes a delta instead of ~330, fewer cache lines for a step to fill."""
    new = object.__new__
    set_index, set_text, set_tokens, set_finish, set_sample, set_logprobs, set_stop = (
        cls.__dict__[f.name].__set__ for f in dataclasses.fields(cls))

    def fast(index: int, text: str, token_ids: tuple[int, ...], finish_reason: str | None,
             sample: int = 0, logprobs=None, stop_reason=None) -> StreamDelta:
        delta = new(cls)
        set_index(delta, index)
        set_text(delta, text)
        set_tokens(delta, token_ids)
        set_finish(delta, finish_reason)
        set_sample(delta, sample)
        set_logprobs(delta, logprobs)
        set_stop(delta, stop_reason)
        return delta

    return staticmethod(fast)


StreamDelta.fast = _fast_constructor(StreamDelta)
