"""KV memory under a sliding window: pages outside every layer's window are released.

The same long-generation workload runs on one KV pool twice, with the same weights:
  full     the model as loaded: every layer attends to the whole context, so a sequence holds
           cdiv(length, page_size) pages
  window   the same weights with `sliding_window` W in every layer (as Mistral does): after each
           step a sequence's pages wholly before the window of its next token are released, so
           it holds at most cdiv(W - 1 + chunk, page_size) + 1 pages however long it grows
(The window changes what the model computes; only the memory behaviour is compared here. The
window's exactness against HF transformers is tested in tests/models/test_sliding_window_vs_hf.py.)
It reports the most pages one sequence held, the most sequences running at once, mean pool
occupancy, preemptions and throughput, and plots the page pool of each at its fullest step
(page_map_window.png; released pages show as free) and pages held over time (window_pages.png).

Usage:
    python scripts/bench_window.py --json /tmp/window.json --out-dir /tmp/window
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_memory  # noqa: E402
import paxpage  # noqa: E402
import workload as wl  # noqa: E402

VARIANTS = ("full", "window")


def windowed(model: paxpage.Model, window: int) -> paxpage.Model:
    """The same weights with a sliding window of `window` keys in every layer."""
    cfg = dataclasses.replace(model.config, sliding_window=window, layer_types=())
    return paxpage.Model(cfg, model.params, model.tokenizer, model.source)


def plot_pages(results: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for name, color in zip(VARIANTS, ("tab:orange", "tab:blue")):
        s = results[name]["series"]
        ax1.plot(s["time_s"], s["used_pages"], color=color, drawstyle="steps-post", label=name)
        ax2.plot(s["time_s"], s["max_pages_per_seq"], color=color, drawstyle="steps-post", label=name)
    ax1.axhline(results["full"]["num_pages"], color="grey", linestyle=":", label="pool")
    ax1.set_ylabel("pages held (all sequences)")
    ax1.legend(loc="lower right")
    ax1.grid(alpha=0.3)
    ax2.set_ylabel("most pages held\nby one sequence")
    ax2.set_xlabel("time since start of the pass (s)")
    ax2.legend(loc="upper right")
    ax2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model source (default SmolLM2-135M-Instruct)")
    parser.add_argument("--sliding-window", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=224)
    parser.add_argument("--page-size", type=int, default=8)
    parser.add_argument("--num-pages", type=int, default=None,
                        help="pool size (default: two full-length sequences' worth)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=".", help="where the PNGs go")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    model = paxpage.load(args.model)
    total = args.prompt_len + args.output_len
    num_pages = args.num_pages or 2 * -(-total // args.page_size)
    lengths = [(args.prompt_len, args.output_len)] * args.num_requests
    work = wl.make_workload(lengths, model.config.vocab_size, args.seed)
    models = {"full": model, "window": windowed(model, args.sliding_window)}
    cfg = paxpage.EngineConfig(page_size=args.page_size, num_pages=num_pages, max_model_len=total,
                               max_num_seqs=args.num_requests,
                               max_num_batched_tokens=args.max_num_batched_tokens,
                               prefill_row_len=min(64, args.max_num_batched_tokens))
    results = {}
    for name in VARIANTS:
        bench_memory.run_scheme(models[name], work.with_fresh_prompts(model.config.vocab_size, args.seed + 1), cfg)
        results[name] = r = bench_memory.run_scheme(models[name], work, cfg)
        print(f"{name:>7}: at most {r['max_pages_per_seq']} pages per sequence, {r['max_running']} running "
              f"(mean {r['mean_running']:.1f}), pool occupancy {r['mean_pool_occupancy']:.0%}, "
              f"{r['preemptions']} preemptions, {r['output_tok_per_s']:.1f} output tok/s", flush=True)
    title = (f"{args.num_requests} requests of {args.prompt_len} + {args.output_len} tokens, pool {num_pages} pages "
             f"x {args.page_size} tokens, window {args.sliding_window}")
    os.makedirs(args.out_dir, exist_ok=True)
    plots = {"page_map": os.path.join(args.out_dir, "page_map_window.png"),
             "pages": os.path.join(args.out_dir, "window_pages.png")}
    bench_memory.plot_page_map(results, args.page_size, plots["page_map"],
                               "KV page pool at the step with the most live tokens\n" + title, names=VARIANTS)
    plot_pages(results, plots["pages"], "Pages held: full attention vs sliding window\n" + title)
    ratio = results["full"]["max_pages_per_seq"] / results["window"]["max_pages_per_seq"]
    print(f"full / window: {ratio:.1f}x pages per sequence, "
          f"{results['window']['mean_running'] / results['full']['mean_running']:.1f}x mean sequences running; "
          f"plots in {args.out_dir}", flush=True)
    if args.json:
        for r in results.values():
            r.pop("_snapshot")
        data = {"backend": jax.default_backend(), "model": args.model or "SmolLM2-135M-Instruct",
                "sliding_window": args.sliding_window, "page_size": args.page_size, "num_pages": num_pages,
                "max_num_batched_tokens": args.max_num_batched_tokens, "num_requests": args.num_requests, "lengths": lengths[0], **results,
                "pages_per_seq_ratio": ratio, "plots": plots}
        wl.write_json(args.json, data, tables=doc_tables(data))
    return 0


def doc_tables(data: dict) -> dict:
    """The docs' table (docs/benchmarks.md): one row per variant."""
    labels = {"full": "full", "window": f"window of {data['sliding_window']} in every layer"}
    rows = [[labels[name], r["max_pages_per_seq"], round(r["mean_running"], 1), r["preemptions"],
             f"{r['mean_pool_occupancy']:.0%}", round(r["output_tok_per_s"], 1)]
            for name, r in ((name, data[name]) for name in VARIANTS)]
    prompt, output = data["lengths"]
    caption = (f"{data['model']} weights, {data['num_requests']} requests of {prompt} + {output} tokens, "
               f"{data['num_pages']} pages of {data['page_size']} tokens, "
               f"--max-num-batched-tokens {data['max_num_batched_tokens']}")
    return {"window": {"caption": caption,
                       "columns": ["attention", "pages held per sequence (max)", "mean sequences running",
                                   "preemptions", "mean pool occupancy", "output tok/s"], "rows": rows}}


if __name__ == "__main__":
    from paxpage.process_tuning import tune_malloc

    tune_malloc()  # glibc keeps large freed buffers for reuse (paxpage/process_tuning.py)
    sys.exit(main())
