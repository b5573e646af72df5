"""paxpage's own checkpoint directory: Orbax params + config.json + tokenizer files. No pickle.

Layout of `path/`:
    config.json   {"paxpage_format": 1, "dtype": "float32", "config": ModelConfig.to_dict()}
    params/       orbax StandardCheckpointer of the parameter tree (models/param_layout.py)
    tokenizer.json, tokenizer_config.json, ...   (only when a tokenizer was given)
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.param_layout import check_dtype, flatten, param_shapes, unflatten
from models.tokenizer import load_tokenizer, save_tokenizer

FORMAT_VERSION = 1
FORMAT_KEY = "paxpage_format"
CONFIG_FILE = "config.json"
PARAMS_DIR = "params"


def read_paxpage_config(directory: str) -> dict[str, Any] | None:
    """The parsed config.json when `directory` holds a paxpage checkpoint, else None."""
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path!r}: {e}") from e
    return d if isinstance(d, dict) and FORMAT_KEY in d else None


def save_model(path: str | os.PathLike, config: ModelConfig, params: dict[str, Any], tokenizer: Any = None) -> None:
    """Writes a checkpoint that `load_model(path)` reads back exactly. Overwrites one already at `path`."""
    path = os.path.abspath(os.fspath(path))
    if any(jnp.dtype(x.dtype) in (jnp.int8, jnp.uint8) for x in jax.tree.leaves(params)):
        raise ValueError("save_model writes float weights; this model holds quantized ones: load it with "
                         "quantization='none' to save it, and quantize when loading the checkpoint")
    expected = flatten(param_shapes(config))
    flat = flatten(params)
    if set(flat) != set(expected):
        missing, extra = sorted(set(expected) - set(flat)), sorted(set(flat) - set(expected))
        raise ValueError(f"params do not match config: missing {missing[:5]}, extra {extra[:5]}")
    dtypes = {jnp.dtype(x.dtype) for x in flat.values()}
    if len(dtypes) != 1:
        raise ValueError(f"params mix dtypes {sorted(map(str, dtypes))}; save_model wants one")
    for name, x in flat.items():
        if tuple(x.shape) != expected[name]:
            raise ValueError(f"params {name} has shape {tuple(x.shape)}; config implies {expected[name]}")
    os.makedirs(path, exist_ok=True)

    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(path, PARAMS_DIR), jax.tree.map(jnp.asarray, params), force=True)
    checkpointer.wait_until_finished()
    checkpointer.close()
    if tokenizer is not None:
        save_tokenizer(tokenizer, path)
    meta = {FORMAT_KEY: FORMAT_VERSION, "dtype": str(dtypes.pop()), "config": config.to_dict()}
    with open(os.path.join(path, CONFIG_FILE), "w") as f:  # written last: marks the checkpoint complete
        json.dump(meta, f, indent=2)


def load_checkpoint(path: str, meta: dict[str, Any], dtype: Any) -> tuple[ModelConfig, dict[str, Any], Any]:
    """Reads a directory written by `save_model`; `meta` is its parsed config.json."""
    dt = check_dtype(dtype)
    if meta.get(FORMAT_KEY) != FORMAT_VERSION:
        raise ValueError(
            f"{path!r} has {FORMAT_KEY} {meta.get(FORMAT_KEY)!r}; this paxpage reads version {FORMAT_VERSION}"
        )
    try:
        config = ModelConfig.from_dict(meta["config"])
        stored = jnp.dtype(meta["dtype"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"corrupt paxpage config in {path!r}: {e!r}") from e

    import orbax.checkpoint as ocp

    # An explicit target puts arrays on this process's default device whatever machine saved them.
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda shape: jax.ShapeDtypeStruct(shape, stored, sharding=sharding),
        param_shapes(config),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    params_dir = os.path.abspath(os.path.join(path, PARAMS_DIR))
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            params = checkpointer.restore(params_dir, target)
    except Exception as e:  # orbax/tensorstore errors for missing or damaged files
        raise ValueError(f"cannot restore paxpage params from {params_dir!r}: {type(e).__name__}: {e}") from e
    if stored != dt:
        params = unflatten({k: v.astype(dt) for k, v in flatten(params).items()})
    return config, params, load_tokenizer(path)
