"""Tensor parallelism on a 4-device CPU mesh (forced host devices, in subprocesses): greedy tokens
for TP = 1, 2, 4 equal HF transformers' on the same weights, seeded sampling gives the same tokens
at every TP size, and the KV pool and weights are split as paxpage/sharding.py documents."""

from __future__ import annotations

import pytest

from tests.conftest import hf_greedy, save_tiny_hf
from tests.parallel.helpers import run_json

PROMPT_LENS = (5, 19, 40)  # the worker's prompts: token (7 i + 3) % vocab


def _prompts(vocab):
    return [[(7 * i + 3) % vocab for i in range(n)] for n in PROMPT_LENS]


@pytest.mark.parametrize("shape", [
    # even: N = 8, K = 4, F and V divisible: tp 2 and 4 split everything
    pytest.param(dict(num_attention_heads=8, num_key_value_heads=4, vocab_size=128, intermediate_size=128),
                 marks=pytest.mark.extended),
    # uneven: N = 6, K = 3 (SmolLM2's ratio) -> attention replicated; V = 126 splits at tp 2 only
    pytest.param(dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=48, vocab_size=126,
                      intermediate_size=96), marks=pytest.mark.extended),
    # K = 2 < tp = 4 with N = 4: each KV head replicated twice so heads still split
    dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=128, intermediate_size=128),
], ids=["even", "uneven", "kv-replicated"])
def test_tp_greedy_matches_hf_and_pool_is_split(tmp_path, shape):
    hf = save_tiny_hf(tmp_path, "llama", **shape)
    out = run_json(["tests.parallel.tp_worker", str(tmp_path), "1,2,4", "6", "--sampling"], timeout=420)
    assert out["num_devices"] == 4
    vocab = shape["vocab_size"]
    want = [hf_greedy(hf, p, 6) for p in _prompts(vocab)]
    for tp in ("1", "2", "4"):
        assert out["greedy"][tp] == want, tp
        assert out["sampled"][tp] == out["sampled"]["1"], tp
    n, k, f = shape["num_attention_heads"], shape["num_key_value_heads"], shape["intermediate_size"]
    hidden = shape.get("hidden_size", 64)
    d = hidden // n
    kv = out["kv"]
    assert kv["1"]["shard_shapes"] == [[2, 48, 4, k, d]]
    for tp in (2, 4):
        t = str(tp)
        splits = n % tp == 0 and (k % tp == 0 or tp % k == 0)
        heads = max(k, tp) if splits else k  # pool heads after any KV-head replication
        assert kv[t]["devices"] == tp
        assert kv[t]["shape"] == [2, 48, 4, heads, d]
        per_device = heads // tp if splits else heads
        assert kv[t]["shard_shapes"] == [[2, 48, 4, per_device, d]] * tp
        assert kv[t]["spec"] == [None, None, None, "model" if splits else None, None]
        q_cols = n * d // tp if splits else n * d
        assert out["params"][t]["q_proj"] == [[hidden, q_cols]] * tp
        assert out["params"][t]["up_proj"] == [[hidden, f // tp]] * tp
    assert out["recompiles"] == {"1": 0, "2": 0, "4": 0}
    for t in ("1", "2", "4"):  # the XLA path scans its layers: the stacked layer axis is never split
        assert out["kv"][t]["scanned"] and out["kv"][t]["layer_axis_split"] is None, t
        assert out["params"][t]["layer_axis_split"] is None, t
    for t, sizes in out["weight_bytes"].items():  # every device the same; the rules' figure
        assert sizes["measured"] == [sizes["rules"]], t


def test_tp_pallas_kernels_under_shard_map(tmp_path):
    """The Pallas kernels (interpreted on CPU) see only their device's heads under shard_map."""
    shape = dict(num_attention_heads=8, num_key_value_heads=4, hidden_size=128, vocab_size=128,
                 intermediate_size=128)  # head_dim 16: the GPU kernels' smallest
    hf = save_tiny_hf(tmp_path, "llama", **shape)
    out = run_json(["tests.parallel.tp_worker", str(tmp_path), "2", "3", "--pallas"], timeout=420)
    assert out["greedy"]["2"] == [hf_greedy(hf, p, 3) for p in _prompts(128)]
    assert out["kv"]["2"]["shard_shapes"] == [[2, 48, 4, 2, 16]] * 2
    assert not out["kv"]["2"]["scanned"]  # Pallas attention keeps the unrolled layers by default


@pytest.mark.extended
def test_tp_pallas_kernels_take_the_sinks(tmp_path):
    """gpt-oss on the Pallas kernels (interpreted) at tp 2: each device's sinks are its own heads'
    (split with the queries), through the windowed and full layers."""
    hf = save_tiny_hf(tmp_path, "gpt_oss", num_attention_heads=8, num_key_value_heads=4, sliding_window=8,
                      num_hidden_layers=2, head_dim=16, intermediate_size=32)
    out = run_json(["tests.parallel.tp_worker", str(tmp_path), "2", "4", "--pallas"], timeout=420)
    assert out["greedy"]["2"] == [hf_greedy(hf, p, 4) for p in _prompts(128)]


@pytest.mark.extended
def test_tp_int8_kv_cache_and_int8_weights(tmp_path):
    """An int8 KV cache and int8 weights at tp 2 (K = 4 heads split 2 + 2): the KV scales are split
    on their K axis like the pages, weight values split like the float kernels (per-channel scales
    along the output axis), and the greedy tokens are tp 1's. tests/models/test_quant_loading.py
    checks the one-device int8 model against HF on the dequantised weights."""
    save_tiny_hf(tmp_path, "llama", num_attention_heads=8, num_key_value_heads=4, vocab_size=128,
                 intermediate_size=128)
    out = run_json(["tests.parallel.tp_worker", str(tmp_path), "1,2", "6", "--int8-kv", "--int8-weights"],
                   timeout=420)
    assert out["greedy"]["2"] == out["greedy"]["1"]
    assert out["kv"]["2"]["shard_shapes"] == [[2, 48, 4, 2, 8]] * 2
    assert out["kv_scales"]["2"]["shard_shapes"] == [[2, 48, 4, 2]] * 2
    assert out["kv_scales"]["2"]["spec"] == [None, None, None, "model"]
    assert out["params"]["2"]["q_proj"] == [[64, 32]] * 2  # kernel_q split on the heads
    assert out["recompiles"] == {"1": 0, "2": 0}


@pytest.mark.slow
@pytest.mark.extended
def test_tp_smollm2_greedy_same_tokens(hf_smollm2):
    """The real SmolLM2 (N = 9, K = 3: attention replicated at tp 2 and 4, MLP and vocab split),
    eight prompts of 32 tokens: greedy and seeded sampling (temperature 1.0, seed 11) give the
    same tokens at tp 1, 2, 4 and on two data-parallel replicas, though the logits differ by
    rounding between these layouts: a seeded draw moves only at a near tie (paxpage/sampling/draw.py)."""
    out = run_json(["tests.parallel.tp_worker", "default", "1,2,4", "32", "--eight", "--dp", "--sampling"],
                   timeout=900)
    want = hf_greedy(hf_smollm2, _prompts(49152)[1], 4)  # the second prompt is --one's
    for layout in ("1", "2", "4", "dp2"):
        assert out["greedy"][layout][1][:4] == want, layout
        assert out["greedy"][layout] == out["greedy"]["1"], layout
        assert out["sampled"][layout] == out["sampled"]["1"], layout
    assert len(set(map(tuple, out["sampled"]["1"]))) == 8


@pytest.mark.parametrize("kind,extra", [
    # every layer windowed; the 19- and 40-token prompts reach past the window of 8
    ("mistral", dict(sliding_window=8)),
    # local / global / local layers, attention and final soft-caps, a query scale of its own
    ("gemma2", dict(sliding_window=8, num_hidden_layers=3, attn_logit_softcapping=1.0,
                    final_logit_softcapping=2.0, query_pre_attn_scalar=24)),
    # attention sinks split over the heads with the queries; biased experts split on their width
    ("gpt_oss", dict(sliding_window=8, num_hidden_layers=3, head_dim=16, intermediate_size=32)),
], ids=["mistral-window", "gemma2-window-softcap", "gpt-oss-window-sinks"])
@pytest.mark.extended
def test_tp_windowed_and_soft_capped_models_match_hf(tmp_path, kind, extra):
    """The layer's window and soft-cap reach the attention each device runs under shard_map."""
    hf = save_tiny_hf(tmp_path, kind, num_attention_heads=8, num_key_value_heads=4, **extra)
    out = run_json(["tests.parallel.tp_worker", str(tmp_path), "2,4", "6"], timeout=420)
    want = [hf_greedy(hf, p, 6) for p in _prompts(128)]
    for tp in ("2", "4"):
        assert out["greedy"][tp] == want, tp
        assert out["kv"][tp]["spec"][3] == "model", tp  # the KV heads really are split
