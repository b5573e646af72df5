"""What each GPU attention launch does at bench_kernels.py's shapes, computed on any host.

Axis legend: B rows, Tq query tokens per row, S context (keys per row), N query heads, K kv heads,
D head dim.

Each workload is lowered for CUDA with jax.export through the engine's entry point
(`dispatch.paged_attention(impl="pallas", backend="gpu")`), so no GPU is needed. Per Triton
launch it prints the grid and programs (read from the exported module), warps / stages, the K/V
bytes the programs load (from the kernel's tile walk, `gpu_attention.plan` + the visible key range
of every query tile) against the minimum (every used K/V byte once), the FLOPs the tensor cores
issue (padded tiles) against the useful ones, and the time the bytes need at the H200's 4.3 TB/s
copy bandwidth and the issued FLOPs at 790 TFLOP/s (bf16 dense). These are computed bounds, not
measurements; bench_kernels.py measures on a device. Loaded bytes count every tile a program
reads, from L2 or HBM: a prefill's query tiles re-read keys that an H200's 50 MB L2 mostly holds.

--ptx also compiles each launch's Triton IR for sm_90a (standalone `triton` + `ptxas -v`, see
pallas_kernels/triton_ptx.py) and prints registers, spills, shared memory and the MMA used.

    python scripts/kernel_report.py [--ptx] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pallas_kernels import dispatch, gpu_attention, gpu_launches, triton_ptx  # noqa: E402

HBM_BYTES_PER_S = 4.3e12  # H200 device-to-device copy, measured on a 4 GiB buffer
BF16_FLOPS = 790e12  # H200 dense bf16 matmul, measured


def workloads(args):
    """(label, B, Tq, S): bench_kernels.py's decode sweep, a verify step and a single prefill."""
    rows = [(f"decode B={b} S={s}", b, 1, s) for b in args.batches for s in args.contexts]
    rows += [(f"verify5 B={b} S={s}", b, 5, s) for b, s in ((8, 4096), (64, 32768))]
    rows += [("prefill 1x2048", 1, 2048, 2048)]
    return rows


