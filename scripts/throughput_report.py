"""The figures of a bench_throughput run (scripts/bench_throughput.py): each paxpage pass as
printed, the vLLM peer's record and paxpage's ratios to it, the decode-step profile as printed,
and the docs' tables made from the run's JSON record.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_matmul import layer_weights, shapes_of  # noqa: E402
from workload import exec_cache_label  # noqa: E402


def print_pass(k: int, pax: dict) -> None:
    """Measured pass k: its rates, steps, TTFT / TPOT percentiles and padding."""
    print(f"paxpage pass {k}: {pax['requests_per_s']:.2f} req/s, {pax['output_tok_per_s']:.1f} output tok/s, "
          f"{pax['total_tok_per_s']:.1f} total tok/s ({pax['wall_s']:.1f} s, {pax['steps']} steps, "
          f"max {pax['max_running']} running, {pax['preemptions']} preemptions, {pax['compiles']} compiles)",
          flush=True)
    print("  TTFT p50/p90/p99: " + " / ".join(f"{v * 1e3:.0f}" for v in pax["ttft_s"].values()) + " ms; "
          "TPOT p50/p90/p99: " + " / ".join(f"{v * 1e3:.0f}" for v in pax["tpot_s"].values()) + " ms; "
          f"host share of wall time {pax['host_share']:.1%}", flush=True)
    p = pax["padding"]
    print(f"  padding: {p['tokens']} real tokens in {p['token_slots']} token slots "
          f"({p['tokens'] / p['token_slots']:.0%}); decode rows {p['decode_rows']}/{p['decode_row_slots']}, "
          f"prefill tokens {p['prefill_tokens']}/{p['prefill_token_slots']}", flush=True)


def vllm_summary(pax: dict, passes: list[dict], vllm_passes: list[dict], vllm_info: dict,
                 warm: dict) -> tuple[dict, dict]:
    """(record, ratios) of the vLLM peer: its fastest pass beside paxpage's fastest (`pax`), pass
    by pass, and the two warm-ups; both printed."""
    best = max(vllm_passes, key=lambda r: r["output_tok_per_s"])
    vllm_record = dict(vllm_info, **{k: best[k] for k in ("wall_s", "requests_per_s", "output_tok_per_s",
                                                          "total_tok_per_s")},
                       passes_output_tok_per_s=[r["output_tok_per_s"] for r in vllm_passes],
                       same_first_tokens=[r["same_first_tokens"] for r in vllm_passes])
    vllm_ratios = {
        "output_tok_per_s": pax["output_tok_per_s"] / best["output_tok_per_s"],
        "passes_output_tok_per_s": [p["output_tok_per_s"] / v["output_tok_per_s"]
                                    for p, v in zip(passes, vllm_passes)],
        "warmup_s": warm["wall_s"] / (vllm_info["startup_s"] + vllm_info["warmup_pass_s"]),
        "warmup_pass_s": warm["wall_s"] / vllm_info["warmup_pass_s"],
    }
    print(f"vLLM (fastest of {len(vllm_passes)} passes): {best['output_tok_per_s']:.1f} output tok/s; "
          f"start-up {vllm_info['startup_s']:.1f} s + warm-up pass {vllm_info['warmup_pass_s']:.1f} s "
          f"(paxpage warm-up {warm['wall_s']:.1f} s{warm_cache_note(warm)})", flush=True)
    print(f"ratio paxpage / vLLM (output tok/s): {vllm_ratios['output_tok_per_s']:.2f}x fastest, pass by pass "
          + ", ".join(f"{r:.2f}x" for r in vllm_ratios["passes_output_tok_per_s"])
          + f"; warm-up paxpage / vLLM {vllm_ratios['warmup_pass_s']:.2f}x the warm-up pass, "
          f"{vllm_ratios['warmup_s']:.2f}x with its start-up", flush=True)
    return vllm_record, vllm_ratios


def matmul_flops(config, layer_tokens: int, sampled_rows: int) -> float | None:
    """FLOPs of a pass's dense matmuls (2 per weight per row): `layer_tokens` tokens through every
    layer's projections (q, k, v, o, gate, up, down) and `sampled_rows` rows through the LM head.
    None for a family whose layers are not those (experts, latent attention)."""
    if config.num_experts or config.kv_lora_rank:
        return None
    n_in, n_out = shapes_of(config)["lm_head"]
    return 2.0 * (config.num_layers * layer_weights(config) * layer_tokens + n_in * n_out * sampled_rows)


def sgemm_gflops(n: int = 2048, repeats: int = 3) -> float:
    """This machine's f32 matmul rate as numpy's BLAS gets it on every core: the fastest of
    `repeats` [n, n] x [n, n] products, GFLOP/s."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best / 1e9


