"""The paxpage parameter tree: its shapes, its HF tensor names, and conversion from HF tensors.

Tree (nested dicts of arrays; kernels are [in, out] like flax Dense):
    embed_tokens/embedding [V, H]
    layers_{i}/input_layernorm/scale [H]
    layers_{i}/{q,k,v}_proj/kernel [H, N*D | K*D]   (+ bias [N*D | K*D] if cfg.qkv_bias)
    layers_{i}/o_proj/kernel [N*D, H]
    layers_{i}/{q,k}_norm/scale [D]                 (if cfg.qk_norm)
    layers_{i}/post_attention_layernorm/scale [H]
    layers_{i}/{pre,post}_feedforward_layernorm/scale [H]  (Gemma; its norms hold w of (1 + w))
    layers_{i}/{gate,up}_proj/kernel [H, F], layers_{i}/down_proj/kernel [F, H]   (dense MLP layers)
    layers_{i}/moe/router [H, E]                    (MoE layers, cfg.is_moe_layer(i); models/moe.py)
    layers_{i}/moe/gate_up_proj [E, H, 2*Fe]        (each expert's gate columns, then its up columns)
    layers_{i}/moe/down_proj [E, Fe, H]
    layers_{i}/moe/{router_bias [E], gate_up_bias [E, 2*Fe], down_bias [E, H]}   (gpt-oss, cfg.moe_bias)
    layers_{i}/o_proj/bias [H], layers_{i}/attention_sinks [N]   (gpt-oss)
    norm/scale [H]
    lm_head/kernel [H, V]                           (unless cfg.tie_word_embeddings)
Latent-attention layers (DeepSeek-V2 / V3, cfg.is_mla; models/deepseek.py) instead of q/k/v/o above:
    layers_{i}/q_proj/kernel [H, N*(Dn+Dr)]         (q_lora_rank None), else
    layers_{i}/q_a_proj/kernel [H, Q], q_a_layernorm/scale [Q], q_b_proj/kernel [Q, N*(Dn+Dr)]
    layers_{i}/kv_a_proj_with_mqa/kernel [H, Cr+Dr], kv_a_layernorm/scale [Cr]
    layers_{i}/kv_b_proj/kernel [Cr, N*(Dn+Dv)], o_proj/kernel [N*Dv, H]
    layers_{i}/mlp/{gate,up,down}_proj/kernel       (dense layers)
    layers_{i}/moe/e_score_correction_bias [E]      (topk_method "noaux_tc": DeepSeek-V3)
    layers_{i}/shared_experts/{gate,up,down}_proj/kernel   (MoE layers, beside moe/router and the experts)
Axis legend: H hidden, N query heads, K kv heads, D head dim, F MLP width, V vocabulary,
E experts, Fe one expert's MLP width (cfg.moe_intermediate_size), Q q_lora_rank, Cr kv_lora_rank,
Dn / Dr / Dv qk_nope / qk_rope / v head dims.
Quantised weights (models/quant.py) replace a `kernel` leaf by `kernel_q` (int8, same shape),
`kernel_scale` and optionally `kernel_offset` (f32, one row per group of inputs), and likewise
`embedding` by `embedding_q` / `embedding_scale` [/ `embedding_offset`] (groups along H), and
MoE experts `gate_up_proj` / `down_proj` by `gate_up_proj_q` / `gate_up_proj_scale` ... (groups
along each expert's inputs: scale [E, I / G, O]).

Expert tensors are named here as transformers 5 holds them in memory (fused 3-D tensors,
`mlp.experts.gate_up_proj` [E, 2*Fe, H]); models/moe_layout.py also assembles them from the
per-expert tensors that checkpoints store. "transpose" swaps the last two axes.
"""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp

from models.config import ModelConfig
from models.moe_layout import with_expert_tensors

SEP = "/"


