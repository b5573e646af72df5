"""KV memory: paged allocation against the contiguous (pre-paging) scheme, one memory budget.

The same workload (scripts/workload.py) runs twice on a KV pool of the same size:
  paged       pages allocated as tokens arrive, returned when a sequence ends (paxpage default)
  contiguous  every admitted sequence reserves max_model_len tokens up front, as systems
              before PagedAttention did (EngineConfig(kv_allocation="contiguous"))
For each it reports the most sequences running at once, KV utilisation (the share of the
allocated pages' token slots that hold live K/V, averaged over steps: internal padding of
last pages and reserved-but-empty slots are the waste), and throughput. The default budget
holds --contiguous-seqs full-length reservations, so the contiguous scheme is memory-bound,
as it is on a real server.

Plots (--out-dir): kv_utilisation.png, utilisation and running sequences over time for both
schemes; page_map.png, the page pool of each scheme at its step holding the most live
tokens: which sequence owns each page (one colour per sequence, pale where allocated but not
yet holding tokens), free and prefix-cached pages, pages shared by several sequences
outlined in red.

KV cache dtypes (--kv-dtypes): instead, the same workload with paged allocation on one fixed
byte budget (--kv-cache-bytes) with the cache stored as each of float32 / bfloat16 (the model's
dtype: the model then also runs in it) and int8 / fp8 (EngineConfig.kv_cache_dtype, f32 model):
pages the budget buys, the most sequences running at once and output tok/s, side by side with
their ratios to the first dtype, in one run.

Latent attention (--mla): instead, the same workload with paged allocation on one fixed byte
budget on two random-weight models of one hidden size and depth: DeepSeek-V2-Lite's latent
attention (one latent of kv_lora_rank + qk_rope_head_dim values per token and layer) and
Llama-3.2-1B's grouped-query attention (K and V of its kv heads: 2 x K x D values). The bytes per
token and layer of each pool (measured from the pool's arrays), pages the budget buys and the most
sequences running at once, side by side with their ratios, in one run. --mla-sizes "attention"
keeps both models' attention widths as released and shrinks the rest (hidden 64, a 512-token
vocabulary, 8 experts), so the bytes per token are the released models'; "tiny" takes both
presets' tiny forms (models/random_init.py).

Usage:
    python scripts/bench_memory.py --json /tmp/memory.json --out-dir /tmp/memory
    python scripts/bench_memory.py --num-pages 512 --max-model-len 2048 --shared-prefix 64
    python scripts/bench_memory.py --kv-dtypes float32,bfloat16,int8,fp8 --kv-cache-bytes 47185920
    python scripts/bench_memory.py --mla --max-model-len 256
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import paxpage  # noqa: E402
import workload as wl  # noqa: E402

SCHEMES = ("paged", "contiguous")
# --mla: the two attention forms compared, as random_init presets of one hidden size (2048)
MLA_PRESETS = {"mla": "deepseek-v2-lite", "gqa": "llama-3.2-1b"}
# what --mla-sizes "attention" takes from the tiny presets: everything but the attention widths
SHRUNK_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "layer_types", "num_experts",
                 "num_experts_per_tok", "moe_intermediate_size", "num_expert_groups", "topk_groups",
                 "max_position_embeddings", "bos_token_id", "eos_token_ids")
# --kv-dtypes entry -> (EngineConfig.dtype, EngineConfig.kv_cache_dtype)
KV_DTYPES = {"float32": ("float32", "auto"), "bfloat16": ("bfloat16", "auto"),
             "int8": ("float32", "int8"), "fp8": ("float32", "fp8")}


@dataclasses.dataclass
class PoolSnapshot:
    """The page pool at one step: per page, owner index (-1 none), live tokens, refcount."""

    step: int
    owner: np.ndarray  # i32[P] index into the running list at that step, -1 = not held
    fill: np.ndarray  # i32[P] tokens of live K/V in the page
    refcount: np.ndarray  # i32[P]
    cached: np.ndarray  # bool[P] free but holding a prefix-cache entry (evictable)
    num_running: int


def snapshot(engine, step: int) -> PoolSnapshot:
    sched = engine.scheduler
    pm, ps = sched.page_manager, engine.config.page_size
    num_pages = engine.config.num_pages
    owner = np.full(num_pages, -1, np.int32)
    fill = np.zeros(num_pages, np.int32)
    for r, seq in enumerate(sched.running):
        for i, page in enumerate(seq.page_table):
            if page < 0:  # released: wholly outside the sliding window
                continue
            if owner[page] < 0:
                owner[page] = r
            fill[page] = max(fill[page], min(ps, max(0, seq.num_computed_tokens - i * ps)))
    refcount = np.array([pm.refcount(p) for p in range(num_pages)], np.int32)
    cached = np.array([pm.refcount(p) == 0 and pm.is_cached(p) for p in range(num_pages)])
    return PoolSnapshot(step, owner, fill, refcount, cached, len(sched.running))


def run_scheme(model, work: wl.Workload, cfg: paxpage.EngineConfig) -> dict:
    """One pass; per-step utilisation, running sequences and a snapshot of the fullest step."""
    engine = model.engine(cfg)
    pool = engine.config.num_pages
    for i, (prompt, out_len) in enumerate(zip(work.prompts, work.output_lens)):
        engine.add_request(prompt, paxpage.SamplingParams(max_tokens=out_len, temperature=0,
                                                          ignore_eos=True), index=i)
    preempt0 = engine.scheduler.num_preemptions
    times, util, running, used, seq_pages = [], [], [], [], []
    best: PoolSnapshot | None = None
    best_live = -1.0
    start = time.perf_counter()
    while engine.has_unfinished():
        # Measured before the step: the batch about to run and the pages it holds.
        st = engine.scheduler.stats()
        if st.num_running:
            times.append(time.perf_counter() - start)
            util.append(st.kv_utilization)
            running.append(st.num_running)
            used.append(st.num_used_pages)
            seq_pages.append(max(sum(p >= 0 for p in seq.page_table) for seq in engine.scheduler.running))
            live = st.kv_utilization * st.num_used_pages  # in pages' worth of live tokens
            if live > best_live:
                best, best_live = snapshot(engine, len(util) - 1), live
        engine.step()
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "output_tok_per_s": work.num_output_tokens / wall,
        "requests_per_s": work.num_requests / wall,
        "steps": len(util),
        "max_running": int(max(running)),
        "mean_running": float(np.mean(running)),
        "mean_kv_utilisation": float(np.mean(util)),
        "mean_pool_occupancy": float(np.mean(used)) / pool,
        "max_pages_per_seq": int(max(seq_pages)),
        "preemptions": engine.scheduler.num_preemptions - preempt0,
        "num_pages": pool,
        "page_bytes": engine.config.page_bytes,
        "series": {"time_s": times, "kv_utilisation": util, "num_running": running, "used_pages": used,
                   "max_pages_per_seq": seq_pages},
        "_snapshot": best,
    }


# ---------------------------------------------------------------------------------------- plots
def plot_utilisation(results: dict, path: str, title: str, names: tuple[str, ...] = SCHEMES) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for name, color in zip(names, ("tab:blue", "tab:orange")):
        s = results[name]["series"]
        mean = results[name]["mean_kv_utilisation"]
        ax1.plot(s["time_s"], np.array(s["kv_utilisation"]) * 100, color=color, drawstyle="steps-post",
                 label=f"{name} (mean {mean:.1%})")
        ax2.plot(s["time_s"], s["num_running"], color=color, drawstyle="steps-post", label=name)
    ax1.set_ylabel("KV utilisation (%)\nlive tokens / allocated slots")
    ax1.set_ylim(0, 105)
    ax1.legend(loc="lower right")
    ax1.grid(alpha=0.3)
    ax2.set_ylabel("sequences running")
    ax2.set_xlabel("time since start of the pass (s)")
    ax2.legend(loc="upper right")
    ax2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pool_image(snap: PoolSnapshot, page_size: int, columns: int):
    import matplotlib

    # tab10 without its grey (grey means free here); pale versions mark reserved, empty pages.
    palette = [c for i, c in enumerate(matplotlib.colormaps["tab10"].colors) if i != 7]
    num_pages = len(snap.owner)
    num_rows = -(-num_pages // columns)
    image = np.ones((num_rows, columns, 3))  # white = past the pool
    for page in range(num_pages):
        r, c = divmod(page, columns)
        if snap.owner[page] >= 0:
            rgb = np.array(palette[snap.owner[page] % len(palette)])
            frac = snap.fill[page] / page_size
            image[r, c] = rgb if frac > 0 else 0.25 * rgb + 0.75  # pale: allocated, still empty
        elif snap.cached[page]:
            image[r, c] = (0.55, 0.55, 0.55)
        else:
            image[r, c] = (0.9, 0.9, 0.9)
    return image


def plot_page_map(results: dict, page_size: int, path: str, title: str, names: tuple[str, ...] = SCHEMES) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch, Rectangle
    from matplotlib.ticker import MaxNLocator

    num_pages = results[names[0]]["num_pages"]
    columns = int(min(64, max(8, 2 ** round(np.log2(np.sqrt(2 * num_pages))))))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    for ax, name in zip(axes, names):
        snap = results[name]["_snapshot"]
        ax.imshow(_pool_image(snap, page_size, columns), interpolation="nearest", aspect="equal")
        for page in np.flatnonzero(snap.refcount > 1):
            r, c = divmod(int(page), columns)
            ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.2))
        held = snap.owner >= 0
        live = snap.fill[held].sum() / max(1, held.sum() * page_size)
        ax.set_title(f"{name}: step {snap.step}, {snap.num_running} sequences,\n"
                     f"{held.sum()}/{num_pages} pages held, {live:.0%} of their slots live")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(f"page id mod {columns}")
        ax.set_ylabel(f"page id // {columns}")
    legend = [
        Patch(facecolor="tab:blue", label="holds a sequence's tokens (one colour per sequence)"),
        Patch(facecolor=0.25 * np.array(to_rgb("tab:blue")) + 0.75, label="allocated to a sequence, no tokens yet"),
        Patch(facecolor=(0.9, 0.9, 0.9), label="free"),
        Patch(facecolor=(0.55, 0.55, 0.55), label="free, holds a prefix-cache entry"),
        Patch(facecolor="white", edgecolor="red", label="shared by several sequences (refcount > 1)"),
    ]
    fig.legend(handles=legend, loc="lower center", ncol=3, fontsize=9)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------- KV dtypes
def compare_kv_dtypes(model, work: wl.Workload, args) -> dict:
    """The workload once per KV cache dtype at one byte budget; prints one line each, then ratios."""
    names = args.kv_dtypes.split(",")
    unknown = [n for n in names if n not in KV_DTYPES]
    if unknown:
        raise ValueError(f"--kv-dtypes has {unknown}; choose from {sorted(KV_DTYPES)}")
    results = {}
    for name in names:
        dtype, kv_cache_dtype = KV_DTYPES[name]
        cfg = paxpage.EngineConfig(page_size=args.page_size, kv_cache_bytes=args.kv_cache_bytes,
                                   max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                                   max_num_batched_tokens=args.max_num_batched_tokens, dtype=dtype,
                                   kv_cache_dtype=kv_cache_dtype)
        if not args.no_warmup:
            run_scheme(model, work.with_fresh_prompts(model.config.vocab_size, args.seed + 7919), cfg)
        r = results[name] = run_scheme(model, work, cfg)
        r.pop("_snapshot")
        r.pop("series")
        r.update(dtype=dtype, kv_cache_dtype=kv_cache_dtype)
        print(f"{name:>9}: {r['num_pages']:5d} pages of {r['page_bytes']} B, max {r['max_running']:3d} running "
              f"(mean {r['mean_running']:.1f}), {r['output_tok_per_s']:.1f} output tok/s "
              f"({r['wall_s']:.1f} s, {r['preemptions']} preemptions)", flush=True)
    base = results[names[0]]
    for name in names[1:]:
        r = results[name]
        r["ratios"] = {"pages": r["num_pages"] / base["num_pages"],
                       "max_running": r["max_running"] / base["max_running"],
                       "output_tok_per_s": r["output_tok_per_s"] / base["output_tok_per_s"]}
        print(f"{name} / {names[0]}: {r['ratios']['pages']:.2f}x pages (tokens), "
              f"{r['ratios']['max_running']:.2f}x max running, {r['ratios']['output_tok_per_s']:.2f}x output tok/s",
              flush=True)
    return results


# ---------------------------------------------------------------------------------------- latent attention
def mla_models(sizes: str, seed: int = 0) -> dict:
    """{"mla": Model, "gqa": Model}: random weights (float32) at --mla-sizes `sizes`."""
    from models import random_init

    if sizes not in ("attention", "tiny"):
        raise ValueError(f"--mla-sizes must be 'attention' or 'tiny', got {sizes!r}")
    models = {}
    for name, preset in MLA_PRESETS.items():
        cfg = tiny = random_init.preset(preset, tiny=True)
        if sizes == "attention":
            cfg = dataclasses.replace(random_init.preset(preset), **{f: getattr(tiny, f) for f in SHRUNK_FIELDS})
        params = random_init.random_params(cfg, "float32", seed=seed)
        models[name] = paxpage.Model(cfg, params, None, source=f"random:{preset}")
    return models


def pool_bytes_per_token_layer(engine) -> float:
    """Bytes one token takes in one layer's pool, from the pool's arrays as allocated."""
    cfg = engine.config
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(engine.runner.kv_cache))
    return total / (engine.model_cfg.num_layers * cfg.num_pages * cfg.page_size)


def compare_mla(models: dict, work: wl.Workload, args) -> dict:
    """The workload on each model at one byte budget; prints one line each, then the ratios."""
    results = {}
    for name, model in models.items():
        cfg = paxpage.EngineConfig(page_size=args.page_size, kv_cache_bytes=args.kv_cache_bytes,
                                   max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                                   max_num_batched_tokens=args.max_num_batched_tokens, dtype="float32")
        if not args.no_warmup:
            run_scheme(model, work.with_fresh_prompts(model.config.vocab_size, args.seed + 7919), cfg)
        r = results[name] = run_scheme(model, work, cfg)
        r.pop("_snapshot")
        r.pop("series")
        m = model.config
        halves, heads, width = m.kv_pool_dims
        r.update(model=MLA_PRESETS[name], num_layers=m.num_layers, hidden_size=m.hidden_size,
                 values_per_token_layer=halves * heads * width,
                 bytes_per_token_layer=pool_bytes_per_token_layer(model.engine(cfg)))
        form = (f"latent {m.kv_lora_rank} + rope {m.qk_rope_head_dim}" if m.is_mla
                else f"2 x {m.num_kv_heads} kv heads x {m.head_dim}")
        print(f"{name:>4} ({MLA_PRESETS[name]}, {form}): {r['bytes_per_token_layer']:g} B per token and layer, "
              f"{r['num_pages']:5d} pages of {r['page_bytes']} B, max {r['max_running']:3d} running "
              f"(mean {r['mean_running']:.1f}), {r['output_tok_per_s']:.1f} output tok/s "
              f"({r['wall_s']:.1f} s, {r['preemptions']} preemptions)", flush=True)
    mla, gqa = results["mla"], results["gqa"]
    mla["ratios"] = {"bytes_per_token_layer": mla["bytes_per_token_layer"] / gqa["bytes_per_token_layer"],
                     "pages": mla["num_pages"] / gqa["num_pages"],
                     "max_running": mla["max_running"] / gqa["max_running"],
                     "output_tok_per_s": mla["output_tok_per_s"] / gqa["output_tok_per_s"]}
    q = mla["ratios"]
    print(f"mla / gqa: {q['bytes_per_token_layer']:.3f}x bytes per token, {q['pages']:.2f}x pages (tokens), "
          f"{q['max_running']:.2f}x max running, {q['output_tok_per_s']:.2f}x output tok/s", flush=True)
    return results


def mla_tables(data: dict) -> dict:
    """--mla's table: one row per attention form at one byte budget."""
    rows = [[f"{name} ({r['model']})", r["values_per_token_layer"], round(r["bytes_per_token_layer"], 1),
             r["num_pages"], r["max_running"], round(r["mean_running"], 1)]
            for name, r in ((name, data["mla"][name]) for name in MLA_PRESETS)]
    caption = (f"random weights, {data['mla_sizes']} sizes, hidden {data['mla']['mla']['hidden_size']}, "
               f"{data['mla']['mla']['num_layers']} layers each, float32; {data['workload']['num_requests']} "
               f"requests on one KV budget of {data['kv_cache_bytes'] / 2**20:.1f} MiB, {data['page_size']}-token pages")
    return {"mla": {"caption": caption, "columns": ["attention", "values per token and layer",
                                                   "bytes per token and layer", "pages", "max sequences running",
                                                   "mean running"], "rows": rows}}


