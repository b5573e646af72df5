"""Benchmark the paged-attention kernels against the jnp reference and jax's shipped Pallas op.

Axis legend: B rows, S context (keys per row), N query heads, K kv heads, D head dim, P pages.

Decode workload (one query token per row, every row at context S). For each (B, S) it times:
  decode   our decode kernel (pallas_kernels.decode_attention; on GPU the Triton lowering)
  mosaic   our Mosaic GPU decode kernel (pallas_kernels.decode_attention_mgpu; GPU family only)
  ragged   our ragged kernel on the same tokens (q_len = 1 per sequence)
  ref      reference.paged_attention_ref (gathers whole page tables; skipped when huge)
  shipped  jax.experimental.pallas.ops.{gpu,tpu}.paged_attention for the platform
and prints median time, achieved GB/s (K/V bytes of the used pages + q bytes, / time) and that
as a fraction of the device copy bandwidth measured here (read + write of a large array).

On CPU use --quick: tiny shapes, every kernel in the Pallas interpreter (a correctness smoke
run; the numbers mean nothing). Usage:
    python scripts/bench_kernels.py --quick --json /tmp/bench.json
    python scripts/bench_kernels.py --json $OUT/bench.json          # on a GPU / TPU
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pallas_kernels import reference  # noqa: E402
from pallas_kernels.decode_attention import decode_attention  # noqa: E402
from pallas_kernels.decode_attention_mgpu import decode_attention_mgpu  # noqa: E402
from pallas_kernels.ragged_attention import ragged_paged_attention  # noqa: E402

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
    impls = {
        "decode": (functools.partial(decode_attention, sm_scale=scale, backend=kernel_backend, interpret=interpret),
                   (q, kv_pages, page_indices, lengths)),
        "mosaic": (functools.partial(decode_attention_mgpu, sm_scale=scale, interpret=interpret),
                   (q, kv_pages, page_indices, lengths)),
        "ragged": (functools.partial(ragged_paged_attention, sm_scale=scale, backend=kernel_backend, interpret=interpret),
                   (q, kv_pages, page_indices, cu, lengths, jnp.array([batch], jnp.int32))),
        "ref": (jax.jit(lambda q, kv, pt, n: reference.paged_attention_ref(
                    q[:, None], kv, pt, n, jnp.ones_like(n), sm_scale=scale)[:, 0]),
                (q, kv_pages, page_indices, lengths)),
    }
    results = []
    want = None
    for name in ("ref", "decode", "mosaic", "ragged", "shipped"):
        row = dict(kernel=name, batch=batch, context=context, dtype=args.dtype)
        try:
            if name == "ref" and batch * context > REF_MAX_TOKENS:
                raise RuntimeError(f"skipped: B*S={batch * context} > {REF_MAX_TOKENS}")
            if name == "mosaic" and kernel_backend != "gpu":
                raise RuntimeError("skipped: Mosaic GPU kernel is GPU-only")
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
        shown = (f"{row['ms']:9.3f} ms {row['gb_s']:8.2f} GB/s {row['frac_copy_bw']:6.1%} of copy bw"
                 if "ms" in row else row["error"])
        print(f"B={batch:3d} S={context:6d} {name:8s} {shown}", flush=True)
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
    args = parser.parse_args(argv)

    platform = jax.default_backend()
    interpret = args.quick or platform not in ("gpu", "tpu")
    kernel_backend = platform if platform in ("gpu", "tpu") else "gpu"
    if args.quick:
        args.num_heads, args.num_kv_heads, args.head_dim = 4, 2, 64
        args.dtype, args.iters = "float32", 2
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
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(jax=jax.__version__, platform=platform, device=jax.devices()[0].device_kind,
                           interpret=interpret, copy_bw_gb_s=copy_bw / 1e9, config=vars(args),
                           results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    from paxpage.process_tuning import tune_malloc

    tune_malloc()  # glibc keeps large freed buffers for reuse (paxpage/process_tuning.py)
    sys.exit(main())
