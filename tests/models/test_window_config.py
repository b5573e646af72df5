"""ModelConfig reads sliding windows, layer types and Gemma options as HF transformers applies them,
and refuses what paxpage cannot run exactly."""

from __future__ import annotations

import json

import pytest
import transformers as tf

from models.config import ModelConfig


def _cfg(hf_config) -> ModelConfig:
    return ModelConfig.from_hf_dict(json.loads(hf_config.to_json_string()))


def test_layer_windows_follow_hf():
    small = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    assert [_cfg(tf.MistralConfig(sliding_window=16, **small)).layer_window(i) for i in range(4)] == [16] * 4
    assert _cfg(tf.MistralConfig(sliding_window=None, **small)).max_window is None
    qwen = _cfg(tf.Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=2, **small))
    assert [qwen.layer_window(i) for i in range(4)] == [None, None, 8, 8] and qwen.max_window is None
    off = _cfg(tf.Qwen3Config(use_sliding_window=False, sliding_window=8, **small))
    assert off.sliding_window is None and off.layer_types == ()
    g2 = _cfg(tf.Gemma2Config(sliding_window=8, head_dim=16, **small))
    assert [g2.layer_window(i) for i in range(4)] == [8, None, 8, None]
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.sm_scale) == (50.0, 30.0, 256 ** -0.5)
    g3 = _cfg(tf.Gemma3TextConfig(sliding_window=8, head_dim=16, **{**small, "num_hidden_layers": 7}))
    assert [g3.layer_window(i) for i in range(7)] == [8] * 5 + [None, 8]
    assert (g3.rope_theta, g3.local_rope_theta, g3.qk_norm, g3.tie_word_embeddings) == (1e6, 1e4, True, True)
    assert ModelConfig.from_dict(g3.to_dict()) == g3


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="multimodal"):
        ModelConfig.from_hf_dict({"model_type": "gemma3", "text_config": {}})
    d = json.loads(tf.Gemma3TextConfig(head_dim=16, num_hidden_layers=2, use_bidirectional_attention=True,
                                       sliding_window=8).to_json_string())
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_dict(d)
    d = json.loads(tf.LlamaConfig(num_hidden_layers=2, hidden_act="gelu").to_json_string())
    with pytest.raises(ValueError, match="hidden_activation 'gelu' is not supported for llama"):
        ModelConfig.from_hf_dict(d)
    with pytest.raises(ValueError, match="layer_types has 3 entries; the model has 2 layers"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                    head_dim=4, sliding_window=4, layer_types=("sliding_attention",) * 3)
