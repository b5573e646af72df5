"""The figures of a bench_step run (scripts/bench_step.py): each case's lines as printed, the
sampled cases against their greedy twins and the longer contexts against the shorter, and the
docs' tables made from the run's JSON record.
"""

from __future__ import annotations

import dataclasses
import json

from step_workload import TINY_CONFIG, Case


def print_case(case: Case, r: dict, att: dict) -> None:
    """One measured case (r: its row of the record; att: its attention timing): its per-step
    figures, and with case.steady False every measured step's host CPU with what else it carried."""
    print(f"{case.key:26s} host {r['host_s'] * 1e3:7.1f} (CPU {r['host_cpu_s'] * 1e3:.1f})  "
          f"device {r['device_s'] * 1e3:8.1f} (busy {r['busy_s'] * 1e3:.1f})  "
          f"wall {r['wall_s'] * 1e3:8.1f} ms/step  overlap {r['overlap']:4.0%}  attention "
          f"{att['seconds'] * 1e3:6.1f} ms ({r['attention_share']:4.0%} of device busy), "
          f"{att['gb_per_s']:5.1f} GB/s ({r['attention_vs_bandwidth']:.2f}x read bandwidth)  "
          f"[fill {r['fill_steps']} steps, {r['fill_s']:.0f} s]", flush=True)
    split = "".join(f"; {name} steps ({r[f'{name}_steps']}) CPU {r[f'{name}_host_cpu_s'] * 1e3:.2f} "
                    f"max {r[f'{name}_host_cpu_max_s'] * 1e3:.2f}" for name in ("decode", "arrival")
                    if f"{name}_steps" in r)
    print(f"{'':26s} host CPU max {r['host_cpu_max_s'] * 1e3:.2f} ms/step "
          f"({r['host_cpu_max_warm_s'] * 1e3:.2f} "
          f"without the {sum(map(bool, r['step_compiles']))} steps that compiled); steady decode step in "
          f"{r['decode_batch_steps']} / {r['measured_steps']} steps; rows {r['step_rows'][0]} to "
          f"{r['step_rows'][-1]}{split}", flush=True)
    if not case.steady:
        print(f"{'':26s} per step (ms): " + " ".join(
            f"{c * 1e3:.1f}{'' if d else '*'}{'+' if a else ''}{'c' if k else ''}{'g' if g else ''}"
            for c, d, a, k, g in zip(r["step_host_cpu_s"], r["step_decode_batch"],
                                     r.get("step_arrival", [False] * r["measured_steps"]),
                                     r["step_compiles"], r["step_full_gcs"])) +
              "  (* a step of the full schedule, + an arrival's prefill, c compiled, g full gc)", flush=True)


def compare_to_greedy(results: list[dict]) -> None:
    """Sampled cases against the greedy case of the same model and shape, when both ran: sets and
    prints each one's device_vs_greedy and busy_vs_greedy."""
    def steady(row):
        return Case(**{f.name: row[f.name] for f in dataclasses.fields(Case)}).steady

    greedy = {(r["model"], r["rows"], r["context"]): r for r in results if r["temperature"] == 0 and steady(r)}
    for row in results:
        base = greedy.get((row["model"], row["rows"], row["context"]))
        if row["temperature"] != 0 and base is not None and steady(row):
            row["device_vs_greedy"] = row["device_s"] / base["device_s"]
            row["busy_vs_greedy"] = row["busy_s"] / base["busy_s"]
            print(f"{row['case']}: device busy {row['busy_vs_greedy']:.2f}x {base['case']}'s "
                  f"(device wait {row['device_vs_greedy']:.2f}x)", flush=True)


def compare_contexts(results: list[dict], interleave: bool) -> None:
    """Each longer context's host CPU over the shorter one's (context_ratios), set as the longer
    row's host_cpu_vs_context and printed, per window too when the run had several."""
    for short, long in context_ratios(results):
        long.setdefault("host_cpu_vs_context", {})[short["case"]] = ratio = long["host_cpu_s"] / short["host_cpu_s"]
        windows = ""
        if "window_host_cpu_s" in long:
            windows = " (per window: " + ", ".join(
                f"{a / b:.2f}" for a, b in zip(long["window_host_cpu_s"], short["window_host_cpu_s"])) + ")"
        print(f"{long['case']}: host CPU {ratio:.2f}x {short['case']}'s "
              f"({long['host_cpu_s'] * 1e3:.2f} vs {short['host_cpu_s'] * 1e3:.2f} ms/step"
              f"{', side by side' if interleave else ', one after the other'}){windows}", flush=True)


def print_tables(data: dict) -> None:
    """The docs' tables (doc_tables) as Markdown."""
    for table in doc_tables(data).values():
        print("\n| " + " | ".join(table["columns"]) + " |\n" + "|---" * len(table["columns"]) + "|")
        for cells in table["rows"]:
            print("| " + " | ".join(str(c) for c in cells) + " |")


