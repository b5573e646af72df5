"""Per-request sampling parameters (vLLM / OpenAI semantics), validated at construction.

`SamplingParams` is frozen and hashable: list-valued arguments (`stop`, `stop_token_ids`) are
normalised to tuples. It remembers which fields its caller gave (`explicit_fields`), so the
model's own defaults (generation_config.json) fill only the others (`with_defaults`). Checks that need the model (vocabulary size, context length, prompt) live
in `validate_for`, which the engine calls when a request is added.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

from paxpage.sampling import fields
from paxpage.structured import StructuredOutputs

# Temperatures at or below this are treated as greedy by the sampler (as in vLLM): dividing
# logits by a tiny temperature overflows, and the result is argmax anyway.
GREEDY_TEMPERATURE = 1e-5


def _check_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    # bool is an int subclass; `n=True` is a bug, not a count.
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an int or None" if allow_none else "an int"
        raise TypeError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got nan")
    return value


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # parallel samples per prompt; the engine repeats the logits row n times
    temperature: float = 1.0  # 0 = greedy (argmax); top_k / top_p / min_p are then ignored
    top_p: float = 1.0  # nucleus: smallest set of tokens whose probability sums to >= top_p
    top_k: int = -1  # -1 or 0 = disabled
    min_p: float = 0.0  # drop tokens with prob < min_p * prob of the most likely token
    repetition_penalty: float = 1.0  # HF style, over prompt + output tokens; 1 = off
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0  # OpenAI style, over output tokens
    seed: int | None = None  # None: the engine draws one per request
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop_token_ids are banned until this many tokens exist
    stop: str | Sequence[str] | None = ()  # normalised to tuple[str, ...]
    stop_token_ids: Sequence[int] | None = ()  # normalised to tuple[int, ...]
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top alternatives to report per generated token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Beam search (HF transformers semantics) when beam_width > 1: the request returns its
    # beam_width best finished beams, best first. Deterministic: temperature, top_p, top_k,
    # min_p and seed are ignored; n must be 1; penalties, min_tokens and stop strings are not
    # supported (HF applies them to log-probs, not logits). EOS and stop_token_ids end a beam.
    # logprobs and prompt_logprobs are reported as for sampling.
    beam_width: int = 1
    length_penalty: float = 1.0  # finished score = sum_logprobs / num_generated ** length_penalty
    early_stopping: bool | str = False  # True | False | "never", as in HF generate
    # Constrained decoding (structured.py): the output must match a JSON schema, any JSON
    # object, a regex, one of some strings or a grammar; a dict of StructuredOutputs' fields is
    # accepted. The request stops ("stop") once the grammar is complete.
    structured_outputs: StructuredOutputs | dict | None = None

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)

        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            set_(name, _check_float(name, getattr(self, name)))
        if not self.temperature >= 0.0 or math.isinf(self.temperature):
            raise ValueError(f"temperature must be in [0, inf), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(
                f"repetition_penalty must be in (0, inf), got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")

        _check_int("seed", self.seed, allow_none=True)
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")

        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )

        set_("stop", self._normalise_stop(self.stop))
        set_("stop_token_ids", self._normalise_stop_token_ids(self.stop_token_ids))

        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check_int(name, value, allow_none=True)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {value}")

        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

        set_("structured_outputs", StructuredOutputs.coerce(self.structured_outputs))
        self._check_beam(set_)

    def _check_beam(self, set_) -> None:
        _check_int("beam_width", self.beam_width)
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        set_("length_penalty", _check_float("length_penalty", self.length_penalty))
        if math.isinf(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if self.beam_width == 1:
            return
        if self.n != 1:
            raise ValueError(f"n must be 1 with beam search (beam_width={self.beam_width} returns "
                             f"beam_width completions), got n={self.n}")
        if self.uses_penalties:
            raise ValueError("beam search does not support repetition / presence / frequency penalties")
        if self.min_tokens:
            raise ValueError(f"beam search does not support min_tokens, got {self.min_tokens}")
        if self.structured_outputs is not None:
            raise ValueError("beam search does not support structured_outputs (each beam would need its "
                             "own grammar state); use n > 1 sampling or beam_width=1")
        if self.stop:
            raise ValueError(f"beam search does not support stop strings, got {list(self.stop)!r}; "
                             "use stop_token_ids")

    @staticmethod
    def _normalise_stop(stop: Any) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)):
            raise TypeError(f"stop must be a str, a list of str or None, got {stop!r}")
        for s in stop:
            if not isinstance(s, str):
                raise TypeError(f"stop must contain only str, got {s!r} in {list(stop)!r}")
            if not s:
                raise ValueError(f"stop must not contain empty strings, got {list(stop)!r}")
        return tuple(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> tuple[int, ...]:
        if ids is None:
            return ()
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"stop_token_ids must be a list of int or None, got {ids!r}")
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int):
                raise TypeError(f"stop_token_ids must contain only int, got {i!r}")
            if i < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {i} in {list(ids)!r}")
        return tuple(ids)

    # ---- construction helpers for the API layer ----

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> SamplingParams:
        """Build from user keyword arguments, rejecting unknown names with the valid list."""
        _check_names(kwargs)
        return cls(**kwargs)

    def replace(self, **kwargs: Any) -> SamplingParams:
        """A copy with some fields changed (validated again); those count as given by the caller."""
        _check_names(kwargs)
        new = dataclasses.replace(self, **kwargs)
        object.__setattr__(new, "_explicit", self.explicit_fields | frozenset(kwargs))
        return new

    @property
    def explicit_fields(self) -> frozenset[str]:
        """Names of the fields the caller set (constructor arguments, `replace` keywords)."""
        return self.__dict__.get("_explicit", _FIELD_NAMES)

    def with_defaults(self, defaults: dict[str, Any]) -> SamplingParams:
        """These params with `defaults` (a model's recommended sampling fields) in the fields the
        caller did not set. Beam search ignores sampling knobs and rejects penalties, so a beam
        request takes none."""
        todo = {k: v for k, v in defaults.items() if k not in self.explicit_fields}
        if not todo or self.beam_width > 1:
            return self
        _check_names(todo)
        new = dataclasses.replace(self, **todo)
        object.__setattr__(new, "_explicit", self.explicit_fields)
        return new

    # ---- derived properties ----

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return bool(fields.counted_rows(lambda name: getattr(self, name)))

    def banned_token_ids(self, num_generated: int, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
        """Token ids masked out at this step: EOS (unless ignore_eos) and stop_token_ids while
        fewer than min_tokens tokens have been generated; () otherwise."""
        if num_generated >= self.min_tokens:
            return ()
        eos = () if self.ignore_eos else tuple(eos_token_ids)
        return tuple(dict.fromkeys(eos + self.stop_token_ids))

    def validate_for(self, vocab_size: int, max_model_len: int, prompt_len: int,
                     prompt_token_ids: Sequence[int] | None = None) -> None:
        """Checks that need the model: raise ValueError naming the offending numbers."""
        if prompt_len < 1:
            raise ValueError("prompt is empty; at least 1 prompt token is required")
        if prompt_len + self.max_tokens > max_model_len:
            raise ValueError(
                f"prompt has {prompt_len} tokens and max_tokens is {self.max_tokens} "
                f"(total {prompt_len + self.max_tokens}); max_model_len is {max_model_len}"
            )
        for i in self.stop_token_ids:
            if i >= vocab_size:
                raise ValueError(
                    f"stop_token_ids contains {i}, outside the vocabulary [0, {vocab_size})"
                )
        if prompt_token_ids is not None:
            for i in prompt_token_ids:
                if not 0 <= i < vocab_size:
                    raise ValueError(
                        f"prompt contains token id {i}, outside the vocabulary [0, {vocab_size})"
                    )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise ValueError(f"{name} must be <= vocab_size={vocab_size}, got {value}")


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_FIELD_ORDER = tuple(f.name for f in dataclasses.fields(SamplingParams))
_dataclass_init = SamplingParams.__init__


@functools.wraps(_dataclass_init)
def _init_recording_explicit(self, *args, **kwargs):
    # The generated __init__ cannot tell a default from the same value passed on purpose
    # (temperature=1.0 must stay 1.0 when the model recommends 0.6), so record what was passed.
    _dataclass_init(self, *args, **kwargs)
    object.__setattr__(self, "_explicit", frozenset(_FIELD_ORDER[:len(args)]) | frozenset(kwargs))


SamplingParams.__init__ = _init_recording_explicit


def _check_names(kwargs: dict[str, Any]) -> None:
    unknown = sorted(set(kwargs) - _FIELD_NAMES)
    if unknown:
        raise TypeError(
            f"unknown sampling parameter(s) {unknown}; valid names are {sorted(_FIELD_NAMES)}"
        )
