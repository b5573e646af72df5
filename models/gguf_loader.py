"""GGUF files: metadata -> ModelConfig, tensors under HF names and HF layout: dequantised to f32, or
(`keep_quantized`) the Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K weights (linear kernels, the embedding and
the 3-D MoE expert tensors) kept in their exact int8 form (`Quantized`, models/gguf_quants.py).
Other types (F32 norms, F16, Q5_x, other K-quants) are always dequantised, and so are an expert
layer's gate and up tensors when their two formats differ (they are joined into one tensor).

llama.cpp's HF->GGUF converter permutes the rows of q_proj/k_proj (weights and biases) for the
"llama" architecture only, so that its interleaved-pair RoPE matches HF's rotate-half RoPE;
`unpermute_qk` undoes it (same as transformers' LlamaTensorProcessor). qwen2/qwen3 are stored unpermuted.
MoE layers (qwen3moe; Mixtral as "llama" with experts) store each expert projection as one 3-D
tensor (`ffn_{gate,up,down}_exps`, numpy shape [E, out, in]); gate and up are joined into HF's
fused `mlp.experts.gate_up_proj` [E, 2*Fe, H].
Llama 3 rope scaling is not stored as metadata but baked into a `rope_freqs.weight` tensor; we recover
the HF llama3 parameters by matching it against the known presets.
Gemma 2 / Gemma 3 ("gemma2", "gemma3"): q/k are stored unpermuted (llama.cpp rotates them NeoX-style,
as HF does); each block has four norms, named after llama.cpp's (attn_norm, post_attention_norm,
ffn_norm = the pre-MLP norm, post_ffw_norm); and since ggml scales by a norm weight w directly where
HF's Gemma scales by (1 + w), the converter stores every "*norm.weight" as w + 1, which we undo.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from models import gguf_quants
from models.config import ModelConfig
from models.gguf_config import GGUF_ARCH_TO_MODEL_TYPE, config_from_gguf_metadata


class Quantized(NamedTuple):
    """A GGUF weight in HF [out, in] layout: q i8[out, in], scale / offset f32[out, in / G]."""
    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None

# Expert gate / up tensors are read under these names, then joined into mlp.experts.gate_up_proj.
_GATE_EXPS, _UP_EXPS = "mlp.experts.gate_exps", "mlp.experts.up_exps"
# GGUF tensor name -> HF name; "{i}" is the layer.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # the MoE router [E, H]
    "ffn_gate_exps.weight": _GATE_EXPS,  # [E, Fe, H], joined with up below
    "ffn_up_exps.weight": _UP_EXPS,
    "ffn_down_exps.weight": "mlp.experts.down_proj",  # [E, H, Fe]
}
# HF names of the weights models/layers.py's Linear and Embedding can hold quantised (not the MoE router).
_QUANTIZABLE_TARGETS = ("_proj.weight", "embed_tokens.weight", "lm_head.weight", "mlp.experts.down_proj",
                        _GATE_EXPS, _UP_EXPS)
# Gemma's four norms per block (llama.cpp's "ffn_norm" is the pre-MLP norm there, not the post-attention one).
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Architectures whose converter writes norm weights as (w + 1): HF's Gemma RMSNorm scales by (1 + w).
_NORM_PLUS_ONE_ARCHS = ("gemma2", "gemma3")
# Arrays above this length (token lists, merges) are skipped when reading metadata: we never need them.
_MAX_METADATA_ARRAY = 1024
# (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) of released Llama 3.x.
_LLAMA3_PRESETS = ((8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (16.0, 1.0, 4.0, 8192))


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name of GGUF tensor `gguf_name` in a file of architecture `arch`, or None if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    layer_names = _GEMMA_LAYER_NAMES if arch in _NORM_PLUS_ONE_ARCHS else _LAYER_NAMES
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
    return None


def permute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's HF->GGUF permutation of q/k rows (`num_heads` = K for k_proj). Rows are dim 0."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of `permute_qk`: GGUF rows back to HF (rotate-half) order."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(theta: float, head_dim: int, factor: float, low: float, high: float, original: int):
    """The per-frequency divisors llama.cpp stores in rope_freqs.weight for HF llama3 rope scaling."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out)


def _open_reader(path: str):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # truncated or not GGUF: ValueError, IndexError, struct/numpy errors...
        raise ValueError(f"cannot read GGUF file {path!r} (truncated or not GGUF?): {type(e).__name__}: {e}") from e


def read_metadata(reader) -> dict[str, Any]:
    """Scalar (and short array) key/values of a GGUFReader."""
    import gguf

    meta = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY and len(field.data) > _MAX_METADATA_ARRAY:
            continue
        meta[key] = field.contents()
    return meta


def _dequantize(path: str, tensor) -> np.ndarray:
    import gguf

    try:
        x = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except Exception as e:
        raise ValueError(f"cannot dequantise tensor {tensor.name!r} ({tensor.tensor_type.name}) of {path!r}: {e}") from e
    return np.asarray(x, dtype=np.float32)


