"""Output throughput with many LoRA adapters mixed in every step, against the base model alone.

The workload is scripts/workload.py's (ShareGPT-like lengths, random prompts, EOS ignored, all
requests queued at t=0), 64 requests by default. Three passes, each after a warm-up pass over
the same lengths with other prompts (so no measured pass compiles or hits the prefix cache):

    base        an engine without LoRA (max_loras=0): the base model's step
    base+slab   the LoRA engine (max_loras slots), every request on the base model
    mixed       the LoRA engine, requests spread uniformly over --num-adapters adapters

The adapters are random (rank --rank, every target), built in memory: their values do not
change the work. The ratio mixed / base is the figure (target >= 0.8x). Machine and versions are
recorded with --json; on a shared machine the figures are noisy.

Usage:
    python scripts/bench_lora.py --json /tmp/lora.json
    python scripts/bench_lora.py --num-requests 16 --model PATH
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import paxpage  # noqa: E402
import workload as wl  # noqa: E402
from models.lora import LoraAdapter, target_shapes  # noqa: E402
from paxpage import compile_counter  # noqa: E402


def random_adapter(cfg, name: str, rank: int, seed: int) -> LoraAdapter:
    """An adapter of `rank` on every target of every layer, small random values."""
    rng = np.random.default_rng(seed)
    weights = {}
    for layer in range(cfg.num_layers):
        for target, (num_in, num_out) in target_shapes(cfg, layer).items():
            weights[(layer, target)] = (rng.normal(0, 0.02, (num_in, rank)).astype(np.float32),
                                        rng.normal(0, 0.02, (rank, num_out)).astype(np.float32))
    return LoraAdapter(name, rank, float(rank), False, 1.0, weights, "random")


def run_pass(engine, work: wl.Workload, loras: list) -> tuple[float, int]:
    """(seconds, output tokens) of one pass, request i on adapter loras[i] (None: the base)."""
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(zip(work.prompts, work.output_lens)):
        engine.add_request(prompt, paxpage.SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True),
                           index=i, lora=loras[i])
    produced = 0
    while engine.has_unfinished():
        for _, deltas in engine.step():
            produced += sum(len(d.token_ids) for d in deltas)
    return time.perf_counter() - start, produced


def measure(engine, work: wl.Workload, fresh: wl.Workload, loras: list, label: str) -> dict:
    run_pass(engine, fresh, loras)  # warm-up: every shape compiled, slots loaded
    compiles = compile_counter.compiles()
    seconds, produced = run_pass(engine, work, loras)
    if produced != work.num_output_tokens:
        raise RuntimeError(f"{label}: {produced} output tokens, expected {work.num_output_tokens}")
    row = {"pass": label, "seconds": seconds, "output_tok_s": produced / seconds,
           "compiles": compile_counter.compiles() - compiles}
    print(f"{label:>10}: {produced} tokens in {seconds:.2f} s = {row['output_tok_s']:.1f} tok/s"
          f" ({row['compiles']} compiles)", flush=True)
    return row


def doc_tables(data: dict) -> dict:
    """The docs' table (docs/lora.md): one row per pass."""
    rows, base = data["rows"], data["rows"][0]["output_tok_s"]
    return {"lora": {"columns": ["pass", "output tok/s", "of the base model alone", "compiles in the pass"],
                     "rows": [[r["pass"], round(r["output_tok_s"], 1), f"{r['output_tok_s'] / base:.2f}x", r["compiles"]]
                              for r in rows]}}


def main(argv=None) -> int:
    defaults = wl.backend_defaults()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    wl.add_workload_args(parser, defaults)
    parser.set_defaults(num_requests=64)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--json", default=None, help="write the figures (with provenance) here")
    args = parser.parse_args(argv)
    compile_counter.install()
    model = paxpage.load(args.model)
    cfg = model.config
    for i in range(args.num_adapters):
        model.loras[f"lora{i}"] = random_adapter(cfg, f"lora{i}", args.rank, seed=i)
    work = wl.workload_from_args(args, cfg.vocab_size)
    fresh = work.with_fresh_prompts(cfg.vocab_size, args.seed + 1000)
    common = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    base_cfg = paxpage.EngineConfig(**common)
    lora_cfg = paxpage.EngineConfig(max_loras=args.num_adapters, max_lora_rank=args.rank, **common)
    n = work.num_requests
    mixed = [f"lora{i % args.num_adapters}" for i in range(n)]
    print(f"machine: {platform.processor() or platform.machine()}; {n} requests, "
          f"{work.num_output_tokens} output tokens; {args.num_adapters} adapters of rank {args.rank} (noisy "
          f"if the machine is shared)", flush=True)
    rows = [measure(model.engine(base_cfg), work, fresh, [None] * n, "base")]
    model.close()  # one engine's KV pool at a time
    lora_engine = model.engine(lora_cfg)
    rows.append(measure(lora_engine, work, fresh, [None] * n, "base+slab"))
    rows.append(measure(lora_engine, work, fresh, mixed, "mixed"))
    ratio = rows[2]["output_tok_s"] / rows[0]["output_tok_s"]
    print(f"mixed {args.num_adapters} adapters / base alone: {ratio:.2f}x (target >= 0.8x); "
          f"base on the LoRA engine: {rows[1]['output_tok_s'] / rows[0]['output_tok_s']:.2f}x", flush=True)
    if args.json:
        data = dict(workload=work.summary(), num_adapters=args.num_adapters, rank=args.rank, rows=rows, ratio=ratio)
        wl.write_json(args.json, data, tables=doc_tables(data))
    model.close()
    return 0 if all(r["compiles"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
