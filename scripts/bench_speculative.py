"""Speculative decoding: output tokens/s with and without it, side by side in one process.

    python scripts/bench_speculative.py --json /tmp/spec.json
    python scripts/bench_speculative.py --quick            # a smaller run (smoke test, CI)
    python scripts/bench_speculative.py --sweep 1 2 4 8    # where speculation stops paying

Two workloads, each at batch 1 (max_num_seqs 1: requests run one after another, the
latency-bound case speculation is for) and at saturation (every request queued at once,
max_num_seqs --saturation):
  grounded  chat prompts that ask the model to repeat, edit or summarise a passage given in
            the prompt (the input-grounded case n-gram proposals are made for); greedy, each
            answer ends at the model's end of turn or --max-tokens
  random    random-token prompts, greedy, EOS ignored, exactly --max-tokens tokens each
Each configuration runs its workload once to compile (prefix caching off, so the measured pass
recomputes everything) and once measured. Reported: output tokens/s, the ratio against no
speculation in the same run, acceptance rate (accepted / proposed drafts) and mean accepted
length (tokens a speculating sequence emits per verify step, the target's own token included).
Speculation runs with its default adaptive threshold (`speculative_max_batch="auto"`), so at
saturation it switches itself off. --sweep forces it on at each given batch size (grounded
workload) to show where verification starts to cost more than it saves: that is how the
default threshold was chosen. Greedy outputs are checked identical to no speculation.

`--methods draft` drafts with the target truncated to its first --draft-layers layers
(`Model.truncated`, no download). Its K/V pool is filled on every step, speculating or not, so
at saturation (speculation off) it still costs one draft forward per step. On SmolLM2-135M a
truncated copy is a poor draft (its early layers are not aligned with the LM head: the first
24 of 30 layers pick the full model's greedy token ~12% of the time), so expect acceptance
near 0 there.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workload as wl  # noqa: E402

import paxpage  # noqa: E402
from paxpage import EngineConfig, SamplingParams  # noqa: E402

PASSAGES = [
    "The river town of Elmsford was built on trade. Barges carried grain downstream to the coast, "
    "and merchants returned with salt, cloth and news from the capital. In spring the river rose "
    "and flooded the lower streets, so the oldest houses stand on stone pillars, and their doors "
    "open onto wooden walkways that are rebuilt every few years.",
    "To repot a houseplant, water it the day before, then tip the pot and slide the plant out "
    "while supporting the base of the stems. Loosen the outer roots with your fingers, trim any "
    "that are black or soft, and set the plant in a pot one size larger with fresh soil around "
    "it. Press the soil down gently and water until it drains from the bottom.",
    "Our team meeting moved from Tuesday to Thursday at ten in the morning. Please bring the "
    "quarterly figures, the draft of the customer survey and your notes on the new office "
    "layout. Maria will present the budget, and Tom will report on the hiring plan for the "
    "second half of the year.",
    "A lighthouse keeper's day began before sunset, when the lamp was lit and the clockwork "
    "that turned the lens was wound. Through the night the keeper trimmed the wick, polished "
    "soot from the glass and wrote the weather in the log every four hours. At dawn the lamp "
    "was put out and the curtains drawn so the sun could not scorch the lens.",
]
TASKS = [
    "Repeat the following passage exactly, word for word:\n\n{}",
    "Rewrite the following passage, changing every past tense verb to present tense and "
    "keeping everything else the same:\n\n{}",
    "Copy the following passage, but replace each sentence's first word with its uppercase "
    "version:\n\n{}",
    "Summarise the following passage in two sentences, reusing its wording:\n\n{}",
]


def grounded_prompts(num: int) -> list[list[dict]]:
    return [[{"role": "user", "content": TASKS[i % len(TASKS)].format(PASSAGES[(i // len(TASKS) + i) % len(PASSAGES)])}]
            for i in range(num)]


def _run(model, prompts, params, config: EngineConfig) -> dict:
    """Compiles with one pass, then measures one; returns tok/s and the engine's spec figures."""
    t = time.perf_counter()
    paxpage.generate(model, prompts, sampling_params=params, engine_config=config, use_tqdm=False)
    print(f"  (compile pass: {time.perf_counter() - t:.0f} s)", flush=True)
    engine = model.engine(config)
    before = dict(vars(engine.stats))
    start = time.perf_counter()
    outs = paxpage.generate(model, prompts, sampling_params=params, engine_config=config, use_tqdm=False)
    wall = time.perf_counter() - start
    stats = {k: getattr(engine.stats, k) - before[k]
             for k in ("spec_steps", "spec_rows", "draft_tokens", "accepted_tokens", "steps")}
    tokens = [o.outputs[0].token_ids for o in outs]
    n = sum(map(len, tokens))
    return dict(tok_s=n / wall, output_tokens=n, seconds=wall, tokens=tokens, **stats,
                acceptance_rate=stats["accepted_tokens"] / max(1, stats["draft_tokens"]),
                mean_accepted_length=(stats["accepted_tokens"] + stats["spec_rows"]) / max(1, stats["spec_rows"]))


