"""MoE config parsing and expert-tensor assembly on hand-written inputs (no model runs)."""

from __future__ import annotations

import numpy as np
import pytest

from models.config import ModelConfig
from models.moe_layout import with_expert_tensors
from models.param_layout import param_specs

BASE = dict(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=1)


def test_qwen3_moe_sparse_layers():
    # decoder_sparse_step 2: layers 1 and 3 are sparse; mlp_only_layers takes layer 3 back.
    cfg = ModelConfig.from_hf_dict(dict(BASE, model_type="qwen3_moe", num_experts=6, num_experts_per_tok=2,
                                        moe_intermediate_size=4, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert cfg.dense_mlp_layers == (0, 2, 3)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (6, 2, 4)
    assert cfg.qk_norm and not cfg.norm_topk_prob
    specs = param_specs(cfg)
    assert specs["layers_1/moe/gate_up_proj"][0] == (6, 8, 8)  # [E, H, 2 * Fe]
    assert specs["layers_0/gate_proj/kernel"][0] == (8, 16)
    assert "layers_1/gate_proj/kernel" not in specs
    # transformers 5's save_pretrained names the count num_local_experts.
    alias = ModelConfig.from_hf_dict(dict(BASE, model_type="qwen3_moe", num_local_experts=6,
                                          num_experts_per_tok=2, moe_intermediate_size=4))
    assert alias.num_experts == 6 and alias.dense_mlp_layers == ()
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_mixtral_config_and_refusals():
    cfg = ModelConfig.from_hf_dict(dict(BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2))
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (4, 16, True)
    with pytest.raises(ValueError, match="sliding_window=4096"):
        ModelConfig.from_hf_dict(dict(BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=4096))
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf_dict(dict(BASE, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=4, use_sliding_window=True))
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in 1..num_experts \(4\), got 5"):
        ModelConfig.from_hf_dict(dict(BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=5))


def test_per_expert_tensors_are_fused():
    cfg = ModelConfig.from_hf_dict(dict(BASE, model_type="mixtral", num_local_experts=2, num_experts_per_tok=1))
    p = "model.layers.0.block_sparse_moe."
    tensors = {p + "gate.weight": np.full((2, 8), 7.0)}
    for j in range(2):  # w1 gate [Fe, H], w3 up [Fe, H], w2 down [H, Fe]; value = 10 * expert + kind
        tensors[p + f"experts.{j}.w1.weight"] = np.full((16, 8), 10.0 * j + 1)
        tensors[p + f"experts.{j}.w3.weight"] = np.full((16, 8), 10.0 * j + 3)
        tensors[p + f"experts.{j}.w2.weight"] = np.full((8, 16), 10.0 * j + 2)
    get = with_expert_tensors(cfg, tensors.__getitem__)
    assert get("model.layers.0.mlp.gate.weight")[0, 0] == 7.0
    gate_up = get("model.layers.0.mlp.experts.gate_up_proj")  # [E, 2 * Fe, H]: gate rows, then up rows
    assert gate_up.shape == (2, 32, 8)
    assert gate_up[1, :16].max() == gate_up[1, :16].min() == 11.0 and gate_up[1, 16:].min() == 13.0
    down = get("model.layers.0.mlp.experts.down_proj")
    assert down.shape == (2, 8, 16) and down[0, 0, 0] == 2.0 and down[1, 0, 0] == 12.0
    del tensors[p + "experts.1.w2.weight"]
    with pytest.raises(ValueError, match=r"experts\.1\.w2\.weight' \(expert 1 of 2\)"):
        get("model.layers.0.mlp.experts.down_proj")
    with pytest.raises(KeyError):
        get("model.layers.1.mlp.experts.down_proj")  # nothing at all: params_from_hf names it missing
