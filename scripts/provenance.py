"""Where a benchmark figure comes from: the machine, the software, the date, the command and the
commit it measured. Every benchmark script's JSON carries this under "provenance", and the docs'
tables print it beside the figures (scripts/docs_figures.py)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_model() -> str:
    """lscpu's "Model name" and the number of CPUs this process may use."""
    name = None
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                name = line.split(":", 1)[1].strip()
                break
    except (OSError, subprocess.SubprocessError):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name or platform.processor() or 'unknown CPU'}, {cores} cores"


def machine() -> str:
    """The accelerator jax runs on (device kind and count), else the CPU."""
    import jax

    backend = jax.default_backend()
    if backend == "cpu":
        return cpu_model()
    devices = jax.devices()
    return f"{len(devices)} x {devices[0].device_kind}" if len(devices) > 1 else devices[0].device_kind


def git(*args: str) -> str | None:
    """A git command's output in this checkout; None when git is missing or the command fails."""
    try:
        proc = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def git_commit() -> tuple[str | None, bool]:
    """The checkout's HEAD and whether its tracked files differ from it."""
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, bool(status)


def provenance(argv: list[str] | None = None) -> dict:
    import jax
    import jaxlib

    commit, dirty = git_commit()
    args = sys.argv if argv is None else argv
    script = os.path.relpath(os.path.abspath(args[0]), ROOT) if args else "?"
    return {
        "machine": machine(),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": shlex.join(["python", script, *args[1:]]),
        "commit": commit,
        "dirty": dirty,
        "source": "measured",
    }


# The code an end-to-end figure measures: a commit touching any of it may change the figure.
ENGINE_CODE = ("paxpage", "models", "pallas_kernels")


def write_record(path: str, data: dict, tables: dict | None = None, measures=ENGINE_CODE,
                 argv: list[str] | None = None, charts: dict | None = None) -> None:
    """Writes a benchmark's figures as JSON with "provenance" and "measures" (the code paths the
    figures measure) beside them. `tables`: the rows the docs show, {id: {"columns": [...],
    "rows": [[...]]}}; `charts`: the plots they show, {id: {"kind": "line" | "bar", "panels": [...]}};
    scripts/docs_figures.py renders both into the pages (its docstring has the chart format)."""
    clash = {"provenance", "measures", "tables", "charts"} & set(data)
    if clash:
        raise ValueError(f"benchmark results may not use the record's own keys {sorted(clash)}")
    record = dict(data, provenance=provenance(argv), measures=list(measures))
    if tables is not None:
        record["tables"] = tables
    if charts is not None:
        record["charts"] = charts
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")
