"""The on-disk cache of converted GGUF files, and what `paxpage cache info|clear` report and remove.

Dequantising a GGUF takes seconds (about 10 s for the default model on 2 CPU cores), so the
result is kept under `cache_dir()`: $PAXPAGE_CACHE_DIR, else $XDG_CACHE_HOME/paxpage, else
~/.cache/paxpage. One entry per source file, named from its resolved path, so re-runs, symlinks
and reinstalls of the same file reuse or replace one entry and never add a second:

    gguf-<sha256(real path)[:16]>-<file stem>/
        config.json         {"paxpage_gguf_cache": VERSION, "source": real path, "source_size": ...,
                             "source_mtime_ns": ..., "files": {name: bytes}, "config": ModelConfig,
                             "tokenizer_class": ...}
        params.safetensors  arrays under flat paxpage names ("layers_0/q_proj/kernel"): the GGUF's
                            quantised weights in their exact int8 form ("layers_0/q_proj/kernel_q"
                            i8 + "_scale" / "_offset" f32, models/quant.py), everything else f32.
                            One entry serves every dtype and every `quantization`: the cast, the
                            f32 expansion or the int8 re-quantisation happen on load
        tokenizer files     save_pretrained of the GGUF's tokenizer

An entry is built in a `.building-*` directory and renamed into place, so a reader never sees
half of one. On read, the source's size and mtime must match (else the entry is stale and is
rebuilt in place) and every file must have its recorded size (a truncated file is caught
before parsing); an entry that still fails to load is deleted and rebuilt.
The jax compilation cache of the CLI lives beside the entries, in `xla/` (paxpage/xla_cache.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from typing import Any

from models.config import ModelConfig
from models.tokenizer import FAST_CLASSES, load_tokenizer, save_tokenizer

log = logging.getLogger(__name__)

VERSION = 5  # bump when the entry layout or the GGUF conversion changes
KEY = "paxpage_gguf_cache"  # not the checkpoint marker: load_model(entry) must not take an entry for a checkpoint
META_FILE = "config.json"
PARAMS_FILE = "params.safetensors"
ENTRY_PREFIX = "gguf-"
BUILD_PREFIX = ".building-"
STALE_PREFIX = ".stale-"
XLA_DIR = "xla"
EXECUTABLES_DIR = "executables"  # paxpage/exec_cache.py, listed with the XLA cache
NATIVE_DIR = "native"  # compiled native kernels (pallas_kernels/native), listed with the XLA cache
_ABANDONED_AFTER_S = 3600.0  # a .building-* directory this old belongs to a crashed write


def cache_dir() -> str:
    """Root of paxpage's cache; PAXPAGE_CACHE_DIR overrides it."""
    if os.environ.get("PAXPAGE_CACHE_DIR"):
        return os.path.abspath(os.environ["PAXPAGE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "paxpage")


def native_dir() -> str:
    """Where the native CPU kernels (pallas_kernels/native) are built: cache_dir() + /native."""
    return os.path.join(cache_dir(), NATIVE_DIR)


def entry_path(source: str) -> str:
    """The entry directory of GGUF file `source` (resolved, so a symlink shares its target's entry)."""
    real = os.path.realpath(source)
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.splitext(os.path.basename(real))[0])[:60]
    digest = hashlib.sha256(real.encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), f"{ENTRY_PREFIX}{digest}-{stem}")


