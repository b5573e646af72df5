"""SamplingParams: one test per validation rule; messages name the parameter and the value."""

import copy
import dataclasses
import pickle

import pytest

from paxpage.sampling.params import SamplingParams


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(n=0), r"n must be >= 1, got 0"),
        (dict(temperature=-0.5), r"temperature must be in \[0, inf\), got -0.5"),
        (dict(temperature=float("inf")), r"temperature must be in \[0, inf\), got inf"),
        (dict(temperature=float("nan")), r"temperature must be a number, got nan"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_k=-2), r"top_k must be -1 or 0 \(disabled\) or >= 1, got -2"),
        (dict(min_p=1.5), r"min_p must be in \[0, 1\], got 1.5"),
        (dict(min_p=-0.1), r"min_p must be in \[0, 1\], got -0.1"),
        (dict(repetition_penalty=0.0), r"repetition_penalty must be in \(0, inf\), got 0.0"),
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5"),
        (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\], got -3"),
        (dict(seed=-1), r"seed must be >= 0, got -1"),
        (dict(max_tokens=0), r"max_tokens must be >= 1, got 0"),
        (dict(min_tokens=-1), r"min_tokens must be in \[0, max_tokens=16\], got -1"),
        (dict(max_tokens=4, min_tokens=5), r"min_tokens must be in \[0, max_tokens=4\], got 5"),
        (dict(stop=["a", ""]), r"stop must not contain empty strings, got \['a', ''\]"),
        (dict(stop=""), r"stop must not contain empty strings"),
        (dict(stop_token_ids=[3, -1]), r"stop_token_ids must be >= 0, got -1"),
        (dict(logprobs=-1), r"logprobs must be >= 0 or None, got -1"),
        (dict(prompt_logprobs=-2), r"prompt_logprobs must be >= 0 or None, got -2"),
    ],
)
def test_range_rules(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(n=2.0), r"n must be an int, got 2.0"),
        (dict(n=True), r"n must be an int, got True"),
        (dict(top_k=1.5), r"top_k must be an int"),
        (dict(temperature="hot"), r"temperature must be a number, got 'hot'"),
        (dict(seed=1.0), r"seed must be an int or None"),
        (dict(stop=[1]), r"stop must contain only str, got 1"),
        (dict(stop=5), r"stop must be a str, a list of str or None"),
        (dict(stop_token_ids=["x"]), r"stop_token_ids must contain only int"),
        (dict(ignore_eos=1), r"ignore_eos must be a bool, got 1"),
    ],
)
def test_type_rules(kwargs, pattern):
    with pytest.raises(TypeError, match=pattern):
        SamplingParams(**kwargs)


def test_defaults_and_boundaries_accepted():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, -1, 0.0, 16)
    assert p.stop == () and p.stop_token_ids == () and p.seed is None and p.logprobs is None
    # Edges of every range are allowed.
    SamplingParams(temperature=0, top_p=1, top_k=0, min_p=1, presence_penalty=-2,
                   frequency_penalty=2, seed=0, max_tokens=1, min_tokens=1, logprobs=0)
    assert SamplingParams(top_k=1).top_k == 1


def test_ints_become_floats_and_lists_become_tuples():
    p = SamplingParams(temperature=1, stop=["a", "b"], stop_token_ids=[7, 9])
    assert isinstance(p.temperature, float)
    assert p.stop == ("a", "b") and p.stop_token_ids == (7, 9)
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()
    hash(p)  # frozen and hashable
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.7).greedy
    assert not SamplingParams().uses_penalties
    assert SamplingParams(frequency_penalty=0.1).uses_penalties


def test_banned_token_ids_follow_min_tokens():
    p = SamplingParams(min_tokens=3, stop_token_ids=[5, 2])
    assert p.banned_token_ids(0, (2,)) == (2, 5)  # deduplicated, EOS first
    assert p.banned_token_ids(2, (2,)) == (2, 5)
    assert p.banned_token_ids(3, (2,)) == ()
    assert SamplingParams(min_tokens=3, ignore_eos=True).banned_token_ids(0, (2,)) == ()


def test_from_kwargs_and_replace():
    p = SamplingParams.from_kwargs(temperature=0.5, max_tokens=8)
    assert p == SamplingParams(temperature=0.5, max_tokens=8)
    q = p.replace(top_p=0.9)
    assert q.top_p == 0.9 and q.temperature == 0.5 and p.top_p == 1.0
    with pytest.raises(TypeError, match=r"unknown sampling parameter\(s\) \['temprature'\]"):
        SamplingParams.from_kwargs(temprature=0.5)
    with pytest.raises(ValueError, match="top_p must be in"):
        p.replace(top_p=2.0)  # replace validates again


def test_validate_for_empty_prompt():
    with pytest.raises(ValueError, match="prompt is empty"):
        SamplingParams().validate_for(vocab_size=100, max_model_len=64, prompt_len=0)


def test_validate_for_context_length():
    SamplingParams(max_tokens=14).validate_for(vocab_size=100, max_model_len=64, prompt_len=50)
    with pytest.raises(ValueError, match=r"prompt has 50 tokens and max_tokens is 15 "
                                         r"\(total 65\); max_model_len is 64"):
        SamplingParams(max_tokens=15).validate_for(vocab_size=100, max_model_len=64, prompt_len=50)


def test_validate_for_stop_token_outside_vocab():
    with pytest.raises(ValueError, match=r"stop_token_ids contains 100, outside the vocabulary \[0, 100\)"):
        SamplingParams(stop_token_ids=[3, 100]).validate_for(100, 64, 5)


def test_validate_for_prompt_token_outside_vocab():
    with pytest.raises(ValueError, match=r"prompt contains token id 120, outside the vocabulary \[0, 100\)"):
        SamplingParams().validate_for(100, 64, 3, prompt_token_ids=[1, 120, 3])


def test_validate_for_logprobs_above_vocab():
    with pytest.raises(ValueError, match=r"logprobs must be <= vocab_size=100, got 101"):
        SamplingParams(logprobs=101).validate_for(100, 64, 3)


def test_explicit_fields_and_model_defaults():
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert SamplingParams().explicit_fields == frozenset()
    # unset fields take the defaults; set ones keep their value, even SamplingParams' own default
    p = SamplingParams(0 + 1, 1.0, max_tokens=5).with_defaults(defaults)  # n, temperature positional
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 0.9, 20, 5)
    p = SamplingParams(temperature=0).with_defaults(defaults)
    assert p.greedy and (p.top_p, p.top_k) == (0.9, 20)
    p = SamplingParams().replace(top_k=-1).with_defaults(defaults)
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.9, -1)
    assert p.explicit_fields == {"top_k"}  # defaults do not count as set by the caller
    # the record survives copying and pickling
    q = pickle.loads(pickle.dumps(SamplingParams(seed=1)))
    assert q.explicit_fields == {"seed"} and copy.copy(q).explicit_fields == {"seed"}
    # beam search takes none (it would reject a default repetition penalty)
    beam = SamplingParams(beam_width=2)
    assert beam.with_defaults({"repetition_penalty": 1.2}) is beam
