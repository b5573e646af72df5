"""One streamed answer read as it comes: the reasoning split off first (server/reasoning.py),
then tool calls read from what follows (server/tools.py). Chat chunks and Responses events
both read their deltas through it."""

from __future__ import annotations

from paxpage.server.tools import ToolCallStream, ToolPlan


class AnswerStream:
    def __init__(self, plan: ToolPlan, reasoning, prompt_text: str | None):
        """reasoning: the server's ReasoningParser, or None."""
        self._think = reasoning.stream(prompt_text, plan.harmony_calls) if reasoning is not None else None
        self._tools = ToolCallStream(plan) if plan.parse else None

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that can be sent now."""
        thought = ""
        if self._think is not None:
            thought, text = self._think.feed(text)
        if self._tools is not None:
            text = self._tools.feed(text)
        return thought, text

    def call_deltas(self) -> list[dict]:
        """OpenAI tool-call deltas for what the calls gained since the last time (tools.py)."""
        return self._tools.call_deltas() if self._tools is not None else []

    def final_deltas(self, calls: list) -> list[dict]:
        """The tool-call deltas that complete finish()'s calls."""
        return self._tools.final_deltas(calls) if self._tools is not None else []

    def finish(self) -> tuple[str, str, list]:
        """(reasoning, content, ParsedCalls) still held once the answer has ended."""
        thought, text = self._think.finish() if self._think is not None else ("", "")
        calls = []
        if self._tools is not None:
            text = self._tools.feed(text)
            rest, calls = self._tools.finish()
            text += rest
        return thought, text, calls
