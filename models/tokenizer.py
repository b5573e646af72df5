"""Tokenizer loading and saving: HF tokenizers from a model directory or a GGUF file, offline only.

transformers is imported lazily: it costs seconds, and a checkpoint without a tokenizer never needs it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

# Any of these marks a directory as holding a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(directory: str | os.PathLike) -> bool:
    return any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES)


class _DropNoTorchNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


def import_transformers_quietly() -> None:
    """Imports transformers without the "PyTorch was not found" notice it logs when torch is absent.

    Tokenizers and configs need no torch, and torch is only a test dependency here, so on a plain
    install the notice reads like an error. transformers logs it once, while its package is first
    imported, on its "transformers" logger: a filter dropping that one message is attached for the
    import only, so every other transformers message, and any later configuration, is untouched.
    """
    if "transformers" in sys.modules:
        return
    logger, notice_filter = logging.getLogger("transformers"), _DropNoTorchNotice()
    logger.addFilter(notice_filter)
    try:
        import transformers  # noqa: F401
    finally:
        logger.removeFilter(notice_filter)


# Classes that are exactly "a tokenizer.json plus config": loadable without AutoTokenizer.
FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(
    directory: str | os.PathLike, *, gguf_file: str | None = None, fast_class: bool = False
) -> Any | None:
    """Loads the tokenizer in `directory` (or the one embedded in `directory/gguf_file`).

    fast_class: load tokenizer.json with PreTrainedTokenizerFast instead of AutoTokenizer. Only for
        directories whose tokenizer is known to be of a FAST_CLASSES class (our GGUF cache): it skips
        AutoTokenizer's import of the model-config machinery (and torch), about a second.
    Returns None when a plain directory holds no tokenizer files (random-weight test models).
    Raises ValueError naming the directory when tokenizer files exist but cannot be read.
    """
    directory = os.fspath(directory)
    if gguf_file is None and not has_tokenizer(directory):
        return None
    where = os.path.join(directory, gguf_file) if gguf_file else directory
    try:
        import_transformers_quietly()
        if fast_class:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)
        from transformers import AutoTokenizer

        if gguf_file is not None:
            try:
                return gguf_tokenizer(where)
            except ImportError:  # transformers moved its GGUF helpers: take the official path
                return AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file, local_files_only=True)
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as e:  # transformers raises many types; users get one.
        raise ValueError(f"cannot load tokenizer from {where!r}: {type(e).__name__}: {e}") from e


# Tokenizer special-token arguments and the GGUF keys ("tokenizer.ggml.<key>") holding their ids.
GGUF_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                       "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def gguf_tokenizer(path: str) -> Any:
    """The tokenizer embedded in a GGUF file, without torch.

    transformers' own GGUF path (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) reads the
    metadata with a torch-based reader, and torch is only a test dependency here. This reads the
    same fields with the `gguf` package and hands them to transformers' GGUF tokenizer builder,
    as that path does; tests check it against AutoTokenizer token for token.
    """
    import gguf

    import_transformers_quietly()
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)

    reader = gguf.GGUFReader(path)
    metadata = {key: field.contents() for key, field in reader.fields.items()
                if key.startswith("tokenizer.") or key == "general.architecture"}
    grouped = {group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in metadata}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece vocabularies
    for name, key in GGUF_SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


def save_tokenizer(tokenizer: Any, directory: str | os.PathLike) -> None:
    """Writes `tokenizer` (chat template included) with `save_pretrained`."""
    if not hasattr(tokenizer, "save_pretrained"):
        raise ValueError(f"tokenizer of type {type(tokenizer).__name__} has no save_pretrained")
    tokenizer.save_pretrained(os.fspath(directory))
