"""Servers for the serving benchmark: paxpage's and HF transformers' own, as subprocesses.

Both listen on 127.0.0.1 at a free ephemeral port, log to a file, and are ready when
`/health` answers 200 and `/v1/models` names a model. `ServerProcess` is a context manager:
the server is stopped (SIGINT to its process group, then SIGKILL) however the block exits,
Ctrl-C included. `write_hf_copy` converts a GGUF to an HF model directory, the format
`transformers serve` reads, so both servers run the same dequantised weights.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A port the kernel just handed out and released (a small race, fine on loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One server subprocess in its own process group, with a readiness deadline."""

    def __init__(self, name: str, command: list[str], port: int, startup_timeout: float,
                 env: dict | None = None):
        self.name, self.command, self.port = name, command, port
        self.startup_timeout = startup_timeout
        self.env = env
        self.base_url = f"http://127.0.0.1:{port}"
        self.model_id: str | None = None
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile("w+b", prefix=f"bench_serving_{name}_", suffix=".log",
                                               delete=False)

    def __enter__(self) -> "ServerProcess":
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=REPO, env=self.env,
                                     start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, num_bytes: int = 3000) -> str:
        self.log.flush()
        with open(self.log.name, "rb") as f:
            f.seek(max(0, os.path.getsize(self.log.name) - num_bytes))
            return f.read().decode(errors="replace")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with code {self.proc.returncode} before it was "
                                   f"ready; last log lines:\n{self.log_tail()}")
            try:
                health = httpx.get(f"{self.base_url}/health", timeout=5)
                models = httpx.get(f"{self.base_url}/v1/models", timeout=5)
                if health.status_code == 200 and models.status_code == 200 and models.json().get("data"):
                    self.model_id = models.json()["data"][0]["id"]
                    return
            except (httpx.HTTPError, ValueError):
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} server not ready within {self.startup_timeout:g} s; last log "
                                   f"lines:\n{self.log_tail()}")
            time.sleep(1.0)

    def stop(self, grace: float = 15.0) -> None:
        """SIGINT to the whole group (uvicorn shuts down cleanly), SIGKILL after `grace` s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def paxpage_command(model_dir: str, port: int, name: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "paxpage.cli", "serve", "--model", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", name, *extra]


def hf_command(model_dir: str, port: int, extra: list[str]) -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "transformers")
    if not os.path.exists(exe):
        exe = shutil.which("transformers") or "transformers"
    return [exe, "serve", model_dir, "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", *extra]


def hf_kv_block_bytes(model_dir: str, page_size: int = 256, itemsize: int = 4) -> int:
    """Bytes of one `transformers serve` KV block (page_size tokens, every layer, K and V)."""
    import json

    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * itemsize * page_size


def write_hf_copy(source: str, out_dir: str) -> str:
    """An HF-format directory (config, float32 safetensors, tokenizer) of `source`.

    A directory with a config.json is used as it is; a .gguf is loaded by transformers
    (dequantised, as tests/conftest.py does) and saved to `out_dir`, reused when present."""
    if os.path.isdir(source) and os.path.isfile(os.path.join(source, "config.json")):
        return source
    if not source.endswith(".gguf"):
        raise ValueError(f"--model {source!r}: expected a .gguf file or an HF model directory")
    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, gguf_file = os.path.split(os.path.abspath(source))
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
    # A GGUF-loaded model counts as quantised and refuses save_pretrained, though its weights
    # are already dequantised: move them into a plain model of the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = type(model)(config)
    plain.load_state_dict(model.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = model.generation_config
    os.makedirs(out_dir, exist_ok=True)
    plain.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file).save_pretrained(out_dir)
    return out_dir
