"""Where the CPU attention's time goes: XLA's per-thunk times of bench_attention_ab's step.

Builds scripts/bench_attention_ab.py's jitted step (every layer's KV write, then its decode
attention) for one shape, calls it under `jax.profiler.trace`, and sums the XLA CPU thunk
events of the calls by name, with the per-layer suffix dropped (`gather_bitcast_fusion.12`
counts as `gather_bitcast_fusion`). Per call it prints each name's total ms, how many times it
ran and its mean us per run: inside the attention's while loop a run is one loop iteration
(tiny: 96 per layer; smollm2: 5 per layer). The profiler may miss
some events; runs/call shows how many it caught. What a fusion holds is in the optimised HLO
(`--hlo` prints the loop body and the ops inside each fusion).

`--probe gather` times a read-only loop instead, as the floor to compare with: the same
pages gathered chunk by chunk and summed into a carried buffer (no dots, no softmax).

The profiler slows each event; compare names within one run, not with bench_attention_ab's
wall times.

Usage:
    python scripts/profile_attention.py --shape tiny
    python scripts/profile_attention.py --shape smollm2 --layers 30 --hlo
    python scripts/profile_attention.py --shape tiny --probe gather
    python scripts/profile_attention.py --shape tiny --baseline /tmp/attn_base
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import bench_attention_ab as ab  # noqa: E402


def gather_probe(q, kv_pages, page_indices, kv_lens, q_lens, *, sm_scale):
    """Reads what the attention reads, one page per row per iteration, and nothing else."""
    del q_lens, sm_scale
    batch = q.shape[0]
    _, num_pages, page_size, num_kv_heads, head_dim = kv_pages.shape
    rows = kv_pages.reshape(2 * num_pages, page_size * num_kv_heads * head_dim)
    num_chunks = (jnp.max(kv_lens) + page_size - 1) // page_size

    def body(carry):
        c, acc = carry
        idx = lax.dynamic_slice_in_dim(page_indices, c, 1, axis=1)  # [B, 1]
        k = rows.at[idx].get(mode="promise_in_bounds")
        v = rows.at[idx + num_pages].get(mode="promise_in_bounds")
        return c + 1, acc + k + v

    init = (jnp.int32(0), jnp.zeros((batch, 1, rows.shape[1]), jnp.float32))
    _, acc = lax.while_loop(lambda carry: carry[0] < num_chunks, body, init)
    return q + acc[:, :, :q.shape[2] * q.shape[3]].reshape(q.shape).astype(q.dtype)


def thunk_times(trace_dir: str, calls: int) -> list[tuple[str, float, float]]:
    """(name, ms per call, runs per call) of the XLA CPU thunk events, largest first."""
    path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    data = jax.profiler.ProfileData.from_file(path)
    total = collections.Counter()
    runs = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):  # the threads that run the thunks, not python's
                continue
            for event in line.events:
                if event.name.startswith(("end: ", "ThreadpoolListener", "ThunkExecutor", "while")):
                    continue  # bookkeeping, and the loop itself (it holds the thunks listed)
                name = re.sub(r"\.\d+$", "", event.name)
                total[name] += event.duration_ns
                runs[name] += 1
    return [(name, ns / calls / 1e6, runs[name] / calls) for name, ns in total.most_common()]


def loop_body_hlo(text: str) -> str:
    """The optimised HLO's computations (each fusion's ops, the loop body, the loop condition),
    metadata dropped and lines cut at 240 characters."""
    keep = []
    for line in text.splitlines():
        line = re.sub(r", metadata=\{[^}]*\}", "", line)
        if line.startswith("%fused_computation") or line.startswith("%region") or line.startswith("  "):
            keep.append(line[:240])
        elif line.startswith("}"):
            keep.append("}")
    return "\n".join(keep)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tiny", choices=sorted(ab.SHAPES))
    parser.add_argument("--layers", type=int, default=1, help="layers in the step (the shape's own count: 0)")
    parser.add_argument("--calls", type=int, default=3, help="profiled calls")
    parser.add_argument("--baseline", default=None, help="profile this tree's xla_attention.py instead")
    parser.add_argument("--probe", choices=["gather"], default=None, help="profile the read-only loop")
    parser.add_argument("--hlo", action="store_true", help="print the optimised HLO (fusions, loop body)")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    shape = dict(ab.SHAPES[args.shape])
    if args.layers:
        shape["layers"] = args.layers
    if args.probe:
        attention = gather_probe
    elif args.baseline:
        attention = ab.load_baseline(args.baseline)
    else:
        attention = ab.xla_attention.paged_attention_xla
    call, kv_bytes, (_, compile_s) = ab.make_step(attention, shape)
    for _ in range(2):
        call()
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(args.calls):
                call()
        rows = thunk_times(trace_dir, args.calls)
    print(f"jax {jax.__version__}, shape {args.shape} x {shape['layers']} layers, "
          f"{kv_bytes / 2**20:.1f} MiB of K/V per call, compile {compile_s:.2f} s")
    print(f"{'thunk':36s} {'ms/call':>9s} {'runs/call':>10s} {'us/run':>9s}")
    for name, ms, runs in rows[:args.top]:
        print(f"{name:36s} {ms:9.2f} {runs:10.1f} {ms * 1e3 / max(runs, 1e-9):9.1f}")
    if args.hlo:
        print(loop_body_hlo(_compiled_text(attention, shape)))
    return 0


def _compiled_text(attention, shape: dict) -> str:
    """The optimised HLO of make_step's computation (compiled again, as text)."""
    texts = []
    real_jit = ab.jax.jit

    class Recorder:
        def __init__(self, fun, **kwargs):
            self.jitted = real_jit(fun, **kwargs)

        def lower(self, *a):
            lowered = self.jitted.lower(*a)
            texts.append(lowered.compile().as_text())
            return lowered

    ab.jax.jit = Recorder  # make_step calls jax.jit(...).lower(...): record what it compiles
    try:
        ab.make_step(attention, shape)
    finally:
        ab.jax.jit = real_jit
    return texts[0]


if __name__ == "__main__":
    from paxpage.process_tuning import tune_malloc

    tune_malloc()  # glibc keeps large freed buffers for reuse (paxpage/process_tuning.py)
    sys.exit(main())
