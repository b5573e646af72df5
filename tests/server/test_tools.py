"""Tool calling over HTTP with the real `openai` client, on tiny random models carrying each
family's real chat template (Qwen2.5 / Hermes, Llama 3.1, Mistral v0.3; files in chat_templates/).

- The prompt the server builds from tools, assistant tool calls and tool results has exactly
  the tokens HF's `apply_chat_template(..., tools=...)` gives for the same conversation written
  in HF's form (arguments as dicts): nothing the client sent is dropped or changed.
- tool_choice "required" and a named function: the grammar makes the random model write a call
  in its family's format; the answer's tool_calls parse and validate (jsonschema), streamed and not.
- "auto": a call the model writes (forced here with a regex constraint) comes back as tool_calls,
  its leading text as content, streamed as content deltas then tool-call deltas."""

from __future__ import annotations

import json
import pathlib

import jsonschema
import pytest

from tests.conftest import save_tiny_hf
from tests.server.conftest import LiveServer

TEMPLATES = pathlib.Path(__file__).parent / "chat_templates"
VOCAB = 400  # one model width for the three families: their steps compile once
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now"}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}, "additionalProperties": False}}

# family: (template, special tokens, non-special added tokens, bos, eos, call id, the text a call is).
# EOS first, then one more special token: ids 0 and 1 in every family, so that the three models
# have one config and their steps compile once.
FAMILIES = {
    "qwen2.5": ("qwen2.5.jinja", ["<|im_end|>", "<|endoftext|>", "<|im_start|>"], ["<tool_call>", "</tool_call>"],
                None, "<|im_end|>", "call_abc123",
                '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    "llama3.1": ("llama3.1.jinja", ["<|eot_id|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                    "<|eom_id|>", "<|python_tag|>"], [], "<|begin_of_text|>", "<|eot_id|>",
                 "call_abc123", '{"name": "get_time", "parameters": {}}'),
    "mistral": ("mistral-v0.3.jinja", ["</s>", "<s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                       "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], [],
                "<s>", "</s>", "a1B2c3D4e", '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]'),
}


