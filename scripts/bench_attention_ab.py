"""CPU attention + KV write of two trees' `paged_attention_xla`, timed in turns in one process.

For each shape, one jitted call does every layer's KV write of `rows` tokens and its decode
attention over `rows` x `context` keys (as scripts/bench_step.py's attention timing does: one
pool per layer, permuted page table). The baseline's pallas_kernels/xla_attention.py is loaded
from --baseline (e.g. a `git archive` of main); both compiled steps are then called in turns,
so the shared machine's noise hits both alike. Reported per variant: the minimum and median
wall ms, the minimum process CPU ms (both threads; steadier than wall on a loaded machine),
GB/s of the K/V bytes the call must read, and the step's lower and XLA compile seconds.

Shapes: "smollm2" is SmolLM2-135M's attention (30 layers, 9 q / 3 kv heads of 64, 64 rows x
context 65, pages_per_seq 512 = 8192 / 16); "tiny" is bench_step's tiny model (2 layers, 4 / 4
heads of 16, 256 rows x 1536, pages_per_seq 128).

Usage:
    git archive main | tar -x -C /tmp/attn_base
    python scripts/bench_attention_ab.py --baseline /tmp/attn_base --rounds 6
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import xla_attention  # noqa: E402
from pallas_kernels.reference import write_kv  # noqa: E402

SHAPES = {  # layers, rows, context, q heads, kv heads, head dim, page size, pages per sequence
    "smollm2": dict(layers=30, rows=64, context=65, heads=9, kv_heads=3, head_dim=64, page_size=16, pps=512),
    "tiny": dict(layers=2, rows=256, context=1536, heads=4, kv_heads=4, head_dim=16, page_size=16, pps=128),
}


def load_baseline(root: str):
    path = os.path.join(root, "pallas_kernels", "xla_attention.py")
    spec = importlib.util.spec_from_file_location("baseline_xla_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.paged_attention_xla


def make_step(attention, s: dict, seed: int = 0):
    """(call, kv_bytes, (lower s, compile s)): call() runs every layer's KV write + decode attention once."""
    rng = np.random.default_rng(seed)
    rows, ps = s["rows"], s["page_size"]
    pages_per_row = -(-s["context"] // ps)
    num_pages = rows * pages_per_row + 8
    table = np.zeros((rows, s["pps"]), np.int32)
    table[:, :pages_per_row] = rng.permutation(num_pages)[:rows * pages_per_row].reshape(rows, -1)
    last = s["context"] - 1
    slots = table[:, last // ps] * ps + last % ps
    shape = (2, num_pages, ps, s["kv_heads"], s["head_dim"])
    pools = [jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in range(s["layers"])]
    q = jnp.asarray(rng.standard_normal((rows, 1, s["heads"], s["head_dim"]), np.float32))
    k = jnp.asarray(rng.standard_normal((rows, s["kv_heads"], s["head_dim"]), np.float32))
    args = [jnp.asarray(a) for a in (table, np.full(rows, s["context"], np.int32), np.ones(rows, np.int32), slots)]

    def layers(pools, q, k, table, kv_lens, q_lens, slots):
        out = []
        for pool in pools:  # the model's order: write this step's K/V, then attend
            pool = write_kv(pool, k, k, slots)
            q = attention(q, pool, table, kv_lens, q_lens, sm_scale=s["head_dim"] ** -0.5)
            out.append(pool)
        return out, q

    t = time.perf_counter()
    lowered = jax.jit(layers, donate_argnums=(0,)).lower(pools, q, k, *args)
    t_lower = time.perf_counter()
    step = lowered.compile()
    compile_s = (t_lower - t, time.perf_counter() - t_lower)
    state = {"pools": pools}

    def call():
        state["pools"], out = step(state["pools"], q, k, *args)
        jax.block_until_ready(out)

    kv_bytes = 2 * s["layers"] * rows * s["context"] * s["kv_heads"] * s["head_dim"] * 4
    return call, kv_bytes, compile_s


def read_bandwidth(num_bytes: int = 512 << 20, iters: int = 5) -> float:
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    jax.block_until_ready(total(x))
    best = float("inf")
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(total(x))
        best = min(best, time.perf_counter() - t)
    return num_bytes / best / 1e9


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="root of the tree to compare against")
    parser.add_argument("--shapes", nargs="+", default=sorted(SHAPES), choices=sorted(SHAPES))
    parser.add_argument("--rounds", type=int, default=6, help="turns; each calls every variant twice")
    parser.add_argument("--json", metavar="PATH", help="write the figures here")
    args = parser.parse_args(argv)
    rows = []
    variants = {"baseline": load_baseline(args.baseline), "this tree": xla_attention.paged_attention_xla}
    print(f"jax {jax.__version__}: read bandwidth {read_bandwidth():.1f} GB/s (jitted sum, best of 5)")
    for name in args.shapes:
        built = {}
        for label, fn in variants.items():
            call, kv_bytes, compile_s = make_step(fn, SHAPES[name])
            call()
            built[label] = (call, kv_bytes, compile_s)
        wall = {label: [] for label in built}
        cpu = {label: [] for label in built}
        for _ in range(args.rounds):
            for label, (call, _, _) in built.items():
                for _ in range(2):
                    t, c = time.perf_counter(), time.process_time()
                    call()
                    wall[label].append(time.perf_counter() - t)
                    cpu[label].append(time.process_time() - c)
        for label, (_, kv_bytes, (lower_s, compile_s)) in built.items():
            w = min(wall[label])
            print(f"{name:8s} {label:10s} wall min {w * 1e3:7.1f} ms  median {np.median(wall[label]) * 1e3:7.1f} ms  "
                  f"cpu min {min(cpu[label]) * 1e3:7.1f} ms  {kv_bytes / w / 1e9:5.2f} GB/s  "
                  f"lower {lower_s:5.2f} s  compile {compile_s:5.2f} s", flush=True)
            rows.append({"shape": name, "variant": label, "wall_min_ms": w * 1e3,
                         "wall_median_ms": float(np.median(wall[label])) * 1e3, "cpu_min_ms": min(cpu[label]) * 1e3,
                         "gb_per_s": kv_bytes / w / 1e9, "lower_s": lower_s, "compile_s": compile_s})
    print(f"read bandwidth after: {read_bandwidth():.1f} GB/s")
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from provenance import write_record  # the figures with machine, versions, date, command, commit

        data = {"rounds": args.rounds, "rows": rows}
        write_record(args.json, data, doc_tables(data), measures=("pallas_kernels/xla_attention.py",))
    return 0


def doc_tables(data: dict) -> dict:
    """The table it prints, as rows a docs page may show: each tree's attention step per shape."""
    return {"attention_ab": {
        "caption": f"Every layer's KV write and decode attention, the two trees called in turns ({data['rounds']} rounds)",
        "columns": ["shape", "tree", "wall min ms", "wall median ms", "CPU min ms", "GB/s", "lower s", "compile s"],
        "rows": [[r["shape"], r["variant"], round(r["wall_min_ms"], 1), round(r["wall_median_ms"], 1),
                  round(r["cpu_min_ms"], 1), round(r["gb_per_s"], 2), round(r["lower_s"], 2), round(r["compile_s"], 2)]
                 for r in data["rows"]]}}


if __name__ == "__main__":
    sys.exit(main())
