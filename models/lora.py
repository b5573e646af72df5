"""LoRA adapters in HF PEFT's format: reading, checking against a model config, and the
per-layer matrices the mixed-adapter step runs.

An adapter directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`,
`target_modules`) and `adapter_model.safetensors` with, per adapted linear layer,
`...layers.{i}.{self_attn|mlp}.{name}.lora_A.weight` [r, in] and `.lora_B.weight` [out, r].
A target's output gains x @ A^T @ B^T * scale, scale = alpha / r (rsLoRA: alpha / sqrt(r)).

Here each target's matrices are held in paxpage's [in, out] orientation, A [in, r] and
B [r, out], with the scale folded into B, so the step computes (x @ A) @ B.

Axis legend: I a target's input width, O its output width, R the adapter's rank.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
from typing import Any

import numpy as np

from models.config import ModelConfig

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT options that change what the adapter computes beyond x A B * scale: refused, not ignored.
_UNSUPPORTED = {"use_dora": False, "modules_to_save": None, "layer_replication": None,
                "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {}, "use_qalora": False,
                "lora_bias": False, "trainable_token_indices": None, "alora_invocation_tokens": None,
                "target_parameters": None}
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)\.lora_([AB])(?:\.default)?\.weight$")
_uids = itertools.count(1)


@dataclasses.dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One loaded adapter. `weights[(layer, target)] = (A f32[I, R], B f32[R, O])`, B already
    multiplied by `scale`. `uid` is unique per load: prefix-cache keys use it, so pages
    computed under one adapter (or an earlier load of the same name) are never reused."""

    name: str
    rank: int
    alpha: float
    use_rslora: bool
    scale: float
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    source: str = ""
    uid: int = dataclasses.field(default_factory=lambda: next(_uids))

    def __hash__(self) -> int:
        return hash(("lora", self.uid))

    def __eq__(self, other) -> bool:
        return isinstance(other, LoraAdapter) and other.uid == self.uid

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t for t in TARGETS if any(key[1] == t for key in self.weights))


def target_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, int]]:
    """(I, O) of every linear layer of `layer` an adapter may target. MoE layers' experts are
    not targets (their MLP is a fused expert tensor): only the attention projections."""
    H, N, K, D, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    shapes = {"q_proj": (H, N * D), "k_proj": (H, K * D), "v_proj": (H, K * D), "o_proj": (N * D, H)}
    if not cfg.is_moe_layer(layer):
        shapes.update(gate_proj=(H, F), up_proj=(H, F), down_proj=(F, H))
    return shapes


def _read_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"LoRA adapter {path!r} has no {CONFIG_FILE}")
    with open(file) as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type is {config.get('peft_type')!r}; only 'LORA' is supported")
    for key, default in _UNSUPPORTED.items():
        value = config.get(key, default)
        if value not in (default, None, {}, False):
            raise ValueError(f"LoRA adapter {path!r}: {key}={value!r} is not supported (only plain LoRA)")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path!r}: bias={config['bias']!r} is not supported; expected 'none'")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unknown = sorted({t.rsplit(".", 1)[-1] for t in targets} - set(TARGETS))
        if unknown:
            raise ValueError(f"LoRA adapter {path!r}: target_modules {unknown} are not supported; "
                             f"targets are {list(TARGETS)}")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"LoRA adapter {path!r}: r must be a positive int, got {rank!r}")
    return config


def load_adapter(name: str, path: str | os.PathLike, cfg: ModelConfig) -> LoraAdapter:
    """Reads the PEFT adapter at `path` and checks it against the base model `cfg`; ValueError
    names what does not fit (a missing file, an unknown target, a shape the model does not have)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a LoRA adapter name must be a non-empty str, got {name!r}")
    path = os.fspath(path)
    config = _read_config(path)
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"LoRA adapter {path!r} has no {WEIGHTS_FILE}")
    from safetensors.numpy import load_file

    try:
        tensors = load_file(file)
    except Exception as e:  # torch-only dtypes (bf16 saved by torch) load through torch
        tensors = _load_with_torch(file, e)
    rank, alpha = config["r"], float(config.get("lora_alpha", config["r"]))
    use_rslora = bool(config.get("use_rslora", False))
    scale = alpha / (math.sqrt(rank) if use_rslora else rank)
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is not a LoRA weight of a supported "
                             f"target ({list(TARGETS)} of a decoder layer)")
        layer, target, half = int(match.group(1)), match.group(2), match.group(3)
        halves.setdefault((layer, target), {})[half] = np.asarray(value, np.float32)
    weights = {}
    for (layer, target), pair in sorted(halves.items()):
        where = f"LoRA adapter {path!r}: layer {layer} {target}"
        if layer >= cfg.num_layers:
            raise ValueError(f"{where}: the model has {cfg.num_layers} layers")
        shapes = target_shapes(cfg, layer)
        if target not in shapes:
            raise ValueError(f"{where} is not a supported target of this layer; targets are {sorted(shapes)}")
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where} has lora_{''.join(pair)} without its other half")
        a, b = pair["A"], pair["B"]  # [R, I], [O, R]
        (num_in, num_out) = shapes[target]
        if a.shape != (rank, num_in) or b.shape != (num_out, rank):
            raise ValueError(f"{where}: lora_A {a.shape} / lora_B {b.shape} do not fit the model; expected "
                             f"{(rank, num_in)} / {(num_out, rank)} (r={rank})")
        weights[(layer, target)] = (np.ascontiguousarray(a.T), np.ascontiguousarray(b.T * scale))
    if not weights:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA weights")
    return LoraAdapter(name, rank, alpha, use_rslora, scale, weights, path)


def _load_with_torch(file: str, error: Exception) -> dict[str, np.ndarray]:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise ValueError(f"cannot read {file!r}: {error}") from error
    return {k: v.float().numpy() for k, v in load_file(file).items()}
