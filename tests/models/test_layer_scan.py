"""Decoder layers under a scan (models/layer_stack.py) against the unrolled loop and HF transformers.

Each model runs the same two steps (a prompt's prefill, then one decode token reading the cache the
prefill wrote) with scan_layers True and False; the logits of both agree tightly with each other and
with HF's on the same weights. A wrong page offset for some layer would read another layer's keys.
The engine's greedy tokens with scanned layers (the CPU default) against HF's are
tests/models/test_llama_vs_hf.py's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import paxpage
from models import layer_stack
from models.config import ModelConfig
from paxpage.engine import LLMEngine
from paxpage.packing import RowPlan
from tests.conftest import random_prompts, save_tiny_hf

PAGE_SIZE = 4


def _two_step_logits(model, scan: bool, prompt: list[int], next_token: int, **engine) -> np.ndarray:
    """Logits f32[2, V]: after the prompt's prefill, then after one decode of next_token."""
    cfg = paxpage.EngineConfig(page_size=PAGE_SIZE, num_pages=64, max_num_seqs=4, max_num_batched_tokens=64,
                               prefill_row_len=8, scan_layers=scan, **engine)
    runner = LLMEngine(model.config, model.params, None, cfg).runner
    assert runner.scanned == scan
    # pages in a scattered order, as after many allocations
    table = list(np.random.default_rng(0).permutation(64)[:16])
    tokens = list(prompt) + [next_token]
    out = []
    for start, num_new in ((0, len(prompt)), (len(prompt), 1)):
        batch, _, _, _ = runner.packer.pack([RowPlan(tokens, table, start, num_new, 1)])
        logits, _ = runner.forward(batch)
        out.append(np.asarray(logits)[0])
    return np.stack(out)


def _hf_logits(hf, prompt, next_token) -> np.ndarray:
    with torch.no_grad():
        logits = hf(torch.tensor([list(prompt) + [next_token]])).logits[0].numpy()
    return logits[[len(prompt) - 1, len(prompt)]]


@pytest.mark.parametrize("kind,layers,period", [
    ("llama", 6, 1),  # SmolLM2's kind of stack, deeper than the usual 2-layer toy
    ("gemma2", 4, 2),  # local / global alternate: scanned two layers at a time
])
def test_scan_equals_unrolled_and_hf(tmp_path, kind, layers, period):
    hf = save_tiny_hf(tmp_path, kind, num_hidden_layers=layers, **(
        dict(sliding_window=6) if kind == "gemma2" else {}))
    model = paxpage.load(tmp_path)
    assert layer_stack.scan_period(model.config) == period
    prompt = random_prompts(1, 128, [19], seed=5)[0]
    scanned = _two_step_logits(model, True, prompt, 7)
    unrolled = _two_step_logits(model, False, prompt, 7)
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(scanned, _hf_logits(hf, prompt, 7), rtol=1e-4, atol=1e-4)


def test_scanned_pallas_kernels_equal_unrolled_and_hf(tmp_path):
    """The Pallas kernels (interpreted here) over the stacked pool of L * P pages: what GPU runs
    by default (paxpage.config.BACKEND_DEFAULTS scans with the Pallas kernels there)."""
    hf = save_tiny_hf(tmp_path, "llama", num_hidden_layers=3)
    model = paxpage.load(tmp_path)
    prompt = random_prompts(1, 128, [13], seed=6)[0]
    scanned = _two_step_logits(model, True, prompt, 5, attention_impl="pallas-interpret")
    unrolled = _two_step_logits(model, False, prompt, 5, attention_impl="pallas-interpret")
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(scanned, _hf_logits(hf, prompt, 5), rtol=1e-4, atol=1e-4)


def test_scanned_custom_calls_read_every_groups_weights_in_place(tmp_path):
    """Under a scan the native matmul and LoRA delta take all groups' panels and slabs and the
    group (layer_stack.variables): the compiled step slices none of them out of the stack (XLA
    copies a slice a custom call takes), and its logits are bitwise those of the step that slices."""
    import re

    from models import panel_layout

    save_tiny_hf(tmp_path, "llama", num_hidden_layers=3, hidden_size=128, intermediate_size=192,
                 num_attention_heads=4, num_key_value_heads=2)
    model = paxpage.load(tmp_path)
    cfg = paxpage.EngineConfig(page_size=PAGE_SIZE, num_pages=64, max_num_seqs=4, max_num_batched_tokens=64,
                               prefill_row_len=8, scan_layers=True, max_loras=2, max_lora_rank=8)
    runner = LLMEngine(model.config, model.params, None, cfg).runner
    if runner.matmul_impl != "native" or runner.lora_impl != "native":
        pytest.skip("the native kernels do not build here")
    from paxpage import lora_slab

    rng = np.random.default_rng(8)  # a random adapter in every slot of every layer
    slab = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape) * 0.1, x.dtype), runner.lora_slab)
    params = lora_slab.merge(runner.params, slab)  # the step's params (ModelRunner merges them so)
    whole = layer_stack.variables(params)
    assert set(whole) == {"params", layer_stack.WHOLE}
    assert not panel_layout.holds_panels(whole["params"]["layers"])
    held = whole[layer_stack.WHOLE]["layers"]["0"]
    assert held["gate_proj"]["kernel_panels"].shape == (3, 3, 128, 64)
    assert held["gate_proj"]["lora_a"].shape == (3, 2, 128, 8) and "gate_proj" not in whole["params"]["layers"]["0"]
    sliced = {"params": params}  # everything in "params": the scan slices each group's out
    tokens = random_prompts(2, 128, [13, 6], seed=7)
    batch, _, _, _ = runner.packer.pack([RowPlan(tokens[0], list(range(16)), 0, 13, 1, lora_slot=1),
                                         RowPlan(tokens[1], list(range(16, 32)), 0, 6, 1, lora_slot=0)])
    # a group's panels ([P, 128 or 192, 64]) or LoRA A ([2, 128 or 192, 8]), maybe a leading 1
    group_slice = re.compile(r"f32\[(1,)?\d+,(128|192),(64|8)\]\S* dynamic-slice")
    logits = {}
    for name, variables in (("whole", whole), ("sliced", sliced)):
        step = jax.jit(runner.model.apply)
        hlo = step.lower(variables, batch, runner.kv_cache).compile().as_text()
        copies = group_slice.findall(hlo)
        assert bool(copies) == (name == "sliced"), (name, len(copies))
        logits[name] = np.asarray(step(variables, batch, runner.kv_cache)[0])
    np.testing.assert_array_equal(logits["whole"], logits["sliced"])
    no_adapter = lora_slab.merge(runner.params, jax.tree.map(jnp.zeros_like, slab))
    base = np.asarray(jax.jit(runner.model.apply)(layer_stack.variables(no_adapter), batch, runner.kv_cache)[0])
    assert np.abs(logits["whole"][:2] - base[:2]).max() > 1e-3  # the adapters moved the logits


