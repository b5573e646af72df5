"""LoRA adapters against HF PEFT on tiny random models (Llama, Qwen3): prompt logprobs, the
merged model's greedy tokens, a batch mixing adapters of different ranks with the base,
rsLoRA, bad adapters, compiles, the slot swap, prefix caching, n > 1 and beams."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

import paxpage
from paxpage import compile_counter
from tests.conftest import random_prompts, save_tiny_hf

# (name, rank, alpha, rsLoRA, targets): three ranks in one batch, one rsLoRA
ADAPTERS = [
    ("attn", 4, 8, False, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    ("mlp", 8, 16, False, ["gate_proj", "up_proj", "down_proj"]),
    ("all", 2, 4, True, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
]
# Two slots for three adapters: a batch of all three makes one wait for a slot and swap in.
ENGINE = dict(max_loras=2, max_lora_rank=8, num_pages=64, page_size=8, max_num_seqs=8,
              max_num_batched_tokens=64, prefill_row_len=16, use_tqdm=False)
PROMPT_LENS = [21, 9, 30, 5]
MIX = ["attn", "mlp", None, "all"]


def _save_adapter(base, path, rank, alpha, rslora, targets, seed):
    import peft
    import torch

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
                             init_lora_weights=False)  # random, non-zero lora_B
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # larger deltas, so a wrong or missing adapter changes the tokens
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    model.save_pretrained(path)
    return model.eval()


def _family(root, kind):
    base = save_tiny_hf(root / "base", kind)
    peft_models, dirs = {}, {}
    for i, (name, rank, alpha, rslora, targets) in enumerate(ADAPTERS):
        dirs[name] = root / name
        peft_models[name] = _save_adapter(copy.deepcopy(base), dirs[name], rank, alpha, rslora, targets, 10 + i)
    model = paxpage.load(str(root / "base"))
    for name, path in dirs.items():
        model.load_lora(name, path)
    return model, base, peft_models, dirs


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    family = _family(tmp_path_factory.mktemp("lora_llama"), "llama")
    yield family
    family[0].close()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    family = _family(tmp_path_factory.mktemp("lora_qwen3"), "qwen3")
    yield family
    family[0].close()


def _hf_prompt_logprobs(hf, ids):
    import torch

    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


def _greedy(hf, ids, n, **kw):
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long), **kw)
    return out[0, len(ids):].tolist()


def _check_mixed_batch(family, alone: bool, **engine):
    model, base, peft_models, _ = family
    engine = {**ENGINE, **engine}
    prompts = random_prompts(4, model.config.vocab_size, PROMPT_LENS, seed=3)
    mixed = paxpage.generate(model, prompts, lora=MIX, max_tokens=6, temperature=0, prompt_logprobs=1, **engine)
    for ids, name, out in zip(prompts, MIX, mixed):
        hf = peft_models[name] if name else base
        ours = [out.prompt_logprobs[i][ids[i]] for i in range(1, len(ids))]
        np.testing.assert_allclose(ours, _hf_prompt_logprobs(hf, ids), atol=1e-4, err_msg=str(name))
        merged = copy.deepcopy(hf).merge_and_unload() if name else base
        assert out.token_ids == _greedy(merged, ids, 6), name
        if alone:
            single = paxpage.generate(model, [ids], lora=name, max_tokens=6, temperature=0, **engine)[0]
            assert single.token_ids == out.token_ids, name
    return prompts


def test_mixed_batch_matches_peft_llama(llama):
    _check_mixed_batch(llama, alone=True)


def test_mixed_batch_matches_peft_qwen3(qwen3):
    _check_mixed_batch(qwen3, alone=False)


def test_mixed_batch_matches_peft_on_the_xla_path(llama):
    """XLA's attention, dot and gathered LoRA delta under the layer scan, the slab read whole by
    group (models/layer_stack.variables)."""
    model = llama[0]
    assert model.engine(_config(attention_impl="xla")).runner.lora_impl == "xla"
    _check_mixed_batch(llama, alone=False, attention_impl="xla")


def test_adapter_mix_changes_no_compile(llama):
    model, *_ = llama
    prompts = random_prompts(4, model.config.vocab_size, [7, 7, 7, 7], seed=7)
    first = paxpage.generate(model, prompts, lora=["attn", None, "attn", None], max_tokens=4, temperature=0,
                             **ENGINE)
    before = compile_counter.compiles()
    loads = model.engine(_config()).scheduler.lora_slots.num_loads
    # other adapters in the same shapes, swapped into the two slots
    again = paxpage.generate(model, prompts, lora=["mlp", "all", "mlp", None], max_tokens=4, temperature=0,
                             **ENGINE)
    paxpage.generate(model, prompts, lora=["attn", "all", "all", "attn"], max_tokens=4, temperature=0, **ENGINE)
    assert compile_counter.compiles() == before
    assert model.engine(_config()).scheduler.lora_slots.num_loads > loads
    assert again[3].token_ids == first[3].token_ids  # a base row, whatever the adapters beside it


def test_batch_invariant_rows_alone_equal_rows_mixed(llama):
    """batch_invariant with adapters (on CPU the native LoRA delta, whose per-token sums have a
    fixed order): each request's greedy tokens and their logprobs are the same alone as in the
    mixed batch, bit for bit."""
    model, *_ = llama
    if model.engine(_config(batch_invariant=True)).runner.lora_impl != "native":
        pytest.skip("the native LoRA delta is not used here")
    prompts = random_prompts(4, model.config.vocab_size, PROMPT_LENS, seed=5)
    opts = dict(max_tokens=5, temperature=0, logprobs=1, batch_invariant=True, **ENGINE)
    mixed = paxpage.generate(model, prompts, lora=MIX, **opts)
    for ids, name, out in zip(prompts, MIX, mixed):
        single = paxpage.generate(model, [ids], lora=name, **opts)[0]
        assert single.token_ids == out.token_ids, name
        assert single.outputs[0].logprobs == out.outputs[0].logprobs, name


def _config(**changes):
    from paxpage.config import EngineConfig

    return EngineConfig(**{k: v for k, v in ENGINE.items() if k != "use_tqdm"}, **changes)


def test_prefix_cache_is_per_adapter(llama):
    model, _, peft_models, _ = llama
    ids = random_prompts(1, model.config.vocab_size, [26], seed=11)[0]  # three full pages of 8
    first = paxpage.generate(model, [ids], lora="attn", max_tokens=3, temperature=0, **ENGINE)[0]
    other = paxpage.generate(model, [ids], lora="mlp", max_tokens=3, temperature=0, **ENGINE)[0]
    base = paxpage.generate(model, [ids], max_tokens=3, temperature=0, **ENGINE)[0]
    again = paxpage.generate(model, [ids], lora="attn", max_tokens=3, temperature=0, **ENGINE)[0]
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert again.num_cached_tokens == 24 and again.token_ids == first.token_ids
    assert other.token_ids == _greedy(copy.deepcopy(peft_models["mlp"]).merge_and_unload(), ids, 3)


def test_parallel_samples_and_beams_run_the_adapter(llama):
    import torch

    model, _, peft_models, _ = llama
    ids = random_prompts(1, model.config.vocab_size, [10], seed=13)[0]
    merged = copy.deepcopy(peft_models["all"]).merge_and_unload()
    out = paxpage.generate(model, [ids], lora="all", n=2, max_tokens=5, temperature=0, **ENGINE)[0]
    assert [c.token_ids for c in out.outputs] == [_greedy(merged, ids, 5)] * 2
    beams = paxpage.generate(model, [ids], lora="all", beam_width=2, max_tokens=5, **ENGINE)[0]
    with torch.no_grad():
        hf = merged.generate(torch.tensor([ids]), num_beams=2, do_sample=False, max_new_tokens=5, min_new_tokens=5,
                             pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert beams.token_ids == hf[0, len(ids):].tolist()


def test_ngram_speculation_verifies_with_the_adapter(llama):
    model, _, peft_models, _ = llama
    ids = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # repeats: the n-gram proposer drafts
    merged = copy.deepcopy(peft_models["attn"]).merge_and_unload()
    out = paxpage.generate(model, [ids], lora="attn", max_tokens=6, temperature=0, speculative_method="ngram",
                           num_speculative_tokens=2, **ENGINE)[0]
    assert out.token_ids == _greedy(merged, ids, 6)
    assert model.engine(_config(speculative_method="ngram", num_speculative_tokens=2)).stats.draft_tokens > 0


def test_stream_takes_lora(llama):
    model, *_ = llama
    ids = random_prompts(2, model.config.vocab_size, [6, 6], seed=17)
    want = paxpage.generate(model, ids, lora=["mlp", None], max_tokens=4, temperature=0, **ENGINE)
    engine_kw = {k: v for k, v in ENGINE.items() if k != "use_tqdm"}
    tokens = {0: [], 1: []}
    for delta in paxpage.stream(model, ids, lora=["mlp", None], max_tokens=4, temperature=0, **engine_kw):
        tokens[delta.index] += list(delta.token_ids)
    assert [tokens[0], tokens[1]] == [w.token_ids for w in want]


# ---------------------------------------------------------------- bad adapters and requests
def test_bad_adapters_raise_naming_value_and_limit(llama, tmp_path):
    import safetensors.numpy as st

    model, _, _, dirs = llama
    good = dirs["attn"]
    tensors = st.load_file(str(good / "adapter_model.safetensors"))
    config = json.loads((good / "adapter_config.json").read_text())

    def variant(name, tensors=tensors, **changes):
        path = tmp_path / name
        path.mkdir()
        st.save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({**config, **changes}))
        return path

    key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    wide = dict(tensors, **{key: np.zeros((4, 65), np.float32)})
    with pytest.raises(ValueError, match=r"lora_A \(4, 65\).*expected \(4, 64\)"):
        model.load_lora("wide", variant("wide", wide))
    head = dict(tensors, **{"base_model.model.lm_head.lora_A.weight": np.zeros((4, 64), np.float32)})
    with pytest.raises(ValueError, match="lm_head"):
        model.load_lora("head", variant("head", head))
    with pytest.raises(ValueError, match=r"target_modules \['embed_tokens'\]"):
        model.load_lora("embed", variant("embed", target_modules=["q_proj", "embed_tokens"]))
    with pytest.raises(ValueError, match="use_dora"):
        model.load_lora("dora", variant("dora", use_dora=True))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        model.load_lora("missing", tmp_path)
    assert sorted(model.loras) == ["all", "attn", "mlp"]  # nothing else was registered
    ids = [1, 2, 3]
    with pytest.raises(ValueError, match="rank 8; max_lora_rank is 4"):
        paxpage.generate(model, [ids], lora="mlp", **dict(ENGINE, max_lora_rank=4))
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'nope'.*\['all', 'attn', 'mlp'\]"):
        paxpage.generate(model, [ids], lora="nope", **ENGINE)
    with pytest.raises(ValueError, match="max_loras is 0"):
        paxpage.generate(model, [ids], lora="attn", use_tqdm=False, num_pages=16)
    with pytest.raises(ValueError, match="2 lora entries for 1 prompts"):
        paxpage.generate(model, [ids], lora=["attn", None], **ENGINE)
