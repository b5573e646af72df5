"""OpenAI logprob objects from the engine's per-token `{token_id: logprob}` dicts (chosen token
first, then the top alternatives; the chosen token appears once even when it is one of them)."""

from __future__ import annotations

import functools
import math
from typing import Any


class TokenStrings:
    """token id -> its text, as the tokenizer decodes it alone (cached; vocabularies are finite).
    Without a tokenizer, vLLM's `token_id:N` spelling."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self.get = functools.lru_cache(maxsize=1 << 16)(self._decode)

    def _decode(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id])


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else -9999.0  # JSON has no -inf


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def chat_logprobs(entries, token_ids, k: int, strings: TokenStrings) -> dict:
    """`choice.logprobs` of a chat completion: {"content": [...], "refusal": None}."""
    content = []
    for token, entry in zip(token_ids, entries):
        text = strings.get(token)
        content.append({
            "token": text, "logprob": _finite(entry[token]), "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": strings.get(t), "logprob": _finite(lp),
                              "bytes": list(strings.get(t).encode("utf-8"))} for t, lp in _top(entry, k)],
        })
    return {"content": content, "refusal": None}


def completion_logprobs(token_ids, entries, k: int, strings: TokenStrings, text_offset: int = 0) -> dict:
    """The legacy completions shape: parallel lists over tokens. An entry may be None (the first
    prompt token when echoing: nothing predicts it)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for token, entry in zip(token_ids, entries):
        text = strings.get(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(entry[token]))
        top: dict[str, float] = {}
        for t, lp in _top(entry, k):
            top.setdefault(strings.get(t), _finite(lp))
        out["top_logprobs"].append(top)
    return out


def merge_completion_logprobs(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {key: a[key] + b[key] for key in a}
