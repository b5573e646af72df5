"""Subprocess helpers for the multi-device tests: jax reads XLA_FLAGS once, when it starts, so
every check with forced host devices runs in a fresh interpreter, bounded in time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def device_env(num_devices: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={num_devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_json(args: list[str], *, num_devices: int = 4, timeout: float = 300) -> dict:
    """Runs `python -m <args>` with forced devices; returns the JSON its last stdout line holds."""
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=device_env(num_devices),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