def matmul_ceiling(config, work, pax: dict, vllm_record: dict | None, peak_gflops: float) -> dict | None:
    """Each system's fastest pass as matmul GFLOP/s (the pass's matmul FLOPs over its wall time)
    and as a fraction of `peak_gflops` (sgemm_gflops), and what 1.2x vLLM's output rate would
    ask; printed. None when matmul_flops is (not a dense llama-style family)."""
    flops = matmul_flops(config, sum(work.prompt_lens) + sum(work.output_lens) - len(work.output_lens),
                         sum(work.output_lens))
    if flops is None:
        return None
    record = {"pass_tflop": flops / 1e12, "sgemm_gflops": peak_gflops,
              "paxpage_gflops": flops / pax["wall_s"] / 1e9}
    line = (f"matmuls: {record['pass_tflop']:.2f} TFLOP a pass; numpy's sgemm on this machine "
            f"{peak_gflops:.0f} GFLOP/s; paxpage {record['paxpage_gflops']:.0f} GFLOP/s "
            f"({record['paxpage_gflops'] / peak_gflops:.0%})")
    if vllm_record is not None:
        record["vllm_gflops"] = flops / vllm_record["wall_s"] / 1e9
        record["gflops_for_1_2x_vllm"] = 1.2 * record["vllm_gflops"]
        line += (f", vLLM {record['vllm_gflops']:.0f} ({record['vllm_gflops'] / peak_gflops:.0%}); "
                 f"1.2x vLLM asks {record['gflops_for_1_2x_vllm']:.0f} "
                 f"({record['gflops_for_1_2x_vllm'] / peak_gflops:.0%}) over the whole pass")
    print(line, flush=True)
    return record


def print_profile(profile: dict) -> None:
    """The decode-step profile (scripts/step_profile.py): each part's time and share."""
    t = profile["seconds"]
    print(f"decode step profile ({profile['rows']} rows, context {profile['context']}): "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items()), flush=True)
    print("  shares: " + ", ".join(f"{k} {v:.0%}" for k, v in profile["shares"].items()), flush=True)


def doc_tables(data: dict) -> dict:
    """The docs' table (docs/benchmarks.md): one row per system."""
    def row(name, r):
        return [name, round(r["requests_per_s"], 2), round(r["output_tok_per_s"], 1),
                round(r["total_tok_per_s"], 1)]

    rows = [row("paxpage", data["paxpage"])]
    if data.get("vllm"):
        rows.append(row(f"vLLM {data['vllm']['version']} (CPU build, tuned)", data["vllm"]))
    if data["hf"]:
        rows.append(row(f"HF transformers `generate`, batch {data['hf']['best_batch_size']}", data["hf"]))
    work = data["workload"]
    tables = {"throughput": {
        "caption": (f"{data['model']}, f32, {work['num_requests']} requests ({work['prompt_tokens']:,} prompt + "
                    f"{work['output_tokens']:,} output tokens), all queued at once; the fastest measured pass of each"),
        "columns": ["system", "requests/s", "output tok/s", "total tok/s"], "rows": rows}}
    if data.get("vllm"):
        tables["peers"] = peers_table(data)
    tables["profile"] = profile_table(data)
    invariant = data.get("batch_invariant")
    if invariant:
        passes = len(invariant["default_passes"])
        tables["batch_invariant"] = {
            "columns": ["mode", f"fastest of {passes} passes (s)", "output tok/s", "time / default"],
            "rows": [[mode, round(wall, 2), round(max(r["output_tok_per_s"] for r in runs), 1), f"{wall / base:.2f}x"]
                     for base in (invariant["default_wall_s"],)
                     for mode, wall, runs in (("default", invariant["default_wall_s"], invariant["default_passes"]),
                                              ("batch_invariant=True", invariant["invariant_wall_s"],
                                               invariant["invariant_passes"]))]}
    return tables


