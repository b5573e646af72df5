"""What a draft model must share with its target, and what its pool costs: the checks and page
bytes EngineConfig.resolve needs before any runner exists (no jax work, no runner import)."""

from __future__ import annotations

from models.config import ModelConfig
from paxpage.sharding import ShardingPlan, kv_page_bytes_per_device


def validate_draft_model(draft_model, target_model_cfg, target_tokenizer=None) -> None:
    """TypeError / ValueError when `draft_model` cannot draft for the target (EngineConfig.resolve
    calls it, so a bad draft fails before any pool is allocated)."""
    if not all(hasattr(draft_model, name) for name in ("config", "params", "tokenizer")):
        raise TypeError(f"draft_model must be a paxpage Model (paxpage.load(...), or Model.truncated(n)), "
                        f"got {type(draft_model).__name__}")
    check_compatible(target_model_cfg, target_tokenizer, draft_model.config, draft_model.tokenizer)


def check_compatible(target_cfg: ModelConfig, target_tokenizer, draft_cfg: ModelConfig, draft_tokenizer) -> None:
    """ValueError naming the mismatch when the draft cannot propose tokens for the target."""
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"the draft model's vocabulary has {draft_cfg.vocab_size} tokens; the target's has "
                         f"{target_cfg.vocab_size}: they must share the tokenizer")
    if target_tokenizer is not None and draft_tokenizer is not None and draft_tokenizer is not target_tokenizer:
        target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if target_vocab != draft_vocab:
            differ = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=str)[:3]
            raise ValueError(f"the draft model's tokenizer differs from the target's (e.g. {differ}); "
                             "they must share the tokenizer")
    # The scheduler releases pages outside the target's window when every target layer slides;
    # a draft layer that looks further back would then read released pages.
    window, draft_window = target_cfg.max_window, draft_cfg.max_window
    if window is not None and (draft_window is None or draft_window > window):
        raise ValueError(f"the target attends to at most {window} tokens (its pages before that are released) "
                         f"but the draft model attends to {draft_window or 'all'}: the draft's window must not exceed "
                         "the target's")


def draft_page_bytes(draft_cfg: ModelConfig, page_size: int, itemsize: int, kv_cache_dtype: str = "auto",
                     layout=None) -> int:
    """Bytes one page takes in the draft's pool (K and V, all draft layers, on one device: the
    draft is not sharded); the draft's pool has the target's kv_cache_dtype and layout."""
    return kv_page_bytes_per_device(draft_cfg, ShardingPlan.for_model(draft_cfg, 1), page_size, itemsize,
                                    kv_cache_dtype, layout)