def _stamp(source: str) -> dict[str, Any]:
    st = os.stat(source)
    return {"source": os.path.realpath(source), "source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns}


def _read_meta(entry: str) -> dict[str, Any]:
    with open(os.path.join(entry, META_FILE)) as f:
        meta = json.load(f)
    if not isinstance(meta, dict):
        raise ValueError(f"{META_FILE} holds a {type(meta).__name__}, not an object")
    return meta


def _check_files(entry: str, meta: dict[str, Any]) -> None:
    """Raises ValueError when a recorded file is missing or has another size (a truncated write)."""
    files = meta.get("files")
    if not isinstance(files, dict) or PARAMS_FILE not in files:
        raise ValueError("no file list")
    for name, size in files.items():
        path = os.path.join(entry, name)
        actual = os.path.getsize(path) if os.path.isfile(path) else None
        if actual != size:
            raise ValueError(f"{name} has {actual} bytes; {size} were written")


def read_entry(source: str, check: Any = None) -> tuple[ModelConfig, dict, Any] | None:
    """(config, flat arrays, tokenizer) of GGUF file `source` from its entry, or None when there is
    no current entry. `check(cfg, flat)` may raise to reject what was read. A damaged entry is
    deleted (with a warning) so the caller rebuilds it."""
    from safetensors.numpy import load_file

    entry = entry_path(source)
    if not os.path.isdir(entry):
        return None
    try:
        meta = _read_meta(entry)
        if meta.get(KEY) != VERSION or any(meta.get(k) != v for k, v in _stamp(source).items()):
            return None  # older format or the source changed: rebuilt and replaced by write_entry
        _check_files(entry, meta)
        cfg = ModelConfig.from_dict(meta["config"])
        flat = load_file(os.path.join(entry, PARAMS_FILE))
        if check is not None:
            check(cfg, flat)
        tokenizer = None
        if meta.get("tokenizer_class") is not None:
            tokenizer = load_tokenizer(entry, fast_class=meta["tokenizer_class"] in FAST_CLASSES)
            if tokenizer is None:
                raise ValueError("tokenizer files are missing")
        return cfg, flat, tokenizer
    except Exception as e:  # anything wrong with the entry: rebuild it from the GGUF file
        log.warning("paxpage: rebuilding damaged cache entry %s (%s: %s)", entry, type(e).__name__, e)
        shutil.rmtree(entry, ignore_errors=True)
        return None


def write_entry(source: str, cfg: ModelConfig, flat: dict, tokenizer: Any) -> str | None:
    """Writes the entry of `source` (replacing an outdated one) and removes other entries of the same
    file and abandoned partial writes. Best effort: a read-only or full disk costs the next run
    speed, not this load. Returns the entry path, or None when nothing was written."""
    import numpy as np
    from safetensors.numpy import save_file

    entry, root = entry_path(source), cache_dir()
    tmp = None
    try:
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=BUILD_PREFIX, dir=root)
        save_file({k: np.ascontiguousarray(v, dtype=v.dtype if np.dtype(v.dtype) in (np.int8, np.uint8) else np.float32)
                   for k, v in flat.items()},
                  os.path.join(tmp, PARAMS_FILE))
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
        files = {name: os.path.getsize(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}
        meta = {KEY: VERSION, **_stamp(source), "files": files, "config": cfg.to_dict(),
                "tokenizer_class": type(tokenizer).__name__ if tokenizer is not None else None}
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(meta, f, indent=2)
        _move_into_place(tmp, entry)
        tmp = None
    except OSError as e:
        log.warning("paxpage: cannot write cache entry %s (%s); the next load converts again", entry, e)
        return None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    _prune(root, keep=entry, source=os.path.realpath(source))
    return entry


def _move_into_place(tmp: str, entry: str) -> None:
    """Renames the finished `tmp` to `entry`; an outdated `entry` is first renamed aside, then deleted.
    Between the two renames a reader finds no entry and converts on its own, never half of one."""
    try:
        os.rename(tmp, entry)
        return
    except OSError:
        if not os.path.isdir(entry):
            raise
    stale = tempfile.mkdtemp(prefix=STALE_PREFIX, dir=os.path.dirname(entry))
    try:
        os.rename(entry, os.path.join(stale, "entry"))
    except FileNotFoundError:
        pass  # another process moved it first
    try:
        os.rename(tmp, entry)
    except OSError:
        if not os.path.isdir(entry):  # lost a race to a writer of the same file: its entry is as good
            raise
    finally:
        shutil.rmtree(stale, ignore_errors=True)


def _prune(root: str, keep: str, source: str) -> None:
    """Deletes other entries of `source` (older formats, keyed by path + size + mtime) and abandoned
    partial writes, so one file never holds more than one entry's worth of disk."""
    now = time.time()
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if path == keep or not os.path.isdir(path):
            continue
        try:
            if name.startswith((BUILD_PREFIX, STALE_PREFIX)):
                if now - os.path.getmtime(path) > _ABANDONED_AFTER_S:
                    shutil.rmtree(path, ignore_errors=True)
            elif name.startswith(ENTRY_PREFIX):
                other = _read_meta(path).get("source")
                if isinstance(other, str) and os.path.realpath(other) == source:
                    shutil.rmtree(path, ignore_errors=True)
        except (OSError, ValueError):
            continue  # unreadable: left to `paxpage cache clear`


# ---------------------------------------------------------------- paxpage cache info | clear

@dataclasses.dataclass(frozen=True)
class CacheItem:
    path: str
    kind: str  # "model" | "partial" | "xla"
    num_bytes: int
    source: str | None = None  # the GGUF file a model entry was converted from
    state: str = "ok"  # model entries: ok | stale (source changed) | source missing | older format | unreadable


def _tree_bytes(path: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def _entry_state(path: str) -> tuple[str | None, str]:
    try:
        meta = _read_meta(path)
    except (OSError, ValueError):
        return None, "unreadable"
    source = meta.get("source") if isinstance(meta.get("source"), str) else None
    if meta.get(KEY) != VERSION:
        return source, "older format"
    if source is None or not os.path.isfile(source):
        return source, "source missing"
    if any(meta.get(k) != v for k, v in _stamp(source).items()):
        return source, "stale (source changed)"
    try:
        _check_files(path, meta)
    except (OSError, ValueError):
        return source, "unreadable"
    return source, "ok"


def list_cache() -> list[CacheItem]:
    """Everything paxpage keeps under cache_dir(): converted models, partial writes, the XLA cache.
    Files it did not write are not listed (and never removed)."""
    root = cache_dir()
    if not os.path.isdir(root):
        return []
    items = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        if name.startswith(ENTRY_PREFIX):
            source, state = _entry_state(path)
            items.append(CacheItem(path, "model", _tree_bytes(path), source, state))
        elif name.startswith((BUILD_PREFIX, STALE_PREFIX)):
            items.append(CacheItem(path, "partial", _tree_bytes(path)))
        elif name in (XLA_DIR, EXECUTABLES_DIR, NATIVE_DIR):
            items.append(CacheItem(path, "xla", _tree_bytes(path)))
    return items


def clear_cache() -> tuple[int, int]:
    """Removes everything `list_cache` lists; returns (items removed, bytes freed)."""
    items = list_cache()
    for item in items:
        shutil.rmtree(item.path, ignore_errors=True)
    return len(items), sum(item.num_bytes for item in items)
