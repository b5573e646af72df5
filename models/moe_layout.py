"""Expert tensors of HF MoE checkpoints, in whichever of their layouts a checkpoint uses.

models/param_layout.py names expert weights as transformers 5 holds them in memory: per layer
`mlp.gate.weight` [E, H] (the router), `mlp.experts.gate_up_proj` [E, 2*Fe, H] (each expert's
gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, Fe]. Checkpoints on disk
(transformers 5's own save_pretrained included) mostly keep one Linear per expert instead:
    Qwen3-MoE  mlp.experts.{j}.{gate,up,down}_proj.weight
    Mixtral    block_sparse_moe.gate.weight, block_sparse_moe.experts.{j}.{w1,w3,w2}.weight
               (w1 gate [Fe, H], w3 up [Fe, H], w2 down [H, Fe])
`with_expert_tensors` answers the fused names from either.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from models.config import ModelConfig

# (gate, up, down) per-expert names under a layer's MoE prefix.
_PER_EXPERT = {
    ".mlp.": ("gate_proj.weight", "up_proj.weight", "down_proj.weight"),
    ".block_sparse_moe.": ("w1.weight", "w3.weight", "w2.weight"),
}


def with_expert_tensors(cfg: ModelConfig, get_tensor: Callable[[str], Any]) -> Callable[[str], Any]:
    """Wraps `get_tensor(name)` (KeyError when absent) so that fused expert names also resolve from
    per-expert tensors. Other names pass through unchanged."""
    if not cfg.num_experts:
        return get_tensor

    def get(name: str):
        try:
            return get_tensor(name)
        except KeyError:
            if name.endswith(".mlp.gate.weight"):  # Mixtral's router
                return get_tensor(name.replace(".mlp.", ".block_sparse_moe."))
            for suffix, parts in ((".mlp.experts.gate_up_proj", (0, 1)), (".mlp.experts.down_proj", (2,))):
                if name.endswith(suffix):
                    return _stack_experts(cfg.num_experts, name[: -len(suffix)], parts, get_tensor)
            raise

    return get


def _stack_experts(num_experts: int, layer: str, parts: tuple[int, ...], get_tensor) -> np.ndarray:
    """[E, rows, cols] from per-expert tensors; two parts (gate, up) are joined along the rows."""
    for moe_prefix, names in _PER_EXPERT.items():
        first = f"{layer}{moe_prefix}experts.0.{names[parts[0]]}"
        try:
            get_tensor(first)
        except KeyError:
            continue
        experts = []
        for j in range(num_experts):
            pieces = []
            for part in parts:
                name = f"{layer}{moe_prefix}experts.{j}.{names[part]}"
                try:
                    pieces.append(np.asarray(get_tensor(name)))
                except KeyError:
                    raise ValueError(f"missing tensor {name!r} (expert {j} of {num_experts})") from None
            experts.append(np.concatenate(pieces, axis=0))
        return np.stack(experts)
    raise KeyError(f"{layer}.mlp.experts")
