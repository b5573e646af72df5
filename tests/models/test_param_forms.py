"""One cast / stacked copy of a model's params, shared by its engines (models/param_forms.py).

Two engines of one model with scanned layers run the very same stacked arrays (same objects,
same buffers), the model's own arrays where no copy is needed, and still produce HF
transformers' greedy tokens; the shared copy is freed once no engine holds it."""

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


def _config(max_num_seqs: int, scan: bool = True) -> paxpage.EngineConfig:
    return paxpage.EngineConfig(page_size=4, num_pages=64, max_num_seqs=max_num_seqs, max_num_batched_tokens=32,
                                prefill_row_len=16, scan_layers=scan)


def test_engines_share_the_stacked_params_and_match_hf(tiny):
    path, hf = tiny
    model = paxpage.load(path)
    first, second = _config(2), _config(4)  # two engine configs: two engines, two KV pools
    a, b = model.engine(first).runner, model.engine(second).runner
    assert a.scanned and b.scanned and a is not b
    assert a.params is b.params
    stacked_a = jax.tree.leaves(a.params["layers"])
    stacked_b = jax.tree.leaves(b.params["layers"])
    assert len(stacked_a) == 9 and all(x is y for x, y in zip(stacked_a, stacked_b))
    assert all(x.unsafe_buffer_pointer() == y.unsafe_buffer_pointer() for x, y in zip(stacked_a, stacked_b))
    assert stacked_a[0].shape[0] == NUM_LAYERS
    # outside the layer stack (f32 engine of an f32 model) the model's own arrays, not copies
    assert a.params["embed_tokens"]["embedding"] is model.params["embed_tokens"]["embedding"]
    # the stacked copy holds the per-layer weights (an independent stack of the model's arrays)
    q = np.stack([np.asarray(model.params[f"layers_{i}"]["q_proj"]["kernel"]) for i in range(NUM_LAYERS)])
    np.testing.assert_array_equal(np.asarray(a.params["layers"]["0"]["q_proj"]["kernel"]), q)
    assert "stacked for the scanned layers" in model.describe_memory()

    prompt = random_prompts(1, 128, [7], seed=3)[0]
    want = hf_greedy(hf, prompt, 6)
    # the second engine, which was handed the arrays the first one's runner made
    out = paxpage.generate(model, [prompt], engine_config=second, max_tokens=6, temperature=0.0,
                           use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == want

    del a, b, stacked_a, stacked_b
    model.close()
    gc.collect()
    assert model.param_forms.held() == []  # the last engine gone, the stacked copy is freed
    assert "shared by its engines" not in model.describe_memory()


def test_unrolled_engine_runs_the_models_own_arrays(tiny):
    path, _ = tiny
    model = paxpage.load(path)
    runner = model.engine(_config(2, scan=False)).runner
    assert not runner.scanned
    assert all(x is y for x, y in zip(jax.tree.leaves(runner.params), jax.tree.leaves(model.params)))
    assert model.param_forms.copies() == []  # nothing held beyond the model's weights
    model.close()


def test_quantised_stacked_form_keeps_int8_values_and_f32_scales(tiny):
    path, _ = tiny
    model = paxpage.load(path, quantization="int8")
    forms = ParamForms(model.params, NUM_LAYERS)
    bf16 = forms.get(1, "bfloat16")
    assert forms.get(1, "bfloat16") is bf16 and forms.get(1, "float32") is not bf16
    proj = bf16.tree["layers"]["0"]["q_proj"]
    want_q = np.stack([np.asarray(model.params[f"layers_{i}"]["q_proj"]["kernel_q"]) for i in range(NUM_LAYERS)])
    assert proj["kernel_q"].dtype == np.int8 and proj["kernel_scale"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(proj["kernel_q"]), want_q)
    norm = bf16.tree["layers"]["0"]["input_layernorm"]["scale"]
    assert norm.dtype == jax.numpy.bfloat16 and norm.shape[0] == NUM_LAYERS