def test_stacked_pool_page_copy(tiny_llama_dir):
    """Copy-on-write copies a page in every layer of the stacked pool, and nothing else."""
    model = paxpage.load(tiny_llama_dir)
    cfg = paxpage.EngineConfig(page_size=4, num_pages=8, max_num_seqs=2, max_num_batched_tokens=16,
                               scan_layers=True)
    runner = LLMEngine(model.config, model.params, None, cfg).runner
    shape = runner.kv_cache.shape  # [2, L, P, page_size, K, D]
    assert shape[:3] == (2, model.config.num_layers, 8)
    before = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    runner.kv_cache = jnp.asarray(before)
    runner.copy_pages([(1, 5), (6, 2)])
    want = before.copy()
    want[:, :, 5], want[:, :, 2] = before[:, :, 1], before[:, :, 6]
    np.testing.assert_array_equal(np.asarray(runner.kv_cache), want)


def _cfg(**kw) -> ModelConfig:
    base = dict(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=6,
                num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=64)
    base.update(kw)
    return ModelConfig(**base)


def test_scan_period_by_layer_pattern():
    assert layer_stack.scan_period(_cfg()) == 1
    assert layer_stack.scan_period(_cfg(sliding_window=8)) == 1  # Mistral: every layer slides
    gemma3 = ["sliding_attention"] * 5 + ["full_attention"]
    assert layer_stack.scan_period(_cfg(num_layers=12, sliding_window=8, layer_types=tuple(gemma3 * 2))) == 6
    # 26 layers of a period-6 pattern: no period divides the stack -> unrolled
    types26 = tuple((gemma3 * 5)[:26])
    assert layer_stack.scan_period(_cfg(num_layers=26, sliding_window=8, layer_types=types26)) is None
    # Qwen2's max_window_layers: full layers first, then sliding ones -> unrolled
    qwen2 = ("full_attention",) * 2 + ("sliding_attention",) * 4
    assert layer_stack.scan_period(_cfg(sliding_window=8, layer_types=qwen2)) is None
    assert layer_stack.scan_period(_cfg(num_layers=1)) is None  # nothing to scan


def test_stack_layers_round_trip_keeps_every_leaf():
    """Whatever leaves a layer has (here an int8 kernel with its scale) stack and unstack."""
    rng = np.random.default_rng(0)
    layers = {f"layers_{i}": {"q_proj": {"kernel": jnp.asarray(rng.integers(-9, 9, (4, 6)), jnp.int8),
                                         "scale": jnp.asarray(rng.standard_normal(6), jnp.float32)},
                              "norm": {"scale": jnp.asarray(rng.standard_normal(4), jnp.float32)}}
              for i in range(4)}
    params = {"embed_tokens": {"embedding": jnp.ones((3, 4))}, **layers}
    stacked = layer_stack.stack_layers(params, 4, 2)
    assert set(stacked) == {"embed_tokens", "layers"}
    assert stacked["layers"]["1"]["q_proj"]["kernel"].shape == (2, 4, 6)
    assert stacked["layers"]["1"]["q_proj"]["kernel"].dtype == jnp.int8
    np.testing.assert_array_equal(stacked["layers"]["1"]["q_proj"]["scale"][1], layers["layers_3"]["q_proj"]["scale"])
    back = layer_stack.unstack_layers(stacked, 4)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), back, params))


def test_scan_layers_config_is_validated(tmp_path):
    with pytest.raises(ValueError, match="scan_layers"):
        paxpage.EngineConfig(scan_layers="yes")
    with pytest.raises(ValueError, match="scan_layers"):
        paxpage.EngineConfig(scan_layers=1)
    qwen2 = _cfg(sliding_window=8, layer_types=("full_attention",) * 2 + ("sliding_attention",) * 4)
    with pytest.raises(ValueError, match="do not repeat"):
        paxpage.EngineConfig(scan_layers=True).resolve(qwen2, backend="cpu")
    assert paxpage.EngineConfig().resolve(qwen2, backend="cpu").scan_period == 0  # auto: unrolled
    assert paxpage.EngineConfig().resolve(_cfg(), backend="cpu").scan_period == 1
    assert paxpage.EngineConfig(attention_impl="pallas").resolve(_cfg(), backend="cpu").scan_period == 0
    assert paxpage.EngineConfig(scan_layers=False).resolve(_cfg(), backend="cpu").scan_period == 0
