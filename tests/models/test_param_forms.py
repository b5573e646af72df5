"""A model's weights held once, in the form its engines run (paxpage.load, models/param_forms.py).

`paxpage.load` holds the layers stacked when the backend's default engine scans them, so that
engine runs the model's own arrays (same objects, same buffers) and produces HF transformers'
greedy tokens; an engine of another form (the unrolled loop) makes one copy, shared by such
engines and freed once none holds it. tests/engine/test_weight_bytes.py counts the device's bytes."""

from __future__ import annotations

import gc

import jax
import numpy as np
import pytest

import paxpage
from models.param_forms import ParamForms
from tests.conftest import hf_greedy, random_prompts

NUM_LAYERS = 2  # tiny_llama_dir's


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return tiny_llama_dir, AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()


def _config(max_num_seqs: int, scan: bool | str = True, dtype: str | None = None) -> paxpage.EngineConfig:
    return paxpage.EngineConfig(page_size=4, num_pages=64, max_num_seqs=max_num_seqs, max_num_batched_tokens=32,
                                prefill_row_len=16, scan_layers=scan, dtype=dtype)


def test_engines_run_the_models_stacked_arrays_and_match_hf(tiny):
    path, hf = tiny
    model = paxpage.load(path)
    assert sorted(model.params) == ["embed_tokens", "layers", "lm_head", "norm"]  # held stacked
    first, second = _config(2), _config(4)  # two engine configs: two engines, two KV pools
    a, b = model.engine(first).runner, model.engine(second).runner
    assert a.scanned and b.scanned and a is not b
    own = jax.tree.leaves(model.params)
    for runner in (a, b):  # the model's own arrays, not copies
        assert all(x is y for x, y in zip(jax.tree.leaves(runner.params), own))
    assert jax.tree.leaves(a.params["layers"])[0].shape[0] == NUM_LAYERS
    assert model.param_forms.copies() == []
    assert "shared by its engines" not in model.describe_memory()
    # the per-layer view: kernels in the plain [I, O] form, HF's weights transposed (on CPU they
    # are held in column panels: models/panel_layout.py), other leaves numpy views of the stacked
    # arrays' layers (no copy)
    per_layer = model.per_layer_params()
    for i in range(NUM_LAYERS):
        np.testing.assert_array_equal(per_layer[f"layers_{i}"]["q_proj"]["kernel"],
                                      hf.model.layers[i].self_attn.q_proj.weight.detach().numpy().T)
    norm = model.params["layers"]["0"]["input_layernorm"]["scale"]
    assert np.shares_memory(per_layer["layers_1"]["input_layernorm"]["scale"], np.asarray(norm))

    prompt = random_prompts(1, 128, [7], seed=3)[0]
    want = hf_greedy(hf, prompt, 6)
    out = paxpage.generate(model, [prompt], engine_config=second, max_tokens=6, temperature=0.0,
                           use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == want
    model.close()


def test_unrolled_engines_share_one_per_layer_copy(tiny):
    path, hf = tiny
    model = paxpage.load(path)
    a = model.engine(_config(2, scan=False)).runner
    b = model.engine(_config(4, scan=False)).runner
    assert not a.scanned and "layers_1" in a.params
    assert all(x is y for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)))
    assert a.params["embed_tokens"]["embedding"] is model.params["embed_tokens"]["embedding"]
    ((form, num_bytes),) = model.param_forms.copies()
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params["layers"]))
    assert form.period == 0 and num_bytes == layer_bytes
    assert "per layer for the unrolled loop" in model.describe_memory()

    prompt = random_prompts(1, 128, [9], seed=4)[0]
    out = paxpage.generate(model, [prompt], engine_config=_config(2, scan=False), max_tokens=5,
                           temperature=0.0, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 5)
    del a, b, form
    model.close()
    gc.collect()
    assert model.param_forms.held() == []  # the last such engine gone, the copy is freed
    assert "shared by its engines" not in model.describe_memory()


def test_quantised_stacked_form_keeps_int8_values_and_f32_scales(tiny):
    path, _ = tiny
    model = paxpage.load(path, quantization="int8")
    forms = ParamForms(model.per_layer_params(), NUM_LAYERS)
    bf16 = forms.get(1, "bfloat16")
    assert forms.get(1, "bfloat16") is bf16 and forms.get(1, "float32") is not bf16
    proj = bf16.tree["layers"]["0"]["q_proj"]
    per_layer = model.per_layer_params()
    want_q = np.stack([per_layer[f"layers_{i}"]["q_proj"]["kernel_q"] for i in range(NUM_LAYERS)])
    assert proj["kernel_q"].dtype == np.int8 and proj["kernel_scale"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(proj["kernel_q"]), want_q)
    norm = bf16.tree["layers"]["0"]["input_layernorm"]["scale"]
    assert norm.dtype == jax.numpy.bfloat16 and norm.shape[0] == NUM_LAYERS
