"""Qwen3-MoE and Mixtral against HF transformers on tiny random weights (f32): greedy tokens and
prompt / sampled logprobs, from HF safetensors (per-expert and fused expert layouts) and GGUF."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import paxpage
from models.gguf_loader import permute_qk
from tests.conftest import hf_greedy, random_prompts, round_to_int8_per_channel, save_tiny_hf
from tests.models.test_loading import gguf_writer

# qwen3_moe: layer 1 keeps a dense MLP (mlp_only_layers), so both MLP kinds are exercised.
QWEN3_MOE = dict(num_hidden_layers=2, mlp_only_layers=[1])


def _check_against_hf(model, hf, num_tokens=8, lengths=(5, 19, 33)):
    """A batch of prompts of different lengths: greedy tokens, then every prompt and output
    token's logprob, equal to HF's."""
    prompts = random_prompts(len(lengths), 128, list(lengths), seed=7)
    outs = paxpage.generate(model, prompts, max_tokens=num_tokens, temperature=0, ignore_eos=True,
                            prompt_logprobs=1, logprobs=1, page_size=8, num_pages=64, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, num_tokens)
        ids = prompt + out.token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1).numpy()  # [S, V]
        got = [out.prompt_logprobs[p][prompt[p]] for p in range(1, len(prompt))]
        got += [entry[tok] for entry, tok in zip(out.outputs[0].logprobs, out.token_ids)]
        want = [ref[p - 1, ids[p]] for p in range(1, len(ids))]
        np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("kind,extra", [
    ("qwen3_moe", QWEN3_MOE),                               # norm_topk_prob false (HF default)
    ("mixtral", dict(num_hidden_layers=2)),                  # renormalised top 2 of 4
])
def test_moe_matches_hf(tmp_path, kind, extra):
    hf = save_tiny_hf(tmp_path, kind, **extra)
    model = paxpage.load(tmp_path)
    assert model.config.model_type == kind
    assert [model.config.is_moe_layer(i) for i in range(model.config.num_layers)] == (
        [True, False] if kind == "qwen3_moe" else [True, True])
    _check_against_hf(model, hf)


def test_fused_expert_checkpoint_matches_hf(tmp_path):
    """transformers 5's in-memory layout (experts.gate_up_proj as one 3-D tensor) written as is,
    with norm_topk_prob on and top 3 of 8."""
    from safetensors.torch import save_file

    hf = save_tiny_hf(tmp_path / "ref", "qwen3_moe", norm_topk_prob=True, num_experts_per_tok=3,
                      num_hidden_layers=2)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    os.makedirs(tmp_path / "fused")
    save_file(state, str(tmp_path / "fused" / "model.safetensors"))
    with open(tmp_path / "ref" / "config.json") as f:
        config = json.load(f)
    with open(tmp_path / "fused" / "config.json", "w") as f:
        json.dump(config, f)
    model = paxpage.load(tmp_path / "fused")
    assert model.config.norm_topk_prob and model.config.num_experts_per_tok == 3
    _check_against_hf(model, hf, num_tokens=4, lengths=(21,))


def _write_moe_gguf(path, hf, arch, expert_types=None):
    """A GGUF file as llama.cpp's converter lays MoE models out (3-D *_exps tensors). expert_types:
    {"gate" | "up" | "down": gguf.GGMLQuantizationType} for experts stored quantised; HF `hf`'s
    experts are then set to gguf's own dequantisation of what was written (the reference)."""
    import gguf

    expert_types = expert_types or {}

    def add_expert(name, part, x):  # x [E, out, in] float32 -> written; returns what the file holds
        qtype = expert_types.get(part)
        if qtype is None:
            w.add_tensor(name, np.ascontiguousarray(x))
            return x
        data = gguf.quants.quantize(np.ascontiguousarray(x), qtype)
        w.add_tensor(name, data, raw_dtype=qtype)
        return gguf.quants.dequantize(data, qtype)

    params = dict(hf.named_parameters())
    c = hf.config
    N, K = c.num_attention_heads, c.num_key_value_heads
    w = gguf_writer(path, c, arch)
    w.add_expert_count(getattr(c, "num_experts", None) or c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
                   "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
                   "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
                   "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
                   "mlp.gate.weight": "ffn_gate_inp", "mlp.experts.down_proj": "ffn_down_exps",
                   "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
                   "mlp.down_proj.weight": "ffn_down"}
    for hf_name, x in hf.state_dict().items():
        x = x.detach().numpy().astype(np.float32)
        if not hf_name.startswith("model.layers."):
            w.add_tensor(names[hf_name], x)
            continue
        _, _, i, rest = hf_name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":  # [E, 2*Fe, H]: llama.cpp keeps gate and up apart
            gate, up = np.split(x, 2, axis=1)
            held = [add_expert(f"blk.{i}.ffn_{part}_exps.weight", part, y) for part, y in (("gate", gate), ("up", up))]
            with torch.no_grad():
                params[hf_name].copy_(torch.from_numpy(np.concatenate(held, axis=1)))
            continue
        if rest == "mlp.experts.down_proj":
            with torch.no_grad():
                params[hf_name].copy_(torch.from_numpy(add_expert(f"blk.{i}.ffn_down_exps.weight", "down", x)))
            continue
        name = f"blk.{i}.{layer_names[rest]}.weight"
        if arch == "llama" and layer_names[rest] in ("attn_q", "attn_k"):
            x = permute_qk(x, N if layer_names[rest] == "attn_q" else K)
        w.add_tensor(name, np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind,arch,extra", [
    # llama.cpp's qwen3moe always renormalises the top k, so the reference does too.
    ("qwen3_moe", "qwen3moe", dict(QWEN3_MOE, norm_topk_prob=True)),
    ("mixtral", "llama", dict(num_hidden_layers=2)),
])
def test_moe_gguf_matches_hf(tmp_path, monkeypatch, kind, arch, extra):
    monkeypatch.setenv("PAXPAGE_CACHE_DIR", str(tmp_path / "cache"))
    hf = save_tiny_hf(tmp_path / "hf", kind, **extra)
    _write_moe_gguf(tmp_path / "tiny.gguf", hf, arch)
    model = paxpage.load(tmp_path / "tiny.gguf")
    cfg = model.config
    assert (cfg.model_type, cfg.norm_topk_prob) == (kind, True)
    assert cfg.dense_mlp_layers == ((1,) if kind == "qwen3_moe" else ())
    again = paxpage.load(tmp_path / "tiny.gguf")  # from the conversion cache this time
    assert again.config == cfg
    np.testing.assert_array_equal(again.per_layer_params()["layers_0"]["moe"]["gate_up_proj"],
                                  model.per_layer_params()["layers_0"]["moe"]["gate_up_proj"])
    _check_against_hf(model, hf, num_tokens=4, lengths=(21,))


