"""What the script tests share: loading a script as a module, a tiny random HF llama on disk,
and the checks every script's JSON record passes."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from tests.conftest import save_tiny_hf

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts")
TINY_WORKLOAD = ["--num-requests", "6", "--prompt-range", "3", "20", "--output-range", "2", "9"]


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_tiny_llama")
    save_tiny_hf(path, "llama")
    return str(path)


def _check_record(data: dict, table: str) -> list:
    """The provenance every script's JSON carries (scripts/provenance.py) and one docs table's rows."""
    import jax

    p = data["provenance"]
    assert (p["jax"], p["backend"], p["source"]) == (jax.__version__, "cpu", "measured")
    assert p["machine"] and p["date"] and p["command"].startswith("python ")
    assert p["commit"] is None or len(p["commit"]) == 40
    assert data["measures"]
    t = data["tables"][table]
    assert t["rows"] and all(len(row) == len(t["columns"]) for row in t["rows"])
    # ... as the docs pages render it (scripts/docs_figures.py), machine and command beside it
    sys.path.insert(0, SCRIPTS)
    import docs_figures

    text = docs_figures.render_record("run", data, table, docs_figures.ROOT)
    assert p["machine"] in text and f"`{p['command']}`" in text
    return t["rows"]
