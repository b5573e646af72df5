"""What scripts/tpu_compile_check.py compiles for, with no TPU here: TPU topologies that
`jax.experimental.topologies` describes, the model shapes compiled, and the bytes of abstract
arrays.

Import it before jax: it points libtpu away from a GCE metadata server and keeps jax's default
backend the CPU (the kernels and the step compile for the TPU device they are given).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling only: no chip to share
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402

from models.config import ModelConfig  # noqa: E402
from pallas_kernels import kv_layout, kv_quant  # noqa: E402

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192)
LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                        max_position_embeddings=8192)
# (name, topology, HBM bytes/s, peak bf16 flop/s per chip) of the chips compiled for.
CHIPS = {"v5e": ("v5e:2x2", 819e9, 197e12), "v6e": ("v6e:2x2", 1.6e12, 918e12)}
TP_TOPOLOGY = "v5e:2x4"
PAGE_SIZE = 16


def devices(topology: str) -> list:
    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)


def mib(x: float) -> str:
    return f"{x / 2**20:.1f} MiB"


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def abstract_pool(num_pages: int, num_kv_heads: int, head_dim: int, kv_dtype: str, layout: str = "canonical"):
    shape = kv_layout.get(layout).shape(num_pages, PAGE_SIZE, num_kv_heads, head_dim)
    return jax.eval_shape(lambda: kv_quant.zeros(shape, kv_dtype, jnp.bfloat16, layout))


def device_shape(leaf) -> tuple[int, ...]:
    """The shape one device holds of an array or ShapeDtypeStruct (its shard when it has a sharding)."""
    sharding = getattr(leaf, "sharding", None)
    return tuple(sharding.shard_shape(leaf.shape)) if sharding is not None else tuple(leaf.shape)


def logical_bytes(tree) -> int:
    """Bytes of the leaves' logical shapes; per device for leaves that carry a sharding."""
    return sum(int(np.prod(device_shape(x))) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