def _pass_range(rates: list[float]) -> str:
    low, high = min(rates), max(rates)
    return f"{low:.0f}" if round(low) == round(high) else f"{low:.0f}-{high:.0f}"


def peers_table(data: dict) -> dict:
    """The docs' side-by-side table of a run with the vLLM peer: each system's output tok/s over
    its measured passes, its warm-up pass and its start-up."""
    pax, vllm, warm, hf = data["paxpage"], data["vllm"], data["warmup"], data["hf"]
    cached = warm.get("executable_cache") or {}
    rows = [["paxpage", _pass_range(pax["passes_output_tok_per_s"]),
             f"{warm['wall_s']:.1f} s" + (" (executables from its cache)" if cached.get("loaded") else
                                          f" ({warm['compiles']} compiles)"),
             "engine build: in its warm-up pass"],
            [f"vLLM {vllm['version']} (CPU build, tuned)", _pass_range(vllm["passes_output_tok_per_s"]),
             f"{vllm['warmup_pass_s']:.1f} s", f"{vllm['startup_s']:.0f} s (load, torch.compile)"]]
    if hf:
        rows.append([f"HF transformers `generate`, batch {hf['best_batch_size']}", f"{hf['output_tok_per_s']:.0f}",
                     "", ""])
    work = data["workload"]
    return {"caption": (f"{data['model']}, f32, {work['num_requests']} requests (random-token prompts, EOS ignored, "
                        "greedy), all queued at once; output tok/s over the measured passes, the systems taking "
                        "turns pass by pass"),
            "columns": ["system", "output tok/s", "warm-up pass", "start-up"], "rows": rows}


def doc_charts(data: dict) -> dict | None:
    """The docs' bar chart of a run with the vLLM peer: output tok/s of each system, the bar at
    its fastest pass, its range over the passes. None without the peer."""
    if not data.get("vllm"):
        return None
    systems = [("paxpage", data["paxpage"]["passes_output_tok_per_s"]),
               (f"vLLM {data['vllm']['version']}, tuned", data["vllm"]["passes_output_tok_per_s"])]
    if data["hf"]:
        systems.append(("HF transformers generate", [data["hf"]["output_tok_per_s"]]))
    bars = [{"label": name, "value": round(max(rates), 1), "low": round(min(rates), 1), "high": round(max(rates), 1),
             "text": _pass_range(rates)} for name, rates in systems]
    return {"throughput": {"kind": "bar", "panels": [{"bars": bars, "title": ""}], "xlabel": "output tok/s",
                           "title": f"{data['model']}, {data['workload']['num_requests']} requests, output tok/s "
                                    "(range over passes)"}}


def warm_cache_note(warm: dict) -> str:
    """How the warm-up found the executable cache (bench_throughput --exec-cache): "" without one."""
    stats = warm.get("executable_cache")
    return f"; executable cache {exec_cache_label(stats)}" if stats else ""


def profile_table(data: dict) -> dict:
    """The docs' "where the time goes" table of the same run: paxpage's warm-up, latency
    percentiles, padding and the decode step's profile (when the run took one)."""
    pax, warm = data["paxpage"], data["warmup"]
    pad = pax["padding"]

    def pcts(r, scale, unit):
        return " / ".join(f"{r[k] * scale:.3g}" for k in ("p50", "p90", "p99")) + f" {unit}"

    rows = [[f"warm-up pass (engine build and {warm['compiles']} compiles included{warm_cache_note(warm)})",
             f"{warm['wall_s']:.1f} s"],
            ["compiles after warm-up", data["compiles_after_warmup"]],
            ["TTFT p50 / p90 / p99 (all requests queued at t = 0)", pcts(pax["ttft_s"], 1, "s")],
            ["TPOT p50 / p90 / p99", pcts(pax["tpot_s"], 1e3, "ms")],
            ["engine thread not blocked on the device's results", f"{pax['host_share']:.1%} of wall time"]]
    profile = data.get("profile")
    if profile:
        rows.append([f"one decode step, {profile['rows']} rows at context {profile['context']}",
                     f"{profile['seconds']['step'] * 1e3:.0f} ms"])
    rows.append(["token slots of the bucketed step shapes holding real tokens",
                 f"{pad['tokens'] / pad['token_slots']:.0%}"])
    return {"caption": "The same run: where the time goes", "columns": ["measure", "value"], "rows": rows}
