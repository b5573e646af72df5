"""The step shapes a config compiles, against hand-counted sets (compile_plan.step_shapes)."""

from __future__ import annotations

import pytest

from paxpage.packing import bucket
from paxpage.compile_plan import step_shapes


def test_small_config_shapes_by_hand():
    # 8 seqs, 64 tokens, rows of 16, 4 prefill rows: decode buckets {0, 4, 8} (4 rows at least),
    # prefill buckets {0, 1, 2, 4}; every pair but (0, 0) is reachable (8 decode rows with a prefill
    # row: 5-7 decodes pad to 8).
    want = [(d, p) for d in (0, 4, 8) for p in (0, 1, 2, 4) if d or p]
    assert step_shapes(8, 64, 16, 4) == want


@pytest.mark.parametrize("seqs,decode_buckets", [
    (16, (0, 4, 8, 16)),
    (32, (0, 4, 8, 16, 24, 32)),
    (64, (0, 4, 8, 16, 24, 32, 48, 64)),
])
def test_default_config_shape_counts(seqs, decode_buckets):
    """512 tokens in rows of 32: at most 16 prefill rows, buckets {0, 1, 2, 4, 8, 16}. Before the
    prefill-row cap and the 4-row decode minimum: 41 / 71 / 109 shapes for 16 / 32 / 64 seqs."""
    prefill_buckets = (0, 1, 2, 4, 8, 16)
    assert {bucket(n, 4) for n in range(seqs + 1)} == set(decode_buckets)
    shapes = step_shapes(seqs, 512, 32, 16)
    assert len(shapes) == len(decode_buckets) * len(prefill_buckets) - 1  # 23 / 35 / 47
    assert set(shapes) == {(d, p) for d in decode_buckets for p in prefill_buckets if d or p}


def test_prefill_row_cap_default_and_validation():
    from models.config import ModelConfig
    from paxpage import EngineConfig

    model = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=8, max_position_embeddings=64)
    assert EngineConfig().resolve(model, backend="cpu").prefill_rows == 512 // 32
    assert EngineConfig(max_num_batched_tokens=16).resolve(model, backend="cpu").prefill_rows == 1
    assert EngineConfig(max_prefill_rows=3).resolve(model, backend="cpu").prefill_rows == 3
    with pytest.raises(ValueError, match="max_prefill_rows must be a positive int or None, got 0"):
        EngineConfig(max_prefill_rows=0)


def test_single_row_decode_shape():
    """On CPU one decode row alone keeps its one row: one more shape, (1, 0); a decode row
    beside prefill rows, and 2-3 decode rows, still pad to 4."""
    from paxpage.packing import decode_rows

    assert step_shapes(8, 64, 16, 4, single_row_decode=True) == sorted([(1, 0), *step_shapes(8, 64, 16, 4)])
    assert [decode_rows(n, 0, True) for n in (0, 1, 2, 3, 5)] == [0, 1, 4, 4, 8]
    assert [decode_rows(1, 1, True), decode_rows(1, 0, False)] == [4, 4]


def test_mask_rows_by_hand_and_precompile_covers_every_count():
    import types

    import numpy as np

    from paxpage.compile_plan import CompilePlan
    from paxpage.packing import mask_row_counts, mask_rows

    assert [mask_rows(n) for n in (0, 1, 4, 5, 16, 17, 64, 65, 256)] == [4, 4, 4, 16, 16, 64, 64, 256, 256]
    assert [mask_row_counts(r) for r in (1, 4, 5, 64, 65)] == [[4], [4], [4, 16], [4, 16, 64], [4, 16, 64, 256]]
    # A warm-up masks the logits of every logits-row count R at each count a step of R rows can
    # need, on a runner that records its calls (no compiles here).
    masked = {}
    runner = types.SimpleNamespace(
        packer=types.SimpleNamespace(padding_batch=lambda dec, pre: types.SimpleNamespace(
            logits_indices=np.zeros(bucket(dec + pre), np.int32))),
        forward=lambda batch: ("logits", len(batch.logits_indices)),
        sample=lambda batch, logits, sampling, allowed=None: (None, None, "tokens"),
        mask=lambda logits, masks: masked.setdefault(logits[1], []).append(len(masks.rows)) or logits)
    plan = CompilePlan(tuple(step_shapes(24, 64, 16, 4)), 16, 24)
    from paxpage.sampling.tensors import SamplingTensors

    plan.warm_up(runner, lambda rows: SamplingTensors.build([], 96, pad_rows_to=rows), num_mask_words=3)
    assert set(masked) == {bucket(dec + pre) for dec, pre in plan.shapes}
    for rows, counts in masked.items():
        assert counts == sorted({mask_rows(n) for n in range(1, rows + 1)}), rows
