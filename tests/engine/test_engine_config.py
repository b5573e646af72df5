"""EngineConfig / ResolvedConfig: copying, pickling, and the KV pool size they resolve to."""

from __future__ import annotations

import copy
import pickle

from models.config import ModelConfig
from paxpage.config import EngineConfig

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=256)


def test_resolved_config_copies_and_pickles():
    # __getattr__ forwards to .engine; copy / pickle probe attributes before .engine exists.
    resolved = EngineConfig(page_size=8, num_pages=40).resolve(TINY)
    for clone in (copy.copy(resolved), copy.deepcopy(resolved), pickle.loads(pickle.dumps(resolved))):
        assert clone == resolved
        assert clone.page_size == 8 and clone.num_pages == 40 and clone.max_num_seqs == 64
