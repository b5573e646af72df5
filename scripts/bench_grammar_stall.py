"""Other requests' inter-token latency while a large JSON schema compiles.

Runs --streams greedy streaming requests on one AsyncEngine and records each token's arrival;
prints p50 / p99 time per output token (TPOT: the gaps between a stream's tokens) in three runs:
  alone          the streams by themselves;
  off-thread     the same, with a structured request of a --schema-kb JSON schema submitted
                 mid-decode (its grammar compiles on the AsyncEngine's grammar threads);
  engine-thread  the same, with that compile forced onto the engine loop's thread (what a
                 compile at submission costs every running request).
Writes the figures with the machine's CPU model to --out (JSON).

    python scripts/bench_grammar_stall.py --out grammar_stall.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from provenance import cpu_model, write_record  # noqa: E402  (the record's machine, versions, date, command)


def big_schema(kb: int, tag: str) -> dict:
    props, size = {}, 0
    while size < kb * 1024:
        i = len(props)
        props[f"{tag}_field_{i}"] = {"type": "string", "enum": [f"{tag}_v{i}_{j}" for j in range(5)]}
        size += 100
    schema = {"type": "object", "properties": props, "required": list(props)[:50]}
    while len(json.dumps(schema)) > kb * 1024:
        props.popitem()
        schema["required"] = list(props)[:50]
    return schema


async def _run(engine, prompt, args, schema: dict | None) -> list[float]:
    import paxpage

    params = paxpage.SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    gaps: list[float] = []
    started = asyncio.Event()

    async def one():
        last = None
        async for delta in engine.stream(prompt, params):
            if not delta.token_ids:
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append((now - last) / len(delta.token_ids))
            else:
                started.set()
            last = now

    async def structured():
        await started.wait()
        await asyncio.sleep(0.2)  # mid-decode
        p = paxpage.SamplingParams(max_tokens=1, structured_outputs={"json_schema": schema})
        t = time.perf_counter()
        await engine.generate(prompt, p)
        print(f"    structured request: {time.perf_counter() - t:.2f} s", flush=True)

    tasks = [one() for _ in range(args.streams)] + ([structured()] if schema is not None else [])
    await asyncio.gather(*tasks)
    return gaps


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--schema-kb", type=int, default=250)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import paxpage

    model = paxpage.load(args.model)
    prompt = model.tokenizer.encode("Write a story about a lighthouse keeper.") if model.tokenizer else [1, 2, 3]
    engine = paxpage.AsyncEngine(model, paxpage.EngineConfig(max_num_seqs=8, num_pages=512, page_size=16))
    results = {}
    try:
        asyncio.run(_run(engine, prompt, args, None))  # warm-up: compiles the step shapes
        asyncio.run(_run(engine, prompt, args, big_schema(1, "warm")))
        for name in ("alone", "off-thread", "engine-thread"):
            schema = None if name == "alone" else big_schema(args.schema_kb, name.replace("-", "_"))
            if name == "engine-thread":  # the compile then happens in add_request, on the loop thread
                engine._compile_grammar = lambda params: asyncio.sleep(0)
            gaps = np.array(asyncio.run(_run(engine, prompt, args, schema)))
            results[name] = {"p50_tpot_ms": float(np.percentile(gaps, 50) * 1e3),
                             "p99_tpot_ms": float(np.percentile(gaps, 99) * 1e3),
                             "max_tpot_ms": float(gaps.max() * 1e3), "num_gaps": int(gaps.size)}
            print(f"{name:>13}: p50 {results[name]['p50_tpot_ms']:.1f} ms, p99 {results[name]['p99_tpot_ms']:.1f} ms, "
                  f"max {results[name]['max_tpot_ms']:.1f} ms", flush=True)
    finally:
        engine.shutdown()
    base = results["alone"]["p99_tpot_ms"]
    for name in ("off-thread", "engine-thread"):
        print(f"p99 TPOT {name} / alone: {results[name]['p99_tpot_ms'] / base:.2f}x")
    report = {"machine": cpu_model(), "command": "python scripts/bench_grammar_stall.py", "args": vars(args),
              "schema_bytes": len(json.dumps(big_schema(args.schema_kb, "off_thread"))), "results": results}
    print(f"machine: {report['machine']}")
    if args.out:
        write_record(args.out, report, doc_tables(report))
    return report


RUNS = ("alone", "off-thread", "engine-thread")  # the tables' order (records are written with sorted keys)


def doc_tables(report: dict) -> dict:
    """A docs table: the streams' time per output token in each run."""
    rows = [[name, round(r["p50_tpot_ms"], 1), round(r["p99_tpot_ms"], 1), round(r["max_tpot_ms"], 1)]
            for name in RUNS if name in report["results"] for r in (report["results"][name],)]
    return {"grammar_stall": {
        "caption": f"{report['args']['streams']} greedy streams; a {report['schema_bytes'] / 1024:.0f} KiB JSON schema "
                   "submitted mid-decode (off the engine's thread, or forced onto it)",
        "columns": ["run", "TPOT p50 ms", "TPOT p99 ms", "TPOT max ms"], "rows": rows}}


if __name__ == "__main__":
    main()
