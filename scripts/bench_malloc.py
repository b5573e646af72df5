"""glibc malloc settings, end to end: bench_step.py and bench_throughput.py run in separate
processes under three settings, alternated over rounds (the machine is noisy):

  default  glibc's own thresholds (MALLOC_PERTURB_=0 only: glibc's default, and it stops
           tune_malloc)
  env      MALLOC_MMAP_THRESHOLD_=4000000000 MALLOC_TRIM_THRESHOLD_=4000000000: the thresholds
           alone (each thread keeps its own arena)
  mallopt  paxpage/process_tuning.tune_malloc() called at process start (what the CLI does): the
           thresholds and one arena

Prints, per figure, the median over rounds of each setting and its ratio to `default`.

    python scripts/bench_malloc.py --rounds 2 --json /tmp/malloc.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
SETTINGS = ("default", "env", "mallopt")
BENCHES = {
    "step": ["scripts/bench_step.py", "--cases", "tiny-256x128", "tiny-256x1536", "smollm2-64x65"],
    "throughput": ["scripts/bench_throughput.py", "--num-requests", "32", "--seed", "777", "--no-hf"],
}
# Runs a script as __main__ (after tune_malloc for the `mallopt` setting, as `python -m paxpage.cli
# bench` does) and reports the process's peak RSS on stderr at exit.
_WRAPPER = ("import atexit, resource, runpy, sys\n"
            "atexit.register(lambda: print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
            "file=sys.stderr, flush=True))\n"
            "if sys.argv[1] == 'mallopt':\n"
            "    from paxpage.process_tuning import tune_malloc\n"
            "    assert tune_malloc(), 'mallopt refused'\n"
            "sys.argv = sys.argv[2:]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def _command(setting: str, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if setting == "default":
        # glibc's default perturb byte: changes nothing, but is a MALLOC_* setting of the user's,
        # so a script that calls tune_malloc itself leaves glibc's thresholds alone.
        env["MALLOC_PERTURB_"] = "0"
    if setting == "env":
        env["MALLOC_MMAP_THRESHOLD_"] = env["MALLOC_TRIM_THRESHOLD_"] = "4000000000"
    return [sys.executable, "-c", _WRAPPER, setting, *argv], env


def _figures(bench: str, result: dict) -> dict[str, float]:
    """{name: value} where lower is better (ms per step, seconds per output token)."""
    if bench == "step":
        return {f"{c['key']} wall ms/step": c["wall_s"] * 1e3 for c in result["cases"]}
    pax = result["paxpage"]
    return {"throughput ms/output token": 1e3 / pax["output_tok_per_s"],
            "throughput fill wall s": pax["wall_s"]}


def _run(bench: str, setting: str, timeout: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.json")
        cmd, env = _command(setting, BENCHES[bench] + ["--json", path])
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"{bench} under {setting} failed (exit status {proc.returncode}):\n{stderr[-3000:]}")
        with open(path) as f:
            figures = _figures(bench, json.load(f))
    peaks = [int(line.split()[1]) for line in stderr.splitlines() if line.startswith("PEAK_RSS_KB ")]
    if peaks:
        figures[f"{bench} peak RSS MB"] = peaks[-1] / 1024
    figures[f"{bench} process wall s"] = time.perf_counter() - t
    return figures


def doc_tables(data: dict) -> dict:
    """The table it prints (and a docs page may show): per figure, each setting's median over the
    rounds and its ratio to the first setting."""
    settings, runs = data["settings"], data["runs"]
    base = settings[0]
    rows = []
    for k in runs[base]:
        med = {s: statistics.median(runs[s][k]) for s in settings}
        rows.append([k, *(round(med[s], 1) for s in settings), *(f"{med[s] / med[base]:.2f}x" for s in settings[1:])])
    return {"malloc": {"caption": f"Median of {data['rounds']} rounds per setting, in separate processes; lower is better",
                       "columns": ["figure", *settings, *(f"{s} / {base}" for s in settings[1:])], "rows": rows}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--benches", nargs="+", default=list(BENCHES), choices=list(BENCHES))
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per subprocess")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    runs: dict[str, dict[str, list[float]]] = {s: {} for s in args.settings}
    for r in range(args.rounds):
        for bench in args.benches:
            # Alternate the order too, so no setting always runs first in a round.
            order = args.settings if r % 2 == 0 else args.settings[::-1]
            for setting in order:
                figures = _run(bench, setting, args.timeout)
                print(f"round {r} {bench:10s} {setting:8s} "
                      + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()), flush=True)
                for k, v in figures.items():
                    runs[setting].setdefault(k, []).append(v)
    data = {"settings": args.settings, "rounds": args.rounds, "benches": args.benches, "runs": runs}
    table = doc_tables(data)["malloc"]
    print("\n| " + " | ".join(table["columns"]) + " |\n" + "|---" * len(table["columns"]) + "|")
    for row in table["rows"]:
        print("| " + " | ".join(str(c) for c in row) + " |")
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from provenance import write_record  # the figures with machine, versions, date, command, commit

        write_record(args.json, data, doc_tables(data), measures=("paxpage/process_tuning.py",))
    return 0


if __name__ == "__main__":
    sys.exit(main())
