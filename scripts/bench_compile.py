"""Compile cost and step time of the decoder stack unrolled vs under a scan, side by side.

For each `scan_layers` setting (False: the unrolled loop of L layers; True: one lax.scan over
stacked params and the stacked KV pool, models/layer_stack.py) it builds an LLMEngine on the
same weights and pool size, then for each step shape (decode rows, prefill rows):
    lower    trace + lower seconds of the jitted step
    compile  XLA compile seconds
    temp     the executable's temporary bytes (memory_analysis): a step that copied a layer's
             pages (or the pool) would show it here
    step     median ms of the compiled step on a filled batch: decode rows at context
             --context over permuted page tables with real KV writes; prefill rows of
             prefill_row_len new tokens (the context's last ones) at the same context
Both settings' steps are compiled, then timed in turns (unrolled, scan, unrolled, scan ...) so
machine noise hits both alike; the ratio rows compare them.

Usage:
    python scripts/bench_compile.py                                  # SmolLM2, 4096 pages
    python scripts/bench_compile.py --model /path/to/hf_dir --num-pages 256 --iters 3
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import paxpage  # noqa: E402
from paxpage.engine import LLMEngine  # noqa: E402


def filled_batch(runner, dec: int, pre: int, context: int, seed: int = 0):
    """A padding batch of (dec, pre) rows made real: every row at `context` tokens over its own
    pages drawn from a permutation of the pool, this step's K/V written at the row's last slots."""
    cfg = runner.cfg
    page_size, row_len = cfg.page_size, cfg.prefill_row_len
    batch = runner.packer.padding_batch(dec, pre)
    rng = np.random.default_rng(seed)
    rows = dec + pre
    pages_per_row = -(-context // page_size)
    assert rows * pages_per_row <= cfg.num_pages, "pool too small for the batch"
    tables = np.zeros((rows, cfg.pages_per_seq), np.int32)
    tables[:, :pages_per_row] = rng.permutation(cfg.num_pages)[:rows * pages_per_row].reshape(rows, -1)
    slots = np.full(batch.token_ids.shape[0], -1, np.int32)
    positions = np.zeros_like(slots)
    for r in range(dec):
        p = context - 1
        slots[r], positions[r] = tables[r, p // page_size] * page_size + p % page_size, p
    num_q = min(row_len, context)  # a prefill row's new tokens: the context's last ones
    for r in range(pre):
        lo = context - num_q
        for t in range(num_q):
            p = lo + t
            i = dec + r * row_len + t
            slots[i], positions[i] = tables[dec + r, p // page_size] * page_size + p % page_size, p
    return dataclasses.replace(
        batch, slot_mapping=slots, positions=positions,
        dec_page_indices=tables[:dec], dec_kv_lens=np.full(dec, context, np.int32),
        pre_page_indices=tables[dec:], pre_kv_lens=np.full(pre, context, np.int32),
        pre_q_lens=np.full(pre, num_q, np.int32))


def compile_step(engine: LLMEngine, dec: int, pre: int, context: int) -> dict:
    """Lowers and compiles the step for (dec, pre); returns timings and a call that runs it once."""
    runner = engine.runner
    batch = filled_batch(runner, dec, pre, context)
    prev_rows = np.full(batch.token_ids.shape[0], -1, np.int32)
    t = time.perf_counter()
    lowered = runner._step.lower(runner.params, runner.kv_cache, batch, prev_rows, runner._no_prev_tokens)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    stats = compiled.memory_analysis()

    def call():
        runner.kv_cache, logits, _ = compiled(runner.params, runner.kv_cache, batch, prev_rows,
                                              runner._no_prev_tokens)
        jax.block_until_ready(logits)

    call()  # warm-up
    return {"lower_s": t1 - t, "compile_s": t2 - t1, "call": call,
            "temp_mib": None if stats is None else stats.temp_size_in_bytes / 2**20}


def interleaved_ms(calls: dict, iters: int) -> dict:
    """Median ms of each call, timed in turns (a, b, a, b, ...) so load changes hit all alike."""
    times: dict = {k: [] for k in calls}
    for _ in range(iters):
        for key, call in calls.items():
            t = time.perf_counter()
            call()
            times[key].append(time.perf_counter() - t)
    return {k: float(np.median(v)) * 1e3 for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-pages", type=int, default=4096)
    parser.add_argument("--context", type=int, default=65)
    parser.add_argument("--shapes", nargs="+", default=["64,0", "0,8", "16,4"],
                        help="decode rows,prefill rows pairs")
    parser.add_argument("--iters", type=int, default=9, help="timed calls of each step (interleaved)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model = paxpage.load(args.model)
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes]
    results: dict = {}
    engines = {}
    for scan in (False, True):
        cfg = paxpage.EngineConfig(num_pages=args.num_pages, scan_layers=scan, max_num_seqs=64,
                                   max_model_len=max(256, args.context + 64))
        engines[scan] = LLMEngine(model.config, model.params, model.tokenizer, cfg)
        assert engines[scan].runner.scanned == scan
    print(f"{model.config.num_layers} layers, pool {args.num_pages} pages, context {args.context}, "
          f"CPU: {_cpu_name()}", flush=True)
    print(f"{'shape':>8} {'mode':>9} {'lower s':>8} {'compile s':>9} {'temp MiB':>9} {'step ms':>8}")
    for dec, pre in shapes:
        compiled = {scan: compile_step(engines[scan], dec, pre, args.context) for scan in (False, True)}
        step_ms = interleaved_ms({scan: c.pop("call") for scan, c in compiled.items()}, args.iters)
        for scan in (False, True):
            r = dict(compiled[scan], step_ms=step_ms[scan])
            results[f"{dec},{pre},{'scan' if scan else 'unrolled'}"] = r
            temp = "-" if r["temp_mib"] is None else f"{r['temp_mib']:.1f}"
            print(f"{dec:>4},{pre:<3} {'scan' if scan else 'unrolled':>9} {r['lower_s']:8.2f} "
                  f"{r['compile_s']:9.2f} {temp:>9} {r['step_ms']:8.1f}", flush=True)
        u, s = results[f"{dec},{pre},unrolled"], results[f"{dec},{pre},scan"]
        print(f"{'':>8} {'scan/unr':>9} {s['lower_s'] / u['lower_s']:8.2f} "
              f"{s['compile_s'] / u['compile_s']:9.2f} {'':>9} {s['step_ms'] / u['step_ms']:8.2f}", flush=True)
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from provenance import write_record  # the figures with machine, versions, date, command, commit

        write_record(args.json, results, doc_tables(results))
    return 0


def doc_tables(results: dict) -> dict:
    """A docs table: per step shape, scanned against unrolled layers (compile and step time)."""
    rows = []
    for key, r in results.items():
        dec, pre, mode = key.split(",")
        rows.append([f"({dec}, {pre})", mode, round(r["lower_s"], 2), round(r["compile_s"], 2),
                     "" if r["temp_mib"] is None else round(r["temp_mib"], 1), round(r["step_ms"], 1)])
    return {"compile": {"caption": "One step shape (decode rows, prefill rows): lowering, compile and step time with "
                                   "the layers unrolled and scanned",
                        "columns": ["shape", "layers", "lower s", "compile s", "temporary MiB", "step ms"],
                        "rows": rows}}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    from paxpage.process_tuning import tune_malloc

    tune_malloc()  # glibc keeps large freed buffers for reuse (paxpage/process_tuning.py)
    sys.exit(main())
