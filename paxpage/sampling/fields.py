"""The one table of per-row sampling fields: each logits row's value of a SamplingParams field,
as the sampler reads it. Pure numpy.

A field has a name (the SamplingParams attribute and the SamplingTensors array), a dtype, the
neutral value a padding row takes (the field does nothing), and `derive(params, vocab_size)`,
the row's value (with normalisation such as top_k <= 0 or >= vocab -> 0, "off"). A neutral value
is a valid SamplingParams value too: params with every field neutral sample greedily with no
filter and no penalty (the rows of beam search). `counted` marks a penalty: a row whose value of
it is not neutral needs its tokens' counts (penalty_counts.py).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    dtype: type
    neutral: Any  # a padding row's value: the field has no effect
    derive: Callable[[Any, int], Any] = None  # (SamplingParams, vocab_size) -> the row's value
    counted: bool = False  # a penalty: a row using it needs its token counts

    def value(self, params, vocab_size: int):
        return getattr(params, self.name) if self.derive is None else self.derive(params, vocab_size)


def _top_k(params, vocab_size: int) -> int:
    return 0 if params.top_k <= 0 or params.top_k >= vocab_size else params.top_k


FIELDS = (
    Field("temperature", np.float32, 0.0),  # <= GREEDY_TEMPERATURE: greedy
    Field("top_p", np.float32, 1.0),
    Field("top_k", np.int32, 0, _top_k),  # 0: off
    Field("min_p", np.float32, 0.0),
    Field("repetition_penalty", np.float32, 1.0, counted=True),  # counts the prompt's tokens too
    Field("presence_penalty", np.float32, 0.0, counted=True),
    Field("frequency_penalty", np.float32, 0.0, counted=True),
)
NAMES = tuple(f.name for f in FIELDS)
COUNTED = tuple(f for f in FIELDS if f.counted)
NEUTRAL = {f.name: f.neutral for f in FIELDS}  # as SamplingParams keywords: greedy, unfiltered, unpenalised


def write_row(arrays: dict, row: int, params, vocab_size: int) -> None:
    """Sets row `row` of every field's array (arrays: {name: array}) from params."""
    for f in FIELDS:
        arrays[f.name][row] = f.value(params, vocab_size)


def neutral_rows(num_rows: int) -> dict[str, np.ndarray]:
    """{name: [num_rows] array of the field's neutral value}."""
    return {f.name: np.full(num_rows, f.neutral, f.dtype) for f in FIELDS}


def counted_rows(value_of: Callable[[str], Any]):
    """bool[R]: the rows that use a penalty (a counted field's value is not its neutral one).
    value_of(name) -> that field's [R] array (numpy or jax) or a scalar: one row."""
    return functools.reduce(operator.or_, (value_of(f.name) != f.neutral for f in COUNTED))
