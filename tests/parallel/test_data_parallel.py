"""Data parallelism on a forced 4-device CPU mesh (subprocess): replicas on disjoint devices, the
router's choices (shared prefix -> same replica, else least loaded), and outputs equal to one
engine's (greedy: HF transformers' tokens; seeded sampling: one replica's tokens)."""

from __future__ import annotations

from tests.conftest import hf_greedy, save_tiny_hf
from tests.parallel.helpers import run_json


def test_data_parallel_routes_and_matches_one_engine(tmp_path):
    hf = save_tiny_hf(tmp_path, "llama", num_attention_heads=4, num_key_value_heads=2)
    out = run_json(["tests.parallel.dp_worker", str(tmp_path), "5"], timeout=420)
    shared = [(5 * i + 1) % 100 for i in range(16)]
    prompts = [shared + [1, 2], [3] * 9, shared + [7], [11, 12, 13, 14, 15]]
    want = [hf_greedy(hf, p, 5) for p in prompts]
    assert out["one"]["greedy"] == want
    for name in ("dp2", "dp2tp2"):
        assert out[name]["greedy"] == want, name
        assert out[name]["sampled"] == out["one"]["sampled"], name
        # routing, worked by hand: p0 -> replica 0 (tie), p1 -> 1 (least loaded), p2 shares
        # p0's 4 pages -> 0, p3 -> 1 (loads 2 / 1); the second call: every prompt's pages (p3
        # has one) are where they went first, so the same again. Prompt tokens per replica:
        assert out[name]["prompt_tokens"] == [2 * (18 + 17), 2 * (9 + 5)], name
    assert out["dp2tp2"]["devices"] == [[2, 3], [0, 1]]  # the explicit mesh's rows
    assert out["dp2"]["devices"] == [[0], [1]]
    # a one-device replica runs the native matmul on kernels held in panels, as one engine does;
    # tensor parallelism splits plain kernels and runs XLA's dot
    assert out["one"]["matmul"] == ["native"] and out["dp2"]["matmul"] == ["native", "native"]
    assert out["dp2tp2"]["matmul"] == ["xla", "xla"]
