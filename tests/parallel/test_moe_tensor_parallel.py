"""Routed experts split over a forced 4-device CPU mesh (in subprocesses): at tp 2 and 4 each device
holds 1 / tp of every expert's width (paxpage/sharding.py, paxpage/sharded_experts.py), the greedy
tokens are HF transformers' and one device's, each token's logprob is one device's within 1e-5
(f32), and the compiled decode step sums each MoE layer once, gathering no expert weight."""

from __future__ import annotations

import pytest

from tests.conftest import hf_greedy, save_tiny_deepseek, save_tiny_hf, to_mxfp4_checkpoint
from tests.parallel.helpers import run_json


def _run(path, hf, sizes: str = "1,2,4", max_tokens: int = 6, one: bool = False, ep: bool = False) -> dict:
    """The worker's results, checked against HF's greedy tokens and one device's logprobs.
    one: only the worker's 19-token prompt (fewer step shapes to compile). ep: expert parallelism."""
    out = run_json(["tests.parallel.moe_tp_worker", str(path), sizes, str(max_tokens), "--hlo"] + ["--one"] * one
                   + ["--ep"] * ep, timeout=420)
    assert out["num_devices"] == 4
    vocab = hf.config.vocab_size
    prompts = [[(7 * i + 3) % vocab for i in range(n)] for n in ((19,) if one else (5, 19, 40))]
    want = [hf_greedy(hf, p, max_tokens) for p in prompts]
    for tp in sizes.split(","):
        assert out["greedy"][tp] == want, tp
        for got, one in zip(out["logprobs"][tp], out["logprobs"]["1"]):
            assert max(abs(a - b) for a, b in zip(got, one)) < 1e-5, tp
        assert out["weight_bytes"][tp]["measured"] == [out["weight_bytes"][tp]["rules"]], tp
        # at most the logits are gathered (a vocabulary split), never an expert weight
        assert set(out["collectives"][tp]["all_gather_shapes"]) <= {f"f32[1,{vocab}]{{0,1}}"}, tp
    return out


def _expert_shards(out, tp: int, num_experts: int, hidden: int, width: int, held: int | None = None) -> None:
    """At `tp`, each device holds `width` columns of `held` experts (default: every expert)."""
    experts = out["experts"][str(tp)]
    held = num_experts if held is None else held
    assert experts["gate_up_proj"] == [[held, hidden, 2 * width]] * tp
    assert experts["down_proj"] == [[held, width, hidden]] * tp
    assert experts["router"] == [[hidden, num_experts]] * tp


