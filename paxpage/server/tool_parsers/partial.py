"""Reading tool calls out of text that is still arriving: where each call's JSON object begins,
its function name once the name's string is whole, and the raw text of its arguments object so
far. Streamed chat answers send the name first, then the arguments as they grow (OpenAI's
tool-call deltas); the text sent is the model's own, so the fragments add up to the arguments
of the whole answer (ToolParser.read keeps the same raw text)."""

from __future__ import annotations

import dataclasses
import json
import re

_SCALAR_END = frozenset(",}] \t\r\n")
_STRUCTURE = re.compile(r'["{}\[\]]')


@dataclasses.dataclass(frozen=True)
class PartialCall:
    name: str | None  # once its JSON string is complete
    arguments: str | None  # the raw text of the arguments object so far (None: not begun, or not an object)
    arguments_done: bool  # the object is closed


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


class ValueScan:
    """The scan of one JSON string, object or array in a growing text, resumed where it stopped,
    so a streamed call costs its new characters at each delta (quotes found by str.find,
    brackets by a regular expression), however long its arguments grow."""

    __slots__ = ("j", "depth", "in_string", "end")

    def __init__(self, text: str, start: int):
        self.in_string = text[start] == '"'
        self.j, self.depth, self.end = start + 1 if self.in_string else start, 0, None

    def advance(self, text: str) -> int | None:
        """The value's end (exclusive) in `text` (the old text, grown), or None while it is open."""
        j = self.j
        while self.end is None:
            if self.in_string:
                k = text.find('"', j)
                if k < 0:
                    break
                j = k + 1
                b = k - 1
                while text[b] == "\\":  # escaped when an odd number of backslashes precede it
                    b -= 1
                self.in_string = (k - 1 - b) % 2 == 1
                if not self.in_string and self.depth == 0:  # the value was this string
                    self.end = j
                continue
            m = _STRUCTURE.search(text, j)
            if m is None:
                break
            k = m.start()
            j = k + 1
            if text[k] == '"':
                self.in_string = True
            else:
                self.depth += 1 if text[k] in "{[" else -1
                if self.depth == 0:
                    self.end = j
        self.j = j if self.end is not None else len(text)
        return self.end


def value_end(text: str, i: int, memo: dict[int, ValueScan] | None = None) -> int | None:
    """The end (exclusive) of the JSON value that starts at text[i]; None while it is incomplete.
    memo: the scans of objects and arrays by start, kept between calls on the same growing text."""
    if i >= len(text):
        return None
    if text[i] in '"{[':
        scan = memo.get(i) if memo is not None else None
        if scan is None:
            scan = ValueScan(text, i)
            if memo is not None:
                memo[i] = scan
        return scan.advance(text)
    j = i  # a number, true, false or null: complete at the next delimiter
    while j < len(text) and text[j] not in _SCALAR_END:
        j += 1
    return j if j < len(text) else None


def read_call(text: str, i: int, arguments_keys: tuple[str, ...], memo: dict | None = None) -> PartialCall:
    """What the call object starting at text[i] ("{") holds so far (memo: as value_end takes it)."""
    name, args, done = None, None, False
    j = i + 1
    while True:
        j = skip_space(text, j)
        if j >= len(text) or text[j] == "}":
            break
        if text[j] == ",":
            j += 1
            continue
        key_end = value_end(text, j, memo) if text[j] == '"' else None
        if key_end is None:
            break
        key = json.loads(text[j:key_end])
        j = skip_space(text, key_end)
        if j >= len(text) or text[j] != ":":
            break
        j = skip_space(text, j + 1)
        end = value_end(text, j, memo)
        if key in arguments_keys and j < len(text) and text[j] == "{":
            args, done = text[j:end if end is not None else len(text)], end is not None
        if end is None:
            break
        if key == "name":
            value = json.loads(text[j:end])
            name = value if isinstance(value, str) else None
        j = end
    return PartialCall(name, args, done)


def objects_after(text: str, j: int, separator: str, memo: dict | None = None) -> list[int]:
    """Starts of the JSON objects from text[j] on, one after another with `separator` between
    them (and whitespace), up to anything else."""
    starts = []
    while True:
        j = skip_space(text, j)
        if j >= len(text) or text[j] != "{":
            return starts
        starts.append(j)
        end = value_end(text, j, memo)
        if end is None:
            return starts
        j = skip_space(text, end)
        if j >= len(text) or text[j] != separator:
            return starts
        j += 1