def param_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str, bool]]:
    """Flat path -> (shape, HF tensor name, transpose). HF Linear weights are [out, in]."""
    H, N, K, D, F, V = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.vocab_size)
    specs = {"embed_tokens/embedding": ((V, H), "model.embed_tokens.weight", False)}
    for i in range(cfg.num_layers):
        p, hf = f"layers_{i}/", f"model.layers.{i}."
        specs[p + "input_layernorm/scale"] = ((H,), hf + "input_layernorm.weight", False)
        if cfg.is_mla:
            specs.update(_latent_layer_specs(cfg, i))
            continue
        for name, width in (("q_proj", N * D), ("k_proj", K * D), ("v_proj", K * D)):
            specs[p + name + "/kernel"] = ((H, width), hf + f"self_attn.{name}.weight", True)
            if cfg.qkv_bias:
                specs[p + name + "/bias"] = ((width,), hf + f"self_attn.{name}.bias", False)
        specs[p + "o_proj/kernel"] = ((N * D, H), hf + "self_attn.o_proj.weight", True)
        if cfg.o_proj_bias:
            specs[p + "o_proj/bias"] = ((H,), hf + "self_attn.o_proj.bias", False)
        if cfg.attention_sinks:
            specs[p + "attention_sinks"] = ((N,), hf + "self_attn.sinks", False)
        if cfg.qk_norm:
            specs[p + "q_norm/scale"] = ((D,), hf + "self_attn.q_norm.weight", False)
            specs[p + "k_norm/scale"] = ((D,), hf + "self_attn.k_norm.weight", False)
        specs[p + "post_attention_layernorm/scale"] = ((H,), hf + "post_attention_layernorm.weight", False)
        if cfg.is_gemma:  # norms around the MLP too
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                specs[p + name + "/scale"] = ((H,), hf + name + ".weight", False)
        if cfg.is_moe_layer(i) and cfg.moe_bias:
            specs.update(_biased_moe_specs(cfg, i))
            continue
        if cfg.is_moe_layer(i):
            E, Fe = cfg.num_experts, cfg.moe_intermediate_size
            specs[p + "moe/router"] = ((H, E), hf + "mlp.gate.weight", True)
            specs[p + "moe/gate_up_proj"] = ((E, H, 2 * Fe), hf + "mlp.experts.gate_up_proj", True)
            specs[p + "moe/down_proj"] = ((E, Fe, H), hf + "mlp.experts.down_proj", True)
            continue
        specs[p + "gate_proj/kernel"] = ((H, F), hf + "mlp.gate_proj.weight", True)
        specs[p + "up_proj/kernel"] = ((H, F), hf + "mlp.up_proj.weight", True)
        specs[p + "down_proj/kernel"] = ((F, H), hf + "mlp.down_proj.weight", True)
    specs["norm/scale"] = ((H,), "model.norm.weight", False)
    if not cfg.tie_word_embeddings:
        specs["lm_head/kernel"] = ((H, V), "lm_head.weight", True)
    return specs


def _biased_moe_specs(cfg: ModelConfig, i: int) -> dict[str, tuple[tuple[int, ...], str, bool]]:
    """A gpt-oss MoE layer (cfg.moe_bias): the router and every expert projection with biases.
    transformers holds its experts as x @ W ([E, H, 2*Fe], gate and up columns interleaved;
    models/moe_layout.py regroups them as gate columns, then up)."""
    H, E, Fe = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    p, hf = f"layers_{i}/moe/", f"model.layers.{i}.mlp."
    return {p + "router": ((H, E), hf + "router.weight", True),
            p + "router_bias": ((E,), hf + "router.bias", False),
            p + "gate_up_proj": ((E, H, 2 * Fe), hf + "experts.gate_up_proj", False),
            p + "gate_up_bias": ((E, 2 * Fe), hf + "experts.gate_up_proj_bias", False),
            p + "down_proj": ((E, Fe, H), hf + "experts.down_proj", False),
            p + "down_bias": ((E, H), hf + "experts.down_proj_bias", False)}


