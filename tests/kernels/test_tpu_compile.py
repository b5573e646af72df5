"""Every TPU kernel and the engine step compile for TPU v5e / v6e here, with no TPU
(scripts/tpu_compile_check.py --quick, in a separate environment holding libtpu).

libtpu (~700 MB) never enters the test environment: the first run makes a virtual environment
with `jax[tpu]` at this jax's version and flax at this flax's version under paxpage's cache
directory (PAXPAGE_TPU_VENV overrides the place), later runs reuse it. The project itself is
imported from this checkout (PYTHONPATH). Skipped, saying why, only when libtpu cannot be
installed (no package index reachable).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from models.cache import cache_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "tpu_compile_check.py")
JAX_VERSION = importlib.metadata.version("jax")
FLAX_VERSION = importlib.metadata.version("flax")
REQUIREMENTS = [f"jax[tpu]=={JAX_VERSION}", f"flax=={FLAX_VERSION}", "numpy"]
CHIPS = ("v5e", "v6e")


def _venv_dir() -> str:
    return os.environ.get("PAXPAGE_TPU_VENV") or os.path.join(cache_dir(), f"venv-tpu-jax{JAX_VERSION}")


def _has_libtpu(python: str) -> bool:
    if not os.path.exists(python):
        return False
    probe = subprocess.run([python, "-c", "import libtpu, jax, flax; print(jax.__version__)"],
                           capture_output=True, text=True, timeout=120)
    return probe.returncode == 0 and probe.stdout.strip() == JAX_VERSION


def _tpu_python() -> str:
    """The TPU environment's python, made (or completed) if needed; skips if it cannot be."""
    venv = _venv_dir()
    python = os.path.join(venv, "bin", "python")
    if _has_libtpu(python):
        return python
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    install = subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *REQUIREMENTS],
                             capture_output=True, text=True, timeout=400)
    if install.returncode != 0 or not _has_libtpu(python):
        pytest.skip(f"cannot install {' '.join(REQUIREMENTS)} into {venv} (libtpu needs a package index): "
                    f"{(install.stderr or install.stdout).strip()[-400:]}")
    return python


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    python = _tpu_python()
    out = tmp_path_factory.mktemp("tpu") / "report.json"
    # Not the suite's shared compilation cache: TPU executables are not the CPU suite's, and its
    # file lock needs a package the TPU environment does not hold.
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    run = subprocess.run([python, SCRIPT, "--quick", "--json", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=400)
    print(run.stdout[-4000:])
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_every_kernel_case_compiles_for_v5e_and_v6e(report):
    compiled = {(row["chip"], row["case"]) for row in report["kernels"]}
    # The quick cases by name (the script's list), so dropping one from the run fails here too.
    expected = {(chip, case) for chip in CHIPS for case in (
        "decode smollm2 bf16", "decode llama8b int8", "decode window 512", "mixed 512 fp8",
        "mixed soft-cap 50", "kv write 512 int8", "decode smollm2 bf16 tpu-layout",
        "mixed 512 smollm2 tpu-layout", "kv write 512 tpu-layout", "decode llama8b int8 tpu-layout",
        "mixed 512 fp8 tpu-layout", "kv write 512 int8 tpu-layout")}
    assert expected <= compiled, sorted(expected - compiled)
    assert report["failures"] == []


@pytest.mark.slow
def test_engine_step_compiles_on_one_chip_and_tp8(report):
    steps = {row["step"]: row for row in report["steps"]}
    assert set(steps) == {"smollm2 1 chip, 2 layers", "smollm2 1 chip int8, 2 layers", "smollm2 tp8, 2 layers",
                          "llama8b tp8, 2 layers", "llama8b tp8 int8, 2 layers"}
    for row in steps.values():
        assert row["argument_bytes"] > 0 and row["flops"] > 0
        # The pool is donated: the step's outputs reuse its buffers.
        assert row["alias_bytes"] >= 2 * row["layer_pool_bytes"]
        # The TPU pool's layout tiles: no kernel makes XLA relayout it (an int8 pool's scales neither).
        assert row["pool_copies"] == 0, row
        # Nor stages a leaf of it through VMEM: the int8 scales' write stays in place in HBM, and the
        # kernels read the pool from HBM (a staged leaf came back as a fresh buffer, or was copied).
        assert row["pool_staging"] == 0, row
        # SmolLM2's tied table [49152, 576] is held row-major (models/table_layout.py): its default
        # TPU layout is column-major, which the token gather copies in every step.
        assert row["weight_copies"] == 0, row


@pytest.mark.slow
def test_the_tpu_pool_is_its_logical_bytes_and_never_copied(report):
    rows = {row["pool"]: row for row in report["pool_layout"]}
    # K = 3 / D = 64, K = 1 / D = 128, K = 8 / D = 128: bf16 in both layouts, int8 and fp8 in the tpu one
    assert len(rows) == 12
    chosen = [row for row in rows.values() if row["tpu_pool"]]
    assert len(chosen) == 9 and all(row["layout"] == "tpu" for row in chosen), chosen
    assert all(row["ratio"] <= 1.1 and row["pool_copies"] == 0 and row["scale_copies"] == 0 for row in chosen), chosen
    assert not [f for f in report["findings"] if f.startswith("pool ")], report["findings"]


@pytest.mark.slow
def test_the_canonical_layouts_copies_on_tpu_are_counted(report):
    # Where K < 8 the kernels relay out a canonical [2, P, page_size, K, D] pool: the count that
    # makes the tpu layout the TPU's; a layout change that ends them must change this and the docs.
    canonical = [row for row in report["pool_layout"] if row["layout"] == "canonical"]
    assert len(canonical) == 3 and not any(row["tpu_pool"] for row in canonical)
    assert all(row["pool_copies"] > 0 for row in canonical if not row["pool"].startswith("K=8")), canonical


@pytest.mark.slow
def test_quantised_experts_are_never_expanded_whole(report):
    # gpt-oss-20b's experts held quantised (int8 per channel or per 32 inputs, MXFP4's 4-bit codes)
    # through both grouped matmuls: XLA fuses each expansion into its matmul, so no temporary reaches
    # one expert's bf16 size (~32 MiB); expanding every expert for ragged_dot measured 1-3 GiB.
    rows = {(row["form"], row["impl"]): row for row in report["moe"]}
    forms = ("bf16", "int8 per channel", "int8, G=32 (GGUF Q8_0)", "mxfp4 4-bit, G=32")
    assert set(rows) == {(form, impl) for form in forms for impl in ("ragged_dot", "tiled")}
    assert all(row["temp_bytes"] < 8 * 2**20 for row in rows.values()), rows
    assert rows[("mxfp4 4-bit, G=32", "tiled")]["argument_bytes"] < 0.35 * rows[("bf16", "tiled")]["argument_bytes"]
    assert not [f for f in report["findings"] if f.startswith("moe ")], report["findings"]
