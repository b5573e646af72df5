"""Structured outputs, host side: spec validation, the bitmask a matcher fills, and the device
mask compared with llguidance's own numpy reference (`apply_token_bitmask_inplace`)."""

from __future__ import annotations

import numpy as np
import pytest

from paxpage import SamplingParams as SP
from paxpage.structured import StructuredOutputs


@pytest.mark.parametrize("spec, message", [
    (dict(regex="a(b"), "regex is invalid: .*unclosed group"),
    (dict(json_schema="{not json"), "json_schema is not valid JSON"),
    (dict(json_schema={"type": "frobnicate"}), "json_schema is invalid: .*frobnicate"),
    (dict(grammar="start: undefined_rule"), "grammar is invalid: .*undefined_rule"),
    (dict(), "exactly one of .* got none"),
    (dict(regex="a", choice=["x"]), r"exactly one of .* got \['regex', 'choice'\]"),
    (dict(choice=[]), "at least one"),
    (dict(choice=["a", ""]), "empty strings"),
])
def test_invalid_specs_raise_value_error_naming_the_problem(spec, message):
    with pytest.raises(ValueError, match="(?s)" + message):
        SP(structured_outputs=spec)


def test_spec_types_and_normalisation():
    with pytest.raises(TypeError, match="choice must be a list of str"):
        StructuredOutputs(choice="yes")
    with pytest.raises(TypeError, match="unknown structured_outputs field"):
        SP(structured_outputs={"json": {}})
    with pytest.raises(TypeError, match="json_schema must be a dict"):
        StructuredOutputs(json_schema=[1, 2])
    a = SP(structured_outputs={"json_schema": {"type": "object", "properties": {"b": {}, "a": {}}}})
    b = SP(structured_outputs=StructuredOutputs(json_schema='{"type": "object", "properties": {"b": {}, "a": {}}}'))
    assert a == b and hash(a) == hash(b)  # a dict and its JSON text are one spec
    assert a.structured_outputs.json_schema.index('"b"') < a.structured_outputs.json_schema.index('"a"')
    assert SP(structured_outputs={"choice": ["x", "y"]}).structured_outputs.choice == ("x", "y")


def test_beam_search_rejects_structured_outputs():
    with pytest.raises(ValueError, match="beam search does not support structured_outputs"):
        SP(beam_width=2, structured_outputs={"regex": "a+"})


@pytest.fixture(scope="module")
def backend(tiny_text_dir):
    from models.tokenizer import load_tokenizer
    from paxpage.structured_backend import GrammarBackend

    tok = load_tokenizer(tiny_text_dir)
    # a model vocabulary wider than the tokenizer's: ids 320..399 have no token
    return tok, GrammarBackend(tok, 400, [0])


def _allowed(mask_row: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(mask_row.view(np.uint8), bitorder="little")).tolist())