def _latent_layer_specs(cfg: ModelConfig, i: int) -> dict[str, tuple[tuple[int, ...], str, bool]]:
    """A DeepSeek-V2 / V3 layer's specs past its input norm (see the module docstring)."""
    H, N, F = cfg.hidden_size, cfg.num_heads, cfg.intermediate_size
    Dn, Dr, Dv, Cr = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    p, hf = f"layers_{i}/", f"model.layers.{i}."
    attn = hf + "self_attn."
    shapes = {}
    if cfg.q_lora_rank is None:
        shapes["q_proj/kernel"] = (H, N * (Dn + Dr))
    else:
        Q = cfg.q_lora_rank
        shapes.update({"q_a_proj/kernel": (H, Q), "q_a_layernorm/scale": (Q,), "q_b_proj/kernel": (Q, N * (Dn + Dr))})
    shapes.update({"kv_a_proj_with_mqa/kernel": (H, Cr + Dr), "kv_a_layernorm/scale": (Cr,),
                   "kv_b_proj/kernel": (Cr, N * (Dn + Dv)), "o_proj/kernel": (N * Dv, H)})
    specs = {p + path: (shape, attn + path.split("/")[0] + ".weight", path.endswith("kernel"))
             for path, shape in shapes.items()}
    specs[p + "post_attention_layernorm/scale"] = ((H,), hf + "post_attention_layernorm.weight", False)

    def mlp(prefix: str, hf_prefix: str, width: int):
        for name, shape in (("gate_proj", (H, width)), ("up_proj", (H, width)), ("down_proj", (width, H))):
            specs[f"{p}{prefix}/{name}/kernel"] = (shape, f"{hf}{hf_prefix}.{name}.weight", True)

    if not cfg.is_moe_layer(i):
        mlp("mlp", "mlp", F)
        return specs
    E, Fe = cfg.num_experts, cfg.moe_intermediate_size
    specs[p + "moe/router"] = ((H, E), hf + "mlp.gate.weight", True)
    if cfg.topk_method == "noaux_tc":
        specs[p + "moe/e_score_correction_bias"] = ((E,), hf + "mlp.gate.e_score_correction_bias", False)
    specs[p + "moe/gate_up_proj"] = ((E, H, 2 * Fe), hf + "mlp.experts.gate_up_proj", True)
    specs[p + "moe/down_proj"] = ((E, Fe, H), hf + "mlp.experts.down_proj", True)
    if cfg.num_shared_experts:
        mlp("shared_experts", "mlp.shared_experts", cfg.num_shared_experts * Fe)
    return specs


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """The nested tree of shapes (tuples) a loader must produce for `cfg`."""
    return unflatten({path: shape for path, (shape, _, _) in param_specs(cfg).items()})


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": x}} -> {"a/b": x}."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, prefix + key + SEP))
        else:
            flat[prefix + key] = value
    return flat


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        *parents, leaf = path.split(SEP)
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def hf_shape(shape: tuple[int, ...], transpose: bool) -> tuple[int, ...]:
    """The HF shape of a paxpage tensor of `shape` (transpose: last two axes swapped)."""
    return (*shape[:-2], shape[-1], shape[-2]) if transpose else shape


def from_hf_layout(x: Any, transpose: bool) -> Any:
    """A HF tensor in paxpage layout (numpy or jax): last two axes swapped when `transpose`."""
    return x.swapaxes(-1, -2) if transpose else x


def check_dtype(dtype: Any) -> jnp.dtype:
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype {dtype!r} is not a dtype; expected e.g. 'float32' or 'bfloat16'") from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"dtype {dtype!r} is not a floating dtype; expected e.g. 'float32' or 'bfloat16'")
    return dt