def context_ratios(results: list[dict]) -> list[tuple[dict, dict]]:
    """(shorter, longer) context pairs among cases that differ in nothing else."""
    def rest(row):
        return tuple(row[f.name] for f in dataclasses.fields(Case) if f.name not in ("key", "context"))
    pairs = []
    for short in results:
        for long in results:
            if rest(short) == rest(long) and short["context"] < long["context"]:
                pairs.append((short, long))
    return pairs


def case_label(row: dict) -> str:
    """A case as the docs name it: "tiny 256 x 1536, temperature 0.7, top-p 0.9"."""
    parts = [f"{'SmolLM2' if row['model'] == 'smollm2' else row['model']} {row['rows']} x {row['context']}"]
    if row["temperature"]:
        parts.append(f"temperature {row['temperature']:g}")
    if row["top_p"] != 1:
        parts.append(f"top-p {row['top_p']:g}")
    if row["repetition_penalty"] != 1:
        parts.append(f"repetition penalty {row['repetition_penalty']:g}")
    if row["stream"]:
        parts.append("streamed")
    if not row.get("prefix_caching", True):
        parts.append("prefix caching off")
    if row.get("prompt_spread"):
        parts.append(f"prompts of {row['context'] - row['prompt_spread']} to {row['context']} tokens")
    if row.get("ending"):
        parts.append(f"{row['ending']:.0%} of rows ending in the window")
    if row.get("arrivals_every"):
        k = row["arrivals_every"]
        parts.append("a request arriving every step" if k == 1 else f"a request arriving every {k} steps")
    if row.get("n", 1) != 1:
        parts.append(f"n {row['n']}")
    if row.get("logprobs") is not None:
        parts.append(f"logprobs {row['logprobs']}")
    if row.get("stop"):
        parts.append("stop " + json.dumps(list(row["stop"])))
    if row.get("structured"):
        requests = row["structured"]  # requests with a regex; each of their n samples is a row
        parts.append(f"{requests} request{'s' if requests > 1 else ''} following a regex")
    return ", ".join(parts)


def doc_tables(data: dict) -> dict:
    """The docs' table (docs/benchmarks.md): one row per case, times in ms per step."""
    def ms(seconds):
        return round(seconds * 1e3, 1)

    rows = [[case_label(r), ms(r["host_s"]), ms(r["host_cpu_s"]), ms(r["device_s"]), ms(r["busy_s"]), ms(r["wall_s"]),
             round(r["wall_s"] / max(r["host_cpu_s"], r["busy_s"]), 2), f"{r['overlap']:.0%}",
             f"{r['attention_share']:.0%}", round(r["attention_gb_per_s"], 1)] for r in data["cases"]]
    tiny = TINY_CONFIG
    caption = (f"One steady decode step per case ({data['steps']} measured), rows x context; tiny: a random "
               f"{tiny['num_hidden_layers']}-layer Llama (hidden {tiny['hidden_size']}, vocabulary "
               f"{tiny['vocab_size']:,}); this machine's read bandwidth {data['read_bandwidth_gb_per_s']:.1f} GB/s")
    every = []  # every measured step: the target is each step's, not only the mean
    for r in data["cases"]:
        split = {name: (f"{ms(r[f'{name}_host_cpu_s'])} / {ms(r[f'{name}_host_cpu_max_s'])}"
                        if f"{name}_steps" in r else "") for name in ("decode", "arrival")}
        every.append([case_label(r), ms(r["host_cpu_s"]), ms(r["host_cpu_max_s"]), ms(r["host_cpu_max_warm_s"]),
                      f"{r['decode_batch_steps']} / {r['measured_steps']}",
                      f"{r['step_rows'][0]} to {r['step_rows'][-1]}", split["decode"], split["arrival"]])
    return {"step": {"caption": caption,
                     "columns": ["case", "host ms", "host CPU ms", "device wait ms", "device busy ms", "wall ms",
                                 "wall / max(host CPU, busy)", "overlap", "attention share", "attention GB/s"],
                     "rows": rows},
            "step_every": {"caption": f"Host CPU of every measured step per case ({data['steps']} measured), ms: "
                                      "mean, max, and max over the steps that compiled nothing; the steps that "
                                      "took the steady decode step; running rows "
                                      "in the first and last step; with arrivals, the steps without and with "
                                      "an arriving request's prefill (mean / max)",
                           "columns": ["case", "host CPU ms", "max host CPU ms", "max without compiles",
                                       "steady decode steps", "rows",
                                       "decode-only steps' host CPU ms", "prefill steps' host CPU ms"],
                           "rows": every}}

