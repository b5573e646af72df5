"""One short run on an accelerator that generates, measures and reports (scripts/device_check.sh).

    python scripts/device_check.py [OUT_DIR] [--quick] [--stages e2e,moe] [--budget 480]

Stages, in order, each its own process under `timeout` (seconds on an H200, the whole run inside
--budget, 8 minutes by default; a stage gets the smaller of its budget and what is left):
    env            20   jax, backend, devices, nvidia-smi; device copy bandwidth over 4 GiB
    e2e           120   a Llama-3.2-1B-shaped random model (models/random_init.py), 16 prompts of
                        50-1,500 random tokens x 64 greedy tokens with the Pallas and the XLA
                        attention (token agreement and first divergence per prompt), then an int8
                        KV cache and n-gram speculation; compiles, TTFT, tok/s, NaN logprobs
    kernel_tests  110   tests/kernels --extended compiled natively (PAXPAGE_KERNEL_INTERPRET=0),
                        pytest -n 4; ragged, sliding-window, soft-cap and quantised cases first
    bench_kernels  75   scripts/bench_kernels.py: our kernels, jax's shipped one, cuDNN's prefill
    decode_8b      70   one Llama-3-8B decode step, 256 rows x 2k context: ms, tok/s, the weight +
                        K/V bytes it reads as a share of 4.3 TB/s, compiled temp bytes vs the pool
    moe            85   one Qwen3-30B-A3B decode step, 64 rows x 2k context
Each stage writes OUT_DIR/<stage>.json as it goes ("status": "ok", "error" with the traceback,
or "timeout" keeping what it had written) and OUT_DIR/<stage>.log; a failed stage does not stop
the next. The summary table comes last (also written to OUT_DIR as "summary"); the exit status is 0 when
every stage is ok.

--quick rehearses every stage on CPU (JAX_PLATFORMS=cpu, Pallas interpreted, tiny models,
a handful of kernel tests): about a minute, run by tests/test_device_check.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
# Kernel test cases never run compiled on a GPU before the others: first, so a cut-off run still has them.
PRIORITY_TESTS = "ragged or window or cap or quantiz or int8 or mixed"
# The --quick stand-in for the kernel matrix: the GPU kernel interpreted on an int8 pool with a
# sliding window, and the reference's window and soft cap by hand.
QUICK_TESTS = ["tests/kernels/test_gpu_attention.py::test_quantized_sliding_window",
               "tests/kernels/test_attn_reference.py::test_sliding_window_and_soft_cap_by_hand"]


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    budget_s: int  # on an H200: the stage's timeout
    quick_s: int  # --quick on CPU


STAGES = (Stage("env", 20, 60), Stage("e2e", 120, 120), Stage("kernel_tests", 110, 120),
          Stage("bench_kernels", 75, 90), Stage("decode_8b", 70, 60), Stage("moe", 85, 60))
DEFAULT_BUDGET_S = 480
SUMMARY_FILE = "summary"  # the table, as printed


class Record(dict):
    """A stage's JSON, rewritten on every save() so a timeout leaves what was measured."""

    def __init__(self, path: str, **fields):
        super().__init__(fields)
        self.path = path

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self, f, indent=1, default=str)
        os.replace(tmp, self.path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", nargs="?", default=os.environ.get("OUT") or "device_check_out")
    parser.add_argument("--quick", action="store_true", help="every stage on CPU at tiny shapes")
    parser.add_argument("--stages", help="comma-separated subset, e.g. e2e,moe")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for the whole run")
    parser.add_argument("--stage", help=argparse.SUPPRESS)  # internal: run one stage in this process
    args = parser.parse_args(argv)
    args.out_dir = os.path.abspath(args.out_dir)  # the stages run from the repository root
    os.makedirs(args.out_dir, exist_ok=True)
    if args.stage:
        return run_stage(args.stage, args.out_dir, args.quick)
    names = [s.name for s in STAGES]
    chosen = args.stages.split(",") if args.stages else names
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"unknown stages {unknown}; expected some of {names}")
    deadline = time.monotonic() + args.budget
    for stage in STAGES:
        if stage.name in chosen:
            launch(stage, args, deadline)
    table = summary(args.out_dir, [s.name for s in STAGES if s.name in chosen])
    print(table, flush=True)
    with open(os.path.join(args.out_dir, SUMMARY_FILE), "w") as f:
        f.write(table + "\n")
    return 0 if all(read(args.out_dir, n).get("status") == "ok" for n in chosen) else 1


