"""Compiles every TPU kernel and the engine's whole step for TPU v5e and v6e on a host without a TPU.

    python scripts/tpu_compile_check.py [--quick] [--strict] [--json out.json]

Needs libtpu (`pip install "jax[tpu]"`; tests/kernels/test_tpu_compile.py builds a separate
environment for it). jax then compiles for a TPU topology it describes but does not have
(`jax.experimental.topologies`): the real XLA TPU compiler and Mosaic run, nothing executes.
Each compile reports its executable's memory analysis. Exit status 1 if anything fails to
compile; the other checks print FINDING lines, fatal with --strict:

1. kernels: decode, ragged (prefill / mixed) and KV write, at SmolLM2 (9 / 3 heads, D = 64) and
   Llama-3-8B (32 / 8, D = 128) shapes, bf16 / int8 / fp8 pools, sliding window, soft cap, each
   for v5e and v6e;
2. page layout: the pool's compiled argument bytes over its logical bytes (values and scales) at
   K = 3 / D = 64, K = 1 / D = 128 and K = 8 / D = 128, bf16, int8 and fp8, in the canonical and
   the tpu layout (pallas_kernels/kv_layout.py), measured as the difference between pools of P
   and 2P pages so the other arguments cancel, and the pool-sized copies (relayouts) the decode,
   mixed and KV write kernels make of its values and of its scales; the layout the TPU backend's
   pool gets must be <= 1.1x and never copied (a FINDING otherwise; docs/gpu-tpu.md);
3. the engine step (paxpage.runner.ModelRunner's own jitted step, built from abstract params:
   no weights are made) for SmolLM2 and a Llama-3-8B-shaped config, on one chip and tensor
   parallel over v5e:2x4, decode and mixed shapes, bf16 and int8 pools: argument, output, temp and alias bytes; no
   pool-sized copy (a relayout) and no temporary as large as one layer's pool beyond the logits
   (XLA staging a pool through VMEM is counted apart), the step's working bytes within the
   pool sizing's bound (kv_sizing.step_bytes_bound), no weight-shaped f32 array (an upcast), and
   the copies it makes of whole weights in every step (a relayout, wherever it lands: one staged
   in VMEM adds no temporary bytes);
4. a roofline for decoding the 8B shape at batch 64 and 256 from the compiled step's
   cost_analysis and the chips' HBM bandwidth: compiled, not run;
5. the routed experts' grouped matmuls at gpt-oss-20b's shapes, experts held as bf16, int8 per
   channel and MXFP4's int8 form, through "ragged_dot" and "tiled": a quantised form whose
   temporaries reach one expert's bf16 expansion is a FINDING (scripts/tpu_moe_check.py).

The engine step and the roofline are scripts/tpu_step_check.py, what a compiled program's text
shows scripts/tpu_hlo.py, the chips and model shapes scripts/tpu_targets.py.

--quick (what the test runs, ~2 minutes): twelve kernel cases per chip, the layout on v5e (a
quantised pool in the TPU pool's layout only), and the engine step of SmolLM2 (one chip, a
mixed int8 step on one chip, tp 8) and of the 8B shape (tp 8, bf16 and int8) with two of their
layers (every layer is the same program; the full layer counts take minutes per compile), no
roofline, the experts at 64 tokens on v5e.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tpu_targets import CHIPS, PAGE_SIZE, abstract_pool, devices, logical_bytes, mib, sds  # noqa: E402, I001 (before jax)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import dispatch, kv_layout  # noqa: E402
from tpu_hlo import leaf_copies  # noqa: E402
from tpu_moe_check import check_moe  # noqa: E402
from tpu_step_check import check_steps, roofline  # noqa: E402

MAX_POOL_RATIO = 1.1


# ---------------------------------------------------------------- 1. kernels
QUICK_KERNELS = ("decode smollm2 bf16", "decode llama8b int8", "decode window 512", "mixed 512 fp8",
                 "mixed soft-cap 50", "kv write 512 int8", "decode smollm2 bf16 tpu-layout",
                 "mixed 512 smollm2 tpu-layout", "kv write 512 tpu-layout", "decode llama8b int8 tpu-layout",
                 "mixed 512 fp8 tpu-layout", "kv write 512 int8 tpu-layout")


def kernel_cases(quick: bool):
    """(name, heads (N, K, D), kind, rows B or tokens T, max keys S, kv dtype, window, soft cap[,
    pool layout]): the canonical pool layout unless a case names one (kv_layout.py)."""
    small, large = (9, 3, 64), (32, 8, 128)
    cases = [
        ("decode smollm2 bf16", small, "decode", 8, 2048, "auto", None, None),
        ("decode llama8b bf16", large, "decode", 8, 4096, "auto", None, None),
        ("decode llama8b int8", large, "decode", 8, 4096, "int8", None, None),
        ("decode smollm2 fp8", small, "decode", 8, 2048, "fp8", None, None),
        ("decode window 512", large, "decode", 8, 4096, "auto", 512, None),
        ("decode soft-cap 50", small, "decode", 8, 2048, "auto", None, 50.0),
        ("prefill 512 smollm2 bf16", small, "ragged", 512, 2048, "auto", None, None),
        ("mixed 512 llama8b bf16", large, "ragged", 512, 4096, "auto", None, None),
        ("mixed 512 llama8b int8", large, "ragged", 512, 4096, "int8", None, None),
        ("mixed 512 fp8", small, "ragged", 512, 2048, "fp8", None, None),
        ("mixed window 512", large, "ragged", 512, 4096, "auto", 512, None),
        ("mixed soft-cap 50", small, "ragged", 512, 2048, "auto", None, 50.0),
        ("kv write 512 bf16", large, "write", 512, 4096, "auto", None, None),
        ("kv write 512 int8", small, "write", 512, 2048, "int8", None, None),
        ("kv write 64 fp8", large, "write", 64, 4096, "fp8", None, None),
        ("decode smollm2 bf16 tpu-layout", small, "decode", 8, 2048, "auto", None, None, "tpu"),
        ("decode llama8b bf16 tpu-layout", large, "decode", 8, 4096, "auto", None, None, "tpu"),
        ("decode window 512 tpu-layout", large, "decode", 8, 4096, "auto", 512, None, "tpu"),
        ("mixed 512 smollm2 tpu-layout", small, "ragged", 512, 2048, "auto", None, None, "tpu"),
        ("mixed soft-cap 50 tpu-layout", small, "ragged", 512, 2048, "auto", None, 50.0, "tpu"),
        ("kv write 512 tpu-layout", small, "write", 512, 2048, "auto", None, None, "tpu"),
        ("decode llama8b int8 tpu-layout", large, "decode", 8, 4096, "int8", None, None, "tpu"),
        ("decode smollm2 fp8 tpu-layout", small, "decode", 8, 2048, "fp8", None, None, "tpu"),
        ("decode window 512 int8 tpu-layout", large, "decode", 8, 4096, "int8", 512, None, "tpu"),
        ("mixed 512 llama8b int8 tpu-layout", large, "ragged", 512, 4096, "int8", None, None, "tpu"),
        ("mixed 512 fp8 tpu-layout", small, "ragged", 512, 2048, "fp8", None, None, "tpu"),
        ("mixed soft-cap 50 int8 tpu-layout", small, "ragged", 512, 2048, "int8", None, 50.0, "tpu"),
        ("kv write 512 int8 tpu-layout", small, "write", 512, 2048, "int8", None, None, "tpu"),
        ("kv write 64 fp8 tpu-layout", large, "write", 64, 4096, "fp8", None, None, "tpu"),
    ]
    return [c for c in cases if c[0] in QUICK_KERNELS] if quick else cases


def compile_kernel(case, device, num_pages: int | None = None):
    name, (n, k, d), kind, rows, keys, kv_dtype, window, cap = case[:8]
    layout = case[8] if len(case) > 8 else "canonical"
    pages_per_seq = keys // PAGE_SIZE
    num_pages = num_pages or 2048
    pool = abstract_pool(num_pages, k, d, kv_dtype, layout)
    masking = dict(sliding_window=window, soft_cap=cap, layout=layout)
    if kind == "write":
        args = (pool, sds((rows, k, d), jnp.bfloat16), sds((rows, k, d), jnp.bfloat16), sds((rows,), jnp.int32))
        fn = jax.jit(lambda *a: dispatch.write_kv(*a, impl="pallas", layout=layout), donate_argnums=(0,))
    else:
        batch, tq = (rows, 1) if kind == "decode" else (rows // 32, 32)  # ragged: rows of 32 tokens
        args = (sds((batch, tq, n, d), jnp.bfloat16), pool, sds((batch, pages_per_seq), jnp.int32),
                sds((batch,), jnp.int32), sds((batch,), jnp.int32))
        fn = jax.jit(lambda *a: dispatch.paged_attention(*a, sm_scale=d ** -0.5, impl="pallas", **masking))
    with jax.default_device(device):  # the compile target: tpu_target.compile_target()
        return fn.lower(*args).compile()


def check_kernels(quick: bool, report: dict) -> list[str]:
    failures = []
    for chip, (topology, _, _) in CHIPS.items():
        device = devices(topology)[0]
        for case in kernel_cases(quick):
            t = time.perf_counter()
            try:
                mem = compile_kernel(case, device).memory_analysis()
            except Exception as e:  # noqa: BLE001 - every failure is reported, then the script fails
                failures.append(f"kernel {case[0]} on {chip}: {type(e).__name__}: {str(e)[:300]}")
                print(f"  {chip:4} {case[0]:28} FAILED {type(e).__name__}: {str(e)[:200]}")
                continue
            seconds = time.perf_counter() - t
            print(f"  {chip:4} {case[0]:31} compiled in {seconds:4.2f} s; args {mib(mem.argument_size_in_bytes)}, "
                  f"temp {mib(mem.temp_size_in_bytes)}")
            report.setdefault("kernels", []).append({"chip": chip, "case": case[0], "seconds": round(seconds, 2),
                                                     "argument_bytes": mem.argument_size_in_bytes,
                                                     "temp_bytes": mem.temp_size_in_bytes})
    return failures


# ---------------------------------------------------------------- 2. page layout
LAYOUT_HEADS = ((9, 3, 64), (8, 1, 128), (32, 8, 128))  # SmolLM2, one kv head, Llama-3-8B


def pool_ratio(device, heads, kv_dtype: str, layout: str = "canonical") -> tuple[float, int, int]:
    """(compiled argument bytes per logical byte of the pool, from pools of P and 2P pages; how
    many pool-sized copies (relayouts) the decode, mixed and KV write kernels make of its values,
    and of its scales: 0 for a plain pool)."""
    n, k, d = heads
    small, large = 1024, 2048
    case = ("layout", heads, "decode", 8, 2048, kv_dtype, None, None, layout)
    a = compile_kernel(case, device, small).memory_analysis().argument_size_in_bytes
    compiled = compile_kernel(case, device, large)
    b = compiled.memory_analysis().argument_size_in_bytes
    pool = abstract_pool(large, k, d, kv_dtype, layout)
    extra = logical_bytes(pool) - logical_bytes(abstract_pool(small, k, d, kv_dtype, layout))
    copies = leaf_copies(compiled.as_text(), pool)
    for kind, rows in (("ragged", 256), ("write", 256)):
        hlo = compile_kernel(("layout", heads, kind, rows, 2048, kv_dtype, None, None, layout), device,
                             large).as_text()
        copies = [x + y for x, y in zip(copies, leaf_copies(hlo, pool))]
    return (b - a) / extra, copies[0], sum(copies[1:])


def check_layout(quick: bool, report: dict) -> list[str]:
    """Both layouts of each pool measured (--quick: a quantised pool in the TPU pool's only); the
    one the TPU backend's pool gets (kv_layout.for_backend) must be <= MAX_POOL_RATIO and never
    copied, its scales included."""
    findings = []
    for chip, (topology, _, _) in list(CHIPS.items())[:1 if quick else None]:
        device = devices(topology)[0]
        for heads in LAYOUT_HEADS:
            for kv_dtype in ("auto", "int8", "fp8"):
                for layout in kv_layout.LAYOUTS:
                    chosen = kv_layout.for_backend("tpu").name == layout
                    if quick and kv_dtype != "auto" and not chosen:
                        continue
                    ratio, copies, scale_copies = pool_ratio(device, heads, kv_dtype, layout)
                    label = f"K={heads[1]} D={heads[2]} {'bf16' if kv_dtype == 'auto' else kv_dtype} {layout}"
                    scales = "" if kv_dtype == "auto" else f", scales {scale_copies} times"
                    print(f"  {chip:4} pool {label:28} compiled / logical bytes {ratio:.3f}x, values copied "
                          f"{copies} times{scales} by the decode, mixed and write kernels"
                          f"{'' if chosen else ' (not the TPU pool)'}")
                    report.setdefault("pool_layout", []).append({
                        "chip": chip, "pool": label, "layout": layout, "kv_dtype": kv_dtype, "tpu_pool": chosen,
                        "ratio": round(ratio, 4), "pool_copies": copies, "scale_copies": scale_copies})
                    if chosen and (ratio > MAX_POOL_RATIO or copies or scale_copies):
                        findings.append(f"pool {label} on {chip}: {ratio:.3f}x logical bytes (limit "
                                        f"{MAX_POOL_RATIO}x), {copies} pool-sized copies of its values, "
                                        f"{scale_copies} of its scales")
    return findings


def _weight_copies_cell(row: dict) -> str:
    return f"{row['weight_copies']} ({row['weight_copy_bytes'] / 2**20:,.0f})" if row["weight_copies"] else "0"


def doc_tables(report: dict) -> dict:
    """docs/gpu-tpu.md's tables (scripts/docs_figures.py renders them), compiled, not run: the pool
    layout per chip and pool; the engine steps per device; the 8B decode roofline; the routed
    experts' grouped matmuls."""
    tables = {}
    if "pool_layout" in report:
        rows = [[r["chip"], r["pool"].rsplit(" ", 1)[0], r["layout"], "yes" if r["tpu_pool"] else "no",
                 f"{r['ratio']:.2f}x", r["pool_copies"], "-" if r["kv_dtype"] == "auto" else r["scale_copies"]]
                for r in report["pool_layout"]]
        columns = ["chip", "pool", "layout", "the TPU pool", "compiled / logical bytes",
                   "value copies (decode + mixed + write)", "scale copies"]
        tables["pool_layout"] = {"columns": columns, "rows": rows}
    if "steps" in report:
        as_mib = lambda x: f"{x / 2**20:,.0f}"
        rows = [[r["step"], r.get("topology", ""), r["decode_rows"], r["prefill_rows"], as_mib(r["argument_bytes"]),
                 as_mib(r["output_bytes"]), as_mib(r["temp_bytes"]), as_mib(r["layer_pool_bytes"]),
                 r["pool_copies"], r["pool_staging"], _weight_copies_cell(r),
                 f"{as_mib(r['working_bytes'])} / {as_mib(r['bound_bytes'])}"]
                for r in report["steps"]]
        columns = ["step", "chips", "decode rows", "prefill rows", "arguments", "outputs", "temporaries",
                   "one layer's pool", "pool copies", "VMEM stagings", "weight copies (MiB)",
                   "working / sizing bound"]
        tables["steps"] = {"columns": columns, "rows": rows}
    if "roofline" in report:
        rows = [[r["step"], r["chip"], r["batch"], r["context"], f"{r['weight_bytes'] / 1e9:.2f}",
                 f"{r['kv_bytes'] / 1e9:.2f}", f"{r['tokens_per_second_bound']:,}",
                 f"{r['compiled_bytes'] / 1e9:.2f}", f"{r['tokens_per_second_as_compiled']:,}"]
                for r in report["roofline"]]
        columns = ["step", "chip", "B", "context", "weights (GB)", "KV (GB)", "bound from weights + KV (tok/s)",
                   "compiled bytes (GB)", "bound as compiled (tok/s)"]
        tables["roofline"] = {"columns": columns, "rows": rows}
    if "moe" in report:
        rows = [[r["chip"], r["tokens"], r["form"], r["impl"], f"{r['argument_bytes'] / 2**20:,.0f}",
                 f"{r['temp_bytes'] / 2**20:,.1f}"] for r in report["moe"]]
        columns = ["chip", "tokens", "experts held as", "impl", "weights + inputs (MiB)", "temporaries (MiB)"]
        tables["moe"] = {"columns": columns, "rows": rows}
    return tables


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a third of the kernel cases and two engine configs")
    ap.add_argument("--json", help="write the measurements here")
    ap.add_argument("--strict", action="store_true", help="FINDING lines (layout, hidden copies) fail too")
    ap.add_argument("--skip", nargs="*", default=[], choices=["kernels", "layout", "steps", "moe"])
    ap.add_argument("--steps", default="", metavar="TEXT", help="only the engine steps whose label holds TEXT")
    ap.add_argument("--roofline-from", metavar="JSON", help="only print the roofline of a --json report's steps")
    args = ap.parse_args(argv)
    if args.roofline_from:
        with open(args.roofline_from) as f:
            rows = json.load(f)["steps"]
        roofline({(r["step"], r["decode_rows"], r["prefill_rows"]): r for r in rows}, {})
        return 0
    print(f"jax {jax.__version__}; compiling for TPU v5e / v6e with no TPU here (compiled, not run)")
    report: dict = {"jax": jax.__version__}
    failures: list[str] = []
    findings: list[str] = []
    t = time.perf_counter()
    if "kernels" not in args.skip:
        print("kernels:")
        failures += check_kernels(args.quick, report)
    if "layout" not in args.skip:
        print("page layout:")
        findings += check_layout(args.quick, report)
    if "steps" not in args.skip:
        print("engine step (per device):")
        step_failures, step_findings, costs = check_steps(args.quick, report, args.steps)
        failures += step_failures
        findings += step_findings
        if not args.quick:
            print("roofline, 8B decode:")
            roofline(costs, report)
    if "moe" not in args.skip:
        print("routed experts (gpt-oss-20b shapes):")
        moe_failures, moe_findings = check_moe(args.quick, report)
        failures += moe_failures
        findings += moe_findings
    print(f"total {time.perf_counter() - t:.0f} s")
    report["failures"], report["findings"] = failures, findings
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from provenance import write_record  # the figures with machine, versions, date, command, commit

        write_record(args.json, report, tables=doc_tables(report))
    for finding in findings:
        print("FINDING:", finding)
    for failure in failures:
        print("FAIL:", failure)
    return 1 if failures or (args.strict and findings) else 0


if __name__ == "__main__":
    sys.exit(main())
