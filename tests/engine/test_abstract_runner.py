"""ModelRunner(abstract=True): the engine's own step built from abstract params and lowered
ahead of time (what scripts/tpu_compile_check.py compiles for TPU), here for the CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.param_layout import param_shapes
from pallas_kernels import tpu_target
from paxpage.config import EngineConfig
from paxpage.runner import ModelRunner

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=256)
CONFIG = EngineConfig(num_pages=32, max_num_seqs=4, max_num_batched_tokens=64, dtype="float32",
                      attention_impl="xla", kv_cache_dtype="int8")


def test_abstract_runner_lowers_the_same_step_as_a_real_one():
    cfg = CONFIG.resolve(TINY, backend="cpu")
    rng = np.random.default_rng(0)
    shapes = param_shapes(TINY)
    is_shape = lambda x: isinstance(x, tuple)
    params = jax.tree.map(lambda s: rng.standard_normal(s).astype(np.float32), shapes, is_leaf=is_shape)
    abstract_params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16), shapes, is_leaf=is_shape)

    real = ModelRunner(TINY, params, cfg)
    abstract = ModelRunner(TINY, abstract_params, cfg, abstract=True)
    leaves = jax.tree.leaves((abstract.params, abstract.kv_cache))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # nothing allocated
    # Cast to the config's dtype as the real runner casts its params; the int8 pool and its scales.
    assert {x.dtype for x in jax.tree.leaves(abstract.params)} == {jnp.dtype(jnp.float32)}
    assert jax.tree.map(lambda x: (x.shape, x.dtype), abstract.kv_cache) == \
        jax.tree.map(lambda x: (x.shape, x.dtype), real.kv_cache)

    for dec, pre in ((4, 0), (4, 1)):
        a = abstract.lower_step(dec, pre).compile().memory_analysis()
        b = real.lower_step(dec, pre).compile().memory_analysis()
        assert (a.argument_size_in_bytes, a.output_size_in_bytes, a.alias_size_in_bytes) == \
            (b.argument_size_in_bytes, b.output_size_in_bytes, b.alias_size_in_bytes)
        assert a.alias_size_in_bytes > 0  # the pool is donated


def test_abstract_runner_needs_num_pages():
    cfg = EngineConfig(max_num_seqs=4, dtype="float32", attention_impl="xla", kv_cache_bytes=1 << 20)
    resolved = cfg.resolve(TINY, backend="cpu")
    import dataclasses

    with pytest.raises(ValueError, match="num_pages"):
        ModelRunner(TINY, {}, dataclasses.replace(resolved, num_pages=None), abstract=True)


def test_compile_target_follows_jax_default_device():
    assert tpu_target.compile_platform() == jax.default_backend()
    with jax.default_device(jax.devices("cpu")[0]):
        assert tpu_target.compile_target().platform == "cpu"
