"""Reasoning parsers: the model's `<think>...</think>` text goes to `reasoning_content`, the rest
to the answer (where tool calls are then read, server/tools.py).

- `qwen3`: the answer starts as content; a `<think>` before any other text opens the reasoning,
  `</think>` closes it. A prompt that already ends in `<think>` (a template that opens the
  reasoning for the model) starts the answer inside it. No tags at all: everything is content.
- `gpt_oss`: gpt-oss answers in OpenAI's harmony format, as messages
  `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`
  (its template's generation prompt ends in `<|start|>assistant`, so the answer opens with a
  header). The text of `analysis` messages is the reasoning, that of every other channel (`final`;
  `commentary`, preambles and tool calls) the content; headers and tags are never sent, and an
  answer with no `<|message|>` at all is content as it stands. The tags are special tokens, so
  requests it reads keep them in the text (`keeps_special_tokens`). With `keep_calls` (the
  `openai` tool parser reads the answer, server/tool_parsers/harmony.py) a message addressed
  `to=functions.NAME` goes to the content whole, opened with `<|start|>` and closed with its end tag.
- `deepseek_r1`: R1's templates put `<think>` in the prompt, so the answer starts inside the
  reasoning, with or without its own `<think>`; everything up to `</think>` is reasoning. An
  answer without `</think>` is all reasoning (it stopped while thinking).

For `<think>`: whitespace just after `</think>` is dropped from the content. One state machine reads streams
and whole answers alike; a tag split over several deltas is held back until it can be told
from text."""

from __future__ import annotations

import dataclasses

START, END = "<think>", "</think>"
HARMONY_START, HARMONY_MESSAGE, HARMONY_CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")  # a harmony message's end


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_inside: bool  # the answer begins inside the reasoning, whatever the prompt
    harmony: bool = False  # gpt-oss's harmony messages, not <think> tags
    keeps_special_tokens: bool = False  # its tags are special tokens, kept in the answer's text

    def stream(self, prompt_text: str | None = None, keep_calls: bool = False):
        """A ReasoningStream (or HarmonyStream): feed(text) -> (reasoning, content), finish().
        keep_calls: harmony messages addressed to a function stay whole in the content."""
        if self.harmony:
            return HarmonyStream(keep_calls)
        inside = self.starts_inside or (prompt_text or "").rstrip().endswith(START)
        return ReasoningStream(inside)

    def split(self, text: str, prompt_text: str | None = None, keep_calls: bool = False) -> tuple[str, str]:
        """(reasoning, content) of a whole answer."""
        reader = self.stream(prompt_text, keep_calls)
        r1, c1 = reader.feed(text)
        r2, c2 = reader.finish()
        return r1 + r2, c1 + c2


PARSERS = {p.name: p for p in (ReasoningParser("deepseek_r1", True), ReasoningParser("qwen3", False),
                                ReasoningParser("gpt_oss", False, harmony=True, keeps_special_tokens=True))}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not one of {sorted(PARSERS)}")
    return PARSERS[name]


def keep_reasoning_tags(parser, params):
    """SamplingParams that keep special tokens in the text when the parser reads them as tags."""
    if parser is not None and parser.keeps_special_tokens and params.skip_special_tokens:
        return dataclasses.replace(params, skip_special_tokens=False)
    return params


def _partial_suffix(text: str, *tags: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `tags`."""
    return max((k for tag in tags for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


class ReasoningStream:
    """One answer read delta by delta: feed(text) -> (reasoning, content) safe to send now."""

    def __init__(self, inside: bool):
        self._inside = inside
        self._may_open = not inside  # `<think>` opens the reasoning only before any content
        self._opened_once = inside  # an inside start may still repeat `<think>` itself
        self._strip = False  # drop whitespace after `</think>`
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = [], []
        while self._buf:
            if self._inside:
                if self._opened_once and self._buf.lstrip().startswith(START):
                    self._buf = self._buf.lstrip()[len(START):]
                    self._opened_once = False
                    continue
                if self._opened_once and START.startswith(self._buf.lstrip()):
                    break  # may still be the model's own `<think>`
                self._opened_once = False
                i = self._buf.find(END)
                if i >= 0:
                    reasoning.append(self._buf[:i])
                    self._buf, self._inside, self._strip = self._buf[i + len(END):], False, True
                    continue
                hold = _partial_suffix(self._buf, END)
                reasoning.append(self._buf[:len(self._buf) - hold])
                self._buf = self._buf[len(self._buf) - hold:]
                break
            if self._strip:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._strip = False
            if self._may_open:
                head = self._buf.lstrip()
                if head.startswith(START):
                    self._buf, self._inside, self._may_open = head[len(START):], True, False
                    continue
                if START.startswith(head):
                    break  # whitespace or part of `<think>`: wait for more
                self._may_open = False
            content.append(self._buf)
            self._buf = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held back, once the answer has ended."""
        rest, self._buf = self._buf, ""
        if self._inside:
            return rest, ""
        return "", "" if self._strip else rest


class HarmonyStream:
    """One answer read delta by delta: feed(text) -> (reasoning, content) safe to send now."""

    def __init__(self, keep_calls: bool = False):
        self._channel: str | None = None  # inside a message: its channel; None: in a header
        self._keep_calls = keep_calls
        self._call = False  # inside a message addressed to a function, kept whole
        self._messages = 0
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = [], []
        while self._buf:
            if self._channel is None:  # a header: everything up to <|message|>
                i = self._buf.find(HARMONY_MESSAGE)
                if i < 0:
                    break  # the header so far stays in the buffer
                header = self._buf[:i]
                self._buf = self._buf[i + len(HARMONY_MESSAGE):]
                channel = header.rsplit(HARMONY_CHANNEL, 1)[1] if HARMONY_CHANNEL in header else ""
                self._channel = channel.split()[0] if channel.split() else ""
                self._messages += 1
                self._call = self._keep_calls and "to=functions." in header
                if self._call:
                    content.append(HARMONY_START + header.rsplit(HARMONY_START, 1)[-1] + HARMONY_MESSAGE)
                continue
            ends = [(self._buf.find(tag), tag) for tag in HARMONY_ENDS if tag in self._buf]
            out = reasoning if self._channel == "analysis" and not self._call else content
            if ends:
                i, tag = min(ends)
                out.append(self._buf[:i] + (tag if self._call else ""))
                self._buf = self._buf[i + len(tag):]
                self._channel = None  # the next header (<|start|>assistant<|channel|>...) follows
                continue
            hold = _partial_suffix(self._buf, *HARMONY_ENDS)
            out.append(self._buf[:len(self._buf) - hold])
            self._buf = self._buf[len(self._buf) - hold:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held back, once the answer has ended: a message cut off mid-way keeps its
        channel; a partial header is dropped, unless the answer had no message at all."""
        rest, self._buf = self._buf, ""
        if self._channel is not None:
            return (rest, "") if self._channel == "analysis" and not self._call else ("", rest)
        return "", rest if not self._messages else ""
