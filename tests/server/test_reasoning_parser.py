"""The reasoning parsers on hand-written answers, whole and cut into every possible pair of
deltas and into single characters: the split never depends on where a delta ends."""

from __future__ import annotations

import pytest

from paxpage.server.reasoning import PARSERS, reasoning_parser

# (parser, prompt ends in <think>, answer, reasoning, content)
CASES = [
    ("qwen3", False, "<think>Let me see.</think>\n\nIt is 4.", "Let me see.", "It is 4."),
    ("qwen3", False, "\n<think>a < b</think>4", "a < b", "4"),
    ("qwen3", False, "No thinking here.", "", "No thinking here."),
    ("qwen3", False, "x <think>y</think>", "", "x <think>y</think>"),  # only at the start
    ("qwen3", False, "<think>cut off while thi", "cut off while thi", ""),
    ("qwen3", False, "<thin", "", "<thin"),
    ("qwen3", True, "reasoned</think> answer", "reasoned", "answer"),
    ("qwen3", False, "", "", ""),
    ("deepseek_r1", False, "inside already</think>\n\nanswer", "inside already", "answer"),
    ("deepseek_r1", False, "<think>\nown tag</think>answer </think>", "\nown tag", "answer </think>"),
    ("deepseek_r1", False, "no tags at all", "no tags at all", ""),
    ("deepseek_r1", False, "</think>only content", "", "only content"),
    ("deepseek_r1", False, "ends on a partial </thi", "ends on a partial </thi", ""),
]


@pytest.mark.parametrize("name,opened,text,reasoning,content", CASES)
def test_split_whole_and_streamed(name, opened, text, reasoning, content):
    parser = reasoning_parser(name)
    prompt = "<|im_start|>assistant\n<think>\n" if opened else "<|im_start|>assistant\n"
    assert parser.split(text, prompt) == (reasoning, content)
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        reader = parser.stream(prompt)
        r, c = "", ""
        for piece in pieces:
            dr, dc = reader.feed(piece)
            r, c = r + dr, c + dc
            if "think>" not in content:  # a tag is never sent as reasoning or content text
                assert "think>" not in dr + dc, pieces
        dr, dc = reader.finish()
        assert (r + dr, c + dc) == (reasoning, content), pieces


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="deepseek_r1"):
        reasoning_parser("nope")
    assert reasoning_parser(None) is None and set(PARSERS) == {"deepseek_r1", "qwen3"}