def launch(stage: Stage, args, deadline: float) -> None:
    """Runs one stage in its own process under `timeout`, its output echoed and logged; a stage
    that died without saying why gets its JSON here."""
    limit = int(min(stage.quick_s if args.quick else stage.budget_s, deadline - time.monotonic()))
    path = os.path.join(args.out_dir, f"{stage.name}.json")
    if os.path.exists(path):
        os.remove(path)
    if limit < 5:
        Record(path, stage=stage.name, status="skipped", error="no time left in the run's budget").save()
        return
    print(f"=== {stage.name} (timeout {limit} s)", flush=True)
    cmd = ["timeout", "--kill-after=10", str(limit), sys.executable, os.path.abspath(__file__),
           args.out_dir, "--stage", stage.name] + (["--quick"] if args.quick else [])
    start = time.monotonic()
    with open(os.path.join(args.out_dir, f"{stage.name}.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=stage_env(args.quick))
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        rc = proc.wait()
    record = Record(path, **read(args.out_dir, stage.name))
    record.setdefault("stage", stage.name)
    record["seconds"] = round(time.monotonic() - start, 1)
    record["timeout_s"] = limit
    if rc in (124, 137):
        record.update(status="timeout", error=f"killed after {limit} s")
    elif record.get("status") != "ok" and "error" not in record:
        record.update(status="error", error=f"exit status {rc} before the stage wrote its result")
    record.save()


def stage_env(quick: bool) -> dict:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if quick:
        env.update(JAX_PLATFORMS="cpu", PAXPAGE_KERNEL_INTERPRET="1")
    return env


def run_stage(name: str, out_dir: str, quick: bool) -> int:
    record = Record(os.path.join(out_dir, f"{name}.json"), stage=name, status="running", quick=quick)
    record.save()
    try:
        from provenance import provenance

        record["provenance"] = provenance()
        if name in ("kernel_tests", "bench_kernels"):
            (kernel_tests if name == "kernel_tests" else bench_kernels)(quick, record, out_dir)
        else:
            import device_stages

            device_stages.STAGES[name](quick, record)
        record["status"] = "ok"
    except Exception as e:  # recorded; the next stage still runs
        record.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        traceback.print_exc()
    record.save()
    return 0 if record["status"] == "ok" else 1


def kernel_tests(quick: bool, record: Record, out_dir: str) -> None:
    """tests/kernels: natively compiled, the priority cases first, pytest -n 4 (quick: a few
    interpreted cases, one process)."""
    base = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    if quick:
        passes = [("quick", QUICK_TESTS)]
    else:
        full = ["tests/kernels", "--extended", "-n", "4", "--dist", "load", "--durations=10"]
        passes = [("priority", full + ["-k", PRIORITY_TESTS]), ("rest", full + ["-k", f"not ({PRIORITY_TESTS})"])]
    env = dict(os.environ, PAXPAGE_KERNEL_INTERPRET="1" if quick else "0")
    record["passes"] = {}
    for name, extra in passes:
        xml = os.path.join(out_dir, f"kernel_tests_{name}.xml")
        start = time.monotonic()
        rc = subprocess.run(base + extra + [f"--junitxml={xml}"], cwd=ROOT, env=env).returncode
        counts = junit_counts(xml)
        counts.update(rc=rc, seconds=round(time.monotonic() - start, 1))
        record["passes"][name] = counts
        record.save()
    total = {k: sum(p.get(k, 0) for p in record["passes"].values()) for k in ("passed", "failed", "errors", "skipped")}
    record.update(total)
    record["headline"] = (f"{total['passed']} passed, {total['failed']} failed, {total['errors']} errors, "
                          f"{total['skipped']} skipped")
    if total["failed"] or total["errors"] or not total["passed"]:
        failed = [n for p in record["passes"].values() for n in p.get("failed_tests", [])]
        raise RuntimeError(f"kernel tests: {record['headline']}; first failures {failed[:5]}")


def junit_counts(path: str) -> dict:
    if not os.path.exists(path):
        return {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "note": "no junit report"}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in root.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"], "failed": n["failures"],
            "errors": n["errors"], "skipped": n["skipped"], "failed_tests": failed[:50]}


def bench_kernels(quick: bool, record: Record, out_dir: str) -> None:
    """scripts/bench_kernels.py as the docs' figure runs it (quick: its --quick), its JSON kept
    beside this record and its best decode and prefill lines lifted into it."""
    path = os.path.join(out_dir, "bench_kernels_data.json")
    cmd = [sys.executable, os.path.join(HERE, "bench_kernels.py"), "--json", path]
    cmd += ["--quick", "--batches", "1", "--contexts", "64"] if quick else ["--iters", "5"]
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    if rc:
        raise RuntimeError(f"bench_kernels.py exited {rc}")
    with open(path) as f:
        data = json.load(f)
    results = data.get("results", [])
    decode = [r for r in results if "gb_s" in r]
    best = max(decode, key=lambda r: r["gb_s"], default=None)
    record.update(data_file=os.path.basename(path), copy_bw_gb_s=data.get("copy_bw_gb_s"), results=results)
    headline = []
    if best:
        headline.append(f"best decode {best['kernel']} B={best['batch']} S={best['context']}: "
                        f"{best['gb_s']:.0f} GB/s ({best['frac_copy_bw']:.0%} of copy)")
    prefill = {r["kernel"]: r for r in results if "tflop_s" in r}
    if prefill:
        headline.append("prefill " + ", ".join(f"{k} {r['tflop_s']:.0f} TFLOP/s" for k, r in prefill.items()))
    record["headline"] = "; ".join(headline)


def read(out_dir: str, name: str) -> dict:
    try:
        with open(os.path.join(out_dir, f"{name}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def summary(out_dir: str, names: list[str]) -> str:
    """The run's table: stage, status, seconds (of its timeout), headline or error."""
    rows = [("stage", "status", "seconds", "result")]
    for name in names:
        r = read(out_dir, name)
        result = r.get("headline") if r.get("status") == "ok" else (r.get("error") or r.get("headline") or "")
        seconds = f"{r.get('seconds', '?')} / {r.get('timeout_s', '?')}"
        rows.append((name, r.get("status", "missing"), seconds, str(result).splitlines()[0][:160] if result else ""))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3] for row in rows]
    lines.insert(1, "-" * max(map(len, lines)))
    return "\n".join(["device check summary", *lines])


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
