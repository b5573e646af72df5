"""ModelConfig from a HF `config.json`: the fields each supported `model_type` names, HF's
defaults where a key is absent, its sliding-window and rope-scaling rules (YaRN included), and
a ValueError naming what paxpage does not model.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from models.config import GEMMA_MODEL_TYPES, SUPPORTED_MODEL_TYPES, ModelConfig, RopeScaling
from models.generation_config import GenerationConfig


def config_from_hf_dir(path: str | os.PathLike) -> ModelConfig:
    """The config of a HF model directory: its config.json, with generation_config.json's defaults."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"no config.json in model directory {os.fspath(path)!r}")
    with open(config_path) as f:
        cfg = config_from_hf_dict(json.load(f))
    return dataclasses.replace(cfg, generation=GenerationConfig.from_hf_dir(path))


def config_from_hf_dict(d: dict[str, Any]) -> ModelConfig:
    """Builds a config from the contents of a HF `config.json`."""
    model_type = d.get("model_type", "llama")
    if model_type == "gemma3":
        raise ValueError(
            "model_type 'gemma3' is the multimodal Gemma 3 (text_config + vision tower); paxpage runs "
            "text-only Gemma 3 checkpoints (model_type 'gemma3_text', e.g. gemma-3-1b)"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = d.get("architectures")
        raise ValueError(
            f"unknown architecture: model_type {model_type!r} (architectures {archs}); "
            f"paxpage supports {SUPPORTED_MODEL_TYPES}"
        )
    num_heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
    # transformers >= 5 moves rope settings into `rope_parameters`.
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    local_rope_theta = None
    if model_type == "gemma3_text":  # one rope per layer type; global layers may be scaled
        local = rope.get("sliding_attention") or {}
        local_rope_theta = float(local.get("rope_theta", d.get("rope_local_base_freq", 10000.0)))
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"Gemma 3 sliding-layer rope type {local.get('rope_type')!r} is not supported")
        rope = rope.get("full_attention") or {k: v for k, v in rope.items() if k != "sliding_attention"}
        rope.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
    rope_theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = rope_scaling_from_hf(rope, d.get("max_position_embeddings"))
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    if model_type in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_from_hf(d, model_type, float(rope_theta), scaling, eos_ids)
    gemma = model_type in GEMMA_MODEL_TYPES
    if gemma and d.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (Gemma embedding models) is not supported; "
                         "paxpage runs causal language models")
    activation = d.get("hidden_activation") or d.get("hidden_act") or "silu"
    activation = {"gelu_pytorch_tanh": "gelu_tanh"}.get(activation, activation)
    sliding_window, layer_types = _hf_sliding_window(d, model_type)
    return ModelConfig(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=d.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
        qkv_bias=bool(d.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids,
        model_type=model_type,
        sliding_window=sliding_window,
        layer_types=layer_types,
        # HF's Gemma 3 attention never applies attn_logit_softcapping (its configs set null).
        attn_logit_softcap=d.get("attn_logit_softcapping") if model_type == "gemma2" else None,
        final_logit_softcap=d.get("final_logit_softcapping") if gemma else None,
        query_pre_attn_scalar=d.get("query_pre_attn_scalar") if gemma else None,
        local_rope_theta=local_rope_theta,
        hidden_activation=activation,
        **_moe_fields_from_hf(d, model_type),
        **_gpt_oss_fields_from_hf(d, model_type),
    )


def rope_scaling_from_hf(rope: dict, max_position_embeddings: int | None) -> RopeScaling:
    """From an HF `rope_scaling` / `rope_parameters` dict (absent keys take HF's defaults)."""
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    original = rope.get("original_max_position_embeddings")
    factor = rope.get("factor")
    if kind == "yarn" and factor is None and original and max_position_embeddings:
        factor = max_position_embeddings / original  # DeepSeek-V3 states only the two lengths
    optional = {name: float(rope[name]) for name in ("mscale", "mscale_all_dim", "attention_factor")
                if rope.get(name) is not None}
    return RopeScaling(
        kind=kind,
        factor=float(1.0 if factor is None else factor),
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original or 8192),
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        truncate=bool(rope.get("truncate", True)),
        **optional,
    )