def params_from_hf(
    cfg: ModelConfig, get_tensor: Callable[[str], Any], dtype: Any, source: str
) -> dict[str, Any]:
    """Builds the tree from HF-named tensors. `get_tensor(name)` raises KeyError when absent.
    Experts stored quantised (gpt-oss's MXFP4) come as models/quant.py's quantised leaves (their
    4-bit codes as stored, and scales)."""
    from models import quant

    dt = check_dtype(dtype)
    get_tensor = with_expert_tensors(cfg, get_tensor)
    flat = {}
    for path, (shape, hf_name, transpose) in param_specs(cfg).items():
        try:
            x = get_tensor(hf_name)
        except KeyError:
            raise ValueError(f"{source}: missing tensor {hf_name!r}") from None
        expected = hf_shape(shape, transpose)
        if tuple(x.shape) != expected:
            raise ValueError(
                f"{source}: tensor {hf_name!r} has shape {tuple(x.shape)}; config implies {expected}"
            )
        if isinstance(x, quant.QuantizedWeight):  # read quantised (gpt-oss's MXFP4 experts), in paxpage layout
            flat[path + quant.Q], flat[path + quant.SCALE] = jnp.asarray(x.q), jnp.asarray(x.scale, jnp.float32)
            continue
        flat[path] = from_hf_layout(jnp.asarray(x, dtype=dt), transpose)
    return unflatten(flat)


def params_from_flat(
    cfg: ModelConfig, flat: dict[str, Any], dtype: Any, source: str
) -> dict[str, Any]:
    """Builds the tree from paxpage-named flat arrays (the GGUF cache), checking names and shapes.
    A kernel or the embedding may come quantised (models/quant.py: `<name>_q` i8 with the same
    shape, `<name>_scale` [+ `<name>_offset`] f32 with a group count dividing the contraction
    axis); floats are cast to `dtype`, scales and offsets stay f32."""
    from models import quant

    dt = check_dtype(dtype)
    check_flat(cfg, flat, source)
    out = {}
    for path, x in flat.items():
        if quant.base_name(path) == path:
            out[path] = jnp.asarray(x, dtype=dt)
        else:
            out[path] = jnp.asarray(x) if path.endswith(quant.Q) else jnp.asarray(x, dtype=jnp.float32)
    return unflatten(out)


def check_flat(cfg: ModelConfig, flat: dict[str, Any], source: str) -> None:
    """Raises ValueError unless `flat` holds exactly the parameters of `cfg` (see params_from_flat)."""
    from models import quant

    specs = param_specs(cfg)
    names = {quant.base_name(path) for path in flat}
    if names != set(specs):
        missing, extra = sorted(set(specs) - names), sorted(names - set(specs))
        raise ValueError(f"{source}: parameter names differ from config; missing {missing[:5]}, extra {extra[:5]}")
    for path, x in flat.items():
        base = quant.base_name(path)
        shape = specs[base][0]
        if path == base:
            if tuple(x.shape) != shape:
                raise ValueError(f"{source}: {path} has shape {tuple(x.shape)}; config implies {shape}")
            continue
        # the contraction axis: kernels [I, O] and experts [E, I, O]; the table [V, H]
        axis = len(shape) - (1 if base.endswith("embedding") else 2)
        if path.endswith(quant.Q):
            # int8 values, or two e2m1 codes a byte along the contraction axis (models/quant.py)
            packed = tuple(d // 2 if a == axis else d for a, d in enumerate(shape))
            ok = (x.dtype == jnp.int8 and tuple(x.shape) == shape) or (x.dtype == jnp.uint8 and tuple(x.shape) == packed)
            if not ok or base + quant.SCALE not in flat:
                raise ValueError(f"{source}: {path} is {x.dtype}{tuple(x.shape)} (scale given: "
                                 f"{base + quant.SCALE in flat}); expected int8{shape} or uint8{packed} with a scale")
            continue
        groups = x.shape[axis] if len(x.shape) == len(shape) else 0
        expected = tuple(groups if a == axis else d for a, d in enumerate(shape))
        if base + quant.Q not in flat or tuple(x.shape) != expected or not groups or shape[axis] % groups:
            raise ValueError(f"{source}: {path} has shape {tuple(x.shape)}; {base} is {shape}, quantised in "
                             "groups along its contraction axis")
