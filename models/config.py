"""Model configuration: one frozen dataclass for the Llama family (Llama, Mistral, Qwen2, Qwen3),
its mixture-of-experts variants (Qwen3-MoE, Mixtral: `num_experts` > 0), the Gemma family
(Gemma 2, Gemma 3 text), DeepSeek-V2 and DeepSeek-V3 (multi-head latent attention: `kv_lora_rank` > 0).

Axis legend used across models/: T tokens in a step, H hidden size, N query heads,
K kv heads, D head dim, F MLP width, V vocabulary, E experts, C latent width.

This module holds the dataclass and its validation. The readers that fill it live beside it:
models/hf_config.py (a HF config.json) and models/gguf_config.py (GGUF metadata); the
classmethods `from_hf_dict`, `from_hf_dir` and `from_gguf_metadata` call them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Collection, Mapping

from models.generation_config import GenerationConfig

# HF `model_type` values this model family covers.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3_text",
                         "deepseek_v2", "deepseek_v3", "gpt_oss")
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
LAYER_TYPES = ("full_attention", "sliding_attention")


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
        """From an HF `rope_scaling` / `rope_parameters` dict (models/hf_config.py)."""
        from models.hf_config import rope_scaling_from_hf

        return rope_scaling_from_hf(rope, max_position_embeddings)


ROPE_KINDS = ("default", "linear", "llama3", "yarn")
ROUTER_SCORINGS = ("softmax", "sigmoid")
# How DeepSeek routers pick the k experts from the scores (HF `topk_method`; models/moe.py route_grouped).
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


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
    # DeepSeek routing (models/moe.py route_grouped): the router's scores (router_scoring) choose the
    # experts by `topk_method`: "greedy" the top k of all; "group_limited_greedy" (DeepSeek-V2) the
    # top k within the `topk_groups` of `num_expert_groups` groups with the highest best score;
    # "noaux_tc" (DeepSeek-V3) scores plus a per-expert correction bias choose (the bias for choosing
    # only), within the groups with the highest sum of their two best. The chosen weights are scaled
    # by routed_scaling_factor. Shared experts run on every token.
    router_scoring: str = "softmax"  # one of ROUTER_SCORINGS
    topk_method: str = "greedy"  # one of TOPK_METHODS
    num_expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0  # their MLP width is num_shared_experts * moe_intermediate_size
    # Multi-head latent attention (DeepSeek-V2 / V3, models/deepseek.py). kv_lora_rank > 0 turns it on:
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
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r} is not supported; expected one of {TOPK_METHODS}")
        groups, top_groups = self.num_expert_groups, self.topk_groups
        if groups < 1 or not 1 <= top_groups <= groups:
            raise ValueError(f"topk_groups ({top_groups}) must be in 1..num_expert_groups ({groups})")
        if groups > 1 and self.topk_method == "greedy":
            raise ValueError(f"topk_method 'greedy' ignores groups; got num_expert_groups={groups}")
        if groups > 1:
            # noaux_tc ranks each group by the sum of its two best scores (HF's DeepseekV3TopkRouter)
            smallest = 2 if self.topk_method == "noaux_tc" else 1
            if self.num_experts % groups or self.num_experts // groups < smallest:
                raise ValueError(f"num_expert_groups {groups} must divide num_experts ({self.num_experts}) "
                                 f"into groups of at least {smallest}")
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
    # The readers import this module, so each classmethod imports its reader when called.
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Builds a config from the contents of a HF `config.json` (models/hf_config.py)."""
        from models.hf_config import config_from_hf_dict

        return config_from_hf_dict(d)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "ModelConfig":
        """The config of a HF model directory: config.json and generation_config.json (models/hf_config.py)."""
        from models.hf_config import config_from_hf_dir

        return config_from_hf_dir(path)

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], tensor_names: Collection[str] = ()
    ) -> "ModelConfig":
        """Builds a config from GGUF key/values and the file's tensor names (models/gguf_config.py)."""
        from models.gguf_config import config_from_gguf_metadata

        return config_from_gguf_metadata(metadata, tensor_names)

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
