"""batch_invariant=True on a 4-device CPU mesh (forced host devices, in a subprocess): at a fixed
tensor-parallel degree (2) and on either of two data-parallel replicas, a request's tokens and
logprobs beside others are bitwise those it gets alone. A tiny Llama, and a tiny Qwen3-MoE at tp 2
(its experts split over the mesh, paxpage/sharded_experts.py), at widths (256 / 512) where XLA's CPU
matmuls change their last bits with the row count."""

from __future__ import annotations

import pytest

from tests.conftest import save_tiny_hf
from tests.parallel.helpers import run_json

pytestmark = pytest.mark.extended  # two 4-device engines in a subprocess (~2 min on 2 cores)


def _runs(tmp_path_factory, kind: str, layouts: str, **widths) -> dict:
    path = tmp_path_factory.mktemp(f"invariant_parallel_{kind}")
    save_tiny_hf(path, kind, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2, num_hidden_layers=1, seed=2, **widths)
    return run_json(["tests.parallel.invariant_worker", str(path), layouts], timeout=420)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return _runs(tmp_path_factory, "llama", "tp2,dp2")


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_batched_equals_alone(layouts, layout):
    runs = layouts[layout]
    assert runs["batched"] == runs["alone"]  # bitwise: JSON floats round-trip exactly


def test_sharded_experts_batched_equal_alone(tmp_path_factory):
    runs = _runs(tmp_path_factory, "qwen3_moe", "tp2", moe_intermediate_size=64)["tp2"]
    assert runs["batched"] == runs["alone"]
