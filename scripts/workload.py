"""Shared benchmark workload: request lengths, random prompts, and backend-sized defaults.

Lengths follow a ShareGPT-like shape, scaled to the machine: prompt and output lengths are
independent log-normals (a long right tail, most requests short) clipped to [lo, hi]. The
median sits at the geometric mean of the range, and sigma is chosen so that lo and hi are
about two standard deviations out, which matches the spread of the ShareGPT conversations
vLLM benchmarks on, at a size a 2-core CPU finishes in minutes. `--lengths FILE` replaces
the draw with explicit [prompt_len, output_len] pairs.

Prompts are uniformly random token ids (fixed seed): no shared prefixes, so prefix caching
never helps and both systems do the full prefill work. Generation ignores EOS, so every
request produces exactly its output length.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from paxpage import config as config_lib  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Defaults:
    """Workload sizes for one backend; the engine's step sizes are the engine's own defaults
    there (paxpage.config.BACKEND_DEFAULTS)."""

    backend: str
    num_requests: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    hf_batch_sizes: tuple[int, ...]

    @property
    def max_num_seqs(self) -> int:
        return config_lib.backend_defaults(self.backend).max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return config_lib.backend_defaults(self.backend).max_num_batched_tokens


# A 2-core CPU runs paxpage and the HF baseline on this in a few minutes; accelerators get
# a workload closer to ShareGPT's (hundreds of requests, prompts and outputs in the hundreds).
CPU_DEFAULTS = Defaults("cpu", 48, (16, 128), (16, 128), (8, 16, 32))
ACCEL_DEFAULTS = Defaults("gpu", 512, (32, 1024), (32, 512), (32, 64, 128))


def backend_defaults() -> Defaults:
    backend = jax.default_backend()
    return CPU_DEFAULTS if backend == "cpu" else dataclasses.replace(ACCEL_DEFAULTS, backend=backend)


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]  # token ids per request
    output_lens: list[int]  # tokens to generate per request (EOS ignored)
    shared_prefix: int = 0  # leading tokens common to every prompt

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def summary(self) -> dict:
        p, o = np.array(self.prompt_lens), np.array(self.output_lens)
        return {
            "num_requests": self.num_requests,
            "prompt_tokens": int(p.sum()), "output_tokens": int(o.sum()),
            "prompt_len": {"min": int(p.min()), "median": float(np.median(p)), "max": int(p.max())},
            "output_len": {"min": int(o.min()), "median": float(np.median(o)), "max": int(o.max())},
        }

    def lengths(self) -> list[tuple[int, int]]:
        return list(zip(self.prompt_lens, self.output_lens))

    def with_fresh_prompts(self, vocab_size: int, seed: int) -> "Workload":
        """Same lengths, other random prompts: a warm-up that meets the same shapes without
        leaving prefix-cache entries the measured pass could hit."""
        return make_workload(self.lengths(), vocab_size, seed, self.shared_prefix)


def _clipped_lognormal(rng: np.random.Generator, n: int, lo: int, hi: int) -> np.ndarray:
    if not 1 <= lo <= hi:
        raise ValueError(f"length range [{lo}, {hi}] must satisfy 1 <= lo <= hi")
    mu = 0.5 * (math.log(lo) + math.log(hi))
    sigma = max(1e-6, (math.log(hi) - math.log(lo)) / 4)  # lo and hi ~2 sigma from the median
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), lo, hi).astype(int)


def sharegpt_lengths(num_requests: int, seed: int, prompt_range: tuple[int, int],
                     output_range: tuple[int, int]) -> list[tuple[int, int]]:
    """[(prompt_len, output_len)] drawn from clipped log-normals (see the module docstring)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = np.random.default_rng(seed)
    prompts = _clipped_lognormal(rng, num_requests, *prompt_range)
    outputs = _clipped_lognormal(rng, num_requests, *output_range)
    return [(int(p), int(o)) for p, o in zip(prompts, outputs)]


