"""`paxpage docs`: the user documentation (docs/, mkdocs.yml) served on 127.0.0.1 or built into
site/, from a source checkout with the `docs` extra installed."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_docs_parser(subparsers) -> argparse.ArgumentParser:
    d = subparsers.add_parser("docs", help="serve the documentation on 127.0.0.1 (or --build it)")
    d.add_argument("--build", action="store_true", help="write the site to site/ with a strict build instead")
    d.add_argument("--port", type=int, default=8000, help="the port to serve on (127.0.0.1 only)")
    d.set_defaults(func=run_docs)
    return d


def mkdocs_command(args: argparse.Namespace) -> list[str]:
    config = os.path.join(ROOT, "mkdocs.yml")
    if not os.path.exists(config):
        raise ValueError(f"no mkdocs.yml in {ROOT}: the docs are read from a source checkout")
    if importlib.util.find_spec("mkdocs") is None:
        raise ValueError('mkdocs is not installed; install the docs extra: pip install -e ".[docs]"')
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.build:
        return [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config]
    return [sys.executable, "-m", "mkdocs", "serve", "-f", config, "-a", f"127.0.0.1:{args.port}"]


def run_docs(args: argparse.Namespace) -> int:
    return subprocess.run(mkdocs_command(args), cwd=ROOT).returncode