def _hf_sliding_window(d: dict[str, Any], model_type: str) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) as HF transformers applies them to `model_type`."""
    window = d.get("sliding_window")
    num_layers = d["num_hidden_layers"]
    if model_type in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        window = None  # Qwen configs carry a window that is off unless use_sliding_window
    if window is None:
        return None, ()
    if model_type == "mistral":
        return int(window), ()  # HF's Mistral slides in every layer, whatever layer_types says
    layer_types = d.get("layer_types")
    if layer_types is None:
        if model_type in ("qwen2", "qwen3"):
            first = d.get("max_window_layers", 28)
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        elif model_type in GEMMA_MODEL_TYPES or model_type == "gpt_oss":
            pattern = 2 if model_type in ("gemma2", "gpt_oss") else d.get("sliding_window_pattern", 6)
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        else:
            layer_types = ["sliding_attention"] * num_layers
    if "sliding_attention" not in layer_types:
        return None, ()
    return int(window), tuple(layer_types)


def _moe_fields_from_hf(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The MoE fields of a HF qwen3_moe / mixtral config.json ({} for dense model types)."""
    num_layers = d["num_hidden_layers"]
    if model_type == "mixtral":
        if d.get("sliding_window") is not None:
            raise ValueError(f"mixtral with sliding_window={d['sliding_window']} is not supported (full attention only)")
        return dict(num_experts=d["num_local_experts"], num_experts_per_tok=d["num_experts_per_tok"],
                    moe_intermediate_size=d["intermediate_size"], norm_topk_prob=True)
    if model_type == "gpt_oss":
        return dict(num_experts=d["num_local_experts"], num_experts_per_tok=d["num_experts_per_tok"],
                    moe_intermediate_size=d["intermediate_size"], norm_topk_prob=True)
    if model_type == "qwen3_moe":
        if d.get("use_sliding_window"):
            raise ValueError("qwen3_moe with use_sliding_window=true is not supported (full attention only)")
        # transformers 5 writes the expert count as num_local_experts; released checkpoints as num_experts.
        num_experts = d.get("num_experts", d.get("num_local_experts"))
        step = d.get("decoder_sparse_step") or 1
        mlp_only = set(d.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(num_layers) if i in mlp_only or not num_experts or (i + 1) % step)
        return dict(num_experts=num_experts or 0, num_experts_per_tok=d["num_experts_per_tok"],
                    moe_intermediate_size=d["moe_intermediate_size"],
                    norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                    dense_mlp_layers=dense if num_experts else ())
    return {}


def _gpt_oss_fields_from_hf(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The gpt-oss fields of a HF gpt_oss config.json ({} for other model types). Its router takes
    the top k of the biased logits and a softmax over those k: the same weights as a softmax over
    every expert renormalised over the top k (norm_topk_prob)."""
    if model_type != "gpt_oss":
        return {}
    bias = bool(d.get("attention_bias", True))
    return dict(o_proj_bias=bias, attention_sinks=True, moe_bias=True,
                swiglu_limit=float(d.get("swiglu_limit", 7.0)), swiglu_alpha=float(d.get("swiglu_alpha", 1.702)))


def _deepseek_from_hf(d: dict[str, Any], model_type: str, rope_theta: float, scaling: RopeScaling,
                      eos_ids: tuple[int, ...]) -> ModelConfig:
    """A HF deepseek_v2 / deepseek_v3 config.json. They share latent attention and shared experts;
    they differ in the router (DeepSeek-V3: sigmoid scores, topk_method "noaux_tc" with a correction
    bias; DeepSeek-V2: softmax scores, "greedy" or "group_limited_greedy", and HF's DeepseekV2 never
    renormalises the top k) and in RoPE's layout (V2 always rotates interleaved pairs; V3 says so in
    rope_interleave). The multi-token-prediction layers of V3 (num_nextn_predict_layers, stored as
    extra decoder layers after the last) are not loaded: the model predicts one token."""
    v3 = model_type == "deepseek_v3"
    fixed = {"attention_bias": False, "hidden_act": "silu"}
    if v3:
        fixed.update(scoring_func="sigmoid", topk_method="noaux_tc")
    else:
        # HF's DeepseekV2TopkRouter ignores norm_topk_prob; DeepSeek's own code renormalises when it
        # is set, so a checkpoint that sets it has no single meaning to follow.
        fixed.update(scoring_func="softmax", mlp_bias=False, norm_topk_prob=False)
    for name, supported in fixed.items():
        value = d.get(name, supported)
        if value != supported:
            raise ValueError(f"{model_type} with {name}={value!r} is not supported; expected {supported!r}")
    method = "noaux_tc" if v3 else (d.get("topk_method") or "greedy")
    if not v3 and method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"deepseek_v2 with topk_method={method!r} is not supported; "
                         "expected 'greedy' or 'group_limited_greedy'")
    groups = (d.get("n_group") or 1) if method != "greedy" else 1  # greedy ignores the groups
    num_layers = d["num_hidden_layers"]
    rope_dim = d["qk_rope_head_dim"]
    first_dense = d.get("first_k_dense_replace") or 0
    return ModelConfig(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=num_layers,
        num_heads=d["num_attention_heads"],
        num_kv_heads=1,
        head_dim=rope_dim,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids,
        model_type=model_type,
        num_experts=d["n_routed_experts"],
        num_experts_per_tok=d["num_experts_per_tok"],
        moe_intermediate_size=d["moe_intermediate_size"],
        norm_topk_prob=bool(d.get("norm_topk_prob", True)) if v3 else False,
        dense_mlp_layers=tuple(range(min(first_dense, num_layers))),
        router_scoring="sigmoid" if v3 else "softmax",
        topk_method=method,
        num_expert_groups=groups,
        topk_groups=(d.get("topk_group") or 1) if groups > 1 else 1,
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        num_shared_experts=d.get("n_shared_experts") or 0,
        kv_lora_rank=d["kv_lora_rank"],
        q_lora_rank=d.get("q_lora_rank"),
        qk_nope_head_dim=d["qk_nope_head_dim"],
        qk_rope_head_dim=rope_dim,
        v_head_dim=d["v_head_dim"],
        rope_interleave=bool(d.get("rope_interleave", True)) if v3 else True,
    )
