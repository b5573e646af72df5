"""ModelConfig from a GGUF file's metadata: llama.cpp's `{arch}.*` keys and tensor names, and
the Gemma values llama.cpp hard-codes rather than reading from the file.
"""

from __future__ import annotations

from typing import Any, Collection, Mapping

from models.config import ModelConfig, RopeScaling
from models.generation_config import GenerationConfig

# GGUF `general.architecture` -> model_type. llama.cpp writes Mistral as "llama", and Mixtral as
# "llama" with `llama.expert_count` (config_from_gguf_metadata tells them apart).
GGUF_ARCH_TO_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                           "gemma2": "gemma2", "gemma3": "gemma3_text"}
# What llama.cpp hard-codes for Gemma rather than reading from the file (src/llama-model.cpp):
# every n-th layer is global (the rest slide), unless {arch}.attention.sliding_window_pattern says otherwise;
_GGUF_GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}
# the 27B models scale queries by (hidden / heads) ** -0.5, all others by head_dim ** -0.5; llama.cpp
# recognises them by their layer count, as we do (no GGUF key holds query_pre_attn_scalar);
_GGUF_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Gemma 2's soft caps when the keys are absent (llama.cpp's and HF's defaults); Gemma 3's local RoPE base
# when {arch}.rope.freq_base_swa is absent.
_GGUF_GEMMA2_SOFTCAPS = (50.0, 30.0)
_GGUF_GEMMA3_LOCAL_ROPE_BASE = 10000.0


def config_from_gguf_metadata(metadata: Mapping[str, Any], tensor_names: Collection[str] = ()) -> ModelConfig:
    """Builds a config from GGUF key/values (e.g. "llama.block_count") and the file's tensor names.

    `metadata` needs scalar values only; `{arch}.vocab_size` must be present (a GGUF reader
    that lacks it fills it from the token_embd shape). Embeddings are tied when the file has
    no "output.weight"; Q/K/V biases are on when "blk.0.attn_q.bias" exists. Llama 3 rope
    scaling (baked into a rope_freqs tensor by llama.cpp) is not visible here; the GGUF
    reader passes it back in as `{arch}.rope.scaling.*` keys.
    """
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCH_TO_MODEL_TYPE:
        raise ValueError(
            f"unknown architecture: GGUF general.architecture {arch!r}; "
            f"paxpage supports {tuple(GGUF_ARCH_TO_MODEL_TYPE)}"
        )

    def get(key, default=None):
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks required key {arch}.{key!r}")
        return value

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    kind = str(get("rope.scaling.type", "none"))
    kind = {"none": "default", "": "default"}.get(kind, kind)
    scaling = RopeScaling(
        kind=kind,
        factor=float(get("rope.scaling.factor", 1.0)),
        low_freq_factor=float(get("rope.scaling.low_freq_factor", 1.0)),
        high_freq_factor=float(get("rope.scaling.high_freq_factor", 4.0)),
        original_max_position_embeddings=int(get("rope.scaling.original_context_length", 8192)),
        # llama.cpp's yarn keys; its attention factor is derived from the factor, as HF's default
        beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
    )
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    names = set(tensor_names)
    model_type = GGUF_ARCH_TO_MODEL_TYPE[arch]
    moe = {}
    num_experts = int(get("expert_count", 0))
    if num_experts:
        model_type = "mixtral" if arch == "llama" else model_type
        expert_width = int(get("expert_feed_forward_length", get("feed_forward_length", 0)))
        num_layers = int(get("block_count"))
        moe = dict(
            num_experts=num_experts,
            num_experts_per_tok=int(get("expert_used_count")),
            moe_intermediate_size=expert_width,
            # llama.cpp renormalises the top k for both qwen3moe and Mixtral.
            norm_topk_prob=bool(get("expert_weights_norm", True)),
            # A layer without a router tensor has a dense MLP.
            dense_mlp_layers=tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names),
        )
    elif model_type == "qwen3_moe":
        raise ValueError(f"GGUF metadata lacks required key {arch}.expert_count")
    head_dim = int(get("attention.key_length", hidden // num_heads))
    gemma = _gemma_fields_from_gguf(arch, get, int(get("block_count")), hidden, num_heads, head_dim)
    return ModelConfig(
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", moe.get("moe_intermediate_size", 0))),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        model_type=model_type,
        generation=GenerationConfig.from_gguf_metadata(metadata),
        **moe,
        **gemma,
    )


def _gemma_fields_from_gguf(arch: str, get, num_layers: int, hidden: int, num_heads: int,
                            head_dim: int) -> dict[str, Any]:
    """The Gemma fields of a gemma2 / gemma3 GGUF's metadata, as llama.cpp reads them ({} otherwise).
    `get(key, default)` reads "{arch}.{key}". llama.cpp's converter writes the window and the soft caps;
    the layer pattern, the query scale and Gemma 3's local RoPE base are llama.cpp's built-in values
    (see _GGUF_GEMMA_*) unless the file carries {arch}.attention.sliding_window_pattern /
    {arch}.rope.freq_base_swa."""
    if arch not in _GGUF_GEMMA_GLOBAL_EVERY:
        return {}
    window = get("attention.sliding_window", 0)
    pattern = get("attention.sliding_window_pattern", _GGUF_GEMMA_GLOBAL_EVERY[arch])
    if isinstance(pattern, (list, tuple)):  # one bool per layer: True = sliding
        if len(pattern) != num_layers:
            raise ValueError(f"{arch}.attention.sliding_window_pattern has {len(pattern)} entries; "
                             f"the model has {num_layers} layers")
        sliding = [bool(p) for p in pattern]
    else:  # every n-th layer is global; n == 0: none is
        every = int(pattern)
        sliding = [every == 0 or (i + 1) % every != 0 for i in range(num_layers)]
    layer_types = tuple("sliding_attention" if s else "full_attention" for s in sliding)
    if not window or not any(sliding):
        window, layer_types = None, ()
    is_27b = num_layers == _GGUF_GEMMA_27B_LAYERS[arch]
    attn_cap, final_cap = _GGUF_GEMMA2_SOFTCAPS if arch == "gemma2" else (0.0, 0.0)
    return dict(
        sliding_window=None if window is None else int(window),
        layer_types=layer_types,
        # HF's Gemma 3 never soft-caps attention scores, whatever the file says; 0 = no cap.
        attn_logit_softcap=(float(get("attn_logit_softcapping", attn_cap)) or None) if arch == "gemma2" else None,
        final_logit_softcap=float(get("final_logit_softcapping", final_cap)) or None,
        query_pre_attn_scalar=float(hidden // num_heads if is_27b else head_dim),
        local_rope_theta=float(get("rope.freq_base_swa", _GGUF_GEMMA3_LOCAL_ROPE_BASE)) if arch == "gemma3" else None,
        hidden_activation="gelu_tanh",
    )
