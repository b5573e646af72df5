"""Incremental detokenization and stop strings for one output sequence.

Decoding token by token is wrong for byte-level BPE: one character (emoji, CJK) can span several
tokens, and decoding a lone piece gives U+FFFD. Following vLLM, we keep two offsets into the
token list: text is decoded over a short window [prefix_offset:] and only what goes beyond the
decode of [prefix_offset:read_offset] is new, and only once it does not end in U+FFFD. The
window also gives SentencePiece tokenizers the left context they need for leading spaces. With a
fast tokenizer the window runs in Rust (tokenizers' DecodeStream, the same algorithm, seeded with
the prompt context); other tokenizers go through `tokenizer.decode`. A byte-level BPE (GPT-2,
Llama 3, Qwen, SmolLM2: a ByteLevel decoder alone) needs no window: its text is the UTF-8 of its
tokens' bytes, so a token whose bytes are whole characters is its own text, read from a table
(`_byte_level_pieces`), and only a token that splits a character (or an added token) goes
through the stream. Either way a token costs a few microseconds or less whatever the length of
the text (scripts/bench_detokenizer.py).

Stop strings are searched in the decoded text across token boundaries. Text that could still
turn out to be the start of a stop string is held back from the streamed deltas (unless the stop
string is included in the output anyway) and released by the next `add` or by `finish`, so a
stream never shows text the final output does not contain. Deltas concatenated equal `.text`.

An output nobody reads before it ends (not streamed, no stop strings) needs no text per token:
with a byte-level tokenizer `FinalText` keeps its tokens and decodes them once, when read, which
gives the same text (the incremental text of such a tokenizer is the full decode).

Contract for the engine: call `add` for each generated token, and `finish()` once when the
sequence ends for any reason other than a matched stop string (EOS, stop token, length):
until then `.text` may lack a held-back tail or an incomplete character.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:
    from tokenizers import Tokenizer as _RustTokenizer
    from tokenizers.decoders import ByteLevel as _ByteLevel, DecodeStream as _DecodeStream
except ImportError:  # tokenizers without DecodeStream: decode the window in Python
    _RustTokenizer = _DecodeStream = _ByteLevel = None

# Prompt tokens kept as left context for the first output token (vLLM uses 5 as well).
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    # Slots: a step reads a few fields of every streamed or stop-checked row's detokenizer, after the
    # device's step has pushed them out of the caches (fewer cache lines than a __dict__ lookup).
    __slots__ = ("_tokenizer", "_skip_special", "_special_ids", "_stop", "_include_stop", "_max_stop_len",
                 "_min_tokens", "_stop_chars", "_stream", "_pieces", "_backend", "_ids", "_read_offset",
                 "_prefix_text", "output_token_ids", "_text", "_tail", "_stopped_by", "_finished")

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, min_tokens: int = 0):
        if isinstance(stop, str):
            stop = (stop,)
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._special_ids = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._max_stop_len = max(map(len, self._stop), default=0)
        self._min_tokens = min_tokens  # stop strings count only from this many output tokens

        # A delta with none of these characters streams as it is while nothing is held back: a
        # new match ends in the delta (so holds a stop string's last character) and, when the
        # held-back tail is empty, also starts in it (no suffix of the streamed text begins a
        # stop string: the tail is the longest that does), and so does any text to hold back.
        self._stop_chars = frozenset(s[-1] if include_stop_str_in_output else s[0] for s in self._stop)

        context = [i for i in prompt_token_ids if i not in self._special_ids][-_CONTEXT_TOKENS:]
        self._stream = None
        self._pieces: list[str | None] | None = None
        self._backend = _rust_backend(tokenizer)  # the fast tokenizer's Rust one, where there is one
        if byte_level(tokenizer):  # no left context needed: see the docstring
            self._pieces = _byte_level_pieces(self._backend)
            context = []
        # context + output tokens still to be decoded; with the piece table only the tokens of a
        # character still incomplete (none left of them matters)
        self._ids: list[int] = list(context)
        self._read_offset = len(context)
        if self._pieces is None and self._backend is not None:
            # A fast tokenizer runs the same window algorithm in Rust (tokenizers' DecodeStream):
            # one call per token instead of two decodes through transformers' Python wrapper.
            try:
                self._stream = _DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
            except TypeError:  # an older DecodeStream without prompt context
                self._stream = None
        # With the stream or the table, the window's text is only needed by finish(): decoded there.
        self._prefix_text = self._decode(self._ids) if self._stream is None and self._pieces is None else None

        self.output_token_ids: list[int] = []
        self._text = ""  # output text returned as deltas so far (grown in place: see _emit)
        self._tail = ""  # decoded text held back (it could start a stop string): < max_stop_len
        self._stopped_by: str | None = None
        self._finished = False

    # ---- public API ----

    @property
    def text(self) -> str:
        """Output text returned so far: the concatenation of every delta."""
        return self._text

    @property
    def stopped_by(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stopped_by

    @property
    def finished(self) -> bool:
        return self._finished or self._stopped_by is not None

    def add(self, token_id: int) -> str:
        """Append one generated token; return the new text to stream (may be "").

        Once a stop string is matched, `stopped_by` is set, the returned delta ends the text
        and further calls return "" (the engine should stop the sequence)."""
        if self._finished or self._stopped_by is not None:
            return ""
        self.output_token_ids.append(token_id)
        if token_id in self._special_ids:
            return ""
        pieces = self._pieces
        if pieces is None or self._ids or token_id >= len(pieces) or (delta := pieces[token_id]) is None:
            delta = self._decode_next(token_id)
            if delta is None:
                return ""  # an incomplete character: wait for the tokens that finish it
        if not self._stop or (not self._tail and self._stop_chars.isdisjoint(delta)):
            return self._emit(delta)  # no stop string can end or begin in it
        return self._append_text(delta)

    def finish(self) -> str:
        """End of sequence: decode what is pending (even an incomplete character, as U+FFFD)
        and release held-back text. Returns the last delta."""
        if self.finished:
            return ""
        delta = ""
        if self._read_offset < len(self._ids):  # tokens that have not produced text yet
            prefix_text = self._prefix_text
            if prefix_text is None:
                prefix_text = self._decode(self._ids[:self._read_offset])
            tail = self._decode(self._ids)
            if len(tail) > len(prefix_text):
                delta = self._append_text(tail[len(prefix_text):])
        self._finished = True
        if self._stopped_by is None:
            delta += self._emit(self._tail)
            self._tail = ""
        return delta

    # ---- internals ----

    def _decode_next(self, token_id: int) -> str | None:
        """The window's new text once `token_id` joins it, or None while a character is
        incomplete. Between calls the window starts at 0: [0, read_offset) is the prefix
        (tokens whose text was consumed last), [read_offset, len) the tokens still to produce
        text. With the piece table the window holds only such tokens, from a fresh stream."""
        ids = self._ids
        if self._pieces is not None and not ids:
            self._stream = _DecodeStream(ids=[], skip_special_tokens=self._skip_special)
        ids.append(token_id)
        if self._stream is not None:
            delta = self._stream.step(self._backend, token_id)
            if delta is None:
                return None
        else:
            new_text = self._decode(ids)
            if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
                return None
            delta = new_text[len(self._prefix_text):]
        if self._pieces is not None:  # every token so far is text: the table takes the next
            self._ids = []
            return delta
        # Slide the window: the new prefix is the tokens just consumed; the ones left of it are
        # forgotten, so the list stays short.
        self._ids = ids = ids[self._read_offset:]
        self._read_offset = len(ids)
        if self._stream is None:
            self._prefix_text = self._decode(ids)
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special,
                                      clean_up_tokenization_spaces=False)

    def _append_text(self, delta: str) -> str:
        """Add decoded text, look for a stop string, return what may be streamed now.

        Work is bounded by the stop strings' length, not the text's: a new match must end in
        `delta`, so the search covers the last max_stop_len - 1 characters before it."""
        keep = self._max_stop_len - 1
        before = (self._text[-keep:] + self._tail)[-keep:] if keep > 0 else ""
        window = before + delta
        num_emitted = len(before) - len(self._tail)  # leading characters already streamed
        match = None
        if len(self.output_token_ids) >= self._min_tokens:
            match = self._find_stop(window)
        if match is not None:
            start, stop = match
            self._stopped_by = stop
            end = start + len(stop) if self._include_stop else start
            assert end >= num_emitted, (end, num_emitted)  # held-back text covers any match
            self._tail = ""
            return self._emit(window[num_emitted:end])
        pending = self._tail + delta
        held = self._held_back(pending)
        self._tail = pending[len(pending) - held:]
        return self._emit(pending[:len(pending) - held])

    def _find_stop(self, window: str) -> tuple[int, str] | None:
        """Earliest stop string occurrence in window (ties: list order)."""
        best = None
        for stop in self._stop:
            i = window.find(stop)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        return best

    def _held_back(self, pending: str) -> int:
        """Length of the longest suffix of pending that is a proper prefix of a stop string."""
        if self._include_stop:
            return 0  # a matched stop string stays in the output, so nothing can be retracted
        for n in range(min(self._max_stop_len - 1, len(pending)), 0, -1):
            suffix = pending[-n:]
            if any(s.startswith(suffix) for s in self._stop):
                return n
        return 0

    def _emit(self, delta: str) -> str:
        """Append to the streamed text. The attribute is cleared first so the string has a
        single reference and CPython grows it in place instead of copying it whole."""
        if delta:
            text, self._text = self._text, ""
            text += delta
            self._text = text
        return delta


class FinalText:
    """The text of an output read only once it has ended (not streamed, no stop strings), from a
    tokenizer whose decoder is byte-level alone (`byte_level`): the tokens are kept and decoded in
    one call when `text` is read, not a Python step per token. For such a tokenizer the
    incremental detokenizer's text is the full decode of the tokens, its special ones dropped
    when skipped (tests/engine/test_detokenizer.py holds both to that), so the text is the same.
    The part of IncrementalDetokenizer's interface the engine uses: add, finish, text, stopped_by."""

    __slots__ = ("_tokenizer", "_skip_special", "output_token_ids", "_finished", "_text", "_num_decoded")
    stopped_by = None  # no stop strings

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self.output_token_ids: list[int] = []
        self._finished = False
        self._text, self._num_decoded = "", 0

    @property
    def finished(self) -> bool:
        return self._finished

    def add(self, token_id: int) -> str:
        if not self._finished:
            self.output_token_ids.append(token_id)
        return ""

    def finish(self) -> str:
        self._finished, self._num_decoded = True, -1  # the held-back tail, if any, is text now
        return ""

    @property
    def text(self) -> str:
        """The decode of the tokens so far; before `finish`, without the tokens of a character
        still incomplete at the end (as the incremental detokenizer holds them back)."""
        ids = self.output_token_ids
        if self._num_decoded != len(ids) or not self._finished:
            text, end = self._decode(ids), len(ids)
            while not self._finished and end and text.endswith(_REPLACEMENT_CHAR):
                end -= 1
                text = self._decode(ids[:end])
            self._text, self._num_decoded = text, len(ids)
        return self._text

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special,
                                      clean_up_tokenization_spaces=False)