def _rope_scaling_from_freqs(path: str, meta: dict[str, Any], arch: str, freqs: np.ndarray) -> None:
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    num_heads = int(meta[f"{arch}.attention.head_count"])
    head_dim = int(meta.get(f"{arch}.attention.key_length", int(meta[f"{arch}.embedding_length"]) // num_heads))
    for factor, low, high, original in _LLAMA3_PRESETS:
        expected = llama3_rope_factors(theta, head_dim, factor, low, high, original)
        if expected.shape == freqs.shape and np.allclose(freqs, expected, rtol=1e-4):
            meta[f"{arch}.rope.scaling.type"] = "llama3"
            meta[f"{arch}.rope.scaling.factor"] = factor
            meta[f"{arch}.rope.scaling.low_freq_factor"] = low
            meta[f"{arch}.rope.scaling.high_freq_factor"] = high
            meta[f"{arch}.rope.scaling.original_context_length"] = original
            return
    raise ValueError(f"{path!r}: rope_freqs.weight matches no known Llama 3 rope scaling; cannot load")


def _read_tensor(path: str, tensor, keep_quantized: bool):
    if keep_quantized and tensor.tensor_type.name in gguf_quants.FORMATS and len(tensor.data.shape) in (2, 3):
        return Quantized(*gguf_quants.decode(tensor.data, tensor.tensor_type.name))
    return _dequantize(path, tensor)


def read_gguf(path: str, keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, Any], dict[str, Any]]:
    """Config, tensors (HF names, HF [out, in] layout, Q/K un-permuted) and metadata of a GGUF file.
    Tensors are f32 arrays, or with `keep_quantized` `Quantized` triples where the type has an exact
    int8 form (the un-permutation moves q, scale and offset rows alike).

    The metadata omits long arrays (the token list, merges); "tokenizer.ggml.model" tells whether the
    file embeds a tokenizer.
    """
    reader = _open_reader(path)
    try:
        meta = read_metadata(reader)
    except Exception as e:
        raise ValueError(f"cannot read GGUF metadata of {path!r}: {type(e).__name__}: {e}") from e
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCH_TO_MODEL_TYPE:
        raise ValueError(
            f"unknown architecture: GGUF file {path!r} has general.architecture {arch!r}; "
            f"paxpage supports {tuple(GGUF_ARCH_TO_MODEL_TYPE)}"
        )
    by_name = {t.name: t for t in reader.tensors}
    if f"{arch}.vocab_size" not in meta and "token_embd.weight" in by_name:
        meta[f"{arch}.vocab_size"] = int(by_name["token_embd.weight"].shape[-1])  # GGUF shape is [H, V]
    if "rope_freqs.weight" in by_name:
        _rope_scaling_from_freqs(path, meta, arch, _dequantize(path, by_name["rope_freqs.weight"]))
    try:
        cfg = config_from_gguf_metadata(meta, tensor_names=by_name)
    except (ValueError, TypeError) as e:
        raise ValueError(f"GGUF file {path!r}: {e}") from e

    tensors = {}
    for name, tensor in by_name.items():
        if name == "rope_freqs.weight":
            continue
        target = hf_name(name, arch)
        if target is None:
            raise ValueError(f"GGUF file {path!r} has tensor {name!r} that paxpage does not know")
        x = _read_tensor(path, tensor, keep_quantized and target.endswith(_QUANTIZABLE_TARGETS))
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads
            if isinstance(x, Quantized):
                x = Quantized(*(None if a is None else unpermute_qk(a, heads) for a in x))
            else:
                x = unpermute_qk(x, heads)
        if arch in _NORM_PLUS_ONE_ARCHS and target.endswith("norm.weight"):
            x = x - np.float32(1.0)
        tensors[target] = x
    for gate_name in [n for n in tensors if n.endswith(_GATE_EXPS)]:
        layer = gate_name[: -len(_GATE_EXPS)]
        up = tensors.pop(layer + _UP_EXPS, None)
        if up is None:
            raise ValueError(f"GGUF file {path!r} has {gate_name!r} but no matching ffn_up_exps tensor")
        tensors[layer + "mlp.experts.gate_up_proj"] = _join_experts(tensors.pop(gate_name), up)
    return cfg, tensors, meta


def _join_experts(gate, up):
    """[E, Fe, H] gate and up tensors -> [E, 2*Fe, H]: quantised when both are in one format (their
    scale and offset rows join as the values' rows), else the f32 expansions joined."""
    pair = (gate, up)
    if all(isinstance(x, Quantized) for x in pair) and gate.scale.shape == up.scale.shape \
            and (gate.offset is None) == (up.offset is None):
        return Quantized(*(None if a is None else np.concatenate([a, b], axis=1) for a, b in zip(gate, up)))
    gate, up = (gguf_quants.dequantize(*x) if isinstance(x, Quantized) else x for x in pair)
    return np.concatenate([gate, up], axis=1)
