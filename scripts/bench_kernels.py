"""Benchmark the paged-attention kernels against the jnp reference and the platform's peers.

Axis legend: B rows, T tokens, S context (keys per row), N query heads, K kv heads, D head dim,
P pages.

Decode workload (one query token per row, every row at context S). For each (B, S) it times:
  gpu      the GPU ragged kernel (pallas_kernels.gpu_attention, which every GPU step runs)
  verify5  the same kernel with 5 new tokens per row (a speculative verify step); its line also
           gives its time as a multiple of gpu's
  mosaic   our Mosaic GPU decode kernel (pallas_kernels.decode_attention_mgpu; GPU only)
  decode   the TPU decode kernel (pallas_kernels.decode_attention; TPU only)
  ragged   the TPU ragged kernel on the same tokens (q_len = 1 per sequence; TPU only)
  ref      reference.paged_attention_ref (gathers whole page tables; skipped when huge)
  shipped  jax.experimental.pallas.ops.{gpu,tpu}.paged_attention for the platform
and prints median time, achieved GB/s (K/V bytes of the used pages + q bytes, / time) and that
as a fraction of the device copy bandwidth measured here (read + write of a large array).

Prefill workload (one sequence of --prefill-tokens tokens, causal): the GPU kernel on the paged
pool against jax.nn.dot_product_attention with implementation "cudnn" (GPU) and "xla" on the
same tokens held contiguously, printing ms, useful TFLOP/s and the time as a multiple of cuDNN's.

On CPU use --quick: tiny shapes, every kernel in the Pallas interpreter (a correctness smoke
run; the numbers mean nothing). Usage:
    python scripts/bench_kernels.py --quick --json /tmp/bench.json
    python scripts/bench_kernels.py --json $OUT/bench.json          # on a GPU / TPU
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pallas_kernels import gpu_attention, reference  # noqa: E402
from pallas_kernels.decode_attention import decode_attention  # noqa: E402
from pallas_kernels.decode_attention_mgpu import decode_attention_mgpu  # noqa: E402
from pallas_kernels.ragged_attention import ragged_paged_attention  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import write_record  # noqa: E402

REF_MAX_TOKENS = 1 << 19  # the reference materialises [B, S, K, D] f32 copies: cap B * S


def timeit(fn, *args, iters: int) -> float:
    """Median seconds per call after one compile/warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def copy_bandwidth(num_bytes: int, iters: int) -> float:
    """Bytes/s of an on-device copy (each element read once and written once)."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0 + 0.0)  # elementwise, not a no-op XLA can elide
    seconds = timeit(copy, x, iters=iters)
    return 2 * x.nbytes / seconds


def make_inputs(rng, batch, context, *, num_heads, num_kv_heads, head_dim, page_size, dtype):
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    kq, kkv = jax.random.split(key)
    kv_pages = jax.random.normal(kkv, (2, num_pages, page_size, num_kv_heads, head_dim), dtype)
    page_indices = jnp.asarray(rng.permutation(num_pages).reshape(batch, pages_per_seq), jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    q = jax.random.normal(kq, (batch, num_heads, head_dim), dtype)
    return q, kv_pages, page_indices, lengths


def shipped_op(platform: str, interpret: bool, q, kv_pages, page_indices, lengths, *, page_size, sm_scale):
    """jax's own paged attention for the platform; pool relaid to its [K, P, page_size, D].
    It applies no softmax scale, so q comes pre-scaled (outside the timed call)."""
    q = (q.astype(jnp.float32) * sm_scale).astype(q.dtype)
    k_pages = jnp.transpose(kv_pages[0], (2, 0, 1, 3))
    v_pages = jnp.transpose(kv_pages[1], (2, 0, 1, 3))
    pages_per_seq = page_indices.shape[1]
    if platform == "tpu":
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as op

        block = max(d for d in (1, 2, 4, 8, 16) if pages_per_seq % d == 0)
        fn = jax.jit(functools.partial(op, pages_per_compute_block=block))
        return fn, (q, k_pages, v_pages, lengths, page_indices)
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as op

    k_splits = max(d for d in (1, 2, 4, 8, 16) if pages_per_seq % d == 0)
    per_split = pages_per_seq // k_splits
    block = max(d for d in (1, 2, 4, 8) if per_split % d == 0 and d * page_size >= 16) if per_split * page_size >= 16 else per_split
    fn = functools.partial(op, k_splits=k_splits, pages_per_compute_block=block, interpret=interpret)
    return fn, (q, k_pages, v_pages, page_indices, lengths)


def bench_one(rng, batch, context, args, platform, interpret, kernel_backend, copy_bw):
    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    q, kv_pages, page_indices, lengths = make_inputs(
        rng, batch, context, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim, page_size=args.page_size, dtype=dtype,
    )
    scale = args.head_dim ** -0.5
    itemsize = jnp.dtype(dtype).itemsize
    bytes_read = (2 * batch * context * args.num_kv_heads * args.head_dim + q.size) * itemsize
    cu = jnp.arange(batch + 1, dtype=jnp.int32)
    verify_q = jnp.repeat(q[:, None], 5, axis=1)  # [B, 5, N, D]
    impls = {
        "gpu": (jax.jit(lambda q, kv, pt, n: gpu_attention.paged_attention(
                    q[:, None], kv, pt, n, jnp.ones_like(n), sm_scale=scale, interpret=interpret)[:, 0]),
                (q, kv_pages, page_indices, lengths)),
        "verify5": (jax.jit(lambda q, kv, pt, n: gpu_attention.paged_attention(
                        q, kv, pt, n, jnp.full_like(n, 5), sm_scale=scale, interpret=interpret)[:, -1]),
                    (verify_q, kv_pages, page_indices, lengths)),
        "decode": (functools.partial(decode_attention, sm_scale=scale, backend="tpu", interpret=interpret),
                   (q, kv_pages, page_indices, lengths)),
        "mosaic": (functools.partial(decode_attention_mgpu, sm_scale=scale, interpret=interpret),
                   (q, kv_pages, page_indices, lengths)),
        "ragged": (functools.partial(ragged_paged_attention, sm_scale=scale, backend="tpu", interpret=interpret),
                   (q, kv_pages, page_indices, cu, lengths, jnp.array([batch], jnp.int32))),
        "ref": (jax.jit(lambda q, kv, pt, n: reference.paged_attention_ref(
                    q[:, None], kv, pt, n, jnp.ones_like(n), sm_scale=scale)[:, 0]),
                (q, kv_pages, page_indices, lengths)),
    }
    gpu_only, tpu_only = ("gpu", "verify5", "mosaic"), ("decode", "ragged")
    results = []
    want = None
    for name in ("ref", "gpu", "verify5", "mosaic", "decode", "ragged", "shipped"):
        row = dict(kernel=name, batch=batch, context=context, dtype=args.dtype)
        try:
            if name == "ref" and batch * context > REF_MAX_TOKENS:
                raise RuntimeError(f"skipped: B*S={batch * context} > {REF_MAX_TOKENS}")
            if name in gpu_only and kernel_backend != "gpu":
                raise RuntimeError("skipped: a GPU-family kernel")
            if name in tpu_only and kernel_backend != "tpu":
                raise RuntimeError("skipped: a TPU-family kernel")
            if name == "shipped":
                fn, call_args = shipped_op(platform, interpret, q, kv_pages, page_indices, lengths,
                                           page_size=args.page_size, sm_scale=scale)
                if platform == "cpu" and kernel_backend == "tpu":
                    raise RuntimeError("skipped: jax's TPU op has no interpret flag")
            else:
                fn, call_args = impls[name]
            seconds = timeit(fn, *call_args, iters=args.iters)
            out = np.asarray(jnp.asarray(fn(*call_args), jnp.float32))
            if want is None and name == "ref":
                want = out
            err = None if want is None else float(np.max(np.abs(out - want)))
            gbs = bytes_read / seconds / 1e9
            row.update(ms=seconds * 1e3, gb_s=gbs, frac_copy_bw=gbs * 1e9 / copy_bw, max_abs_err_vs_ref=err)
        except Exception as e:  # noqa: BLE001 - one failing impl must not stop the sweep
            row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
        results.append(row)
        decode_row = next((r for r in results if r["kernel"] == "gpu"), {})
        if name == "verify5" and "ms" in row and "ms" in decode_row:
            row["x_decode"] = row["ms"] / decode_row["ms"]
        shown = (f"{row['ms']:9.3f} ms {row['gb_s']:8.2f} GB/s {row['frac_copy_bw']:6.1%} of copy bw"
                 if "ms" in row else row["error"])
        if "x_decode" in row:
            shown += f"  {row['x_decode']:.2f}x a decode row's time"
        print(f"B={batch:3d} S={context:6d} {name:8s} {shown}", flush=True)
    return results


def bench_prefill(rng, tokens, args, interpret):
    """One causal sequence of `tokens` tokens: the GPU kernel on a permuted paged pool against
    jax.nn.dot_product_attention on the same K/V held contiguously."""
    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    _, kv_pages, page_indices, lengths = make_inputs(
        rng, 1, tokens, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
        page_size=args.page_size, dtype=dtype)
    q = jax.random.normal(jax.random.PRNGKey(1), (1, tokens, args.num_heads, args.head_dim), dtype)
    scale = args.head_dim ** -0.5
    # Contiguous [1, T, K, D] copies of the row's keys and values (outside the timed calls).
    k, v = (kv_pages[i][page_indices[0]].reshape(1, -1, args.num_kv_heads, args.head_dim)[:, :tokens]
            for i in (0, 1))
    flops = 4 * args.num_heads * args.head_dim * tokens * (tokens + 1) / 2  # causal q.k and p.v
    impls = {
        "gpu": (jax.jit(functools.partial(gpu_attention.paged_attention, sm_scale=scale, interpret=interpret)),
                (q, kv_pages, page_indices, lengths, lengths)),
    }
    for implementation in ("cudnn", "xla"):
        impls[implementation] = (jax.jit(functools.partial(
            jax.nn.dot_product_attention, scale=scale, is_causal=True, implementation=implementation)), (q, k, v))
    results = []
    for name, (fn, call_args) in impls.items():
        row = dict(kernel=f"prefill-{name}", batch=1, context=tokens, dtype=args.dtype)
        try:
            seconds = timeit(fn, *call_args, iters=args.iters)
            row.update(ms=seconds * 1e3, tflop_s=flops / seconds / 1e12)
        except Exception as e:  # noqa: BLE001 - cuDNN is absent off NVIDIA GPUs
            row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
        results.append(row)
    cudnn = results[1].get("ms")
    for row in results:
        if "ms" in row and cudnn:
            row["x_cudnn"] = row["ms"] / cudnn
        shown = (f"{row['ms']:9.3f} ms {row['tflop_s']:7.2f} TFLOP/s"
                 + (f"  {row['x_cudnn']:.2f}x cuDNN's time" if "x_cudnn" in row else "")
                 if "ms" in row else row["error"])
        print(f"prefill T={tokens:5d} {row['kernel']:14s} {shown}", flush=True)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (CPU)")
    parser.add_argument("--json", help="write results to this path")
    parser.add_argument("--batches", type=int, nargs="*")
    parser.add_argument("--contexts", type=int, nargs="*")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--prefill-tokens", type=int, default=2048, help="0 skips the prefill workload")
    args = parser.parse_args(argv)

    platform = jax.default_backend()
    interpret = args.quick or platform not in ("gpu", "tpu")
    kernel_backend = platform if platform in ("gpu", "tpu") else "gpu"
    if args.quick:
        args.num_heads, args.num_kv_heads, args.head_dim = 4, 2, 64
        args.dtype, args.iters = "float32", 2
        args.prefill_tokens = min(args.prefill_tokens, 64)
        batches, contexts = args.batches or [1, 2], args.contexts or [64, 256]
    else:
        batches, contexts = args.batches or [1, 8, 64], args.contexts or [512, 4096, 32768]
    copy_bytes = (32 << 20) if interpret else (1 << 30)
    copy_bw = copy_bandwidth(copy_bytes, iters=max(args.iters, 5))
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({platform}); "
          f"interpret={interpret}; copy bandwidth {copy_bw / 1e9:.1f} GB/s", flush=True)

    rng = np.random.default_rng(0)
    results = []
    for batch in batches:
        for context in contexts:
            results += bench_one(rng, batch, context, args, platform, interpret, kernel_backend, copy_bw)
    if args.prefill_tokens and kernel_backend == "gpu":
        results += bench_prefill(rng, args.prefill_tokens, args, interpret)
    if args.json:
        data = dict(jax=jax.__version__, platform=platform, device=jax.devices()[0].device_kind,
                    interpret=interpret, copy_bw_gb_s=copy_bw / 1e9, config=vars(args), results=results)
        write_record(args.json, data, tables=doc_tables(data), measures=("pallas_kernels",), charts=doc_charts(data))
    return 0


def doc_tables(data: dict) -> dict:
    """The docs' table (docs/gpu-tpu.md): each kernel's time and bandwidth per (B, S)."""
    cfg = data["config"]
    rows = [[r["batch"], r["context"], r["kernel"], round(r["ms"], 3), round(r["gb_s"], 1),
             f"{r['frac_copy_bw']:.1%}"] for r in data["results"] if "gb_s" in r]
    shape = (f"{cfg['dtype']}, {cfg['num_heads']} / {cfg['num_kv_heads']} heads, D = {cfg['head_dim']}, "
             f"{cfg['page_size']}-token pages")
    interpreted = " (interpreted: the figures mean nothing)" if data["interpret"] else ""
    tables = {"kernels": {
        "caption": f"{shape}; copy bandwidth {data['copy_bw_gb_s']:.0f} GB/s{interpreted}",
        "columns": ["B", "S", "kernel", "ms", "GB/s", "of copy bandwidth"], "rows": rows}}
    prefill = [[r["context"], r["kernel"], round(r["ms"], 3), round(r["tflop_s"], 1),
                round(r["x_cudnn"], 2) if "x_cudnn" in r else None] for r in data["results"] if "tflop_s" in r]
    if prefill:
        tables["prefill"] = {"caption": f"one causal sequence, {shape}{interpreted}",
                             "columns": ["T", "kernel", "ms", "TFLOP/s", "x cuDNN's time"], "rows": prefill}
    return tables


def doc_charts(data: dict) -> dict:
    """The docs' plot (scripts/docs_figures.py draws it): decode GB/s against context, one panel per
    batch size, one line per kernel, the copy bandwidth dashed."""
    panels = []
    decode = [r for r in data["results"] if "gb_s" in r]
    for batch in sorted({r["batch"] for r in decode}):
        rows = [r for r in decode if r["batch"] == batch]
        kernels = list(dict.fromkeys(r["kernel"] for r in rows))
        series = [{"label": k, "x": [r["context"] for r in rows if r["kernel"] == k],
                   "y": [round(r["gb_s"], 1) for r in rows if r["kernel"] == k]} for k in kernels]
        panels.append({"title": f"B = {batch}", "series": series,
                       "hline": {"y": round(data["copy_bw_gb_s"], 1), "label": "copy bandwidth"}})
    cfg = data["config"]
    return {"bandwidth": {"kind": "line", "title": f"Paged decode attention on {data['device']}: {cfg['dtype']}, "
                                                   f"{cfg['num_heads']} / {cfg['num_kv_heads']} heads, "
                                                   f"D = {cfg['head_dim']}",
                          "xlabel": "keys per sequence (S)", "ylabel": "K/V read GB/s", "xscale": "log2",
                          "panels": panels}}


if __name__ == "__main__":
    from paxpage.process_tuning import tune_malloc

    tune_malloc()  # glibc keeps large freed buffers for reuse (paxpage/process_tuning.py)
    sys.exit(main())
