"""What a model ships outside config.json: extra end-of-turn ids and its sampling defaults.

HF models carry them in `generation_config.json` (Llama-3-Instruct ends turns with <|eot_id|>,
128009, listed there beside <|end_of_text|>, 128001; many instruct models recommend a temperature
or top_p there). GGUF files carry `tokenizer.ggml.eot_token_id` / `eom_token_id` (llama.cpp stops
at both) and, from newer converters, `general.sampling.*` keys.

The engine stops at config.json's eos ids plus `eos_token_ids` here, and a request's sampling
fields that its caller did not set take the values here (what vLLM does with the generation
config); fields the model does not give keep SamplingParams' defaults.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

GENERATION_CONFIG_FILE = "generation_config.json"
# SamplingParams fields a model may give defaults for (vLLM takes the same ones).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# GGUF key (general.sampling.<key>) -> SamplingParams field.
_GGUF_SAMPLING_KEYS = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "penalty_repeat": "repetition_penalty"}
# End of turn / of message (tool call): llama.cpp stops at both, beside eos (ModelConfig's).
_GGUF_END_IDS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = ()  # ends a sequence, besides ModelConfig.eos_token_ids
    temperature: float | None = None  # None: the model gives no default
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        for i in self.eos_token_ids:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise ValueError(f"generation config eos_token_id must hold ints >= 0, got {i!r}")
        checks = {
            "temperature": lambda v: 0.0 <= v < math.inf,
            "top_p": lambda v: 0.0 < v <= 1.0,
            "top_k": lambda v: v >= -1 and float(v).is_integer(),
            "min_p": lambda v: 0.0 <= v <= 1.0,
            "repetition_penalty": lambda v: 0.0 < v < math.inf,
        }
        for name, ok in checks.items():
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ValueError(f"generation config {name} has an invalid value {value!r}")
            object.__setattr__(self, name, int(value) if name == "top_k" else float(value))

    def sampling_defaults(self) -> dict[str, Any]:
        """{SamplingParams field: value} for the fields this model gives."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> "GenerationConfig":
        """From the contents of a HF `generation_config.json`. Only values written in the file
        count: HF's own class defaults (top_k 50, ...) are not recommendations of the model."""
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(eos_ids, **{name: d.get(name) for name in SAMPLING_FIELDS})

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "GenerationConfig":
        """The generation config of a HF model directory; empty when it has none."""
        file = os.path.join(path, GENERATION_CONFIG_FILE)
        if not os.path.isfile(file):
            return cls()
        try:
            with open(file) as f:
                d = json.load(f)
            if not isinstance(d, dict):
                raise ValueError(f"it holds a {type(d).__name__}, not an object")
            return cls.from_hf_dict(d)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"cannot read {file!r}: {e}") from e

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> "GenerationConfig":
        """From GGUF key/values: end-of-turn and end-of-message ids, general.sampling.*."""
        eos_ids = tuple(dict.fromkeys(int(metadata[k]) for k in _GGUF_END_IDS if metadata.get(k) is not None))
        sampling = {field: metadata[f"general.sampling.{key}"] for key, field in _GGUF_SAMPLING_KEYS.items()
                    if metadata.get(f"general.sampling.{key}") is not None}
        return cls(eos_ids, **sampling)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GenerationConfig":
        return cls(**{**d, "eos_token_ids": tuple(d.get("eos_token_ids", ()))})

    def describe(self) -> str:
        """One line for start-up logs, e.g. "eos ids (2, 7); sampling defaults temperature=0.6"."""
        parts = []
        if self.eos_token_ids:
            parts.append(f"end ids {list(self.eos_token_ids)}")
        defaults = self.sampling_defaults()
        if defaults:
            parts.append("sampling defaults " + ", ".join(f"{k}={v:g}" for k, v in defaults.items()))
        return "; ".join(parts) or "nothing"
