"""What compiling costs a first pass over a workload: cold, with a warm cache, per jitted function.

One process: load the model, then pass 1 over the workload (scripts/bench_throughput.py's
warm-up pass: every request queued at t=0, greedy, EOS ignored), whose wall time includes
building the engine and every compile it meets, then pass 2 over the same lengths with fresh
prompts, which compiles nothing. overhead = pass 1 - pass 2: what compiling (or loading
compiled steps from a cache) cost pass 1. The table gives, per jitted function, how many
times it was traced, lowered and compiled (or read from jax's persistent cache) in pass 1,
and the seconds of each phase (paxpage/compile_counter.py).

Run it twice with the same cache directories: the first run is cold (or pass --clear), the
second warm.
    python scripts/bench_warm_start.py --num-requests 64 --seed 2027 --xla-cache /tmp/xc --clear
    python scripts/bench_warm_start.py --num-requests 64 --seed 2027 --xla-cache /tmp/xc
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

import paxpage  # noqa: E402
import workload as wl  # noqa: E402
from throughput_pass import run_paxpage  # noqa: E402
from paxpage import compile_counter  # noqa: E402


def main(argv=None) -> int:
    defaults = wl.backend_defaults()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    wl.add_workload_args(parser, defaults)
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--xla-cache", metavar="DIR", default=None,
                        help="jax's persistent compilation cache directory; off by default")
    parser.add_argument("--exec-cache", metavar="DIR", default=None,
                        help="paxpage's executable cache directory (EngineConfig.executable_cache_dir)")
    parser.add_argument("--clear", action="store_true", help="empty the cache directories first (a cold run)")
    parser.add_argument("--precompile", action="store_true", help="EngineConfig(precompile=True)")
    parser.add_argument("--json", metavar="PATH", help="write the figures here")
    args = parser.parse_args(argv)

    for directory in (args.xla_cache, args.exec_cache):
        if args.clear and directory:
            shutil.rmtree(directory, ignore_errors=True)
    compile_counter.install()
    if args.xla_cache:
        from paxpage import xla_cache

        print(f"persistent compilation cache: {xla_cache.enable(args.xla_cache)}", flush=True)
    model = paxpage.load(args.model)
    work = wl.workload_from_args(args, model.config.vocab_size)
    longest = max(p + o for p, o in zip(work.prompt_lens, work.output_lens))
    extra = {"executable_cache_dir": args.exec_cache} if args.exec_cache else {}
    cfg = paxpage.EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                               max_model_len=min(model.config.max_position_embeddings,
                                                 1 << (longest - 1).bit_length()),
                               precompile=args.precompile, **extra)

    before, c0, h0 = compile_counter.by_function(), compile_counter.compiles(), compile_counter.cache_hits()
    t = time.perf_counter()
    model.engine(cfg)  # built here to time it apart (pass 1 includes it)
    build = time.perf_counter() - t
    first = run_paxpage(model, work.with_fresh_prompts(model.config.vocab_size, args.seed + 7919), cfg)
    pass1 = time.perf_counter() - t  # engine build and precompile included
    rows = compile_counter.diff(compile_counter.by_function(), before)
    compiles, hits = compile_counter.compiles() - c0, compile_counter.cache_hits() - h0
    engine = model.engine(cfg)
    c1 = compile_counter.compiles()
    second = run_paxpage(model, work, cfg)
    pass2 = second["wall_s"]
    print(compile_counter.format_table(rows))
    exec_stats = wl.exec_cache_stats(engine)
    print(f"pass 1: {pass1:.1f} s (engine build {build:.1f} s; {first['steps']} steps; {compiles} backend compiles, "
          f"{hits} persistent-cache "
          f"hits{'; precompiled %d shapes in %.1f s' % engine.precompiled if engine.precompiled else ''}"
          f"{'; executable cache ' + str(exec_stats) if exec_stats else ''})", flush=True)
    print(f"pass 2: {pass2:.1f} s ({second['steps']} steps, {compile_counter.compiles() - c1} compiles)")
    print(f"overhead (pass 1 - pass 2): {pass1 - pass2:.1f} s; backend {jax.default_backend()}", flush=True)
    if args.json:
        data = {"pass1_s": pass1, "pass2_s": pass2, "overhead_s": pass1 - pass2, "build_s": build,
                "compiles": compiles, "cache_hits": hits, "by_function": rows, "executable_cache": exec_stats,
                "xla_cache": bool(args.xla_cache), "precompile": args.precompile,
                "workload": work.summary()}
        wl.write_json(args.json, data, tables=doc_tables(data))
    return 0


def cache_label(data: dict) -> str:
    """How the run found its caches: workload.exec_cache_label, and jax's persistent cache."""
    label = wl.exec_cache_label(data["executable_cache"])
    if data["xla_cache"]:
        label += f"; jax's persistent cache: {data['cache_hits']} hits"
    return label + ("; precompile=True" if data["precompile"] else "")


def doc_tables(data: dict) -> dict:
    """The docs' table (docs/benchmarks.md): one row per run; a cold and a warm run make the table."""
    caption = (f"{data['workload']['num_requests']} requests. Overhead = pass 1 (engine build and every compile "
               "it meets) - pass 2 (the same lengths again, nothing to compile)")
    row = [cache_label(data), data["compiles"], round(data["pass1_s"], 1), round(data["pass2_s"], 1),
           round(data["overhead_s"], 1)]
    return {"warm_start": {"caption": caption, "columns": ["executable cache", "compiles in pass 1", "pass 1 s",
                                                           "pass 2 s", "overhead s"], "rows": [row]}}


if __name__ == "__main__":
    sys.exit(main())