def main_mla(args, parser) -> int:
    if args.num_pages is not None:
        parser.error("--mla compares at one byte budget: give --kv-cache-bytes, not --num-pages")
    models = mla_models(args.mla_sizes, args.seed)
    work = wl.workload_from_args(args, models["gqa"].config.vocab_size)
    if args.kv_cache_bytes is None:  # what --contiguous-seqs full sequences take in the GQA model's pool
        gqa = paxpage.EngineConfig(page_size=args.page_size, dtype="float32", num_pages=1).resolve(models["gqa"].config)
        args.kv_cache_bytes = args.contiguous_seqs * -(-args.max_model_len // args.page_size) * gqa.page_bytes
    results = compare_mla(models, work, args)
    if args.json:
        data = {"backend": jax.default_backend(), "workload": work.summary(), "page_size": args.page_size,
                "kv_cache_bytes": args.kv_cache_bytes, "mla_sizes": args.mla_sizes, "mla": results}
        wl.write_json(args.json, data, tables=mla_tables(data))
    return 0


# ---------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    defaults = wl.backend_defaults()
    on_cpu = jax.default_backend() == "cpu"
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    wl.add_workload_args(parser, defaults)
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens of a system prompt every request starts with (shared pages)")
    parser.add_argument("--max-model-len", type=int, default=1024,
                        help="what the contiguous scheme reserves per sequence")
    # The only waste of paged allocation is each sequence's unfilled last page, about
    # page_size / 2 tokens: small next to the ~100-token sequences of the CPU-sized workload
    # only with 8-token pages (16: 93%, 8: 97% measured); accelerator workloads are longer.
    parser.add_argument("--page-size", type=int, default=8 if on_cpu else 16)
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--kv-cache-bytes", type=int, default=None)
    budget.add_argument("--num-pages", type=int, default=None)
    parser.add_argument("--contiguous-seqs", type=int, default=4 if on_cpu else 32,
                        help="default budget: room for this many max_model_len reservations")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--kv-dtypes", default=None, metavar="LIST",
                        help=f"compare KV cache dtypes ({','.join(KV_DTYPES)}) at one --kv-cache-bytes "
                             "(default: 4 sequences of max_model_len in float32) instead of the schemes")
    parser.add_argument("--mla", action="store_true",
                        help="compare DeepSeek-V2-Lite's latent attention with Llama-3.2-1B's grouped-query "
                             "attention (random weights) at one --kv-cache-bytes instead of the schemes")
    parser.add_argument("--mla-sizes", choices=("attention", "tiny"), default="attention",
                        help="--mla: 'attention' keeps the released attention widths and shrinks the rest; "
                             "'tiny' takes the presets' tiny forms")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip the warm-up passes (throughput then includes compiles)")
    parser.add_argument("--out-dir", default=".", help="where the PNGs go")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.mla:
        if args.kv_dtypes or args.model:
            parser.error("--mla runs its own two random-weight models at float32: drop --kv-dtypes / --model")
        return main_mla(args, parser)

    model = paxpage.load(args.model)
    work = wl.workload_from_args(args, model.config.vocab_size, shared_prefix=args.shared_prefix)
    if args.kv_dtypes:
        if args.num_pages is not None:
            parser.error("--kv-dtypes compares at one byte budget: give --kv-cache-bytes, not --num-pages")
        if args.kv_cache_bytes is None:  # what --contiguous-seqs full float32 sequences take
            f32 = paxpage.EngineConfig(page_size=args.page_size, dtype="float32", num_pages=1).resolve(model.config)
            args.kv_cache_bytes = args.contiguous_seqs * -(-args.max_model_len // args.page_size) * f32.page_bytes
        results = compare_kv_dtypes(model, work, args)
        if args.json:
            data = {"backend": jax.default_backend(), "model": args.model or "SmolLM2-135M-Instruct",
                    "workload": work.summary(), "page_size": args.page_size, "kv_cache_bytes": args.kv_cache_bytes,
                    "kv_dtypes": results}
            wl.write_json(args.json, data, tables=kv_dtype_tables(data))
        return 0
    num_pages = args.num_pages
    if num_pages is None and args.kv_cache_bytes is None:
        num_pages = args.contiguous_seqs * -(-args.max_model_len // args.page_size)
    results = {}
    for name in SCHEMES:
        cfg = paxpage.EngineConfig(page_size=args.page_size, num_pages=num_pages,
                                   kv_cache_bytes=args.kv_cache_bytes, max_model_len=args.max_model_len,
                                   max_num_seqs=args.max_num_seqs,
                                   max_num_batched_tokens=args.max_num_batched_tokens,
                                   kv_allocation=name)
        if not args.no_warmup:
            run_scheme(model, work.with_fresh_prompts(model.config.vocab_size, args.seed + 7919), cfg)
        results[name] = run_scheme(model, work, cfg)
        r = results[name]
        print(f"{name:>10}: max {r['max_running']:3d} running (mean {r['mean_running']:.1f}), "
              f"KV utilisation {r['mean_kv_utilisation']:.1%}, pool occupancy {r['mean_pool_occupancy']:.0%}, "
              f"{r['output_tok_per_s']:.1f} output tok/s ({r['wall_s']:.1f} s, {r['preemptions']} preemptions)",
              flush=True)
    pool_bytes = results["paged"]["num_pages"] * results["paged"]["page_bytes"]
    summary = work.summary()
    title = (f"{summary['num_requests']} requests, KV pool {results['paged']['num_pages']} pages x "
             f"{args.page_size} tokens ({pool_bytes / 2**20:.1f} MiB), max_model_len {args.max_model_len}")
    os.makedirs(args.out_dir, exist_ok=True)
    plots = {"utilisation": os.path.join(args.out_dir, "kv_utilisation.png"),
             "page_map": os.path.join(args.out_dir, "page_map.png")}
    plot_utilisation(results, plots["utilisation"], "KV cache utilisation: paged vs contiguous\n" + title)
    plot_page_map(results, args.page_size, plots["page_map"], "KV page pool at the step with the most live tokens\n"
                  + title)
    speedup = results["paged"]["output_tok_per_s"] / results["contiguous"]["output_tok_per_s"]
    print(f"paged / contiguous: {results['paged']['max_running'] / results['contiguous']['max_running']:.1f}x "
          f"sequences, {speedup:.2f}x output tok/s; plots in {args.out_dir}", flush=True)
    if args.json:
        for r in results.values():
            r.pop("_snapshot")
        data = {"backend": jax.default_backend(), "model": args.model or "SmolLM2-135M-Instruct",
                "workload": summary, "shared_prefix": args.shared_prefix, "max_model_len": args.max_model_len,
                "page_size": args.page_size, "pool_bytes": pool_bytes, **results,
                "paged_utilisation": results["paged"]["mean_kv_utilisation"],
                "contiguous_utilisation": results["contiguous"]["mean_kv_utilisation"],
                "throughput_ratio": speedup, "plots": plots}
        wl.write_json(args.json, data, tables=doc_tables(data))
    return 0


def doc_tables(data: dict) -> dict:
    """The docs' table (docs/benchmarks.md): one row per allocation scheme (per attention form for
    an --mla record)."""
    if "mla" in data:
        return mla_tables(data)
    rows = [[name, data[name]["max_running"], round(data[name]["mean_running"], 1),
             f"{data[name]['mean_kv_utilisation']:.1%}", round(data[name]["output_tok_per_s"], 1)] for name in SCHEMES]
    paged = data["paged"]
    caption = (f"{data['model']}, {data['workload']['num_requests']} requests on one "
               f"{data['pool_bytes'] / 2**20:.0f} MiB KV pool ({paged['num_pages']} pages of {data['page_size']} "
               f"tokens); contiguous reserves max_model_len = {data['max_model_len']} tokens per admitted sequence")
    return {"memory": {"caption": caption, "columns": ["scheme", "max sequences running", "mean running", "KV utilisation",
                                   "output tok/s"], "rows": rows}}


def kv_dtype_tables(data: dict) -> dict:
    """--kv-dtypes' table: one row per KV cache dtype at one byte budget."""
    rows = [[name, r["num_pages"], r["page_bytes"], r["max_running"], round(r["mean_running"], 1),
             round(r["output_tok_per_s"], 1)] for name, r in data["kv_dtypes"].items()]
    caption = (f"{data['model']}, {data['workload']['num_requests']} requests on one KV budget of "
               f"{data['kv_cache_bytes'] / 2**20:.1f} MiB, {data['page_size']}-token pages")
    return {"kv_dtypes": {"caption": caption, "columns": ["KV dtype", "pages", "page bytes", "max sequences running",
                                                         "mean running", "output tok/s"], "rows": rows}}


if __name__ == "__main__":
    from paxpage.process_tuning import tune_malloc

    tune_malloc()  # glibc keeps large freed buffers for reuse (paxpage/process_tuning.py)
    sys.exit(main())
