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
    # harmony (gpt-oss): the analysis channel is the reasoning, final and commentary the content
    ("gpt_oss", False, "<|channel|>analysis<|message|>2 + 2 is 4.<|end|><|start|>assistant<|channel|>final"
                       "<|message|>It is 4.<|return|>", "2 + 2 is 4.", "It is 4."),
    ("gpt_oss", False, "<|channel|>analysis<|message|>a<b, c<|d<|end|><|start|>assistant<|channel|>commentary"
                       "<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>done",
     "a<b, c<|d", "Checking.done"),
    ("gpt_oss", False, "<|channel|>analysis<|message|>cut off while thi", "cut off while thi", ""),
    ("gpt_oss", False, "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|chan", "x", ""),
    ("gpt_oss", False, "no harmony tags", "", "no harmony tags"),
    ("gpt_oss", False, "<|channel|>final<|message|>only an answer<|return|>", "", "only an answer"),
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
            assert "|>" not in dc and ("|>" in reasoning or "|>" not in dr), pieces
        dr, dc = reader.finish()
        assert (r + dr, c + dc) == (reasoning, content), pieces


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="deepseek_r1"):
        reasoning_parser("nope")
    assert reasoning_parser(None) is None and set(PARSERS) == {"deepseek_r1", "gpt_oss", "qwen3"}


def test_harmony_keeps_special_tokens_in_the_text():
    """The harmony tags are special tokens: requests read by that parser keep them; others as asked."""
    from paxpage import SamplingParams
    from paxpage.server.reasoning import keep_reasoning_tags

    params = SamplingParams(max_tokens=4)
    assert keep_reasoning_tags(reasoning_parser("gpt_oss"), params).skip_special_tokens is False
    assert keep_reasoning_tags(reasoning_parser("qwen3"), params).skip_special_tokens is True
    assert keep_reasoning_tags(None, params) is params
