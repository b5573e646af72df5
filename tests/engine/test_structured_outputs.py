"""Structured outputs through the engine on a tiny random llama with a real BPE tokenizer: every
output matches its constraint whatever the (random) model prefers (checked with `re`, `json`
and `jsonschema`, not with llguidance), with n > 1, streaming, stop strings, preemption, prefix
caching and async scheduling (token for token the synchronous engine's), without a recompile
as constrained requests come and go."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import paxpage
from paxpage import EngineConfig, SamplingParams as SP
from paxpage.engine import LLMEngine

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "kind": {"enum": ["cat", "dog"]},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                    "maxItems": 2}},
          "required": ["name", "age", "kind", "tags"], "additionalProperties": False,
          # the random model loves whitespace: no free whitespace keeps outputs short
          "x-guidance": {"whitespace_flexible": False}}
DATE = r"\d{4}-\d{2}-\d{2}"
CHOICES = ["yes", "no", "maybe so"]


@pytest.fixture(scope="module")
def tiny_text(tiny_text_dir):
    model = paxpage.load(tiny_text_dir)
    yield model
    model.close()


def _check(params: SP, text: str) -> None:
    spec = params.structured_outputs
    if spec is None:
        return
    if spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice, text
    else:
        jsonschema.validate(json.loads(text), json.loads(spec.json_schema))


def _workload():
    prompts = [[5 + i, 17, 3 * i + 1, 40] for i in range(8)]
    kinds = [SP(temperature=1.0, max_tokens=50, structured_outputs={"json_schema": SCHEMA}),
             SP(temperature=1.0, max_tokens=20, structured_outputs={"regex": DATE}),
             SP(temperature=0.8, top_k=5, max_tokens=10, structured_outputs={"choice": CHOICES}),
             SP(temperature=1.0, max_tokens=12, ignore_eos=True),  # unconstrained neighbour
             SP(temperature=0, max_tokens=30, structured_outputs={"regex": "[a-z]{3,}"}, stop=["q"])]
    return prompts, [kinds[i % len(kinds)].replace(seed=i) for i in range(len(prompts))]


# Two running sequences and a 7-page pool (a 40-token answer takes 6): preemptions. Few step
# shapes, so the async engine's precompile (which the compile check needs) stays short.
SMALL = dict(page_size=8, num_pages=7, max_model_len=96, max_num_seqs=2, max_num_batched_tokens=16,
             prefill_row_len=16, enable_prefix_caching=True)
ASYNC = EngineConfig(**SMALL, precompile=True)
SYNC = EngineConfig(**SMALL, async_scheduling=False)


def _check_all(params, results):
    for p, completions in zip(params, results):
        assert len(completions) == p.n
        for token_ids, text, reason, stop_reason in completions:
            if p.structured_outputs is None:
                assert reason == "length"
                continue
            if p.stop:  # [a-z]{3,} never completes: a stop string, EOS or the length ends it
                assert re.fullmatch("[a-z]*", text) and (reason, stop_reason) != ("stop", None), text
                continue
            assert reason == "stop", (p, text)
            _check(p, text)
            assert "<eos>" not in text and 0 not in token_ids[:-1]


@pytest.mark.extended
def test_no_recompiles_as_constrained_requests_come_and_go(tiny_text):
    from paxpage import compile_counter

    engine = tiny_text.engine(ASYNC)  # precompiles every step shape, the sampler and the masking call
    assert engine.precompiled[0] == len(engine.runner.step_shapes())
    before = compile_counter.compiles()
    prompts, params = _workload()
    outs = paxpage.generate(tiny_text, prompts, sampling_params=params, engine_config=ASYNC, use_tqdm=False)
    _check_all(params, [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
                        for o in outs])
    assert compile_counter.compiles() == before


@pytest.mark.extended
def test_outputs_match_and_async_equals_sync_under_preemption(tiny_text):
    prompts, params = _workload()
    params[1] = params[1].replace(n=3)  # each sample its own matcher, forked from the first
    results = {}
    for config in (SYNC, ASYNC):
        outs = paxpage.generate(tiny_text, prompts, sampling_params=params, engine_config=config, use_tqdm=False)
        results[config] = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
                           for o in outs]
    assert results[ASYNC] == results[SYNC]
    engine = tiny_text.engine(ASYNC)
    assert engine.scheduler.num_preemptions > 0 and engine.stats.overlapped_steps > 0
    assert engine.scheduler.page_manager.num_free_pages == SMALL["num_pages"]
    _check_all(params, results[ASYNC])
    dates = [c[1] for c in results[ASYNC][1]]
    assert len(set(dates)) > 1  # the three samples went their own ways
    # the unconstrained neighbour is untouched: the same tokens as alone in an engine
    alone = paxpage.generate(tiny_text, [prompts[3]], sampling_params=params[3], engine_config=ASYNC,
                             use_tqdm=False)
    assert alone[0].token_ids == results[ASYNC][3][0][0]


def test_grammar_end_stops_without_eos_and_stream_concatenates(tiny_text):
    params = SP(temperature=1.0, max_tokens=10, structured_outputs={"choice": CHOICES})
    outs = paxpage.generate(tiny_text, [[1, 2, 3]] * 4, sampling_params=[params.replace(seed=s) for s in range(4)],
                            engine_config=ASYNC, use_tqdm=False)
    for o in outs:
        assert o.text in CHOICES and o.finish_reason == "stop" and o.stop_reason is None
        assert 0 not in o.token_ids  # finished when the grammar was complete, before any EOS
    deltas = list(paxpage.stream(tiny_text, [[4, 5, 6]], temperature=1.0, seed=1, max_tokens=50,
                                 structured_outputs={"json_schema": SCHEMA}, engine_config=ASYNC))
    assert deltas[-1].finish_reason == "stop"
    _check(SP(structured_outputs={"json_schema": SCHEMA}), "".join(d.text for d in deltas))


def test_models_without_tokenizer_reject_structured_requests(tiny_llama_dir):
    model = paxpage.load(tiny_llama_dir)
    try:
        engine = model.engine(EngineConfig(page_size=8, num_pages=16, max_model_len=64))
        assert isinstance(engine, LLMEngine)
        with pytest.raises(ValueError, match="structured_outputs needs the model's tokenizer"):
            engine.add_request([1, 2, 3], SP(structured_outputs={"regex": "a+"}))
        assert not engine.has_unfinished()
    finally:
        model.close()


def test_batch_invariant_constrained_requests_alone_and_batched(tiny_text):
    """batch_invariant=True with grammar masks: each constrained (or unconstrained) request's tokens
    and logprobs are bitwise those it gets alone."""
    prompts, params = _workload()
    params = [p.replace(logprobs=0) for p in params[:5]]
    config = EngineConfig(page_size=8, num_pages=64, max_model_len=96, max_num_seqs=8, max_num_batched_tokens=16,
                          prefill_row_len=8, batch_invariant=True)

    def run(ps, sps):
        outs = paxpage.generate(tiny_text, ps, sampling_params=sps, engine_config=config, use_tqdm=False)
        return [(o.outputs[0].token_ids, [next(iter(d.values())) for d in o.outputs[0].logprobs]) for o in outs]

    batched = run(prompts[:5], params)
    assert batched == [run([p], [sp])[0] for p, sp in zip(prompts[:5], params)]
