"""The figures of a bench_serving run (scripts/bench_serving.py): the highest request rate each
system sustains under a normalised-latency limit, paxpage's ratios to its peers, the printed
table, the plot, and the docs' tables and chart made from the run's JSON record."""

from __future__ import annotations

import math
import os
import textwrap

import numpy as np

import workload as wl

COLORS = {"paxpage": "tab:blue", "hf": "tab:orange", "vllm": "tab:green"}  # the same in every plot
PEERS = ("hf", "vllm")  # each ratio is paxpage's figure over the peer's
SYSTEM_LABELS = {"paxpage": "paxpage", "hf": "HF `transformers serve`", "vllm": "vLLM CPU (tuned)"}
MODE_TITLES = {"natural": "natural EOS (max_tokens = drawn length)", "forced": "forced lengths (EOS ignored)"}


def capacity(points: list[dict], limit: float) -> dict:
    """Highest offered rate sustained under `limit` s/token: every rate up to it finished
    all requests within the limit. `interpolated` is where the curve crosses the limit
    (linear in log rate between the last rate under it and the first over it); when no
    measured rate exceeds the limit it is the highest rate, and `limit_reached` is False."""
    points = sorted(points, key=lambda p: p["rate"])
    highest, interpolated, reached = None, None, False
    for i, p in enumerate(points):
        lat = p["normalised_latency_s"]
        within = lat is not None and lat <= limit and p["num_finished"] == p["num_requests"]
        if within:
            highest = interpolated = p["rate"]
            continue
        reached = True
        if highest is not None and lat is not None and lat > limit:
            prev = points[i - 1]
            frac = (limit - prev["normalised_latency_s"]) / (lat - prev["normalised_latency_s"])
            interpolated = math.exp(math.log(prev["rate"]) + frac * (math.log(p["rate"]) - math.log(prev["rate"])))
        break
    return {"highest_rate": highest, "interpolated_rate": interpolated, "limit_reached": reached}


def ratio(a: dict, b: dict, key: str) -> float | None:
    if a[key] is None or not b[key]:
        return None
    return a[key] / b[key]


def _ms(x):
    return "    -" if x is None else f"{x * 1000:5.0f}"


def print_table(results: dict, systems: list[str]) -> None:
    head = (f"{'mode':>7} {'system':>8} {'rate':>5} {'done':>5} {'req/s':>6} {'tok/s':>6} "
            f"{'TTFT p50/p90/p99 ms':>19} {'TPOT p50/p90/p99 ms':>19} {'norm s/tok':>10} {'stall s':>7}")
    print(head)
    print("-" * len(head))
    for mode, per_system in results.items():
        for system in systems:
            for p in per_system.get(system, []):
                t, o = p["ttft_s"], p["tpot_s"]
                lat = p["normalised_latency_s"]
                print(f"{mode:>7} {system:>8} {p['rate']:5g} {p['num_finished']:2d}/{p['num_requests']:<2d} "
                      f"{p['requests_per_s']:6.2f} {p['output_tok_per_s']:6.1f} "
                      f"{_ms(t['p50'])}/{_ms(t['p90'])}/{_ms(t['p99'])} "
                      f"{_ms(o['p50'])}/{_ms(o['p90'])}/{_ms(o['p99'])} "
                      f"{'-' if lat is None else f'{lat:10.4f}':>10} "
                      f"{p.get('max_token_gap_s', float('nan')):7.2f}", flush=True)


def plot(results: dict, capacities: dict, limits: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in results if results[m]]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.2 * len(modes), 4.8), squeeze=False)
    labels = {"natural": "natural EOS (max_tokens = drawn length)", "forced": "forced lengths (EOS ignored)"}
    for ax, mode in zip(axes[0], modes):
        rates = set()
        for system, points in results[mode].items():
            xs = [p["rate"] for p in points if p["normalised_latency_s"] is not None]
            ys = [p["normalised_latency_s"] for p in points if p["normalised_latency_s"] is not None]
            rates.update(xs)
            cap = capacities[mode].get(system, {})
            if cap.get("interpolated_rate") is None:
                extra = ", sustains no rate"
            elif cap["limit_reached"]:
                extra = f", sustains {cap['interpolated_rate']:.2f} req/s"
            else:
                extra = f", sustains >= {cap['interpolated_rate']:.2f} req/s (limit not reached)"
            ax.plot(xs, ys, marker="o", label=f"{system}{extra}", color=COLORS.get(system))
        ax.axhline(limits[mode], color="grey", linestyle="--", linewidth=1,
                   label=f"latency limit {limits[mode]:.3g} s/token")
        if rates:
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(rates), [f"{r:g}" for r in sorted(rates)])
        ax.set_xlabel("offered request rate (req/s, Poisson arrivals)")
        ax.set_ylabel("normalised latency (s/token)")
        ax.set_title(labels.get(mode, mode))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    # wrapped to the figure's width: one long line was cut at both edges of a one-panel plot
    fig.suptitle(textwrap.fill(title, width=60 * len(modes)), fontsize="medium")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def latency_limit(spec: str, per_system: dict) -> float:
    """--latency-limit as a number, or 'auto': twice the slower system's light-load latency,
    each system's lowest normalised latency over the rates (a stall, such as a compile, can
    spoil any one point, the lowest rate's included)."""
    if spec != "auto":
        return float(spec)
    best = [min((p["normalised_latency_s"] for p in points if p["normalised_latency_s"] is not None),
                default=None) for points in per_system.values()]
    best = [x for x in best if x is not None]
    return 2 * max(best) if best else float("nan")


