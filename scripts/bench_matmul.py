"""The decode-shaped matmuls of a model on their own: XLA (jax.jit) against torch, same shapes.

    python scripts/bench_matmul.py --json docs/benchmarks/matmul.json
    python scripts/bench_matmul.py --batches 1,8,64 --iters 20

One decode step of a llama-style model multiplies B rows of activations by each layer's
projections (q, k, v, o; gate, up, down) and the sampling rows by the LM head. This times
each such matmul, x f32[B, I] times a weight, for B in --batches:
    xla [I,O]    jnp.dot(x, W) with W stored [I, O] (paxpage's Linear layout)
    xla [O,I].T  jnp.dot(x, W.T) with W stored [O, I] (paxpage's tied LM head, torch's layout)
    torch        torch.nn.functional.linear(x, W), W [O, I] (what vLLM's CPU linear layers
                 run when no packed kernel takes over)
Variants are timed round-robin (median of --iters), so drifts in machine load hit all alike.
Also one layer's projections back to back, as jitted together (XLA may fuse or reorder them)
against the same sequence in torch; and the whole layer stack's projections, each layer with its
own weights (so they come from memory, as in a step), XLA's dot against the native CPU matmul on
column panels (pallas_kernels/native_linear.py), the form paxpage runs them in on CPU. The figures are GFLOP/s and torch / XLA time ratios;
the machine is whatever `lscpu` says (provenance), and a shared machine makes them noisy.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workload as wl  # noqa: E402
from timing import interleaved_medians  # noqa: E402


def shapes_of(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each decode matmul of a llama-style config."""
    h, d = config.hidden_size, config.head_dim
    return {"q": (h, config.num_heads * d), "kv": (h, config.num_kv_heads * d), "o": (config.num_heads * d, h),
            "gate_up": (h, config.intermediate_size), "down": (config.intermediate_size, h),
            "lm_head": (h, config.vocab_size)}


# One layer's projections by name, each to its shapes_of key (k and v share a shape, as gate and up).
LAYER_PROJECTIONS = {"q": "q", "k": "kv", "v": "kv", "o": "o", "gate": "gate_up", "up": "gate_up", "down": "down"}


def layer_weights(config) -> int:
    """The weights one token multiplies in one layer's projections (LAYER_PROJECTIONS)."""
    shapes = shapes_of(config)
    return sum(shapes[key][0] * shapes[key][1] for key in LAYER_PROJECTIONS.values())


def time_one(batch: int, n_in: int, n_out: int, iters: int) -> dict:
    import jax
    import jax.numpy as jnp
    import torch

    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, n_in), np.float32)
    w_io = rng.standard_normal((n_in, n_out), np.float32) * 0.02
    w_oi = np.ascontiguousarray(w_io.T)
    jx, jw_io, jw_oi = jnp.asarray(x), jnp.asarray(w_io), jnp.asarray(w_oi)
    dot_io = jax.jit(lambda a, b: jnp.dot(a, b))
    dot_oi = jax.jit(lambda a, b: jnp.dot(a, b.T))
    tx, tw = torch.from_numpy(x), torch.from_numpy(w_oi)
    linear = torch.nn.functional.linear
    with torch.inference_mode():
        t = interleaved_medians({
            "xla [I,O]": lambda: jax.block_until_ready(dot_io(jx, jw_io)),
            "xla [O,I].T": lambda: jax.block_until_ready(dot_oi(jx, jw_oi)),
            "torch": lambda: linear(tx, tw),
        }, iters)
    flops = 2 * batch * n_in * n_out
    return {"seconds": t, "gflops": {k: flops / v / 1e9 for k, v in t.items()},
            "torch_over_xla": t["torch"] / min(t["xla [I,O]"], t["xla [O,I].T"])}


