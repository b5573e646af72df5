"""LoRA under tensor parallelism (forced host devices, in a subprocess): a mixed batch of two
adapters (one slot, so they swap) and the base gives HF PEFT's merged models' greedy tokens at
TP 4, with the slab split like its layers and the KV heads (and k / v's lora_b) replicated."""

from __future__ import annotations

import copy

from tests.conftest import hf_greedy, save_tiny_hf
from tests.engine.test_lora import _save_adapter
from tests.parallel.helpers import run_json


def test_lora_tp_matches_peft(tmp_path):
    # N = 4, K = 2: at TP 4 each KV head is replicated twice, and so are k / v's lora_b
    base = save_tiny_hf(tmp_path / "base", "llama", num_attention_heads=4, num_key_value_heads=2)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    merged = {}
    for name, rank, seed in (("a", 4, 1), ("b", 8, 2)):
        merged[name] = _save_adapter(copy.deepcopy(base), tmp_path / name, rank, 8, False, targets,
                                     seed).merge_and_unload()
    out = run_json(["tests.parallel.lora_tp_worker", str(tmp_path / "base"), "4", "5",
                    f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}"], timeout=420)
    vocab = 128
    prompts = [[(7 * i + 3 + 11 * k) % vocab for i in range(n)] for k, n in enumerate((5, 19, 12))]
    want = [hf_greedy(merged["a"], prompts[0], 5), hf_greedy(merged["b"], prompts[1], 5),
            hf_greedy(base, prompts[2], 5)]
    assert out["greedy"]["4"] == want
    # q_proj's lora_b [G, S, R, N*D] = [2, 1, 8, 64] split on its output axis
    assert out["lora_b_shards"]["4"] == [[2, 1, 8, 16]] * 4