@pytest.mark.parametrize("kind,arch,extra,types", [
    ("qwen3_moe", "qwen3moe", dict(QWEN3_MOE, norm_topk_prob=True), ("Q8_0", "Q8_0", "Q4_1")),
    # gate and up in different forms (Q4_1 has offsets): joined as floats; down stays quantised
    ("mixtral", "llama", dict(num_hidden_layers=2), ("Q8_0", "Q4_1", "Q4_0")),
], ids=["qwen3-moe", "mixtral-mixed"])
def test_moe_gguf_quantised_experts_stay_quantised_and_match_hf(tmp_path, monkeypatch, kind, arch, extra, types):
    """A GGUF's quantised 3-D expert tensors are held in their exact int8 form (quantization="gguf"):
    greedy tokens and logprobs equal HF's on gguf's own dequantisation of the file."""
    import gguf

    from models.param_layout import flatten

    monkeypatch.setenv("PAXPAGE_CACHE_DIR", str(tmp_path / "cache"))
    hf = save_tiny_hf(tmp_path / "hf", kind, **extra)
    qtypes = {part: gguf.GGMLQuantizationType[t] for part, t in zip(("gate", "up", "down"), types)}
    _write_moe_gguf(tmp_path / "tiny.gguf", hf, arch, qtypes)
    model = paxpage.load(tmp_path / "tiny.gguf", quantization="gguf")
    flat = flatten(model.per_layer_params())
    E, H = model.config.num_experts, model.config.hidden_size
    Fe = model.config.moe_intermediate_size
    assert flat["layers_0/moe/down_proj_q"].dtype == np.int8
    assert flat["layers_0/moe/down_proj_scale"].shape == (E, Fe // 32, H)
    assert ("layers_0/moe/down_proj_offset" in flat) == (types[2] == "Q4_1")
    if types[0] == types[1]:
        assert flat["layers_0/moe/gate_up_proj_scale"].shape == (E, H // 32, 2 * Fe)
    else:
        assert flat["layers_0/moe/gate_up_proj"].dtype == np.float32
    _check_against_hf(model, hf, num_tokens=4, lengths=(21,))


def test_int8_quantises_experts_per_channel_and_matches_hf_on_the_rounded_weights(tmp_path):
    """quantization="int8" holds every linear kernel, the embedding and each expert's projections as
    int8 with one f32 scale per output channel (experts: per expert). The reference is HF on weights
    rounded by that rule (tests/conftest.round_to_int8_per_channel)."""
    from models.param_layout import flatten

    hf = save_tiny_hf(tmp_path, "qwen3_moe", **QWEN3_MOE)
    model = paxpage.load(tmp_path, quantization="int8")
    flat = flatten(model.per_layer_params())
    E, H, Fe = model.config.num_experts, model.config.hidden_size, model.config.moe_intermediate_size
    assert flat["layers_0/moe/gate_up_proj_q"].dtype == np.int8
    assert flat["layers_0/moe/gate_up_proj_scale"].shape == (E, 1, 2 * Fe)
    assert flat["layers_0/moe/down_proj_scale"].shape == (E, 1, H)
    assert flat["layers_0/moe/router"].dtype == np.float32
    round_to_int8_per_channel(hf)
    _check_against_hf(model, hf, num_tokens=4, lengths=(21,))
