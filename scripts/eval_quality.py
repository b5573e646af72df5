"""Quality of reduced-precision variants against the f32 model on the same weights.

Variants: f32 (the reference), bf16, int8 weights (`quantization="int8"`), int8 KV and fp8 KV
(`EngineConfig(kv_cache_dtype=...)`, rows marked unavailable where EngineConfig has no such
field), and GGUF-native (`quantization="gguf"`: the GGUF file's own Q4_1 / Q8_0 weights). For
the default model the reference is the f32 expansion of the GGUF (`quantization="none"`).

Figures, each variant against the reference:
    agree    greedy-token agreement over P prompts x T tokens, position by position over all
             positions (after a divergence the two continue from different prefixes, so later
             positions mostly disagree); "prefix" is the mean fraction of the T tokens generated
             before the first divergence
    KL       mean KL(reference || variant) of the full next-token distributions, teacher-forced
             over the reference's greedy continuations (one prefill pass of prompt + continuation
             per prompt through the engine's runner; every one of the P x T positions)
    ppl      perplexity of a fixed text, teacher-forced in chunks of --ppl-chunk tokens; the text
             is the docstrings of Python's own argparse, logging, json and textwrap modules
             (module docstring, then each public class / function defined there, sorted by name)
             of the running interpreter (pinned: Python 3.11; the docs' figures name theirs)
    finite   no NaN / inf in any logit of the teacher-forced passes
    weights  bytes the weights hold (int8 values + f32 scales for quantised ones)
    KV/token bytes of K and V per token, all layers (the engine's page bytes / page size)
    tok/s    generation throughput, --speed-seqs (default P) sequences x T tokens greedy, prefill included,
             best of --repeats rounds; variants measured one after another in each round, in
             this one process, so the ratios are the figure to read
Prompts: the first --prompt-tokens tokens of P docstrings of other stdlib modules (os, shutil,
functools, ...), in a fixed order.

Usage:
    python scripts/eval_quality.py                     # the default model, full table (CPU: ~30 min)
    python scripts/eval_quality.py --model DIR --json /tmp/quality.json --markdown /tmp/quality.table
    python scripts/eval_quality.py --quick             # smoke: 4 prompts x 8 tokens, one short chunk
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import paxpage  # noqa: E402
from models.quant import bytes_by_dtype  # noqa: E402
from paxpage.api import Model  # noqa: E402
from paxpage.packing import RowPlan  # noqa: E402

PPL_MODULES = ("argparse", "logging", "json", "textwrap")
PROMPT_MODULES = ("os", "shutil", "functools", "itertools", "string", "re", "random", "pathlib",
                  "subprocess", "collections", "heapq", "bisect", "statistics", "fractions", "decimal")


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    quantization: str | None = "none"  # passed to paxpage.load
    dtype: str = "float32"  # EngineConfig.dtype
    kv_cache_dtype: str | None = None  # EngineConfig.kv_cache_dtype (branch kvquant), None: unset


VARIANTS = (
    Variant("f32"),
    Variant("bf16", dtype="bfloat16"),
    Variant("int8 weights", quantization="int8"),
    Variant("int8 KV", kv_cache_dtype="int8"),
    Variant("fp8 KV", kv_cache_dtype="fp8"),
    Variant("GGUF-native", quantization="gguf"),
)


def docstrings(module_names) -> list[str]:
    """Module docstring, then each public class / function defined in the module, by name."""
    out = []
    for name in module_names:
        module = importlib.import_module(name)
        if module.__doc__:
            out.append(inspect.cleandoc(module.__doc__))
        for attr in sorted(dir(module)):
            obj = getattr(module, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__doc__:
                out.append(inspect.cleandoc(obj.__doc__))
    return out


def encode(model: Model, text: str) -> list[int]:
    if model.tokenizer is None:  # token-id-only test models: bytes folded into the vocabulary
        return [b % model.config.vocab_size for b in text.encode()]
    return list(model.tokenizer.encode(text, add_special_tokens=False))


def forced_logprobs(engine, token_ids: list[int]) -> np.ndarray:
    """f32[n - 1, V]: log-softmax of the next-token logits at positions 0..n-2 of `token_ids`,
    one prefill of the whole sequence through the engine's runner (the engine must be idle; its
    pages 0.. are overwritten, which is harmless with prefix caching off)."""
    runner = engine.runner
    n = len(token_ids)
    pages = list(range(-(-n // runner.cfg.page_size)))
    assert len(pages) <= runner.cfg.num_pages, (n, runner.cfg.num_pages)
    batch, _, prompt_rows, _ = runner.packer.pack([RowPlan(token_ids, pages, 0, n, 1, num_prompt_tokens=n)])
    _, prompt_logits = runner.forward(batch)
    logits = np.asarray(prompt_logits[: len(prompt_rows)], np.float32)
    assert [p for _, p in prompt_rows] == list(range(n - 1))
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def engine_config(variant: Variant, args, max_len: int) -> paxpage.EngineConfig:
    # All prompts prefill in one step and then decode together, and the speed run reuses those
    # shapes: each variant compiles ~4 step shapes (a 30-layer step takes tens of CPU seconds).
    kw = dict(dtype=variant.dtype, page_size=16, max_num_seqs=args.prompts,
              num_pages=args.prompts * (-(-(args.prompt_tokens + args.tokens) // 16)) + max_len // 16 + 8,
              max_model_len=max_len,
              max_num_batched_tokens=max(512, max_len, args.prompts * args.prompt_tokens),
              enable_prefix_caching=False)
    if variant.kv_cache_dtype is not None:
        kw["kv_cache_dtype"] = variant.kv_cache_dtype
    return paxpage.EngineConfig(**kw)


def load_variants(args) -> tuple[dict[str, Model], dict[str, str], dict[str, float]]:
    """Models by variant name (KV and bf16 variants share the f32 weights), reasons for the
    variants left out, and load seconds."""
    is_gguf = args.model is None or str(args.model).endswith(".gguf")
    kv_field = "kv_cache_dtype" in paxpage.EngineConfig.field_names()
    models, skipped, load_s = {}, {}, {}
    for v in VARIANTS:
        if args.variants and v.name not in args.variants:
            continue
        if v.kv_cache_dtype is not None and not kv_field:
            skipped[v.name] = "unavailable: EngineConfig has no kv_cache_dtype in this checkout"
            continue
        if v.quantization == "gguf" and not is_gguf:
            skipped[v.name] = "n/a: the source is not a GGUF file"
            continue
        if v.quantization == "none" and "f32" in models:
            models[v.name] = Model(models["f32"].config, models["f32"].params, models["f32"].tokenizer)
            continue
        start = time.perf_counter()
        models[v.name] = paxpage.load(args.model, quantization=v.quantization)
        load_s[v.name] = time.perf_counter() - start
    return models, skipped, load_s


def run(args) -> dict:
    by_name = {v.name: v for v in VARIANTS}
    models, skipped, load_s = load_variants(args)
    assert "f32" in models, "the f32 reference is always run"
    ref = models["f32"]
    encoded = (encode(ref, d) for d in docstrings(PROMPT_MODULES))
    prompts = [ids[: args.prompt_tokens] for ids in encoded if len(ids) >= args.prompt_tokens][: args.prompts]
    text_ids = encode(ref, "\n\n".join(docstrings(PPL_MODULES)))
    chunks = [text_ids[i * args.ppl_chunk:(i + 1) * args.ppl_chunk] for i in range(args.ppl_chunks)]
    max_len = max(args.prompt_tokens + args.tokens, args.ppl_chunk) + 1
    configs = {name: engine_config(by_name[name], args, max_len) for name in models}
    greedy = dict(max_tokens=args.tokens, temperature=0, ignore_eos=True, use_tqdm=False)

    rows = {}
    continuations = {}
    for name, model in models.items():
        outs = paxpage.generate(model, prompts, engine_config=configs[name], **greedy)
        continuations[name] = [o.token_ids for o in outs]
        engine = model.engine(configs[name])
        held = bytes_by_dtype(getattr(engine.runner, "runner", engine.runner).params)  # bf16: the cast copy
        rows[name] = {"weights_bytes": int(sum(held.values())),
                      "kv_bytes_per_token": engine.config.page_bytes // engine.config.page_size,
                      "load_s": load_s.get(name)}
    kl = {name: [] for name in models}
    nll = {name: [] for name in models}
    finite = {name: True for name in models}
    for prompt, cont in zip(prompts, continuations["f32"]):  # reference's continuations, all variants
        seq = prompt + cont
        lp_ref = None
        for name, model in models.items():
            lp = forced_logprobs(model.engine(configs[name]), seq)[len(prompt) - 1:]
            finite[name] &= bool(np.isfinite(lp).all())
            if lp_ref is None:
                lp_ref = lp
            p_ref = np.exp(lp_ref)
            kl[name].append(float(np.mean(np.sum(p_ref * (lp_ref - lp), axis=-1))))
    for chunk in chunks:
        for name, model in models.items():
            lp = forced_logprobs(model.engine(configs[name]), chunk)
            finite[name] &= bool(np.isfinite(lp).all())
            nll[name].extend((-lp[np.arange(len(chunk) - 1), chunk[1:]]).tolist())
    speed = {name: math.inf for name in models}
    speed_prompts = prompts[: args.speed_seqs or len(prompts)]
    for name, model in models.items():  # warm-up: compiles the timing run's shapes, if new
        if len(speed_prompts) != len(prompts):
            paxpage.generate(model, speed_prompts, engine_config=configs[name], **dict(greedy, max_tokens=4))
    for _ in range(args.repeats):
        for name, model in models.items():
            start = time.perf_counter()
            paxpage.generate(model, speed_prompts, engine_config=configs[name], **greedy)
            speed[name] = min(speed[name], time.perf_counter() - start)
    ref_tokens = np.asarray(continuations["f32"])
    ppl_ref = math.exp(np.mean(nll["f32"]))
    for name in models:
        tokens = np.asarray(continuations[name])
        same = tokens == ref_tokens
        first_diff = np.where(same.all(axis=1), args.tokens, np.argmin(same, axis=1))
        ppl = math.exp(np.mean(nll[name]))
        rows[name].update(agree=float(same.mean()), prefix=float(np.mean(first_diff) / args.tokens),
                          kl=float(np.mean(kl[name])), ppl=ppl, ppl_change=ppl / ppl_ref - 1.0,
                          finite=finite[name], tok_s=len(speed_prompts) * args.tokens / speed[name])
        models[name].close()
    return {"python": sys.version.split()[0], "model": args.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)",
            "prompts": len(prompts), "tokens": args.tokens, "ppl_tokens": sum(len(c) - 1 for c in chunks),
            "speed_seqs": len(speed_prompts), "rows": rows, "skipped": skipped}


QUALITY_COLUMNS = ["variant", "agree (all / prefix)", "mean KL", "ppl", "ppl vs f32", "finite", "weights MB",
                   "KV bytes/token", "tok/s"]


def doc_tables(result: dict) -> dict:
    """The docs' table (docs/quantisation.md): one row per variant in VARIANTS' order (a record's
    JSON may hold them sorted), skipped ones with the reason."""
    order = {v.name: i for i, v in enumerate(VARIANTS)}
    measured = sorted(result["rows"].items(), key=lambda item: order.get(item[0], len(order)))
    rows = [[name, f"{r['agree']:.3f} / {r['prefix']:.3f}", f"{r['kl']:.2e}", round(r["ppl"], 3),
             f"{100 * r['ppl_change']:+.2f}%", "yes" if r["finite"] else "NO", round(r["weights_bytes"] / 1e6, 1),
             r["kv_bytes_per_token"], round(r["tok_s"], 1)] for name, r in measured]
    rows += [[name, why, *[""] * (len(QUALITY_COLUMNS) - 2)] for name, why in result["skipped"].items()]
    caption = (f"{result['model']} against f32 on the same weights: {result['prompts']} prompts x "
               f"{result['tokens']} greedy tokens; perplexity over {result['ppl_tokens']} tokens of Python "
               f"{result['python']} docstrings; tok/s: {result['speed_seqs']} sequences")
    return {"quality": {"caption": caption, "columns": QUALITY_COLUMNS, "rows": rows}}


def markdown(result: dict) -> str:
    table = doc_tables(result)["quality"]
    lines = [f"Against f32 on the same weights: {result['prompts']} prompts x {result['tokens']} greedy tokens; "
             f"perplexity over {result['ppl_tokens']} tokens of Python {result['python']} docstrings; "
             f"tok/s: {result['speed_seqs']} sequences, this CPU.", "",
             "| " + " | ".join(table["columns"]) + " |", "|---" * len(table["columns"]) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or model directory (default: SmolLM2)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--ppl-chunk", type=int, default=256)
    p.add_argument("--ppl-chunks", type=int, default=8)
    p.add_argument("--speed-seqs", type=int, default=None, help="default: all the prompts (no new shapes)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variants", nargs="*", default=None, help=f"subset of {[v.name for v in VARIANTS]}")
    p.add_argument("--quick", action="store_true", help="smoke test sizes")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.tokens, args.prompt_tokens = 4, 8, 12
        args.ppl_chunk, args.ppl_chunks, args.repeats = 32, 1, 1
    if args.variants is not None and "f32" not in args.variants:
        args.variants = ["f32", *args.variants]
    result = run(args)
    table = markdown(result)
    print(table)
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from provenance import write_record  # the figures with machine, versions, date, command, commit

        write_record(args.json, result, doc_tables(result))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