def compare(model, name, prompts, params, batch, methods, args, **spec_overrides) -> list[dict]:
    rows = []
    base = None
    for method in methods:
        extra = dict(speculative_method=method, num_speculative_tokens=args.k, **spec_overrides) if method else {}
        if method == "draft":
            extra["draft_model"] = args.draft_model
        config = EngineConfig(max_num_seqs=batch, enable_prefix_caching=False, kv_cache_bytes=args.kv_cache_bytes,
                              **extra)
        r = _run(model, prompts, params, config)
        tokens = r.pop("tokens")
        if base is None:
            base, base_tokens = r, tokens
        r.update(workload=name, batch=batch, method=method or "none", ratio=r["tok_s"] / base["tok_s"],
                 identical=tokens == base_tokens)
        rows.append(r)
        print(f"{name:9s} batch {batch:3d} {r['method']:6s} {r['tok_s']:8.1f} tok/s  x{r['ratio']:.2f}  "
              f"accept {r['acceptance_rate']:.0%}  mean accepted length {r['mean_accepted_length']:.2f}  "
              f"identical {r['identical']}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=8, help="requests per workload at batch 1")
    parser.add_argument("--saturation", type=int, default=32, help="max_num_seqs at saturation")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--random-prompt-len", type=int, default=64)
    parser.add_argument("-k", type=int, default=8, help="num_speculative_tokens")
    parser.add_argument("--methods", nargs="+", default=["ngram"], help="ngram and / or draft")
    parser.add_argument("--kv-cache-bytes", type=int, default=None,
                        help="KV pool per engine (default: the engine's; on CPU a 1 GiB pool makes every step "
                             "~10x slower than a 64 MiB one on a loaded machine)")
    parser.add_argument("--draft-layers", type=int, default=8,
                        help="--methods draft: the draft is the target's first N layers")
    parser.add_argument("--sweep", type=int, nargs="*", default=None,
                        help="batch sizes at which to force speculation on (grounded workload)")
    parser.add_argument("--quick", action="store_true", help="2 requests, 16 tokens, saturation 8")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.max_tokens, args.saturation, args.random_prompt_len = 2, 16, 8, 16
    model = paxpage.load(args.model)
    methods = [None] + args.methods
    # one Model object for every draft engine (an EngineConfig is keyed by it)
    args.draft_model = model.truncated(min(args.draft_layers, model.config.num_layers)) if "draft" in methods else None
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    fixed = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    vocab = model.config.vocab_size
    chat = model.tokenizer is not None and getattr(model.tokenizer, "chat_template", None)

    def grounded(num):
        if not chat:  # a model without a chat template (tests' tiny models): a repetitive prompt
            return [(wl.make_workload([(12, 1)], vocab, args.seed + i).prompts[0]) * 4 for i in range(num)]
        return grounded_prompts(num)

    def random_tokens(num):
        return wl.make_workload([(args.random_prompt_len, args.max_tokens)] * num, vocab, args.seed).prompts

    rows = []
    print(f"{model.source or 'default model'}: k = {args.k}, max_tokens {args.max_tokens}", flush=True)
    if args.sweep:
        for batch in args.sweep:
            rows += compare(model, "grounded", grounded(2 * batch), greedy, batch, methods, args,
                            speculative_max_batch=batch)
    else:
        for name, make, params in (("grounded", grounded, greedy), ("random", random_tokens, fixed)):
            rows += compare(model, name, make(args.num_requests), params, 1, methods, args)
            rows += compare(model, name, make(2 * args.saturation), params, args.saturation, methods, args)
    print("\n| workload | batch | method | tok/s | vs none | acceptance | mean accepted length |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['batch']} | {r['method']} | {r['tok_s']:.1f} | {r['ratio']:.2f}x | "
              f"{r['acceptance_rate']:.0%} | {r['mean_accepted_length']:.2f} |")
    if args.json:
        wl.write_json(args.json, dict(k=args.k, max_tokens=args.max_tokens, rows=rows), tables=doc_tables(rows))
    return 0 if all(r["identical"] for r in rows) else 1


def doc_tables(rows: list[dict]) -> dict:
    """The docs' table (docs/speculative-decoding.md), as the script prints it."""
    out = [[r["workload"], r["batch"], r["method"], round(r["tok_s"], 1), f"{r['ratio']:.2f}x",
            f"{r['acceptance_rate']:.0%}", round(r["mean_accepted_length"], 2)] for r in rows]
    return {"speculative": {"columns": ["workload", "batch", "method", "tok/s", "vs none", "acceptance",
                                        "mean accepted length"], "rows": out}}


if __name__ == "__main__":
    from paxpage.process_tuning import tune_malloc

    tune_malloc()  # glibc keeps large freed buffers for reuse (paxpage/process_tuning.py)
    from paxpage import xla_cache

    xla_cache.enable()  # every engine here compiles the same steps: later ones load them
    sys.exit(main())
