"""Gemma 2 / Gemma 3 from GGUF files laid out as llama.cpp's converter writes them (norms stored as
w + 1, four norms per block, window and soft-cap keys), against HF transformers on the same tiny
random weights: config, greedy tokens and every prompt token's logprob."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import paxpage
from models.config import ModelConfig
from tests.conftest import hf_greedy, random_prompts, save_tiny_hf
from tests.models.test_loading import write_gguf

WINDOW = 16
# query_pre_attn_scalar = head_dim: no GGUF key holds it, and llama.cpp takes head_dim below 27B.
MODELS = {
    # Local / global / local, small caps so that soft-capping changes the numbers; tied embeddings
    # (the converter never writes Gemma 2's lm_head).
    "gemma2": ("gemma2", dict(sliding_window=WINDOW, num_hidden_layers=3, attn_logit_softcapping=1.0,
                              final_logit_softcapping=2.0, query_pre_attn_scalar=16, tie_word_embeddings=True)),
    # llama.cpp's 5 local : 1 global; linearly scaled global RoPE, local RoPE at llama.cpp's fixed
    # 10000; qk-norm; an output.weight of its own.
    "gemma3": ("gemma3", dict(sliding_window=WINDOW, num_hidden_layers=6, final_logit_softcapping=3.0,
                              query_pre_attn_scalar=16,
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                  "rope_theta": 1e5},
                                               "sliding_attention": {"rope_type": "default",
                                                                     "rope_theta": 10000.0}})),
}


@pytest.fixture(params=sorted(MODELS))
def gemma_gguf(request, tmp_path, monkeypatch):
    """(HF model, paxpage model loaded from its GGUF, the GGUF's path)."""
    monkeypatch.setenv("PAXPAGE_CACHE_DIR", str(tmp_path / "cache"))
    arch, overrides = MODELS[request.param]
    hf = save_tiny_hf(tmp_path / "hf", request.param, **overrides)
    write_gguf(tmp_path / "tiny.gguf", hf, arch=arch)
    return hf, paxpage.load(tmp_path / "tiny.gguf"), tmp_path / "tiny.gguf"


def test_test_writer_agrees_with_transformers_gguf_reader(gemma_gguf):
    """transformers' own GGUF reader (its Gemma tensor processor subtracts the 1 again) gets HF's
    weights back from our test files: the writer lays them out as transformers expects llama.cpp to."""
    from transformers import AutoModelForCausalLM

    hf, _, path = gemma_gguf
    back = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    want, got = hf.state_dict(), back.state_dict()
    assert set(got) == set(want)
    for name, x in want.items():
        np.testing.assert_allclose(got[name].numpy(), x.numpy(), atol=1e-6, err_msg=name)


def test_gguf_config_matches_hf(gemma_gguf):
    hf, model, _ = gemma_gguf
    c, cfg = hf.config, model.config
    assert model.tokenizer is None  # the test file embeds no tokenizer
    assert cfg.model_type == c.model_type and cfg.is_gemma
    assert [cfg.layer_window(i) for i in range(cfg.num_layers)] == [
        WINDOW if t == "sliding_attention" else None for t in c.layer_types]
    assert cfg.query_pre_attn_scalar == c.query_pre_attn_scalar
    assert cfg.final_logit_softcap == c.final_logit_softcapping
    assert cfg.attn_logit_softcap == (c.attn_logit_softcapping if c.model_type == "gemma2" else None)
    assert cfg.tie_word_embeddings == c.tie_word_embeddings
    assert cfg.qk_norm == (c.model_type == "gemma3_text")
    if c.model_type == "gemma3_text":
        assert cfg.local_rope_theta == c.rope_parameters["sliding_attention"]["rope_theta"]
        assert (cfg.rope_theta, cfg.rope_scaling.kind, cfg.rope_scaling.factor) == (1e5, "linear", 4.0)
    # the norms come back as HF's w, not the stored w + 1
    np.testing.assert_allclose(model.per_layer_params()["layers_0"]["pre_feedforward_layernorm"]["scale"],
                               hf.state_dict()["model.layers.0.pre_feedforward_layernorm.weight"].numpy(),
                               atol=1e-6)


def test_gguf_greedy_and_prompt_logprobs_match_hf(gemma_gguf):
    """Prompts longer than the window, batched, then decode past it."""
    hf, model, _ = gemma_gguf
    prompts = random_prompts(2, 128, [40, 9], seed=11)
    outs = paxpage.generate(model, prompts, max_tokens=12, temperature=0, prompt_logprobs=0, ignore_eos=True,
                            page_size=8, num_pages=64, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1).numpy()  # [S, V]
        got = [out.prompt_logprobs[p][prompt[p]] for p in range(1, len(prompt))]
        np.testing.assert_allclose(got, ref[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-4)
        assert out.token_ids == hf_greedy(hf, prompt, 12)


def _meta(arch, layers, hidden, heads, head_dim, **extra):
    meta = {"general.architecture": arch, f"{arch}.block_count": layers, f"{arch}.embedding_length": hidden,
            f"{arch}.attention.head_count": heads, f"{arch}.attention.head_count_kv": heads // 2,
            f"{arch}.attention.key_length": head_dim, f"{arch}.feed_forward_length": 4 * hidden,
            f"{arch}.vocab_size": 256, f"{arch}.attention.sliding_window": 4096}
    meta.update({f"{arch}.{k}": v for k, v in extra.items()})
    return meta


@pytest.mark.parametrize("arch,layers,hidden,heads,head_dim,scalar", [
    # query_pre_attn_scalar of the released HF configs: 27B uses hidden / heads, the rest head_dim.
    ("gemma2", 42, 3584, 16, 256, 256),   # gemma-2-9b
    ("gemma2", 46, 4608, 32, 128, 144),   # gemma-2-27b
    ("gemma3", 26, 1152, 4, 256, 256),    # gemma-3-1b
    ("gemma3", 62, 5376, 32, 128, 168),   # gemma-3-27b
])
def test_gguf_query_scale_follows_llama_cpp(arch, layers, hidden, heads, head_dim, scalar):
    cfg = ModelConfig.from_gguf_metadata(_meta(arch, layers, hidden, heads, head_dim))
    assert cfg.query_pre_attn_scalar == scalar


def test_gguf_gemma_defaults_and_pattern_key():
    # Gemma 2 without cap keys: llama.cpp's (and HF's) 50 / 30; every 2nd layer global.
    cfg = ModelConfig.from_gguf_metadata(_meta("gemma2", 4, 64, 4, 16))
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (50.0, 30.0)
    assert [cfg.layer_window(i) for i in range(4)] == [4096, None, 4096, None]
    # Gemma 3: every 6th layer global and local RoPE base 10000 unless the file says otherwise.
    cfg = ModelConfig.from_gguf_metadata(_meta("gemma3", 7, 64, 4, 16))
    assert [cfg.layer_window(i) is None for i in range(7)] == [False] * 5 + [True, False]
    assert (cfg.local_rope_theta, cfg.attn_logit_softcap, cfg.final_logit_softcap) == (10000.0, None, None)
    pattern = [True, False, False, True]
    cfg = ModelConfig.from_gguf_metadata(_meta("gemma3", 4, 64, 4, 16, **{
        "attention.sliding_window_pattern": pattern, "rope.freq_base_swa": 500.0}))
    assert [cfg.layer_window(i) is not None for i in range(4)] == pattern and cfg.local_rope_theta == 500.0
    with pytest.raises(ValueError, match="sliding_window_pattern has 3 entries"):
        ModelConfig.from_gguf_metadata(_meta("gemma3", 4, 64, 4, 16, **{
            "attention.sliding_window_pattern": [True] * 3}))