def test_qwen3_moe_experts_split_at_tp_2_and_4(tmp_path):
    """8 experts of width 32, scanned layers: one MoE all-reduce in the layer body. ~20 s."""
    hf = save_tiny_hf(tmp_path, "qwen3_moe", num_attention_heads=8, num_key_value_heads=4)
    out = _run(tmp_path, hf, one=True)
    _expert_shards(out, 1, 8, 64, 32)
    for tp in (2, 4):
        _expert_shards(out, tp, 8, 64, 32 // tp)
        assert out["plan"][str(tp)].endswith("experts split")
        # the scanned body's o_proj and MoE sums, and the vocabulary-split embedding's
        assert out["collectives"][str(tp)]["all-reduce"] == 3 and out["collectives"][str(tp)]["moe_all_reduces"] == 1


def test_qwen3_moe_expert_parallel_at_tp_2_and_4(tmp_path):
    """enable_expert_parallel: 8 whole experts split 4 / 2 per device, each at its full width 32;
    HF's greedy tokens, one device's logprobs, one MoE all-reduce in the scanned layer body."""
    hf = save_tiny_hf(tmp_path, "qwen3_moe", num_attention_heads=8, num_key_value_heads=4)
    out = _run(tmp_path, hf, one=True, ep=True)
    for tp in (2, 4):
        _expert_shards(out, tp, 8, 64, 32, held=8 // tp)
        assert out["plan"][str(tp)].endswith("experts split (whole experts per device)")
        assert out["collectives"][str(tp)]["moe_all_reduces"] == 1


@pytest.mark.parametrize("ep", [False, True], ids=["experts-split", "expert-parallel"])
def test_gpt_oss_mxfp4_experts_held_in_4_bits_split_over_devices(tmp_path, ep):
    """A checkpoint with MXFP4 experts (held as stored, two 4-bit codes a byte, one f32 scale per 32
    inputs, Fe = 64): at tp 2
    each device holds half of every expert's width and of its down projection's 2 groups of
    scales; with expert parallelism at tp 2 and 4, whole experts with their scales. HF's greedy
    tokens on transformers' decoding of the same file, one device's logprobs, the bytes each
    device holds by the shape rules. ~25 s each."""
    hf = save_tiny_hf(tmp_path, "gpt_oss", num_attention_heads=8, num_key_value_heads=4, sliding_window=8,
                      num_hidden_layers=3, head_dim=16, intermediate_size=64)
    to_mxfp4_checkpoint(tmp_path, hf)
    out = _run(tmp_path, hf, "1,2,4" if ep else "1,2", one=True, ep=ep)
    for tp in (2, 4) if ep else (2,):
        held, width = (4 // tp, 64) if ep else (4, 64 // tp)
        experts = out["experts"][str(tp)]
        assert experts["gate_up_proj_q"] == [[held, 64 // 2, 2 * width]] * tp
        assert experts["gate_up_proj_scale"] == [[held, 2, 2 * width]] * tp
        assert experts["down_proj_q"] == [[held, width // 2, 64]] * tp
        assert experts["down_proj_scale"] == [[held, width // 32, 64]] * tp


def test_quantized_expert_groups_that_do_not_split_are_refused():
    """Fe = 64 in groups of 32: two groups do not split over 4 devices (a device would hold half a
    group's scale); expert parallelism keeps the experts whole."""
    import numpy as np

    from models.config import ModelConfig
    from paxpage.sharded_experts import regroup
    from paxpage.sharding import ShardingPlan

    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=4, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    moe = {"gate_up_proj_q": np.zeros((4, 32, 128), np.uint8), "gate_up_proj_scale": np.ones((4, 2, 128), np.float32),
           "down_proj_q": np.zeros((4, 32, 64), np.uint8), "down_proj_scale": np.ones((4, 2, 64), np.float32)}
    regroup(ShardingPlan.for_model(cfg, 2), {"layers_0": {"moe": moe}})  # 2 groups over 2 devices
    with pytest.raises(ValueError, match="2 groups of inputs per expert .* tensor_parallel_size 4"):
        regroup(ShardingPlan.for_model(cfg, 4), {"layers_0": {"moe": moe}})
    assert regroup(ShardingPlan.for_model(cfg, 4, expert_parallel=True), {"layers_0": {"moe": moe}})


@pytest.mark.extended  # ~35 s each: a fresh interpreter with forced devices, three tp sizes
@pytest.mark.parametrize("kind,extra,width,sizes", [
    # biased experts: gate_up's bias regrouped with its columns, the down bias added once
    ("gpt_oss", dict(sliding_window=8, num_hidden_layers=3, head_dim=16, intermediate_size=32), 32, (2, 4)),
    ("mixtral", dict(), 128, (2, 4)),
    # width 20: split at tp 2, whole (replicated) at tp 3 (HF's grouped matmul needs widths of 4n)
    ("qwen3_moe", dict(moe_intermediate_size=20), 20, (2, 3)),
], ids=["gpt-oss", "mixtral", "qwen3-moe-uneven"])
def test_moe_models_at_tp_2_and_4_are_one_device(tmp_path, kind, extra, width, sizes):
    hf = save_tiny_hf(tmp_path, kind, num_attention_heads=8, num_key_value_heads=4, **extra)
    out = _run(tmp_path, hf, ",".join(map(str, (1, *sizes))))
    num_experts = 8 if kind == "qwen3_moe" else 4
    for tp in sizes:
        split = width % tp == 0
        _expert_shards(out, tp, num_experts, 64, width // tp if split else width)
        assert out["plan"][str(tp)].endswith("experts split" if split else "experts replicated")
    if kind == "gpt_oss":
        assert out["experts"]["2"]["gate_up_bias"] == [[4, 32]] * 2
        assert out["experts"]["2"]["down_bias"] == [[4, 64]] * 2
        assert out["collectives"]["2"]["moe_all_reduces"] == 3  # three unrolled MoE layers, one each


@pytest.mark.extended
@pytest.mark.parametrize("version,extra", [
    (3, dict()),
    # DeepSeek-V2's softmax routing, the top 2 from the best of 2 groups, q through q_lora_rank
    (2, dict(norm_topk_prob=False, topk_method="group_limited_greedy", n_group=2, topk_group=1,
             routed_scaling_factor=2.5, rope_parameters=dict(rope_type="default", rope_theta=500.0))),
], ids=["v3", "v2"])
def test_deepseek_routed_experts_split_beside_shared_ones(tmp_path, version, extra):
    """Routed experts split beside the shared expert's MLP (split with the dense MLPs), latent attention."""
    hf = save_tiny_deepseek(tmp_path, version=version, **extra)
    out = _run(tmp_path, hf)
    for tp in (2, 4):
        _expert_shards(out, tp, 8, 64, 32 // tp)
