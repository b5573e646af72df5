"""Tensor / data parallelism: memory per device and step time for TP 1/2/4 (and DP).

For each configuration it builds the engine(s) on a forced-device CPU mesh (or the real devices
on GPU/TPU) and reports, from the arrays' real shardings (summed over each device's shards):
weight bytes and KV-pool bytes per device, the KV page's bytes per device, and the largest KV
pool (pages, tokens) that fits --budget-bytes per device next to the weights. It checks them
against the shape-only rules (paxpage/sharding.py) the accelerator tables of docs/parallelism.md use.

Then it times a steady decode step (--num-seqs sequences decoding) for every TP size, and for
DP the output tok/s of one batch of requests through the front door. On a CPU the "devices"
are slices of the same cores, so these times show the cost of partitioning (collectives,
smaller matmuls), never a speed-up.

    python scripts/bench_parallel.py --json /tmp/parallel.json            # SmolLM2, 4 forced devices
    python scripts/bench_parallel.py --model PATH --tp 1,2,4 --dp 1,2 --paper
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time


def _force_devices(n: int) -> None:
    """Must run before jax starts: on CPU, expose n host devices."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


PAPER_MODELS = {  # HF config.json values of the Llama-3 family
    "Llama-3-8B": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                       num_heads=32, num_kv_heads=8, head_dim=128),
    "Llama-3-70B": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                        num_heads=64, num_kv_heads=8, head_dim=128),
}
# (name, devices, memory per device in GiB, mesh layouts (dp, tp) to list)
PAPER_SYSTEMS = [("TPU v5e-8", 8, 16, [(1, 8), (2, 4), (4, 2), (8, 1)]),
                 ("8x H100 80GB", 8, 80, [(1, 8), (2, 4), (4, 2), (8, 1)])]


