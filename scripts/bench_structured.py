"""Structured outputs' cost: output tok/s of one batch of requests with no constraint, with a
quarter of them constrained, and with all of them constrained (a JSON schema), plus the host
time spent filling bitmasks.

Every request decodes exactly --output-len tokens (ignore_eos; the schema, an array of at least
1000 objects, cannot complete sooner), so the runs do the same device work and differ only by
the constraint. Each mode runs once to compile, then --repeats times interleaved; the median is
reported. --baseline ROOT also times the unconstrained mode on another checkout (e.g. the main
one, "today") in a second process, right after this checkout's.

Usage:
    python scripts/bench_structured.py [--num-requests 64 --output-len 64 --repeats 3] \
        [--baseline OTHER_CHECKOUT] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCHEMA = {  # never complete within the budget: every row keeps its constraint to the end
    "type": "array", "minItems": 1000,
    "items": {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120},
                             "role": {"enum": ["engineer", "artist", "doctor"]}},
              "required": ["name", "age", "role"], "additionalProperties": False},
}
PROMPT = [{"role": "user", "content": "List many people as JSON objects with name, age and role."}]


def _params(mode: str, n: int, output_len: int):
    from paxpage import SamplingParams

    plain = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)
    constrained = plain.replace(structured_outputs={"json_schema": SCHEMA}) if mode != "none" else plain
    every = {"none": n + 1, "quarter": 4, "all": 1}[mode]
    return [(constrained if i % every == 0 else plain).replace(seed=i) for i in range(n)]


def _run(model, config, mode: str, n: int, output_len: int) -> dict:
    import paxpage

    t = time.perf_counter()
    if getattr(model.tokenizer, "chat_template", None):
        outs = paxpage.chat(model, [PROMPT] * n, sampling_params=_params(mode, n, output_len),
                            engine_config=config, use_tqdm=False)
    else:  # a base model (or a test model without a template): the request as raw text
        outs = paxpage.generate(model, [PROMPT[0]["content"]] * n, sampling_params=_params(mode, n, output_len),
                                engine_config=config, use_tqdm=False)
    seconds = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens}


class _MaskTimer:
    """Wraps GrammarBackend.bitmask to time the host's bitmask fills."""

    def __init__(self):
        from paxpage import structured_backend

        self.calls, self.rows, self.seconds = 0, 0, 0.0
        original = structured_backend.GrammarBackend.bitmask
        timer = self

        def timed(backend, entries, *args):
            t = time.perf_counter()
            out = original(backend, entries, *args)
            timer.seconds += time.perf_counter() - t
            timer.calls += 1
            timer.rows += sum(count for _, _, count in entries)
            return out

        structured_backend.GrammarBackend.bitmask = timed


def _worker(args) -> None:
    """One process's runs: every mode in args.modes, warm-up then repeats; JSON to args.worker."""
    sys.path.insert(0, os.getcwd())
    import paxpage

    from paxpage import xla_cache

    xla_cache.enable()  # later processes load the compiled steps instead of compiling again
    model = paxpage.load(args.model) if args.model else paxpage.load()
    config = paxpage.EngineConfig(max_num_seqs=args.num_requests)
    timer = _MaskTimer() if any(m != "none" for m in args.modes) else None
    results, masks = {m: [] for m in args.modes}, {}
    for m in args.modes:  # compile every shape of every mode first
        _run(model, config, m, args.num_requests, min(args.output_len, 8))
    for _ in range(args.repeats):
        for m in args.modes:
            if timer is not None:
                timer.calls, timer.rows, timer.seconds = 0, 0, 0.0
            results[m].append(_run(model, config, m, args.num_requests, args.output_len))
            if timer is not None and timer.calls:
                masks[m] = {"ms_per_step": 1e3 * timer.seconds / timer.calls,
                            "us_per_row": 1e6 * timer.seconds / timer.rows, "steps": timer.calls}
    with open(args.worker, "w") as f:
        json.dump({"runs": results, "masks": masks}, f)


def _spawn(root: str, modes: list[str], args, repeats: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", path, "--modes", *modes,
           "--num-requests", str(args.num_requests), "--output-len", str(args.output_len),
           "--repeats", str(repeats)] + (["--model", args.model] if args.model else [])
    env = {**os.environ, "PYTHONPATH": root}
    subprocess.run(cmd, cwd=root, env=env, check=True, timeout=3600)
    with open(path) as f:
        data = json.load(f)
    os.unlink(path)
    return data


def doc_tables(data: dict) -> dict:
    """The docs' table (docs/structured-outputs.md): median output tok/s per share constrained."""
    tok_s = data["tok_s"]
    labels = {"none": "none", "quarter": "a quarter", "all": "all"}
    rows = [[labels[m], round(tok_s[m], 1), f"{tok_s[m] / tok_s['none']:.3f}"] for m in labels if m in tok_s]
    caption = (f"{data.get('model') or 'SmolLM2-135M-Instruct'}, {data['num_requests']} requests x "
               f"{data['output_len']} tokens (the schema never completes early), median of {data['repeats']}")
    return {"structured": {"caption": caption, "columns": ["requests constrained", "output tok/s", "vs unconstrained"],
                           "rows": rows}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model source (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", help="another checkout's root: time its unconstrained mode alongside")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--modes", nargs="+", default=["none", "quarter", "all"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0

    runs = {m: [] for m in ("none", "quarter", "all", "baseline")}
    # One process per checkout (each compiles once), its modes interleaved repeat by repeat.
    data = _spawn(ROOT, ["none", "quarter", "all"], args, args.repeats)
    for m, values in data["runs"].items():
        runs[m] += values
    masks = data["masks"]
    if args.baseline:
        runs["baseline"] += _spawn(os.path.abspath(args.baseline), ["none"], args, args.repeats)["runs"]["none"]
    median = {m: statistics.median(r["tok_s"] for r in v) for m, v in runs.items() if v}
    print(f"{args.num_requests} requests x {args.output_len} output tokens, median of {args.repeats}")
    print(f"{'mode':<28}{'tok/s':>10}{'vs none':>10}")
    labels = {"baseline": "unconstrained, baseline", "none": "unconstrained",
              "quarter": "a quarter constrained", "all": "all constrained"}
    for m in ("baseline", "none", "quarter", "all"):
        if m in median:
            print(f"{labels[m]:<28}{median[m]:>10.1f}{median[m] / median['none']:>10.3f}")
    for m, v in masks.items():
        print(f"host bitmask fill, {labels[m]}: {v['ms_per_step']:.3f} ms per step, "
              f"{v['us_per_row']:.1f} us per constrained row ({v['steps']} steps)")
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from provenance import write_record  # the figures with machine, versions, date, command, commit

        data = {"tok_s": median, "masks": masks, "runs": runs, "num_requests": args.num_requests,
                "output_len": args.output_len, "repeats": args.repeats, "model": args.model}
        write_record(args.json, data, doc_tables(data))
    return 0


if __name__ == "__main__":
    from paxpage.process_tuning import tune_malloc

    tune_malloc()  # glibc keeps large freed buffers for reuse (paxpage/process_tuning.py)
    sys.exit(main())
