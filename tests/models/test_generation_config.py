"""generation_config.json and its GGUF counterpart: end ids and sampling defaults, against what
HF transformers reads from the same files."""

from __future__ import annotations

import json
import os

import pytest

from models.config import ModelConfig
from models.generation_config import GenerationConfig
from models.loading import load_model, save_model
from tests.conftest import save_tiny_hf

# What Llama-3-Instruct ships, on a tiny vocabulary: eos 5 and 7 end a turn.
LLAMA3_LIKE = {"bos_token_id": 1, "eos_token_id": [5, 7], "do_sample": True, "temperature": 0.6,
               "top_p": 0.9, "transformers_version": "4.40.0"}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAXPAGE_CACHE_DIR", str(tmp_path / "cache"))


def _dir_with(tmp_path, generation: dict | None, **config):
    path = tmp_path / "hf"
    save_tiny_hf(path, "llama", **config)
    gen_file = path / "generation_config.json"
    if generation is None:
        os.remove(gen_file)
    else:
        gen_file.write_text(json.dumps(generation))
    return path


def test_hf_dir_matches_transformers(tmp_path):
    from transformers import GenerationConfig as HFGenerationConfig

    path = _dir_with(tmp_path, LLAMA3_LIKE, eos_token_id=5)
    cfg, _, _ = load_model(path)
    ref = HFGenerationConfig.from_pretrained(path)
    assert list(cfg.end_token_ids) == ref.eos_token_id == [5, 7]
    assert cfg.eos_token_ids == (5,)  # config.json's own, kept
    defaults = cfg.generation.sampling_defaults()
    assert defaults == {"temperature": pytest.approx(ref.temperature), "top_p": pytest.approx(ref.top_p)}
    assert "top_k" not in defaults  # not in the file (transformers 4 reports its class default, 50)


def test_without_generation_config(tmp_path):
    cfg, _, _ = load_model(_dir_with(tmp_path, None, eos_token_id=3))
    assert cfg.end_token_ids == (3,) and cfg.generation == GenerationConfig()


def test_checkpoint_keeps_generation_config(tmp_path):
    cfg, params, tok = load_model(_dir_with(tmp_path, {**LLAMA3_LIKE, "top_k": 20, "min_p": 0.05,
                                                      "repetition_penalty": 1.1}))
    save_model(tmp_path / "ck", cfg, params, tok)
    cfg2, _, _ = load_model(tmp_path / "ck")
    assert cfg2 == cfg and cfg2.generation.sampling_defaults() == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"top_p": 0}, {"top_k": 2.5}, {"eos_token_id": ["x"]},
                                 {"repetition_penalty": 0}])
def test_invalid_values_name_the_file(tmp_path, bad):
    path = _dir_with(tmp_path, bad)
    with pytest.raises(ValueError, match="generation_config.json.*" + next(iter(bad)).split("_id")[0]):
        ModelConfig.from_hf_dir(path)


@pytest.mark.slow
def test_smollm2_ends_where_hf_ends(smollm2):
    """SmolLM2's GGUF has eos 2 (<|im_end|>), no end-of-turn id and no sampling keys; HF builds
    its generation config from the GGUF's model config (there is no generation_config.json)."""
    from transformers import AutoConfig
    from transformers import GenerationConfig as HFGenerationConfig

    from models.loading import default_model_path

    path = default_model_path()
    hf_cfg = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    ref = HFGenerationConfig.from_model_config(hf_cfg)
    assert smollm2.config.end_token_ids == (ref.eos_token_id,) == (2,)
    assert smollm2.config.generation.sampling_defaults() == {}
    assert smollm2.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
