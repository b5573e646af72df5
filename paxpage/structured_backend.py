"""The host side of structured outputs: one llguidance matcher per sample, and the step's bitmask.

Axis legend: R logits rows, W = ceil(V / 32) words of the allowed-token bitmask (bit j of word
w allows token 32 w + j), V the model's vocabulary (the logits width).

Why llguidance: its Rust core computes a mask for a 50k-200k vocabulary in tens of microseconds
(an Earley parser over a token trie, with lexer-level slices for JSON), fills many rows in
parallel outside the GIL straight into a numpy buffer, and needs neither torch nor a GPU; it
takes JSON schemas, regexes, Lark grammars and GBNF. It is what vLLM, SGLang and llama.cpp use.

Pure Python + numpy (no jax): the engine fills `GrammarBackend.bitmask` for a step's
constrained rows only (`RowMasks`), and the runner applies it to their logits on the device
(sampler.apply_bitmask) before it samples: a step with one structured row among hundreds
fills, sends and applies one row's mask.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from paxpage.structured import StructuredOutputs

logger = logging.getLogger("paxpage.structured")

_CACHED_GRAMMARS = 64  # compiled matchers kept as templates (deep copies are cheap)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class RowMasks(NamedTuple):
    """The allowed tokens of a step's constrained logits rows (a pytree: jax takes it as is).
    rows i32[K]: the logits row each mask applies to, distinct; padding rows are >= R (the
    step's logits rows) and apply nowhere. words i32[K, W]: bit j of word w allows token 32 w + j."""

    rows: np.ndarray
    words: np.ndarray

    @classmethod
    def padding(cls, num_rows: int, num_masks: int, num_words: int) -> RowMasks:
        """num_masks padding masks for a step of num_rows logits rows (they apply nowhere)."""
        return cls(np.full(num_masks, num_rows, np.int32), np.full((num_masks, num_words), -1, np.int32))


class GrammarBackend:
    """One per engine: the model's tokenizer in llguidance's form, a thread pool for masks, and
    the compiled grammars of recent specs.

    tokenizer: the engine's HF fast tokenizer (GGUF tokenizers load as one too).
    vocab_size: the model's logits width. Token ids the tokenizer does not have are never allowed.
    eos_token_ids: the ids that end a sequence; llguidance allows them once the grammar accepts.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        from llguidance import LLExecutor, LLTokenizer

        rust = getattr(tokenizer, "backend_tokenizer", None)
        if rust is None:
            raise ValueError("structured outputs need a fast (Rust `tokenizers`) tokenizer; "
                             f"this model's is {type(tokenizer).__name__}")
        if not eos_token_ids:
            raise ValueError("structured outputs need an EOS token id; the model and tokenizer define none")
        rust = copy.copy(rust)
        rust.no_padding()
        rust.no_truncation()
        # n_vocab: the logits width, or the tokenizer's if it is larger (ids past the model's
        # vocabulary are then cut off by the sampler). Ids with no token are never allowed.
        self.num_tokens = max(vocab_size, len(tokenizer))
        self.tokenizer = LLTokenizer(rust.to_str(), n_vocab=self.num_tokens, eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self.num_words = bitmask_words(self.num_tokens)
        self._executor = LLExecutor()
        self._templates: OrderedDict[StructuredOutputs, object] = OrderedDict()  # guarded by _lock
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs):
        """The compiled grammar of `spec` (cached); ValueError if it does not compile against this
        tokenizer. Thread-safe, and llguidance compiles outside the GIL: callers compile ahead
        of submission on their own threads, so the engine's `matcher` finds it cached."""
        from llguidance import LLMatcher

        with self._lock:
            template = self._templates.get(spec)
            if template is not None:
                self._templates.move_to_end(spec)
                return template
        template = LLMatcher(self.tokenizer, spec.to_grammar(), log_level=0)
        if template.is_error():
            raise ValueError(f"structured_outputs {spec.kind} is invalid: {template.get_error()}")
        with self._lock:
            self._templates[spec] = template
            if len(self._templates) > _CACHED_GRAMMARS:
                self._templates.popitem(last=False)
        return template

    def matcher(self, spec: StructuredOutputs):
        """A fresh matcher for `spec` at the start of the output; ValueError if the grammar does
        not compile against this tokenizer."""
        return self.compile(spec).deep_copy()

    def bitmask(self, entries: Sequence[tuple[object, int, int]], num_rows: int, num_masks: int) -> RowMasks:
        """The masks of each (matcher, row, count) entry's `count` logits rows from `row` on (a
        forking request's samples share their parent's state until they diverge), filled in
        parallel outside the GIL: RowMasks of num_masks rows (>= the entries' rows; the rest
        padding, row num_rows), for a step of num_rows logits rows. Rows not listed allow every token."""
        rows, words = RowMasks.padding(num_rows, num_masks, self.num_words)
        fills, at = [], 0
        for matcher, row, count in entries:
            if at + count > num_masks:
                raise ValueError(f"num_masks={num_masks} is fewer than the {sum(c for _, _, c in entries)} "
                                 "constrained rows")
            rows[at:at + count] = range(row, row + count)
            fills.append((matcher, at))
            at += count
        if fills:
            from llguidance.numpy import fill_next_token_bitmask_par

            fill_next_token_bitmask_par(self._executor, fills, words)
            for (_, _, count), (_, first) in zip(entries, fills):
                words[first + 1:first + count] = words[first]
        return RowMasks(rows, words)


def accept(matcher, token: int) -> bool:
    """Advances `matcher` by the sampled token. False when it refuses the token (only a token
    the mask did not allow can do that); the matcher is then in its error state."""
    if matcher.consume_token(token):
        return True
    logger.warning("structured outputs: the grammar refused token %d (%s)", token, matcher.get_error())
    return False