def _rust_backend(tokenizer: Any):
    """The fast tokenizer's Rust tokenizer, or None (or a tokenizers without DecodeStream)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if _DecodeStream is not None and isinstance(backend, _RustTokenizer) else None


def byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer is a fast one whose decoder is ByteLevel alone (GPT-2, Llama 3, Qwen,
    SmolLM2): its text is the UTF-8 of its tokens' bytes, needing no left context."""
    backend = _rust_backend(tokenizer)
    return backend is not None and isinstance(backend.decoder, _ByteLevel)


_PIECES: dict[int, tuple[object, list[str | None]]] = {}  # id(backend) -> (backend, its table)


def _byte_level_pieces(backend) -> list[str | None]:
    """Each token's text where its bytes are whole UTF-8 characters (None for the others, whose
    text depends on their neighbours, and for added tokens), built once per tokenizer (~20 ms
    for 49k tokens: one batched decode)."""
    cached = _PIECES.get(id(backend))
    if cached is not None and cached[0] is backend:
        return cached[1]
    size = backend.get_vocab_size(with_added_tokens=True)
    texts = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    added = backend.get_added_tokens_decoder()
    pieces = [None if (not text or _REPLACEMENT_CHAR in text or i in added) else text
              for i, text in enumerate(texts)]
    _PIECES[id(backend)] = (backend, pieces)
    return pieces
