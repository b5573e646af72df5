"""Where one step shape's compile time goes: lowering vs XLA compile, attention's share, and
the sampler's variants.

For each (decode rows, prefill rows) shape it lowers and compiles (nothing cached: jax's
persistent cache stays off) the engine's jitted step, and the same step with attention and the
KV write swapped for no-ops (the difference is attention's share of the compile). Then the
sampler alone for R logits rows: the all-greedy variant (SamplingTensors.greedy_only) and the
full one (draws, penalties).

Usage:
    python scripts/bench_step_compile.py                       # SmolLM2, a few shapes
    python scripts/bench_step_compile.py --shapes 64,0 4,16 --rows 8 64
    python scripts/bench_step_compile.py --shapes 64,0 4,16 --rows 8 --json docs/benchmarks/step_compile.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import paxpage  # noqa: E402
from models.families import build_model  # noqa: E402
from paxpage.sampling import sampler as sampler_lib  # noqa: E402
from paxpage.sampling.tensors import SamplingTensors  # noqa: E402


def lower_compile(jitted, *args) -> tuple[float, float]:
    t = time.perf_counter()
    lowered = jitted.lower(*args)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t, time.perf_counter() - t1


def doc_tables(data: dict) -> dict:
    """The docs' tables (docs/benchmarks.md): seconds per step shape, with and without attention;
    the sampler's variants per logits row count."""
    steps = data["steps"]
    lower = [1 - s["bare_lower_s"] / s["lower_s"] for s in steps if s["lower_s"]]
    compile_ = [max(0.0, s["compile_s"] - s["bare_compile_s"]) / s["compile_s"] for s in steps if s["compile_s"]]
    share = (f"; attention is {min(lower):.0%}-{max(lower):.0%} of lowering and {min(compile_):.0%}-"
             f"{max(compile_):.0%} of the compile" if lower and compile_ else "")
    tables = {"step_compile": {
        "caption": f"One step shape (decode rows, prefill rows) of {data['model']}: seconds to lower and to compile, "
                   f"with attention and the KV write as they are and as no-ops{share}",
        "columns": ["shape", "lower s", "compile s", "lower s, no attention", "compile s, no attention"],
        "rows": [[f"({s['decode_rows']}, {s['prefill_rows']})", round(s["lower_s"], 1), round(s["compile_s"], 1),
                  round(s["bare_lower_s"], 1), round(s["bare_compile_s"], 1)] for s in steps]}}
    if data["sampler"]:
        tables["sampler"] = {
            "caption": "The sampler alone: the all-greedy variant and the full one (draws, penalties)",
            "columns": ["logits rows", "greedy lower s", "greedy compile s", "full lower s", "full compile s"],
            "rows": [[s["rows"], round(s["greedy_lower_s"], 2), round(s["greedy_compile_s"], 2),
                      round(s["full_lower_s"], 2), round(s["full_compile_s"], 2)] for s in data["sampler"]]}
    return tables


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--shapes", nargs="+", default=["4,0", "64,0", "4,16", "64,16"],
                        help="decode rows,prefill rows")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64], help="sampler logits rows")
    parser.add_argument("--num-pages", type=int, default=1024)
    parser.add_argument("--json", metavar="PATH", help="write the figures here")
    args = parser.parse_args(argv)
    data = {"model": args.model or "SmolLM2-135M-Instruct", "steps": [], "sampler": []}

    model = paxpage.load(args.model)
    engine = model.engine(paxpage.EngineConfig(num_pages=args.num_pages, max_model_len=256))
    runner = engine.runner
    dtype = jnp.dtype(runner.cfg.dtype)

    def no_attention(q, kv_pages, page_indices, kv_lens, q_lens, *, sm_scale, **kw):
        return q

    bare = build_model(runner.step_model_cfg, no_attention, lambda pages, k, v, slots: pages, dtype,
                       scan_period=runner.cfg.scan_period, matmul_impl=runner.matmul_impl)

    def bare_step(params, kv_cache, batch, prev_rows, prev_tokens):
        logits, kv_cache = bare.apply({"params": params}, batch, kv_cache)
        return kv_cache, logits

    print(f"{'shape':>10} {'step lower':>11} {'compile':>8} {'no-attention lower':>19} {'compile':>8} "
          f"{'attention share':>16}", flush=True)
    for shape in args.shapes:
        dec, pre = (int(v) for v in shape.split(","))
        batch = runner.packer.padding_batch(dec, pre)
        prev = (np.full(batch.token_ids.shape[0], -1, np.int32), runner._no_prev_tokens)
        full = lower_compile(jax.jit(runner._forward, donate_argnums=(1,)), runner.params, runner.kv_cache,
                             batch, *prev)
        without = lower_compile(jax.jit(bare_step, donate_argnums=(1,)), runner.params, runner.kv_cache,
                                batch, *prev)
        share = max(0.0, full[1] - without[1]) / full[1]
        data["steps"].append({"decode_rows": dec, "prefill_rows": pre, "lower_s": full[0], "compile_s": full[1],
                              "bare_lower_s": without[0], "bare_compile_s": without[1]})
        print(f"{dec:>5},{pre:<4} {full[0]:>10.2f}s {full[1]:>7.2f}s {without[0]:>18.2f}s {without[1]:>7.2f}s "
              f"{share:>15.0%}", flush=True)

    vocab = model.config.vocab_size
    print(f"{'rows':>10} {'greedy lower':>13} {'compile':>8} {'full lower':>11} {'compile':>8}", flush=True)
    for rows in args.rows:
        greedy = SamplingTensors.build([], vocab, pad_rows_to=rows, token_width=256)
        logits = jnp.zeros((rows, vocab), jnp.float32)
        sample = jax.jit(lambda lg, t: sampler_lib.sample(lg, t, 0))
        g = lower_compile(sample, logits, greedy)
        f = lower_compile(sample, logits, dataclasses.replace(greedy, greedy_only=False, penalised=True))
        print(f"{rows:>10} {g[0]:>12.2f}s {g[1]:>7.2f}s {f[0]:>10.2f}s {f[1]:>7.2f}s", flush=True)
        data["sampler"].append({"rows": rows, "greedy_lower_s": g[0], "greedy_compile_s": g[1],
                                "full_lower_s": f[0], "full_compile_s": f[1]})
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from provenance import write_record  # the figures with machine, versions, date, command, commit

        write_record(args.json, data, doc_tables(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
