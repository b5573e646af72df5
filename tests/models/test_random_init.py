"""models/random_init.py: the trees have param_layout's shapes in the asked dtype and placement,
the byte count is parameters x itemsize, and the real presets count the published totals
(Llama-3.2-1B worked by hand; 8.03B, 30.5B, 15.7B)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import random_init
from models.param_layout import flatten, param_shapes
from models.quant import bytes_by_dtype


@pytest.mark.parametrize("name", sorted(random_init.PRESETS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tiny_trees_have_the_declared_shapes_and_bytes(name, dtype):
    cfg = random_init.preset(name, tiny=True)
    params = random_init.random_params(cfg, dtype)
    flat, shapes = flatten(params), flatten(param_shapes(cfg))
    assert {k: tuple(v.shape) for k, v in flat.items()} == shapes
    assert {v.dtype for v in flat.values()} == {jnp.dtype(dtype)}
    assert bytes_by_dtype(params) == {dtype: random_init.num_params(cfg) * jnp.dtype(dtype).itemsize}
    # where loaders leave their arrays: the default device, uncommitted
    assert {v.sharding for v in flat.values()} == {jax.sharding.SingleDeviceSharding(jax.devices()[0])}
    assert not any(v.committed for v in flat.values())


def test_an_explicit_sharding_commits_every_leaf():
    cfg = random_init.preset("llama-3.2-1b", tiny=True)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[-1])
    leaves = jax.tree.leaves(random_init.random_params(cfg, sharding=sharding))
    assert all(x.committed and x.sharding == sharding for x in leaves)


def test_presets_keep_their_architecture_when_tiny():
    for name, full in random_init.PRESETS.items():
        tiny = random_init.preset(name, tiny=True)
        assert (tiny.model_type, tiny.tie_word_embeddings, tiny.qk_norm, bool(tiny.num_experts)) == \
            (full.model_type, full.tie_word_embeddings, full.qk_norm, bool(full.num_experts))
        assert tiny.num_heads // tiny.num_kv_heads == full.num_heads // full.num_kv_heads
        assert random_init.num_params(tiny) < 250_000


def test_real_shapes_count_by_hand():
    # Llama-3.2-1B: tied [V, H] table, 16 layers of q, o [H, H], k, v [H, 512], 3 MLP [H, F], 2 norms
    H, F, V, L = 2048, 8192, 128256, 16
    per_layer = 2 * H * H + 2 * H * 512 + 3 * H * F + 2 * H
    assert random_init.num_params(random_init.preset("llama-3.2-1b")) == V * H + L * per_layer + H == 1_235_814_400
    assert random_init.num_params(random_init.preset("llama-3-8b")) == 8_030_261_248
    assert random_init.num_params(random_init.preset("qwen3-30b-a3b")) == 30_532_122_624
    assert random_init.preset("qwen3-30b-a3b", num_layers=4).num_layers == 4
    # HF's GptOssForCausalLM at gpt-oss-20b's dims, counted on the meta device: 20,914,757,184
    assert random_init.num_params(random_init.preset("gpt-oss-20b")) == 20_914_757_184
    # HF's DeepseekV2ForCausalLM at DeepSeek-V2-Lite's dims, counted on the meta device: 15,706,484,224
    assert random_init.num_params(random_init.preset("deepseek-v2-lite")) == 15_706_484_224
    assert random_init.preset("gpt-oss-20b", num_layers=3).layer_types == (
        "sliding_attention", "full_attention", "sliding_attention")


def test_draws_are_seeded_and_scaled():
    cfg = random_init.preset("llama-3-8b", tiny=True)
    a, b = (flatten(random_init.random_params(cfg, "float32", seed=s)) for s in (0, 0))
    c = flatten(random_init.random_params(cfg, "float32", seed=1))
    kernel = "layers_0/gate_proj/kernel"
    np.testing.assert_array_equal(a[kernel], b[kernel])
    assert not np.array_equal(a[kernel], c[kernel])
    assert not np.array_equal(a["layers_0/gate_proj/kernel"], a["layers_1/gate_proj/kernel"])
    assert abs(float(jnp.std(a[kernel])) * cfg.hidden_size ** 0.5 - 1) < 0.1
    assert float(jnp.min(a["norm/scale"])) == float(jnp.max(a["norm/scale"])) == 1.0


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="llama-3-8b"):
        random_init.preset("llama-9")
