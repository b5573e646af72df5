"""HF model directories: config.json + *.safetensors (single file, sharded with an index, or bare shards).

safetensors is opened with framework="flax": numpy has no bfloat16, and flax arrays carry it as is.
PyTorch .bin checkpoints are pickles and are refused.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import Any

from safetensors import safe_open

from models.config import ModelConfig
from models.hf_config import config_from_hf_dir
from models.param_layout import params_from_hf

INDEX_FILE = "model.safetensors.index.json"


def is_hf_dir(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "config.json")) and (
        os.path.isfile(os.path.join(directory, INDEX_FILE))
        or bool(glob.glob(os.path.join(directory, "*.safetensors")))
    )


def safetensors_files(directory: str) -> list[str]:
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"corrupt safetensors index {index_path!r}: {e}") from e
        files = [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        hint = " (PyTorch .bin checkpoints are not supported)" if glob.glob(os.path.join(directory, "*.bin")) else ""
        raise ValueError(f"no *.safetensors files in model directory {directory!r}{hint}")
    for path in files:
        if not os.path.isfile(path):
            raise ValueError(f"safetensors shard {path!r} named in {INDEX_FILE} does not exist")
    return files


def load_hf_dir(directory: str, dtype: Any) -> tuple[ModelConfig, dict[str, Any]]:
    """Reads config and weights of a HF directory into the paxpage tree (see models/param_layout.py)."""
    try:
        cfg = config_from_hf_dir(directory)
    except (KeyError, TypeError) as e:  # a config.json lacking a required field
        raise ValueError(f"config.json in {directory!r} is incomplete: missing or bad {e}") from e
    with contextlib.ExitStack() as stack:
        owner: dict[str, tuple[str, Any]] = {}  # tensor name -> (file, open handle)
        for path in safetensors_files(directory):
            try:
                handle = stack.enter_context(safe_open(path, framework="flax"))
                names = list(handle.keys())
            except Exception as e:  # SafetensorError, OSError: truncated or not safetensors at all
                raise ValueError(f"cannot read safetensors file {path!r}: {e}") from e
            for name in names:
                owner[name] = (path, handle)

        def get_tensor(name: str):
            path, handle = owner[name]  # KeyError -> "missing tensor" in params_from_hf
            try:
                return handle.get_tensor(name)
            except Exception as e:
                raise ValueError(f"cannot read tensor {name!r} from {path!r}: {e}") from e

        params = params_from_hf(cfg, get_tensor, dtype, source=directory)
    return cfg, params