def read_lengths(path: str) -> list[tuple[int, int]]:
    """A JSON list of [prompt_len, output_len] pairs, each >= 1."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty JSON list of [prompt_len, output_len]")
    pairs = []
    for i, item in enumerate(data):
        if (not isinstance(item, (list, tuple)) or len(item) != 2
                or not all(isinstance(x, int) and x >= 1 for x in item)):
            raise ValueError(f"{path}: entry {i} is {item!r}; expected [prompt_len, output_len], ints >= 1")
        pairs.append((item[0], item[1]))
    return pairs


def make_workload(lengths: list[tuple[int, int]], vocab_size: int, seed: int,
                  shared_prefix: int = 0) -> Workload:
    """Random prompt token ids for each (prompt_len, output_len). With shared_prefix > 0 every
    prompt starts with the same random tokens (a system prompt; prompt lengths unchanged)."""
    rng = np.random.default_rng(seed + 1)  # a stream independent of the length draw
    prefix = rng.integers(0, vocab_size, size=shared_prefix).tolist()
    prompts = [(prefix[:p] + rng.integers(0, vocab_size, size=max(0, p - shared_prefix)).tolist())
               for p, _ in lengths]
    return Workload(prompts, [o for _, o in lengths], shared_prefix)


def add_workload_args(parser: argparse.ArgumentParser, defaults: Defaults) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=defaults.num_requests)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--prompt-range", type=int, nargs=2, metavar=("LO", "HI"),
                   default=list(defaults.prompt_range), help="clip range of prompt lengths")
    g.add_argument("--output-range", type=int, nargs=2, metavar=("LO", "HI"),
                   default=list(defaults.output_range), help="clip range of output lengths")
    g.add_argument("--lengths", metavar="FILE",
                   help="JSON list of [prompt_len, output_len]; replaces the random draw")
    g.add_argument("--model", default=None,
                   help="anything paxpage.load accepts (default: SmolLM2-135M-Instruct GGUF)")


def workload_from_args(args, vocab_size: int, shared_prefix: int = 0) -> Workload:
    if args.lengths:
        lengths = read_lengths(args.lengths)
    else:
        lengths = sharegpt_lengths(args.num_requests, args.seed, tuple(args.prompt_range),
                                   tuple(args.output_range))
    return make_workload(lengths, vocab_size, args.seed, shared_prefix)


def write_json(path: str, data: dict, tables: dict | None = None, measures=None, charts: dict | None = None) -> None:
    """The figures with their provenance (scripts/provenance.py: write_record)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:  # this module may be loaded by path, without scripts/ on sys.path
        sys.path.insert(0, here)
    import provenance

    provenance.write_record(path, data, tables, measures or provenance.ENGINE_CODE, charts=charts)


def exec_cache_stats(engine) -> dict | None:
    """The engine's executable cache counts (loaded / compiled / stored ..., seconds rounded), or
    None without one (EngineConfig.executable_cache_dir)."""
    cache = getattr(engine.runner, "exec_cache", None)
    return None if cache is None else {k: round(v, 2) for k, v in cache.stats.items()}


def exec_cache_label(stats: dict | None) -> str:
    """How a run found its executable cache (`exec_cache_stats`): "none", "cold (empty; 21
    executables compiled in 8.4 s)" or "warm (21 executables loaded in 0.27 s)"."""
    if stats is None:
        return "none"
    if stats["loaded"] == 0:
        return f"cold (empty; {stats['compiled']} executables compiled in {stats['compile_s']:.1f} s)"
    return (f"warm ({stats['loaded']} executables loaded in {stats['load_s']:.2f} s"
            + (f", {stats['compiled']} compiled)" if stats["compiled"] else ")"))


def percentiles(values, qs=(50, 90, 99)) -> dict[str, float]:
    if len(values) == 0:
        return {f"p{q}": float("nan") for q in qs}
    return {f"p{q}": float(np.percentile(values, q)) for q in qs}
