"""Model configuration: one frozen dataclass for the Llama family (Llama, Mistral, Qwen2, Qwen3),
its mixture-of-experts variants (Qwen3-MoE, Mixtral: `num_experts` > 0), the Gemma family
(Gemma 2, Gemma 3 text) and DeepSeek-V3 (multi-head latent attention: `kv_lora_rank` > 0).

Axis legend used across models/: T tokens in a step, H hidden size, N query heads,
K kv heads, D head dim, F MLP width, V vocabulary, E experts, C latent width.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Collection, Mapping

from models.generation_config import GenerationConfig

# HF `model_type` values this model family covers.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3_text",
                         "deepseek_v3", "gpt_oss")
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
LAYER_TYPES = ("full_attention", "sliding_attention")
# GGUF `general.architecture` -> model_type. llama.cpp writes Mistral as "llama", and Mixtral as
# "llama" with `llama.expert_count` (from_gguf_metadata tells them apart).
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


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """HF rope-scaling variants. `kind` is "default", "linear", "llama3" or "yarn".

    HF's "dynamic" NTK scaling rescales every cached key whenever the sequence grows,
    which a KV cache cannot follow, so it is rejected rather than silently approximated.
    """

    kind: str = "default"
    factor: float = 1.0
    # llama3 only:
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # llama3 and yarn: the context the model was pretrained with
    original_max_position_embeddings: int = 8192
    # yarn only (HF's names and defaults): the rotation counts bounding the interpolation ramp,
    # whether its ends round to whole dimensions, and the cos / sin magnitude (attention_factor,
    # else derived from factor, mscale and mscale_all_dim as DeepSeek's checkpoints state them)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"rope scaling type {self.kind!r} is not supported; expected one of {ROPE_KINDS}")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.kind == "yarn" and self.original_max_position_embeddings <= 0:
            raise ValueError(f"yarn original_max_position_embeddings must be > 0, "
                             f"got {self.original_max_position_embeddings}")

    @classmethod
    def from_hf(cls, rope: dict, max_position_embeddings: int | None) -> "RopeScaling":
        """From an HF `rope_scaling` / `rope_parameters` dict (absent keys take HF's defaults)."""
        kind = rope.get("rope_type", rope.get("type", "default")) or "default"
        original = rope.get("original_max_position_embeddings")
        factor = rope.get("factor")
        if kind == "yarn" and factor is None and original and max_position_embeddings:
            factor = max_position_embeddings / original  # DeepSeek-V3 states only the two lengths
        optional = {name: float(rope[name]) for name in ("mscale", "mscale_all_dim", "attention_factor")
                    if rope.get(name) is not None}
        return cls(
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


ROPE_KINDS = ("default", "linear", "llama3", "yarn")
ROUTER_SCORINGS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int  # H
    intermediate_size: int  # F
    num_layers: int
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # D
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm over D on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    # Sliding-window attention: a query sees its last `sliding_window` keys, itself included
    # (HF's `kv_idx > q_idx - sliding_window`), in the layers `layer_types` marks
    # "sliding_attention"; () = every layer (Mistral). None = no window anywhere.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # Gemma 2 / 3:
    attn_logit_softcap: float | None = None  # attention scores -> c * tanh(scores / c)
    final_logit_softcap: float | None = None  # LM-head logits -> c * tanh(logits / c)
    query_pre_attn_scalar: float | None = None  # softmax scale is this ** -0.5 (default head_dim)
    local_rope_theta: float | None = None  # Gemma 3: RoPE base of sliding layers (unscaled)
    hidden_activation: str = "silu"  # MLP gate activation: "silu" or "gelu_tanh"
    # generation_config.json / GGUF end-of-turn ids and sampling defaults (models/generation_config.py)
    generation: GenerationConfig = GenerationConfig()
    # Mixture of experts (models/moe.py). num_experts == 0: every layer has a dense MLP of width F.
    num_experts: int = 0  # E
    num_experts_per_tok: int = 0  # k, experts each token is routed to
    moe_intermediate_size: int = 0  # one expert's MLP width
    norm_topk_prob: bool = False  # rescale the k routing probabilities to sum to 1 (Mixtral: always)
    dense_mlp_layers: tuple[int, ...] = ()  # layers that keep a dense MLP (Qwen3-MoE mlp_only_layers)
    # DeepSeek-V3 routing (models/moe.py route_grouped): sigmoid scores plus a per-expert bias pick
    # the experts (the bias for choosing only), within the `topk_groups` best of `num_expert_groups`
    # groups; the chosen weights are scaled by routed_scaling_factor. Shared experts run on every token.
    router_scoring: str = "softmax"  # one of ROUTER_SCORINGS
    num_expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0  # their MLP width is num_shared_experts * moe_intermediate_size
    # Multi-head latent attention (DeepSeek-V3, models/deepseek.py). kv_lora_rank > 0 turns it on:
    # the pool caches one latent "head" of C = kv_lora_rank + qk_rope_head_dim values per token, and
    # head_dim is qk_rope_head_dim (the RoPE width), num_kv_heads 1 (the latent is shared by all heads).
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None  # None: a plain q_proj
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # RoPE on interleaved pairs (x0, x1), (x2, x3), ... (HF rope_interleave)
    # gpt-oss: a learned logit per query head joins every softmax's denominator (attention sinks);
    # o_proj has a bias; the router and each expert's projections have biases; and the experts'
    # activation is the clamped SwiGLU (up + 1) * g * sigmoid(swiglu_alpha * g), with the gate
    # g clamped to <= swiglu_limit and up to +-swiglu_limit (None: silu(gate) * up).
    attention_sinks: bool = False
    o_proj_bias: bool = False
    moe_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"ModelConfig.sliding_window must be None or a positive int, got {self.sliding_window!r}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries; the model has {self.num_layers} layers")
        for kind in self.layer_types:
            if kind not in LAYER_TYPES:
                raise ValueError(f"layer type {kind!r} is not supported; expected one of {LAYER_TYPES}")
        for name in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{name} must be None or > 0, got {value!r}")
        wanted = "gelu_tanh" if self.is_gemma else "silu"
        if self.hidden_activation != wanted:
            raise ValueError(
                f"hidden_activation {self.hidden_activation!r} is not supported for {self.model_type}; "
                f"expected {wanted!r}"
            )
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), "
                                 f"got {self.num_experts_per_tok}")
            if self.moe_intermediate_size < 1:
                raise ValueError(f"moe_intermediate_size must be >= 1 with experts, got {self.moe_intermediate_size}")
        bad = [i for i in self.dense_mlp_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"dense_mlp_layers {bad} are not layers of a {self.num_layers}-layer model")
        self._check_routing()
        self._check_mla()
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"ModelConfig.swiglu_limit must be None or > 0, got {self.swiglu_limit!r}")
        if (self.moe_bias or self.swiglu_limit is not None) and not self.num_experts:
            raise ValueError("moe_bias / swiglu_limit describe experts; the config has num_experts=0")
        if self.attention_sinks and self.is_mla:
            raise ValueError("attention sinks are not supported with latent attention")

    def _check_routing(self):
        if self.router_scoring not in ROUTER_SCORINGS:
            raise ValueError(f"router_scoring {self.router_scoring!r} is not supported; expected one of "
                             f"{ROUTER_SCORINGS}")
        groups, top_groups = self.num_expert_groups, self.topk_groups
        if groups < 1 or not 1 <= top_groups <= groups:
            raise ValueError(f"topk_groups ({top_groups}) must be in 1..num_expert_groups ({groups})")
        if groups > 1:
            # each group is ranked by the sum of its two best scores (HF's DeepseekV3TopkRouter)
            if self.num_experts % groups or self.num_experts // groups < 2:
                raise ValueError(f"num_expert_groups {groups} must divide num_experts ({self.num_experts}) "
                                 "into groups of at least 2")
            if self.num_experts_per_tok > top_groups * (self.num_experts // groups):
                raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} exceeds the "
                                 f"{top_groups * (self.num_experts // groups)} experts of {top_groups} groups")
        if self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be >= 0, got {self.num_shared_experts}")

    def _check_mla(self):
        if not self.kv_lora_rank:
            return
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int with latent attention, got {value!r}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"ModelConfig.q_lora_rank must be None or >= 1, got {self.q_lora_rank!r}")
        if (self.head_dim, self.num_kv_heads) != (self.qk_rope_head_dim, 1):
            raise ValueError(f"latent attention needs head_dim == qk_rope_head_dim ({self.qk_rope_head_dim}) "
                             f"and num_kv_heads == 1; got {self.head_dim} and {self.num_kv_heads}")
        if self.sliding_window is not None or self.qkv_bias or self.qk_norm:
            raise ValueError("latent attention supports no sliding window, attention bias or q/k norm")

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention: the pool caches the compressed latent (models/deepseek.py)."""
        return self.kv_lora_rank > 0

    @property
    def kv_pool_dims(self) -> tuple[int, int, int]:
        """(halves, heads, width) of one token's entry in a layer's pool [halves, P, page_size, heads,
        width]: K and V of K heads of D (2, K, D), or with latent attention one latent of
        C = kv_lora_rank + qk_rope_head_dim values and no separate V (1, 1, C)."""
        if self.is_mla:
            return 1, 1, self.kv_lora_rank + self.qk_rope_head_dim
        return 2, self.num_kv_heads, self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a sparse mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    @property
    def is_gemma(self) -> bool:
        return self.model_type in GEMMA_MODEL_TYPES

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None where it attends to every earlier key."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def max_window(self) -> int | None:
        """The window every layer keeps within, or None when some layer is global: only then can
        a sequence's pages before that window be released."""
        windows = [self.layer_window(i) for i in range(self.num_layers)]
        return None if any(w is None for w in windows) else max(windows)

    @property
    def sm_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
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
        scaling = RopeScaling.from_hf(rope, d.get("max_position_embeddings"))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        if model_type == "deepseek_v3":
            return _deepseek_from_hf(cls, d, float(rope_theta), scaling, eos_ids)
        gemma = model_type in GEMMA_MODEL_TYPES
        if gemma and d.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention (Gemma embedding models) is not supported; "
                             "paxpage runs causal language models")
        activation = d.get("hidden_activation") or d.get("hidden_act") or "silu"
        activation = {"gelu_pytorch_tanh": "gelu_tanh"}.get(activation, activation)
        sliding_window, layer_types = _hf_sliding_window(d, model_type)
        return cls(
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

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], tensor_names: Collection[str] = ()
    ) -> "ModelConfig":
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
        return cls(
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

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "ModelConfig":
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"no config.json in model directory {os.fspath(path)!r}")
        with open(config_path) as f:
            cfg = cls.from_hf_dict(json.load(f))
        return dataclasses.replace(cfg, generation=GenerationConfig.from_hf_dir(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["rope_scaling"] = RopeScaling(**d.get("rope_scaling", {}))
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["generation"] = GenerationConfig.from_dict(d.get("generation", {}))
        d["layer_types"] = tuple(d.get("layer_types", ()))
        d["dense_mlp_layers"] = tuple(d.get("dense_mlp_layers", ()))
        return cls(**d)

    @property
    def end_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a sequence: config.json's eos ids, then the generation config's."""
        return tuple(dict.fromkeys(self.eos_token_ids + self.generation.eos_token_ids))

    @property
    def kv_bytes_per_token(self) -> int:
        """f32 bytes of K and V (or the latent) for one token across all layers."""
        halves, heads, width = self.kv_pool_dims
        return halves * self.num_layers * heads * width * 4


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


def _deepseek_from_hf(cls, d: dict[str, Any], rope_theta: float, scaling: RopeScaling,
                      eos_ids: tuple[int, ...]) -> ModelConfig:
    """A HF deepseek_v3 config.json. The multi-token-prediction layers (num_nextn_predict_layers,
    stored as extra decoder layers after the last) are not loaded: the model predicts one token."""
    for name, supported in (("attention_bias", False), ("hidden_act", "silu"), ("scoring_func", "sigmoid"),
                            ("topk_method", "noaux_tc")):
        value = d.get(name, supported)
        if value != supported:
            raise ValueError(f"deepseek_v3 with {name}={value!r} is not supported; expected {supported!r}")
    num_layers = d["num_hidden_layers"]
    rope_dim = d["qk_rope_head_dim"]
    first_dense = d.get("first_k_dense_replace") or 0
    return cls(
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
        model_type="deepseek_v3",
        num_experts=d["n_routed_experts"],
        num_experts_per_tok=d["num_experts_per_tok"],
        moe_intermediate_size=d["moe_intermediate_size"],
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        dense_mlp_layers=tuple(range(min(first_dense, num_layers))),
        router_scoring="sigmoid",
        num_expert_groups=d.get("n_group") or 1,
        topk_groups=d.get("topk_group") or 1,
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        num_shared_experts=d.get("n_shared_experts") or 0,
        kv_lora_rank=d["kv_lora_rank"],
        q_lora_rank=d.get("q_lora_rank"),
        qk_nope_head_dim=d["qk_nope_head_dim"],
        qk_rope_head_dim=rope_dim,
        v_head_dim=d["v_head_dim"],
        rope_interleave=bool(d.get("rope_interleave", True)),
    )