def report(args, results: dict, servers: dict, lengths: list, prompt_lens: dict) -> int:
    """Capacities under the latency limit, the table, the notes, the plot and the JSON."""
    systems = list(servers)
    limits = {mode: latency_limit(args.latency_limit, results[mode]) for mode in args.modes}
    capacities = {mode: {s: capacity(results[mode][s], limits[mode]) for s in systems} for mode in args.modes}
    print()
    print_table(results, systems)
    ratios = {peer: {} for peer in PEERS if {"paxpage", peer} <= set(systems)}
    print("\nhighest rate sustained at normalised latency <= the limit (interpolated crossing in brackets):")
    for mode in args.modes:
        caps = capacities[mode]
        line = ", ".join(f"{s} {_rate(caps[s]['highest_rate'])} ({_rate(caps[s]['interpolated_rate'])}"
                         f"{'' if caps[s]['limit_reached'] else ', limit not reached'})" for s in systems)
        for peer in ratios:
            ratios[peer][mode] = {k: ratio(caps["paxpage"], caps[peer], k)
                                  for k in ("highest_rate", "interpolated_rate")}
            r = ratios[peer][mode]
            bound = "" if caps["paxpage"]["limit_reached"] else ">= "
            line += (f"; ratio paxpage / {peer} {bound}{_x(r['highest_rate'])} measured, "
                     f"{bound}{_x(r['interpolated_rate'])} interpolated")
        print(f"  {mode}, limit {limits[mode]:.3g} s/token: {line}")
    per_rate = {peer: {mode: rate_ratios(results[mode]["paxpage"], results[mode][peer]) for mode in args.modes}
                for peer in ratios}
    for peer, by_mode in per_rate.items():
        print(f"\npaxpage / {peer} at each rate (achieved req/s: higher is better for paxpage; normalised "
              "latency and TTFT p99: lower is):")
        for mode, rows in by_mode.items():
            for row in rows:
                print(f"  {mode:>7} rate {row['rate']:g}: achieved {_x(row['requests_per_s'])}, normalised latency "
                      f"{_x(row['normalised_latency_s'])}, TTFT p99 {_x(row['ttft_p99_s'])}")
    notes = []
    for mode in args.modes:
        for system in systems:
            shares = [p.get("share_exact_length") for p in results[mode][system]]
            if mode == "forced" and any(s is not None and s < 1 for s in shares):
                notes.append(f"{system} did not honour forced lengths on every request ({min(shares):.0%} exact): "
                             f"compare the natural mode only")
    for note in notes:
        print(f"NOTE: {note}")
    name = os.path.basename(os.path.normpath(args.model)) if args.model else "SmolLM2-135M-Instruct"
    (p_lo, o_lo), (p_hi, o_hi) = np.min(lengths, axis=0), np.max(lengths, axis=0)
    title = (f"Online serving, {name}: {args.num_requests} requests per rate, "
             f"prompts {p_lo}-{p_hi}, outputs {o_lo}-{o_hi} tokens")
    if args.plot:
        plot(results, capacities, limits, args.plot, title)
        print(f"plot: {args.plot}")
    if args.json:
        data = {
            "systems": systems, "servers": {s: {"base_url": u, "model": m} for s, (u, m) in servers.items()},
            "request_rates": args.request_rates, "latency_limit": args.latency_limit,
            "latency_limit_s_per_token": limits,
            "workload": {"num_requests": args.num_requests, "lengths": lengths,
                         "prompt_tokens_by_tokenizer": prompt_lens},
            "results": results, "capacity": capacities, "notes": notes,
            **{f"ratio_paxpage_over_{peer}": r for peer, r in ratios.items()},
            **{f"ratio_paxpage_over_{peer}_by_rate": r for peer, r in per_rate.items()},
        }
        wl.write_json(args.json, data, tables=doc_tables(data), charts=doc_charts(data, title))
    return 0


def _seconds(x: float | None) -> str | None:
    """Two significant digits under 10 s ("0.38", "6.0"), tenths above ("10.1")."""
    return None if x is None else f"{x:#.2g}" if x < 10 else f"{x:.1f}"