def save_family_model(path, family: str):
    """A tiny random llama whose byte-level BPE tokenizer has the family's special tokens and chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template, special, added, bos, eos, _, _ = FAMILIES[family]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [json.dumps(TOOLS), '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
              "What is the weather in Paris? The time now, please."] * 4
    tk.train_from_iterator(corpus, trainer)
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=bos, eos_token=eos)
    tok.chat_template = (TEMPLATES / template).read_text()
    tok.save_pretrained(path)
    assert len(tok) <= VOCAB
    assert tok.convert_tokens_to_ids(eos) == 0 and (bos is None or tok.convert_tokens_to_ids(bos) == 1)
    save_tiny_hf(path, "llama", vocab_size=VOCAB, max_position_embeddings=2048, eos_token_id=0, bos_token_id=1)
    return tok


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    import openai

    import paxpage
    from paxpage.async_engine import AsyncEngine

    path = tmp_path_factory.mktemp(f"tiny_{request.param}")
    tok = save_family_model(path, request.param)
    engine = AsyncEngine(paxpage.load(path), paxpage.EngineConfig(num_pages=128, page_size=16, max_num_seqs=1,
                                                                  max_model_len=2048))
    server = LiveServer(engine, served_model_name="tiny")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=180.0, max_retries=0)
    yield request.param, tok, client
    client.close()
    server.stop()


def _conversation(call_id: str) -> tuple[list[dict], list[dict]]:
    """(the OpenAI form the client sends, HF's form of the same turns)."""
    args = {"city": "Oslo", "days": 2}
    openai_form = [{"role": "user", "content": "Weather in Oslo?"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": call_id, "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
                   {"role": "tool", "tool_call_id": call_id, "content": "rain, 8 C"},
                   {"role": "assistant", "content": "Rain in Oslo."},
                   {"role": "user", "content": "And the time?"}]
    hf_form = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
               {"role": "tool", "tool_call_id": call_id, "content": "rain, 8 C"},
               {"role": "assistant", "content": "Rain in Oslo."},
               {"role": "user", "content": "And the time?"}]
    return openai_form, hf_form


def _check_calls(calls, names):
    assert calls, "no tool calls"
    for c in calls:
        assert c.type == "function" and c.id and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_prompt_renders_tools_calls_and_results_as_hf_does(family):
    name, tok, client = family
    messages, hf_messages = _conversation(FAMILIES[name][5])
    expected = tok.apply_chat_template(hf_messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "get_weather" in expected and "rain, 8 C" in expected and "Oslo" in expected
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                       max_completion_tokens=1)
    assert r.usage.prompt_tokens == len(tok.encode(expected, add_special_tokens=False))


def test_required_and_named_calls_parse_and_validate(family):
    name, _, client = family
    messages, _ = _conversation(FAMILIES[name][5])
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, seed=0, max_completion_tokens=120)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        _check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    # a named function, streamed: the name first, then the arguments in fragments as they are
    # sampled, adding up to one valid call: the call of the same request answered whole
    body = dict(model="tiny", messages=messages, tools=TOOLS, temperature=1.0, seed=1, max_completion_tokens=120,
                tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
    calls, reasons, content, fragments = {}, [], "", []
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or ():
                entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                assert d.function.name or entry["name"], "arguments before the name"
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
                fragments += [d.function.arguments] if d.function.arguments else []
    assert reasons[-1] == "tool_calls" and content == ""
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)
    assert len(fragments) > 2, fragments  # streamed as sampled, not sent whole at the end
    (whole,) = client.chat.completions.create(**body).choices[0].message.tool_calls
    assert (whole.function.name, whole.function.arguments) == ("get_weather", calls[0]["arguments"])


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_call_out_of_the_text(family, stream):
    import re

    name, tok, client = family
    text = FAMILIES[name][6]
    lead = "" if name == "llama3.1" else "Sure."  # a Llama call is the whole answer
    # the answer forced by a grammar, where added tokens are named as tokens (never spelled out)
    markers = [t for t in ("[TOOL_CALLS]", "<tool_call>", "</tool_call>") if t in tok.get_vocab()]
    parts = [json.dumps(p) if p not in markers else f"<[{tok.convert_tokens_to_ids(p)}]>"
             for p in re.split("(" + "|".join(map(re.escape, markers)) + ")", lead + text) if p] if markers else \
        [json.dumps(lead + text)]
    body = dict(model="tiny", messages=[{"role": "user", "content": "The time?"}], tools=TOOLS,
                max_completion_tokens=80, extra_body={"guided_grammar": "start: " + " ".join(parts)})
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert (choice.message.content or "") == lead
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
            [("get_time", {})]
        return
    content, calls, reasons = "", {}, []
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                name, args = calls.get(d.index, ("", ""))
                calls[d.index] = (name + (d.function.name or ""), args + (d.function.arguments or ""))
            reasons.append(c.finish_reason)
    assert content == lead and reasons[-1] == "tool_calls"
    assert [(name, json.loads(args)) for name, args in calls.values()] == [("get_time", {})]


def test_tool_request_errors(family):
    import openai

    _, _, client = family
    base = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=2)
    cases = [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
        (dict(tool_choice="required"), "tool_choice", "tools"),
        (dict(tools=TOOLS + TOOLS[:1]), "tools", "more than once"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
         "cannot be combined"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}]),
         "tools", "frobnicate"),
    ]
    for extra, param, word in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**base, **extra)
        err = e.value.body
        assert err["param"] == param and word in err["message"], err


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.extended
def test_smollm2_forced_calls_always_validate(smol_openai, tool_choice):
    """SmolLM2's template renders no tools: they are described in a system message (Hermes
    format). 10 seeded samples at temperature 1 per choice: every call's arguments validate.
    One call per answer: with parallel calls a sample may go on calling until its budget ends."""
    r = smol_openai.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What will the weather be in Oslo this week?"}],
        tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, temperature=1.0, seed=7, n=10,
        max_completion_tokens=80)
    names = {"get_weather"} if isinstance(tool_choice, dict) else {"get_weather", "get_time"}
    assert len(r.choices) == 10
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        _check_calls(choice.message.tool_calls, names)
        assert len(choice.message.tool_calls) == 1
    assert len({c.message.tool_calls[0].function.arguments for c in r.choices}) > 1  # samples, not one answer
