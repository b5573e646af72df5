"""The sampler alone on a decode-sized batch: ms per call for each sampling mode, side by side.

Cases (every row alike): greedy, temperature 0.7, temperature 0.7 + top_p 0.9, top_k 50
(temperature 1), min_p 0.1 (temperature 1), and repetition penalty 1.1; each timed with
`token_width` = --max-model-len as the engine builds the tensors. Two kinds of logits:
  flat    N(0, 0.16^2): what a tiny random model gives (top-p 0.9 keeps ~85% of the vocabulary)
  peaked  N(0, 1) plus a few strong tokens per row, a trained model's shape (top-p 0.9 keeps a
          handful to a few hundred tokens)
--baseline PATH times another checkout's sampler (a directory: its paxpage/sampling/sampler.py with its
own draw.py and noise.py beside it, or the flat layout's paxpage/sampler.py; or a sampler.py alone) in
the same process, interleaved with this one, so before / after share the machine's load. --draw-impl both (the default) times this
sampler's proposal draw in XLA ops and as the native CPU kernel side by side.

Usage:
    git worktree add /tmp/sampler_main main     # or: git archive main | tar -x -C DIR
    python scripts/bench_sampler.py --baseline /tmp/sampler_main --iters 7
    python scripts/bench_sampler.py --rows 64 --iters 5
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from paxpage.sampling import sampler as sampler_lib  # noqa: E402
from paxpage.sampling.tensors import RowInfo  # noqa: E402
from paxpage.sampling.params import SamplingParams  # noqa: E402

CASES = {
    "greedy": SamplingParams(temperature=0),
    "temp0.7": SamplingParams(temperature=0.7),
    "temp0.7+top_p0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "top_k50": SamplingParams(top_k=50),
    "min_p0.1": SamplingParams(min_p=0.1),
    "rep1.1": SamplingParams(temperature=0.7, repetition_penalty=1.1),
}


# Where a checkout keeps the sampler and the modules it imports, (module name, file) in import
# order: the sampling package (with its tensors module where it has one), or the flat layout
# (paxpage/sampler.py beside paxpage/sampling_draw.py).
# A flat-layout sampler imports this tree's modules under their flat names, bar those its checkout has.
_LAYOUTS = (
    (("paxpage.sampling.noise", "paxpage/sampling/noise.py"), ("paxpage.sampling.draw", "paxpage/sampling/draw.py"),
     ("paxpage.sampling.tensors", "paxpage/sampling/tensors.py"), (None, "paxpage/sampling/sampler.py")),
    (("paxpage.sampling_noise", "paxpage/sampling_noise.py"), ("paxpage.sampling_draw", "paxpage/sampling_draw.py"),
     (None, "paxpage/sampler.py")),
)
_FLAT_NAMES = {"paxpage.sampling_params": "paxpage.sampling.params",
               "paxpage.penalty_counts": "paxpage.sampling.penalty_counts",
               "paxpage.sampling_draw": "paxpage.sampling.draw", "paxpage.sampling_noise": "paxpage.sampling.noise"}


def _load(path: str):
    """Another tree's sampler, for --baseline: PATH is a sampler.py, or a checkout (a directory
    holding paxpage/sampling/sampler.py, or paxpage/sampler.py in the flat layout), whose own draw and
    noise modules the sampler then imports."""
    tag = abs(hash(path))
    if os.path.isdir(path):
        layout = next((layout for layout in _LAYOUTS if os.path.isfile(os.path.join(path, layout[-1][1]))), None)
        if layout is None:
            raise SystemExit(f"--baseline {path}: no {' or '.join(files[-1][1] for files in _LAYOUTS)} there")
        files = [(name, os.path.join(path, rel)) for name, rel in layout]
    else:
        files = [(None, path)]
    aliases = {old: importlib.import_module(new) for old, new in _FLAT_NAMES.items()}
    saved = {name: sys.modules.get(name) for name in {*aliases, *(name for name, _ in files if name is not None)}}
    try:
        sys.modules.update(aliases)
        for name, file in files:
            if not os.path.isfile(file):  # a tree without a noise module: its draw holds the noise
                continue
            module = _module(f"baseline_{os.path.basename(file)[:-3]}_{tag}", file)
            if name is None:
                return module
            sys.modules[name] = module  # what the next file imports
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _logits(kind: str, rows: int, vocab: int) -> jax.Array:
    rng = np.random.default_rng(0)
    if kind == "flat":
        x = rng.normal(size=(rows, vocab)).astype(np.float32) * 0.16
    else:
        x = rng.normal(size=(rows, vocab)).astype(np.float32)
        strong = rng.integers(0, vocab, size=(rows, 8))
        x[np.arange(rows)[:, None], strong] += rng.uniform(4, 12, size=(rows, 8)).astype(np.float32)
    return jnp.asarray(x)


def doc_tables(data: dict) -> dict:
    """The table it prints, as rows a docs page may show: ms per call per case and sampler."""
    labels = data["samplers"]
    rows = [[r["logits"], r["case"], *(round(r[label][k], 1) for label in labels for k in ("device_ms", "host_ms"))]
            for r in data["rows"]]
    return {"sampler": {"caption": f"{data['rows_per_call']} rows x {data['vocab']} vocabulary, context {data['context']}; "
                                   f"median of {data['iters']}; device: sample(), host: SamplingTensors.build",
                        "columns": ["logits", "case", *(f"{label} {k}" for label in labels
                                                        for k in ("device ms", "host ms"))], "rows": rows}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--context", type=int, default=1536, help="prompt + output tokens per row")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--logits", choices=["flat", "peaked", "both"], default="both")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--baseline", help="another checkout (directory) or sampler.py to time alongside")
    ap.add_argument("--draw-impl", choices=["xla", "native", "both"], default="both",
                    help="this sampler's proposal draw: XLA ops, the native CPU kernel, or both side by side "
                         "(native: when it builds here)")
    ap.add_argument("--json", metavar="PATH", help="write the figures here")
    args = ap.parse_args(argv)

    impls = ["xla", "native"] if args.draw_impl == "both" else [args.draw_impl]
    if "native" in impls and sampler_lib.resolve_draw_impl(jax.default_backend() == "cpu") != "native":
        print("the native proposal draw is unavailable here: XLA only", flush=True)
        impls = ["xla"]
    modules = {("this" if len(impls) == 1 else impl): (sampler_lib, impl) for impl in impls}
    if args.baseline:
        modules["baseline"] = (_load(args.baseline), None)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, args.vocab, size=args.context // 2).tolist()
    output = rng.integers(0, args.vocab, size=args.context - len(prompt)).tolist()
    names = args.cases.split(",")
    kinds = ["flat", "peaked"] if args.logits == "both" else [args.logits]
    data = {"rows_per_call": args.rows, "vocab": args.vocab, "context": args.context, "iters": args.iters,
            "samplers": list(modules), "rows": []}
    print(f"{args.rows} rows x {args.vocab} vocab, context {args.context}, "
          f"token_width {args.max_model_len}; median ms of {args.iters}", flush=True)
    for kind in kinds:
        logits = _logits(kind, args.rows, args.vocab)
        fns = {}
        for label, (module, impl) in modules.items():
            for name in names:
                rows = [RowInfo(CASES[name], prompt, output, r) for r in range(args.rows)]
                options = {} if impl is None else {"draw_impl": impl}

                def call(module=module, rows=rows, options=options):
                    t0 = time.perf_counter()
                    t = module.SamplingTensors.build(rows, args.vocab, eos_token_ids=(0,),
                                                     token_width=args.max_model_len)
                    t = jax.block_until_ready(t)
                    t1 = time.perf_counter()
                    jax.block_until_ready(module.sample(logits, t, **options))
                    return t1 - t0, time.perf_counter() - t1
                fns[(label, name)] = call
        for fn in fns.values():  # compile
            fn()
        times = {key: [] for key in fns}
        for _ in range(args.iters):
            for key, fn in fns.items():
                times[key].append(fn())
        print(f"\nlogits {kind}: device ms (sample) / host ms (SamplingTensors.build)")
        print(f"{'case':<20}" + "".join(f"{label + ' dev':>14}{label + ' host':>14}" for label in modules))
        for name in names:
            cells = []
            row = {"logits": kind, "case": name}
            for label in modules:
                build, dev = np.median(np.array(times[(label, name)]), axis=0)
                cells.append(f"{1e3 * dev:>14.1f}{1e3 * build:>14.1f}")
                row[label] = {"device_ms": 1e3 * float(dev), "host_ms": 1e3 * float(build)}
            data["rows"].append(row)
            print(f"{name:<20}" + "".join(cells), flush=True)
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from provenance import write_record  # the figures with machine, versions, date, command, commit

        write_record(args.json, data, doc_tables(data),
                     measures=("paxpage/sampling/sampler.py", "paxpage/sampling/draw.py", "paxpage/sampling/batch.py"))


if __name__ == "__main__":
    from paxpage.process_tuning import tune_malloc

    tune_malloc()  # glibc keeps large freed buffers for reuse (paxpage/process_tuning.py)
    main()
