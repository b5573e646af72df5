"""Latent attention (DeepSeek-V3) at tensor parallel 2 on a 2-device CPU mesh (forced host devices, in a
subprocess): greedy tokens equal HF transformers', the per-head projections split over the heads and
the latent pool replicated, as paxpage/sharding.py documents."""

from __future__ import annotations

import pytest

from tests.conftest import hf_greedy, save_tiny_deepseek
from tests.parallel.helpers import run_json


@pytest.mark.extended  # ~40 s: a fresh interpreter with forced devices
def test_tp2_greedy_matches_hf_with_a_replicated_latent_pool(tmp_path):
    hf = save_tiny_deepseek(tmp_path, q_lora_rank=None)
    out = run_json(["tests.parallel.latent_tp_worker", str(tmp_path), "2", "6"], num_devices=2, timeout=420)
    assert out["num_devices"] == 2
    vocab = hf.config.vocab_size
    prompts = [[(7 * i + 3) % vocab for i in range(n)] for n in (5, 19, 40)]
    assert out["greedy"]["2"] == [hf_greedy(hf, p, 6) for p in prompts]
    pool = out["pool"]["2"]
    assert pool["shape"] == [1, 48, 4, 1, 40] and pool["spec"] == [None] * 5
    assert pool["shard_shapes"] == [[1, 48, 4, 1, 40]] * 2
    params = out["params"]["2"]
    assert params["kv_b_proj"] == [[32, 4 * (16 + 16) // 2]] * 2  # heads split
    assert params["o_proj"] == [[4 * 16 // 2, 64]] * 2
    assert params["kv_a_proj_with_mqa"] == [[64, 40]] * 2  # replicated, like the latent it makes
    assert out["weight_bytes"]["2"]["measured"] == [out["weight_bytes"]["2"]["rules"]]
