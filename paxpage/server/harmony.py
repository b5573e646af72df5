"""The `gpt_oss` reasoning parser: gpt-oss answers in OpenAI's harmony format, as messages

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>

(the chat template's generation prompt ends in `<|start|>assistant`, so the answer opens with a
message header). The text of `analysis` messages is the reasoning; that of every other channel
(`final`, and `commentary`, which carries preambles and tool calls) is the content. Headers and the
tags themselves are never sent. An answer with no message at all (no `<|message|>`) is content as
it stands. The tags are special tokens, so requests read by this parser keep them in the text
(`keeps_special_tokens`)."""

from __future__ import annotations

import dataclasses

MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")  # a message's end
REASONING_CHANNEL = "analysis"


@dataclasses.dataclass(frozen=True)
class HarmonyParser:
    name: str = "gpt_oss"
    keeps_special_tokens: bool = True

    def stream(self, prompt_text: str | None = None) -> "HarmonyStream":
        return HarmonyStream()

    def split(self, text: str, prompt_text: str | None = None) -> tuple[str, str]:
        """(reasoning, content) of a whole answer."""
        reader = self.stream(prompt_text)
        r1, c1 = reader.feed(text)
        r2, c2 = reader.finish()
        return r1 + r2, c1 + c2


def _held(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `tags`."""
    return max((k for tag in tags for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


class HarmonyStream:
    """One answer read delta by delta: feed(text) -> (reasoning, content) safe to send now."""

    def __init__(self):
        self._header = ""  # the current header's text (role, channel, recipient), until <|message|>
        self._channel: str | None = None  # inside a message: its channel; None: in a header
        self._messages = 0
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = [], []
        while self._buf:
            if self._channel is None:  # a header: everything up to <|message|>
                i = self._buf.find(MESSAGE)
                if i < 0:
                    break  # the header so far stays in the buffer
                header = self._buf[:i]
                self._buf = self._buf[i + len(MESSAGE):]
                channel = header.rsplit(CHANNEL, 1)[1] if CHANNEL in header else ""
                self._channel = channel.split()[0] if channel.split() else ""
                self._messages += 1
                continue
            ends = [(self._buf.find(tag), tag) for tag in ENDS if tag in self._buf]
            out = reasoning if self._channel == REASONING_CHANNEL else content
            if ends:
                i, tag = min(ends)
                out.append(self._buf[:i])
                self._buf = self._buf[i + len(tag):]
                self._channel = None  # the next header (<|start|>assistant<|channel|>...) follows
                continue
            hold = _held(self._buf, ENDS)
            out.append(self._buf[:len(self._buf) - hold])
            self._buf = self._buf[len(self._buf) - hold:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held back, once the answer has ended: a message cut off mid-way keeps its
        channel; a partial header is dropped, unless the answer had no message at all."""
        rest, self._buf = self._buf, ""
        if self._channel is not None:
            return (rest, "") if self._channel == REASONING_CHANNEL else ("", rest)
        return "", rest if not self._messages else ""