def time_layer(batch: int, shapes: dict, iters: int) -> dict:
    """One layer's projections in sequence (q, k, v from x; o; gate, up; down), no nonlinearity
    beyond SiLU*up: XLA as one jitted function against the same calls in torch."""
    import jax
    import jax.numpy as jnp
    import torch

    rng = np.random.default_rng(1)
    h = shapes["q"][0]
    ws = {k: rng.standard_normal(shapes[k], np.float32) * 0.02 for k in ("q", "kv", "o", "gate_up", "down")}
    x = rng.standard_normal((batch, h), np.float32)

    def layer(x, w):
        q, k, v = x @ w["q"], x @ w["kv"], x @ w["kv"]
        a = q + jnp.tile(k + v, q.shape[1] // k.shape[1])
        y = x + a @ w["o"]
        g, u = y @ w["gate_up"], y @ w["gate_up"]
        return y + (jax.nn.silu(g) * u) @ w["down"]

    jl = jax.jit(layer)
    jw = {k: jnp.asarray(v) for k, v in ws.items()}
    jxx = jnp.asarray(x)
    tw = {k: torch.from_numpy(np.ascontiguousarray(v.T)) for k, v in ws.items()}
    tx = torch.from_numpy(x)
    F = torch.nn.functional

    def torch_layer():
        q, k, v = F.linear(tx, tw["q"]), F.linear(tx, tw["kv"]), F.linear(tx, tw["kv"])
        a = q + (k + v).repeat(1, q.shape[1] // k.shape[1])
        y = tx + F.linear(a, tw["o"])
        g, u = F.linear(y, tw["gate_up"]), F.linear(y, tw["gate_up"])
        return y + F.linear(F.silu(g) * u, tw["down"])

    with torch.inference_mode():
        t = interleaved_medians({"xla": lambda: jax.block_until_ready(jl(jxx, jw)), "torch": torch_layer}, iters)
    return {"seconds": t, "torch_over_xla": t["torch"] / t["xla"]}


def time_stack(batch: int, shapes: dict, num_layers: int, iters: int) -> dict | None:
    """Every layer's projections in sequence with each layer's own weights, so that they come from
    memory as in a model's step (one layer's weights stay in cache when repeated): XLA's dot on
    [I, O] kernels against the native kernel on the same kernels in column panels
    (pallas_kernels/native_linear.py; the form paxpage.load holds them in on CPU). None when the
    native kernel cannot be built here."""
    import jax
    import jax.numpy as jnp

    from models import panel_layout
    from models.cache import native_dir
    from pallas_kernels import native_linear

    if not native_linear.load(native_dir()):
        return None
    rng = np.random.default_rng(2)
    plain = [{k: jnp.asarray(rng.standard_normal(shapes[s], np.float32) * 0.02) for k, s in LAYER_PROJECTIONS.items()}
             for _ in range(num_layers)]
    panels = [{k: panel_layout.to_panels(w) for k, w in layer.items()} for layer in plain]

    def stack(matmul):
        def run(x, weights):
            for w in weights:
                q, k, v = matmul(x, w["q"]), matmul(x, w["k"]), matmul(x, w["v"])
                x = x + matmul(q + jnp.tile(k + v, q.shape[1] // k.shape[1]), w["o"])
                x = x + matmul(jax.nn.silu(matmul(x, w["gate"])) * matmul(x, w["up"]), w["down"])
            return x
        return jax.jit(run)

    xla, native = stack(jnp.dot), stack(native_linear.linear_native)
    x = jnp.asarray(rng.standard_normal((batch, shapes["q"][0]), np.float32))
    t = interleaved_medians({"xla": lambda: jax.block_until_ready(xla(x, plain)),
                             "native panels": lambda: jax.block_until_ready(native(x, panels))}, iters)
    return {"seconds": t, "xla_over_native": t["xla"] / t["native panels"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="its config gives the shapes (default: SmolLM2-135M)")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--torch-threads", type=int, default=None, help="default: the cores this process may use")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    import torch

    from models.loading import load_model

    config = load_model(args.model)[0]
    shapes = shapes_of(config)
    torch.set_num_threads(args.torch_threads or len(os.sched_getaffinity(0)))
    batches = [int(b) for b in args.batches.split(",")]
    rows, results = [], {}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; shapes (in, out): {shapes}", flush=True)
    print(f"{'matmul':>8} {'B':>3} {'xla [I,O]':>10} {'xla [O,I].T':>12} {'torch':>8}  GFLOP/s   torch/xla time")
    for name, (n_in, n_out) in shapes.items():
        for b in batches:
            r = time_one(b, n_in, n_out, args.iters)
            results[f"{name}/{b}"] = r
            g = r["gflops"]
            print(f"{name:>8} {b:3d} {g['xla [I,O]']:10.1f} {g['xla [O,I].T']:12.1f} {g['torch']:8.1f}"
                  f"  {r['torch_over_xla']:.2f}", flush=True)
            rows.append([name, b, round(g["xla [I,O]"], 1), round(g["xla [O,I].T"], 1), round(g["torch"], 1),
                         round(r["torch_over_xla"], 2)])
    layers = {}
    for b in batches:
        layers[str(b)] = time_layer(b, shapes, args.iters)
        t = layers[str(b)]["seconds"]
        print(f"one layer's projections, B {b}: xla {t['xla'] * 1e3:.2f} ms, torch {t['torch'] * 1e3:.2f} ms "
              f"(torch / xla {layers[str(b)]['torch_over_xla']:.2f})", flush=True)
    stacks = {}
    for b in batches:
        r = time_stack(b, shapes, config.num_layers, args.iters)
        if r is None:
            print("the native CPU matmul could not be built here: no layer-stack figures", flush=True)
            break
        stacks[str(b)] = r
        t = r["seconds"]
        print(f"{config.num_layers} layers' projections (weights from memory), B {b}: xla {t['xla'] * 1e3:.1f} ms, "
              f"native on panels {t['native panels'] * 1e3:.1f} ms (xla / native {r['xla_over_native']:.2f})",
              flush=True)
    if args.json:
        wl.write_json(args.json, {"shapes": shapes, "torch": torch.__version__, "matmuls": results,
                                  "layer": layers, "stack": stacks},
                      tables={"matmul": {"columns": ["matmul", "B", "XLA [I,O] GFLOP/s", "XLA [O,I].T GFLOP/s",
                                                     "torch GFLOP/s", "torch / XLA time"], "rows": rows}},
                      measures=("scripts/bench_matmul.py",))
    return 0


if __name__ == "__main__":
    sys.exit(main())
