"""Device memory of one model's weights across its engines, in separate processes side by side:
engines that run the form `paxpage.load` holds the weights in (layers stacked, scanned: the CPU
default), against engines of another form (the unrolled loop, scan_layers=False), which share one
per-layer copy (models/param_forms.py).

Each process loads the model, builds one engine, then a second engine with another config, and
reports after each the bytes of the live device buffers other than the engines' KV pools (the
weights and any copies of them; on CPU the device is host memory) and the process's VmRSS (which
also holds compiled code, and memory the allocator kept from loading).

    python scripts/bench_weight_copies.py            # SmolLM2-135M as paxpage.load holds it
    python scripts/bench_weight_copies.py --model DIR --dtype bfloat16
    python scripts/bench_weight_copies.py --json docs/benchmarks/weight_copies.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MB = 1e6


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(mode: str, model_source: str | None, dtype: str, num_pages: int) -> dict:
    import jax

    import paxpage

    def device_bytes(engines) -> int:  # live buffers, each once, but the engines' pools
        gc.collect()
        pools = {x.unsafe_buffer_pointer() for e in engines for x in jax.tree.leaves(e.runner.kv_cache)}
        live = {x.unsafe_buffer_pointer(): x.nbytes for x in jax.live_arrays() if not x.is_deleted()}
        return sum(n for address, n in live.items() if address not in pools)

    model = paxpage.load(model_source, dtype=dtype)
    out = {"mode": mode, "loaded": device_bytes([]), "loaded_rss": rss_bytes()}
    engines = []
    for i, max_num_seqs in enumerate((4, 8)):  # two engine configs
        cfg = paxpage.EngineConfig(num_pages=num_pages, page_size=16, max_num_seqs=max_num_seqs, dtype=dtype,
                                   scan_layers=mode == "held")
        engines.append(model.engine(cfg))
        out[f"engine_{i + 1}"] = device_bytes(engines)
        out[f"engine_{i + 1}_rss"] = rss_bytes()
    out["scanned"] = engines[0].runner.scanned
    out["weights"] = sum(model.memory().values())
    out["describe"] = model.describe_memory()
    return out


MODES = ("held", "unrolled")
LABELS = {"held": "the form the model is held in (layers stacked, scanned)",
          "unrolled": "another form (scan_layers=False: per-layer)"}


def doc_tables(data: dict) -> dict:
    """The docs' table (docs/models.md): the device bytes each of two engines of one model adds."""
    rows = [[LABELS[r["mode"]], f"{(r['engine_1'] - r['loaded']) / MB:+.0f} MB",
             f"{(r['engine_2'] - r['engine_1']) / MB:+.0f} MB"]
            for r in sorted(data["rows"], key=lambda r: MODES.index(r["mode"]))]
    caption = (f"{data['model']} in {data['dtype']} ({data['rows'][0]['weights'] / MB:.0f} MB of weights): device "
               "bytes (KV pools aside) each of two engines with different configs adds to the loaded model")
    return {"weight_copies": {"caption": caption, "columns": ["engines run", "first engine", "second engine"],
                              "rows": rows}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="anything paxpage.load accepts (default: SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-pages", type=int, default=16)
    parser.add_argument("--json", metavar="PATH", help="write the figures here")
    parser.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.model, args.dtype, args.num_pages)))
        return 0
    rows = []
    for mode in MODES:
        cmd = [sys.executable, __file__, "--one", mode, "--dtype", args.dtype, "--num-pages", str(args.num_pages)]
        if args.model:
            cmd += ["--model", args.model]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=os.environ)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"weights {rows[0]['weights'] / MB:.1f} MB")
    print("| engines run | device bytes after load | + engine 1 | + engine 2 | RSS after load | + engine 1 | + engine 2 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['loaded'] / MB:.1f} MB | {(r['engine_1'] - r['loaded']) / MB:+.1f} MB "
              f"| {(r['engine_2'] - r['engine_1']) / MB:+.1f} MB | {r['loaded_rss'] / MB:.0f} MB "
              f"| {(r['engine_1_rss'] - r['loaded_rss']) / MB:+.0f} MB | {(r['engine_2_rss'] - r['engine_1_rss']) / MB:+.0f} MB |")
    for r in rows:
        print(f"{r['mode']} (scanned: {r['scanned']}): {r['describe']}")
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from provenance import write_record  # the figures with machine, versions, date, command, commit

        data = {"model": args.model or "SmolLM2-135M-Instruct", "dtype": args.dtype, "num_pages": args.num_pages,
                "rows": rows}
        write_record(args.json, data, doc_tables(data), measures=("paxpage", "models"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