def paper_table(budget_fraction: float = 0.9, page_size: int = 16) -> list[dict]:
    """Per-device weights and KV room for Llama-3 8B / 70B in bf16, from the sharding rules."""
    from models.config import ModelConfig
    from paxpage.sharding import ShardingPlan, kv_page_bytes_per_device, param_bytes_per_device

    rows = []
    for system, _, gib, layouts in PAPER_SYSTEMS:
        for name, fields in PAPER_MODELS.items():
            cfg = ModelConfig(**fields)
            for dp, tp in layouts:
                plan = ShardingPlan.for_model(cfg, tp)
                weights = param_bytes_per_device(cfg, plan, 2)
                page = kv_page_bytes_per_device(cfg, plan, page_size, 2)
                room = int(gib * 2**30 * budget_fraction) - weights
                rows.append({"system": system, "model": name, "dp": dp, "tp": tp, "plan": plan.describe(),
                             "weights_gib": weights / 2**30, "kv_bytes_per_token": page // page_size,
                             "kv_tokens_per_replica": max(0, room // page) * page_size if room > 0 else 0,
                             "fits": room > 0})
    return rows


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


# The code these figures measure (scripts/provenance.py: write_record).
MEASURES = ("paxpage/sharding.py", "paxpage/mesh.py", "paxpage/kv_sizing.py", "models")


def doc_tables(results: dict) -> dict:
    """The docs' tables (docs/parallelism.md): memory per layout, step time per TP size, front-door
    throughput per DP size, and the on-paper table when it was asked for."""
    tables = {"memory": {
        "caption": f"{results['model']} ({results['num_heads']} query / {results['num_kv_heads']} KV heads) on "
                   f"{results['device']}, {results['page_size']}-token pages, "
                   f"{_size(results['budget_bytes'])} per device for weights + KV",
        "columns": ["tp", "dp", "plan", "weights / device", f"KV pool / device ({results['num_pages']} pages)",
                    "page / device", "largest pool in budget (pages / tokens per replica)"],
        "rows": [[r["tp"], r["dp"], r["plan"], _size(r["weights_bytes_per_device"]), _size(r["kv_bytes_per_device"]),
                  _size(r["page_bytes_per_device"]), f"{r['max_pages_in_budget']:,} / {r['max_tokens_in_budget']:,}"]
                 for r in results["memory"]]}}
    tables["step"] = {"columns": ["measure", *(f"tp = {r['tp']}" for r in results["step"])],
                      "rows": [[f"one steady decode step, {results['num_seqs']} sequences",
                                *(f"{r['decode_step_ms']:.1f} ms" for r in results["step"])]]}
    if results["dp"]:
        tables["dp"] = {"columns": ["measure", *(f"dp = {r['dp']}" for r in results["dp"])],
                        "rows": [[f"{results['dp_requests']} requests x {results['dp_tokens']} tokens through the "
                                  "front door, output tok/s", *(round(r["output_tok_s"], 1) for r in results["dp"])]]}
    if "paper" in results:
        tables["paper"] = {
            "caption": f"On paper, from the same sharding rules (bf16 weights and KV, {results['page_size']}-token "
                       "pages, 90% of device memory for weights + KV)",
            "columns": ["system", "model", "dp x tp", "weights / device", "KV per token / device",
                        "KV tokens per replica"],
            "rows": [[r["system"], r["model"], f"{r['dp']} x {r['tp']}", f"{r['weights_gib']:.1f} GiB",
                      f"{r['kv_bytes_per_token'] / 1024:.0f} KiB",
                      f"{r['kv_tokens_per_replica']:,}" if r["fits"] else "does not fit"] for r in results["paper"]]}
    return tables


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--devices", type=int, default=4, help="forced host devices on CPU")
    parser.add_argument("--tp", default="1,2,4")
    parser.add_argument("--dp", default="1,2", help="data-parallel sizes (with tp 1 and the largest tp that fits)")
    parser.add_argument("--budget-bytes", type=int, default=1 << 30, help="memory per device for weights + KV")
    parser.add_argument("--num-pages", type=int, default=64, help="pool built for the measurements")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-seqs", type=int, default=8, help="sequences in the timed decode step")
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps per TP size")
    parser.add_argument("--dp-requests", type=int, default=16)
    parser.add_argument("--dp-tokens", type=int, default=16)
    parser.add_argument("--paper", action="store_true", help="also print the TPU v5e-8 / 8x H100 table")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    _force_devices(args.devices)

    import jax
    import numpy as np

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import paxpage
    from paxpage.mesh import bytes_per_device
    from paxpage.sharding import ShardingPlan, kv_page_bytes_per_device, param_bytes_per_device

    model = paxpage.load(args.model)
    cfg = model.config
    num_devices = jax.device_count()
    tps = [t for t in map(int, args.tp.split(",")) if t <= num_devices]
    dps = [d for d in map(int, args.dp.split(",")) if d > 1]
    base = dict(num_pages=args.num_pages, page_size=args.page_size, max_num_seqs=max(args.num_seqs, 8))
    rng = np.random.default_rng(0)
    results = {"device": f"{jax.devices()[0].platform} x {num_devices} ({jax.devices()[0].device_kind})",
               "model": model.source or "SmolLM2-135M-Instruct", "num_pages": args.num_pages, "page_size": args.page_size,
               "num_seqs": args.num_seqs, "dp_requests": args.dp_requests, "dp_tokens": args.dp_tokens,
               "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "budget_bytes": args.budget_bytes,
               "memory": [], "step": [], "dp": []}
    print(f"{results['model']}: N={cfg.num_heads} K={cfg.num_kv_heads} F={cfg.intermediate_size} "
          f"V={cfg.vocab_size}; {results['device']}; budget {args.budget_bytes / 2**20:.0f} MiB per device")

    layouts = [(tp, 1) for tp in tps] + [(t, d) for d in dps for t in tps if t * d <= num_devices]
    print(f"\n| tp | dp | plan | weights / device | KV pool / device ({args.num_pages} pages) | "
          f"page / device | largest pool in budget (pages / tokens per replica) |")
    print("|---|---|---|---|---|---|---|")
    for tp, dp in layouts:
        config = paxpage.EngineConfig(tensor_parallel_size=tp, data_parallel_size=dp, **base)
        engines = model.replicas(config)
        weights = max(max(bytes_per_device(e.runner.params).values()) for e in engines)
        kv = max(max(bytes_per_device(e.runner.kv_cache).values()) for e in engines)
        page = kv // args.num_pages
        plan = ShardingPlan.for_model(cfg, tp)
        itemsize = np.dtype(engines[0].config.dtype).itemsize
        # the shape-only rules must agree with the real arrays
        assert weights == param_bytes_per_device(cfg, plan, itemsize), (weights, tp)
        assert page == kv_page_bytes_per_device(cfg, plan, args.page_size, itemsize) == engines[0].config.page_bytes
        pages = max(0, (args.budget_bytes - weights) // page)
        row = {"tp": tp, "dp": dp, "plan": plan.describe(), "weights_bytes_per_device": weights,
               "kv_bytes_per_device": kv, "page_bytes_per_device": page,
               "max_pages_in_budget": pages, "max_tokens_in_budget": pages * args.page_size}
        results["memory"].append(row)
        print(f"| {tp} | {dp} | {plan.describe()} | {_size(weights)} | {_size(kv)} | "
              f"{_size(page)} | {pages:,} / {pages * args.page_size:,} |")
        del engines
        model.close()
        gc.collect()

    print(f"\nsteady decode step, {args.num_seqs} sequences (CPU: partitioning overhead, not speed-up)")
    for tp in tps:
        config = paxpage.EngineConfig(tensor_parallel_size=tp, **base)
        engine = model.engine(config)
        for i in range(args.num_seqs):
            prompt = rng.integers(0, cfg.vocab_size, 24).tolist()
            engine.add_request(prompt, paxpage.SamplingParams(max_tokens=args.steps + 40, temperature=0,
                                                              ignore_eos=True), index=i)
        for _ in range(6):  # prefill, then a few decode steps (compiles)
            engine.step()
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        ms = (time.perf_counter() - t) / args.steps * 1e3
        results["step"].append({"tp": tp, "decode_step_ms": ms})
        print(f"  tp={tp}: {ms:.1f} ms/step ({ms / results['step'][0]['decode_step_ms']:.2f}x tp=1)")
        del engine
        model.close()
        gc.collect()

    if dps:
        print(f"\nfront door: {args.dp_requests} requests x {args.dp_tokens} tokens (second of two runs)")
        prompts = [rng.integers(0, cfg.vocab_size, 20).tolist() for _ in range(args.dp_requests)]
        for dp in [1] + dps:
            if dp > num_devices:
                continue
            config = paxpage.EngineConfig(data_parallel_size=dp, **base)
            for _ in range(2):
                t = time.perf_counter()
                paxpage.generate(model, prompts, engine_config=config, max_tokens=args.dp_tokens, temperature=0,
                                 ignore_eos=True, use_tqdm=False)
                seconds = time.perf_counter() - t
            tps_out = args.dp_requests * args.dp_tokens / seconds
            results["dp"].append({"dp": dp, "output_tok_s": tps_out})
            print(f"  dp={dp}: {tps_out:.1f} output tok/s")
            model.close()
            gc.collect()

    if args.paper:
        rows = paper_table(page_size=args.page_size)
        results["paper"] = rows
        print("\n| system | model | dp x tp | weights / device | KV per token / device | KV tokens per replica (90% of memory) |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            room = f"{r['kv_tokens_per_replica']:,}" if r["fits"] else "does not fit"
            print(f"| {r['system']} | {r['model']} | {r['dp']} x {r['tp']} | {r['weights_gib']:.1f} GiB | "
                  f"{r['kv_bytes_per_token'] / 1024:.0f} KiB | {room} |")
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from provenance import write_record  # the figures with machine, versions, date, command, commit

        write_record(args.json, results, doc_tables(results), measures=MEASURES)
    return 0


if __name__ == "__main__":
    from paxpage.process_tuning import tune_malloc

    tune_malloc()  # glibc keeps large freed buffers for reuse (paxpage/process_tuning.py)
    sys.exit(main())