def _sustained(c: dict) -> str:
    if c["interpolated_rate"] is None:
        return "none"
    return ("" if c["limit_reached"] else ">= ") + f"{c['interpolated_rate']:.3g}"


def _joined(points: list[dict], value, unit: str = "") -> str:
    cells = ["-" if (v := value(p)) is None else v for p in points]
    return " / ".join(cells) + (f" {unit}" if unit else "")


def doc_tables(data: dict) -> dict:
    """The docs' tables (docs/serving.md): per mode and system, each measure at every offered rate
    (one cell, rates in order); and the highest rate each system sustains under the latency limit."""
    rows = []
    for mode, per_system in data["results"].items():
        for system in data["systems"]:
            points = sorted(per_system.get(system, []), key=lambda p: p["rate"])
            if not points:
                continue
            def fmt(key, spec, scale=1.0):
                return lambda p: None if p[key] is None else format(p[key] * scale, spec)
            rows.append([mode, SYSTEM_LABELS.get(system, system), _joined(points, fmt("rate", "g")),
                         _joined(points, fmt("requests_per_s", ".2f")),
                         _joined(points, lambda p: _seconds(p["ttft_s"]["p50"]), "s"),
                         _joined(points, lambda p: f"{p['tpot_s']['p50'] * 1e3:.0f}", "ms"),
                         _joined(points, fmt("normalised_latency_s", ".2f"), "s"),
                         _joined(points, lambda p: f"{p.get('max_token_gap_s', float('nan')):.1f}", "s")])
    tables = {"serving": {
        "caption": f"{data['workload']['num_requests']} requests per rate, Poisson arrivals, streamed /v1/completions",
        "columns": ["mode", "system", "offered req/s", "achieved req/s", "TTFT p50", "TPOT p50",
                    "normalised latency", "longest stall"], "rows": rows}}
    if {"paxpage", "hf"} <= set(data["systems"]):
        modes = list(data["results"])
        limits = data["latency_limit_s_per_token"]
        same = len({limits[m] for m in modes}) == 1
        limit = (f"{limits[modes[0]]:.3g} s/token" if same
                 else ", ".join(f"{m} {limits[m]:.3g}" for m in modes) + " s/token")
        cells = []
        for mode in modes:
            pax, hf = data["capacity"][mode]["paxpage"], data["capacity"][mode]["hf"]
            r = ratio(pax, hf, "interpolated_rate")
            cells.append(f"{_sustained(pax)} / {_sustained(hf)} req/s" + ("" if r is None else
                         f" ({'' if pax['limit_reached'] else '>= '}{r:.1f}x)"))
        tables["sustained"] = {
            "caption": "Highest request rate sustained under a normalised-latency limit (interpolated on a "
                       "log-rate axis)",
            "columns": ["limit", *(f"{m}: paxpage / HF" for m in modes)], "rows": [[limit, *cells]]}
    return tables


def doc_charts(data: dict, title: str) -> dict:
    """The docs' plot (scripts/docs_figures.py draws it): normalised latency against offered rate,
    one panel per mode, one line per system, the latency limit dashed."""
    panels = []
    for mode, per_system in data["results"].items():
        series = []
        for system in data["systems"]:
            points = [p for p in sorted(per_system.get(system, []), key=lambda p: p["rate"])
                      if p["normalised_latency_s"] is not None]
            series.append({"label": SYSTEM_LABELS.get(system, system).replace("`", ""),
                           "x": [p["rate"] for p in points], "y": [p["normalised_latency_s"] for p in points]})
        limit = data["latency_limit_s_per_token"][mode]
        panels.append({"title": MODE_TITLES.get(mode, mode), "series": series,
                       "hline": {"y": limit, "label": f"latency limit {limit:.3g} s/token"}})
    return {"latency": {"kind": "line", "title": title, "xlabel": "offered request rate (req/s, Poisson arrivals)",
                        "ylabel": "normalised latency (s/token)", "xscale": "log2", "panels": panels}}


def rate_ratios(ours: list[dict], theirs: list[dict]) -> list[dict]:
    """paxpage's figure over the peer's at each rate both measured."""
    by_rate = {p["rate"]: p for p in theirs}
    rows = []
    for p in ours:
        q = by_rate.get(p["rate"])
        if q is None:
            continue
        rows.append({"rate": p["rate"], "requests_per_s": ratio(p, q, "requests_per_s"),
                     "normalised_latency_s": ratio(p, q, "normalised_latency_s"),
                     "ttft_p99_s": ratio(p["ttft_s"], q["ttft_s"], "p99")})
    return rows


def _rate(x):
    return "none" if x is None else f"{x:.2f} req/s"


def _x(x):
    return "n/a" if x is None else f"{x:.2f}x"