def test_bitmask_allows_exactly_the_grammar_tokens(backend):
    tok, grammars = backend
    m = grammars.matcher(StructuredOutputs(choice=["yes", "no"]))
    masks = grammars.bitmask([(m, 1, 1)], 3, 4)
    assert masks.rows.tolist() == [1, 3, 3, 3]  # row 1's mask, then padding (row 3 of 3: none)
    assert masks.words.shape == (4, (400 + 31) // 32)
    assert (masks.words[1:] == -1).all()  # padding masks allow everything
    allowed = _allowed(masks.words[0])
    # hand check: every allowed token is a prefix of a choice; EOS and ids past the tokenizer are not
    assert allowed and max(allowed) < len(tok) and 0 not in allowed
    for t in allowed:
        text = tok.decode([t])
        assert "yes".startswith(text) or "no".startswith(text), text
    for t in range(len(tok)):  # ...and every token that is such a prefix is allowed
        text = tok.decode([t])
        if text and ("yes".startswith(text) or "no".startswith(text)) and t != 0:
            assert t in allowed, (t, text)
    for t in tok.encode("no", add_special_tokens=False):
        assert m.consume_token(t)
    assert m.is_stopped()
    assert _allowed(grammars.bitmask([(m, 0, 1)], 1, 1).words[0]) == {0}  # a complete grammar: EOS only


def test_bitmask_gives_a_forking_requests_rows_one_state(backend):
    _, grammars = backend
    spec = StructuredOutputs(choice=["yes", "no"])
    first, fork = grammars.matcher(spec), grammars.matcher(spec)
    assert fork.consume_token(grammars.tokenizer.tokenize_str("n")[0])
    masks = grammars.bitmask([(first, 0, 1), (fork, 2, 3)], 6, 8)
    assert masks.rows.tolist() == [0, 2, 3, 4, 6, 6, 6, 6]
    reference = grammars.bitmask([(fork, 5, 1)], 6, 4).words[0]
    assert not (reference == masks.words[0]).all()  # a different state: a different mask
    for k in (1, 2, 3):  # the fork's three rows share its one state
        np.testing.assert_array_equal(masks.words[k], reference)
    with pytest.raises(ValueError, match="num_masks=3 is fewer than the 4 constrained rows"):
        grammars.bitmask([(first, 0, 1), (fork, 2, 3)], 6, 3)


def test_device_mask_matches_llguidance_reference():
    import jax.numpy as jnp
    from llguidance.numpy import apply_token_bitmask_inplace

    from paxpage.sampling.sampler import apply_bitmask

    from paxpage.structured_backend import RowMasks

    rng = np.random.default_rng(0)
    for vocab in (100, 128, 49152):
        logits = rng.normal(size=(5, vocab)).astype(np.float32)
        words = (vocab + 31) // 32
        mask = rng.integers(-2**31, 2**31, size=(5, words), dtype=np.int64).astype(np.int32)
        mask[0] = -1
        want = logits.copy()
        apply_token_bitmask_inplace(want, mask)
        got = np.asarray(apply_bitmask(jnp.asarray(logits), RowMasks(np.arange(5, dtype=np.int32), mask)))
        np.testing.assert_array_equal(got, want)
        # some rows' masks, in any order, with padding (row 5 of 5): the other rows unchanged
        rows = np.array([3, 1, 5, 5], np.int32)
        some = np.full((4, words), -1, np.int32)
        some[:2] = mask[[3, 1]]
        partial = logits.copy()
        partial[[1, 3]] = want[[1, 3]]
        got = np.asarray(apply_bitmask(jnp.asarray(logits), RowMasks(rows, some)))
        np.testing.assert_array_equal(got, partial)


def test_every_sampling_mode_respects_the_mask():
    import jax.numpy as jnp

    from paxpage.sampling.sampler import apply_bitmask, sample
    from paxpage.sampling.tensors import SamplingTensors
    from paxpage.structured_backend import RowMasks

    vocab, rows = 300, 8
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 3
    allowed_sets = [rng.choice(vocab, size=k, replace=False) for k in (5, 2, 1, 17, 40, 3, 9, 60)]
    mask = np.zeros((rows, (vocab + 31) // 32), np.int32)
    for r, ids in enumerate(allowed_sets):
        for t in ids:
            mask[r, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    modes = [SP(temperature=0), SP(temperature=1.0), SP(temperature=0.7, top_k=3),
             SP(temperature=1.5, top_p=0.5), SP(temperature=1.0, min_p=0.2),
             SP(temperature=1.0, top_k=200, top_p=0.9), SP(temperature=0, repetition_penalty=1.5),
             SP(temperature=2.0, presence_penalty=1.0)]
    for seed in range(10):
        t = SamplingTensors.build([(p, [1, 2], [3, 4], seed) for p in modes], vocab)
        masked = apply_bitmask(jnp.asarray(logits), RowMasks(np.arange(rows, dtype=np.int32), mask))
        tokens = np.asarray(sample(masked, t, 0).token_ids)
        for r in range(rows):
            assert tokens[r] in allowed_sets[r], (r, modes[r])
        # greedy: the best allowed logit, by hand (row 6 after its repetition penalty on 1..4)
        assert tokens[0] == allowed_sets[0][np.argmax(logits[0, allowed_sets[0]])]
        penalised = logits[6].copy()
        penalised[1:5] = np.where(penalised[1:5] < 0, penalised[1:5] * 1.5, penalised[1:5] / 1.5)
        assert tokens[6] == allowed_sets[6][np.argmax(penalised[allowed_sets[6]])]


@pytest.mark.parametrize("pattern, ascii_form", [
    (r"\d{4}-\d{2}", "[[:digit:]]{4}-[[:digit:]]{2}"),
    (r"[\d.]+\W", "[[:digit:].]+[^[:word:]]"),
    (r"[^\D]\S", "[^[^[:digit:]]][^[:space:]]"),
    (r"\\d\p{Nd}", r"\\d\p{Nd}"),  # an escaped backslash, an explicit Unicode class: kept
    (r"[]\d][[:alpha:]\s]", "[][:digit:]][[:alpha:][:space:]]"),
])
def test_ascii_classes_rewrites_the_six_escapes_only(pattern, ascii_form):
    from paxpage.structured_regex import ascii_classes

    assert ascii_classes(pattern) == ascii_form


def test_regex_classes_are_ascii_unless_unicode_is_asked_for(smollm2):
    """Which strings a regex constraint accepts, through llguidance on the default model's
    tokenizer, against Python's `re` (re.ASCII by default; Unicode for unicode_regex)."""
    import re

    from paxpage.structured_backend import GrammarBackend

    tok = smollm2.tokenizer
    backend = GrammarBackend(tok, len(tok), [tok.eos_token_id])
    strings = ["2024", "\U0001FBF8\U0001FBF8", "\u0663\u0661", "a_9", "\u00e9t\u00e9", "a b", "a\u3000b", "x.y"]
    for pattern in (r"\d+", r"\w+", r"\w\s\w", r"[^\d]+", r"\D\W\S"):
        for unicode_regex, flags in ((False, re.ASCII), (True, 0)):
            spec = StructuredOutputs(regex=pattern, unicode_regex=unicode_regex)
            for s in strings:
                matcher = backend.matcher(spec)
                accepted = all(matcher.consume_token(t) for t in tok.encode(s, add_special_tokens=False)) \
                    and matcher.is_accepting()
                assert accepted == bool(re.fullmatch(pattern, s, flags)), (pattern, unicode_regex, s)


def test_unicode_regex_is_for_regex_constraints_only():
    with pytest.raises(ValueError, match="unicode_regex applies to a regex constraint only"):
        StructuredOutputs(choice=["a"], unicode_regex=True)
    with pytest.raises(TypeError, match="unicode_regex must be a bool"):
        StructuredOutputs(regex="a", unicode_regex="yes")