def tile_walk(batch, num_q, context, geometry, *, num_kv_heads, head_dim, itemsize, window=None):
    """(K/V bytes loaded, tiles visited) by the kernel when every row has `context` keys and Tq new
    tokens: per query tile the keys lo..hi-1 it sees, in block_k tiles (tail keys are not loaded
    from their pages: their slot is 0)."""
    loaded = tiles = 0
    bq, bk = geometry.block_q, geometry.block_k
    for j in range(geometry.num_q_blocks):
        num_tok = min(max(num_q - j * bq, 0), bq)
        if num_tok == 0:
            continue
        pos0 = context - num_q + j * bq
        hi = min(context, pos0 + num_tok)
        lo = 0 if window is None else max(0, pos0 - window + 1)
        loaded += hi - lo
        tiles += -(-hi // bk) - lo // bk
    per_key = 2 * num_kv_heads * head_dim * itemsize  # K and V rows of every kv head
    return batch * loaded * per_key, batch * tiles * num_kv_heads


def report_one(label, batch, num_q, context, args):
    dtype = jnp.dtype(args.dtype)
    S = jax.ShapeDtypeStruct
    pages_per_seq = -(-context // args.page_size)
    shapes = (S((batch, num_q, args.num_heads, args.head_dim), dtype),
              S((2, batch * pages_per_seq, args.page_size, args.num_kv_heads, args.head_dim), dtype),
              S((batch, pages_per_seq), jnp.int32), S((batch,), jnp.int32), S((batch,), jnp.int32))
    fn = functools.partial(dispatch.paged_attention, sm_scale=args.head_dim ** -0.5, impl="pallas", backend="gpu")
    exported = gpu_launches.export_for(fn, shapes, "cuda")
    launches = gpu_launches.triton_launches(exported.mlir_module())
    irs = gpu_launches.triton_irs(exported) if args.ptx else [None] * len(launches)
    geometry = gpu_attention.plan(batch, num_q, args.num_heads, args.num_kv_heads, args.head_dim, pages_per_seq,
                                  args.page_size)
    loaded, tiles = tile_walk(batch, num_q, context, geometry, num_kv_heads=args.num_kv_heads,
                              head_dim=args.head_dim, itemsize=dtype.itemsize)
    minimum = batch * context * 2 * args.num_kv_heads * args.head_dim * dtype.itemsize
    group = args.num_heads // args.num_kv_heads
    # Two products (q.k and p.v) of 2 * D FLOPs per (row, key): issued over padded tiles, useful
    # over real query heads and causally visible keys.
    issued = tiles * geometry.rows * geometry.block_k * 4 * args.head_dim
    visible = sum(context - num_q + t + 1 for t in range(num_q))
    useful = batch * args.num_kv_heads * group * visible * 4 * args.head_dim
    out = []
    for launch, ir_bytes in zip(launches, irs):
        row = dict(workload=label, kernel=launch.name, grid=launch.grid, programs=launch.programs,
                   num_warps=launch.num_warps, num_stages=launch.num_stages, block_q=geometry.block_q,
                   rows=geometry.rows, block_k=geometry.block_k, num_splits=geometry.num_splits,
                   kv_bytes=loaded, kv_bytes_min=minimum, gflop_issued=issued / 1e9, gflop_useful=useful / 1e9,
                   us_at_hbm=loaded / HBM_BYTES_PER_S * 1e6, us_at_bf16_peak=issued / BF16_FLOPS * 1e6)
        out.append(row)
        print(f"{label:22s} {launch.name}: grid {launch.grid} = {launch.programs} programs "
              f"({launch.programs / gpu_attention.NUM_SMS:.1f}/SM), warps {launch.num_warps} stages "
              f"{launch.num_stages}, tile {geometry.rows}x{geometry.block_k} (Bq {geometry.block_q}), "
              f"C {geometry.num_splits}; K/V {loaded / 1e6:.1f} MB = {loaded / minimum:.2f}x min; "
              f"{issued / 1e9:.2f} GFLOP issued ({useful / max(issued, 1):.0%} useful); "
              f"{row['us_at_hbm']:.1f} us at 4.3 TB/s, {row['us_at_bf16_peak']:.1f} us at 790 TFLOP/s", flush=True)
        if ir_bytes is not None:
            row.update(triton_ptx.resources(ir_bytes, num_warps=launch.num_warps, num_stages=launch.num_stages))
            print(f"{'':22s} sm_90a: {row['registers']} registers, spills {row['spill_stores']} / "
                  f"{row['spill_loads']} bytes, {row['shared_bytes']} B shared, {' '.join(row['mma'])}", flush=True)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows to this path")
    parser.add_argument("--ptx", action="store_true", help="also compile to PTX: registers, spills")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 64])
    parser.add_argument("--contexts", type=int, nargs="*", default=[512, 4096, 32768])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    args = parser.parse_args(argv)
    if args.ptx and triton_ptx.unavailable_reason():
        parser.error(f"--ptx needs triton and ptxas: {triton_ptx.unavailable_reason()}")
    print(f"jax {jax.__version__}, lowered for cuda on {jax.default_backend()}; {args.dtype}, "
          f"N={args.num_heads} K={args.num_kv_heads} D={args.head_dim} page_size={args.page_size}", flush=True)
    rows = []
    for label, batch, num_q, context in workloads(args):
        rows += report_one(label, batch, num_q, context, args)
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from provenance import write_record  # the figures with machine, versions, date, command, commit

        write_record(args.json, dict(jax=jax.__version__, config=vars(args), rows=rows), measures=("pallas_kernels",))
    return 0


if __name__ == "__main__":
    sys.exit(main())
