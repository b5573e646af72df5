"""Online serving: normalised latency against request rate, paxpage's server, HF's and vLLM's, side by side.

The vLLM paper's measurement (its Figure 12): requests arrive as a Poisson process at a
given rate; each is a streamed OpenAI `/v1/completions` call; a system sustains a rate while
its normalised latency (mean over requests of end-to-end latency / output tokens) stays low.

    python scripts/bench_serving.py --json /tmp/serving.json --plot /tmp/serving.png
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --api vllm   # a running server
    python scripts/bench_serving.py --from-json /tmp/serving.json --latency-limit 0.2  # re-report

By default the script writes an HF-format copy of the model (`--model`, the SmolLM2 GGUF
unless given) and starts, on 127.0.0.1 at ephemeral ports, both
    paxpage  python -m paxpage.cli serve --model HF_COPY ...
    hf       transformers serve HF_COPY --continuous-batching ...
on that same directory (same weights, same tokenizer, float32), and stops them at the end,
on errors and on Ctrl-C. With a vLLM venv (--vllm-python or $PAXPAGE_VLLM_PYTHON;
scripts/vllm_peer.py; without one it is skipped with a message) also
    vllm     VENV/bin/python -m vllm.entrypoints.openai.api_server --model HF_COPY ...
tuned as vLLM's CPU docs say (tcmalloc and Intel OpenMP preloaded, OpenMP threads on every
core, none reserved), with the same KV budget (VLLM_CPU_KVCACHE_SPACE) and per-step token
budget, and its own page size (its CPU attention takes multiples of 32). The KV budget is the same (1 GiB, paxpage's default; HF gets as
many 256-token blocks) and so is the per-step token budget (512); HF's torch runs on one
thread (--hf-threads: on a busy 2-core machine OpenMP's spinning made 2 threads ~5x slower).
Before measuring, each server gets a burst and an unmeasured pass over the rates (paxpage serve
compiles its step shapes before listening, unless --paxpage-args=--no-precompile, when it
compiles each on first use and Poisson traffic meets shapes a burst does not). The
systems take turns at each rate (same prompts, same lengths, same arrival times), so machine
noise hits both alike.

Workload: ShareGPT-like prompt / output lengths from scripts/workload.py. Prompts are text
made of random single-token words, so each server's tokenizer gives exactly the drawn prompt
length (the usage figures report it). Fresh prompts for every run: no prefix-cache hits.
Two modes:
    natural  `max_tokens` = the drawn output length; a request may stop early at EOS, and
             normalised latency divides by each request's own output tokens
    forced   exactly the drawn length: vLLM's `ignore_eos` for paxpage; for HF (which rejects
             unknown fields) a per-request `generation_config` with `eos_token_id: -1`
`share_exact_length` says whether each server produced exactly the tokens asked for.

Per rate and system: achieved requests/s and output tokens/s, TTFT and TPOT p50/p90/p99,
normalised latency (scripts/serving_load.py defines them), and the longest stall between two
tokens of any request (a paxpage compile of a new step shape shows up there). Per mode: the highest measured
rate each system sustains with normalised latency <= --latency-limit (every lower rate too,
every request finished; the default limit is twice the slower system's lowest normalised
latency), the crossing interpolated on a log-rate axis, and their ratio.
Every request (--request-timeout) and every rate run (--rate-timeout) is bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import re
import shlex
import signal
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serving_load as load  # noqa: E402
import serving_servers as srv  # noqa: E402
import vllm_peer  # noqa: E402
# the run's figures (scripts/serving_report.py); the tests reach them as bench_serving.<name>
from serving_report import capacity, doc_charts, doc_tables, latency_limit, rate_ratios, report  # noqa: E402,F401
import workload as wl  # noqa: E402

KV_CACHE_BYTES = 1 << 30  # paxpage's default KV budget; HF's server gets the same
MAX_BATCH_TOKENS = 512  # paxpage's default max_num_batched_tokens
# Extras each API accepts for forcing the output length (None: it cannot).
APIS = ("paxpage", "vllm", "hf", "openai")
MODES = ("natural", "forced")


# ---------------------------------------------------------------------------------------- requests
def word_vocab(tokenizer) -> list[str]:
    """Words (a leading space, 3+ lowercase letters) that the tokenizer keeps as one token."""
    words = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if re.fullmatch(r" [a-z]{3,}", text) and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
            words.append(text)
    if len(words) < 100:
        raise ValueError(f"the tokenizer has only {len(words)} single-token words; cannot build text prompts")
    return words


def text_prompts(tokenizer, words: list[str], prompt_lens: list[int], seed: int) -> tuple[list[str], list[int]]:
    """Random-word texts of the given token lengths; returns the texts and their real lengths."""
    rng = np.random.default_rng(seed)
    texts = ["".join(rng.choice(words, size=n)) for n in prompt_lens]
    return texts, [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]


def request_body(api: str, mode: str, model_id: str, prompt: str, output_len: int) -> dict:
    body = {"model": model_id, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "stream_options": {"include_usage": True}}
    if mode == "forced":
        if api in ("paxpage", "vllm"):
            body["ignore_eos"] = True
        elif api == "hf":  # transformers serve: a GenerationConfig as JSON; -1 disables EOS
            body["generation_config"] = json.dumps({"max_new_tokens": output_len, "eos_token_id": -1,
                                                    "do_sample": False})
        else:
            raise ValueError(f"--api {api} has no way to force output lengths; use --modes natural")
    return body


# ---------------------------------------------------------------------------------------- capacity


# ---------------------------------------------------------------------------------------- main
def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    wl.add_workload_args(parser, dataclasses.replace(wl.CPU_DEFAULTS, num_requests=24))
    parser.add_argument("--request-rates", default="0.5,1,2,4,8",
                        help="comma-separated offered rates in req/s ('inf': all at once)")
    parser.add_argument("--modes", default="natural,forced", help="natural and/or forced (see above)")
    parser.add_argument("--systems", default="paxpage,hf,vllm",
                        help="servers to start: paxpage, hf, vllm (vllm only with a vLLM venv: see --vllm-python)")
    parser.add_argument("--base-url", help="benchmark this running server instead of starting any")
    parser.add_argument("--api", choices=APIS, default="vllm",
                        help="with --base-url: how it forces lengths (paxpage, vllm: ignore_eos; "
                             "hf: generation_config; openai: it cannot)")
    parser.add_argument("--served-model-name", help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--tokenizer", help="HF dir or .gguf for the prompt texts (default: the model's)")
    parser.add_argument("--hf-dir", help="where the HF copy of --model goes (default: a temporary dir)")
    parser.add_argument("--paxpage-args", default="", help="extra `paxpage serve` arguments (one string)")
    parser.add_argument("--hf-args", default=None,
                        help="extra `transformers serve` arguments (default: the KV / batch budget above)")
    parser.add_argument("--hf-threads", type=int, default=1,
                        help="torch threads of HF's server (OMP_NUM_THREADS; 0: torch's default). On this "
                             "loaded 2-core machine 1 thread decoded ~5x faster than 2 (OpenMP spin barriers)")
    parser.add_argument("--vllm-args", default="",
                        help="extra arguments of vLLM's server (one string)")
    vllm_peer.add_args(parser)
    parser.add_argument("--latency-limit", default="auto",
                        help="normalised latency (s/token) a sustained rate stays under. 'auto' (per mode): "
                             "twice the slower system's light-load value (its lowest over the rates), so "
                             "both can qualify and the limit marks where queueing has doubled the "
                             "per-token time of the slower one")
    parser.add_argument("--warmup-requests", type=int, default=16,
                        help="requests sent at once to each server before measuring (compiles, CB start)")
    parser.add_argument("--warmup-rates", default=None,
                        help="then an unmeasured pass at these rates (default: --request-rates; '' for "
                             "none): Poisson arrivals make step shapes a burst never does, and paxpage "
                             "compiles each shape once (seconds each on a busy CPU)")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--rate-timeout", type=float, default=900.0)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--from-json", metavar="PATH",
                        help="measure nothing: report (limit, table, plot) from an earlier --json")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--plot", metavar="PATH.png")
    args = parser.parse_args(argv)
    args.request_rates = [float(r) for r in args.request_rates.split(",")]
    args.warmup_rates = (args.request_rates if args.warmup_rates is None
                         else [float(r) for r in args.warmup_rates.split(",") if r])
    args.modes = [m for m in args.modes.split(",") if m]
    args.systems = [args.api] if args.base_url else [s for s in args.systems.split(",") if s]
    if any(r <= 0 for r in args.request_rates):
        parser.error(f"--request-rates must be > 0, got {args.request_rates}")
    if not set(args.modes) <= set(MODES):
        parser.error(f"--modes must be among {MODES}, got {args.modes}")
    if not args.base_url and not set(args.systems) <= {"paxpage", "hf", "vllm"}:
        parser.error(f"--systems must be among paxpage,hf,vllm, got {args.systems}")
    args.vllm_version = None
    if "vllm" in args.systems and not args.base_url:
        python, why = (None, "--no-vllm") if args.no_vllm else vllm_peer.find_python(args.vllm_python)
        if python is None:
            vllm_peer.skipped(why)
            args.systems = [s for s in args.systems if s != "vllm"]
        else:
            args.vllm_python, args.vllm_version = python, why
    if args.base_url and args.api == "openai" and "forced" in args.modes:
        print("--api openai cannot force output lengths: measuring natural EOS only", file=sys.stderr)
        args.modes = [m for m in args.modes if m != "forced"]
    return args


def load_tokenizer(source: str):
    from models.loading import default_model_path
    from models.tokenizer import load_tokenizer as load

    source = source or default_model_path()
    if source.endswith(".gguf"):
        return load(os.path.dirname(os.path.abspath(source)), gguf_file=os.path.basename(source))
    return load(source)


def start_servers(args, stack: contextlib.ExitStack, hf_dir: str) -> dict:
    """{system: (base_url, model_id)}; servers stop when `stack` closes."""
    if args.base_url:
        import httpx

        model_id = args.served_model_name
        if model_id is None:
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
            model_id = httpx.get(f"{args.base_url.rstrip('/')}/v1/models", headers=headers,
                                 timeout=30).json()["data"][0]["id"]
        return {args.api: (args.base_url.rstrip("/"), model_id)}
    out = {}
    for system in args.systems:
        port = srv.free_port()
        env = None
        if system == "paxpage":
            command = srv.paxpage_command(hf_dir, port, "smollm2", shlex.split(args.paxpage_args))
        elif system == "vllm":
            extra = ["--max-num-batched-tokens", str(MAX_BATCH_TOKENS), *shlex.split(args.vllm_args)]
            command = vllm_peer.server_command(args.vllm_python, args.vllm_model or hf_dir, port, "smollm2", extra)
            env = vllm_peer.environment(args.vllm_python, KV_CACHE_BYTES / (1 << 30))
        else:
            extra = args.hf_args
            if extra is None:
                blocks = max(1, KV_CACHE_BYTES // srv.hf_kv_block_bytes(hf_dir))
                extra = f"--cb-num-blocks {blocks} --cb-max-batch-tokens {MAX_BATCH_TOKENS}"
            command = srv.hf_command(hf_dir, port, shlex.split(extra))
        if system == "hf" and args.hf_threads > 0:
            env = dict(os.environ, OMP_NUM_THREADS=str(args.hf_threads), MKL_NUM_THREADS=str(args.hf_threads))
        print(f"starting {system}: {shlex.join(command)}", flush=True)
        server = stack.enter_context(srv.ServerProcess(system, command, port, args.startup_timeout, env))
        print(f"  ready at {server.base_url} (model {server.model_id!r}; log {server.log.name})", flush=True)
        out[system] = (server.base_url, server.model_id)
    return out


def run(args, specs_for, servers: dict) -> dict:
    """Warm-ups, then every (mode, rate) with the systems taking turns: {mode: {system: [points]}}."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None

    def one(system, mode, rate, specs, seed):  # one rate run: a summary
        url, _ = servers[system]
        records = asyncio.run(load.run_rate(f"{url}/v1/completions", specs, rate, seed,
                                            args.request_timeout, args.rate_timeout, headers))
        return load.summarise(records, specs)

    # Compiles (paxpage), CB start-up (HF); natural mode first (HF's CB takes its shared
    # sampling settings from its first request). Fresh prompts: nothing left to prefix-cache.
    warmups = [("warm-up burst", math.inf, args.warmup_requests)]
    warmups += [(f"warm-up rate {r:g}", r, args.num_requests) for r in args.warmup_rates]
    for label, rate, n in warmups:
        for system in servers:
            summary = one(system, "natural", rate, specs_for(system, "natural", label, n), args.seed + 1)
            print(f"{label} {system}: {summary['num_finished']}/{summary['num_requests']} finished "
                  f"in {summary['duration_s'] or 0:.1f} s {summary['errors'] or ''}", flush=True)
    results = {mode: {system: [] for system in servers} for mode in args.modes}
    for mode in args.modes:
        for i, rate in enumerate(args.request_rates):
            for system in servers:  # taking turns: the same noise for both
                specs = specs_for(system, mode, i, args.num_requests)
                point = dict(one(system, mode, rate, specs, args.seed + 1000 * i), rate=rate)
                results[mode][system].append(point)
                print(f"{mode:>7} {system:>8} rate {rate:g}: {point['num_finished']}/{point['num_requests']} "
                      f"finished, {point['requests_per_s']:.2f} req/s, normalised latency "
                      f"{point['normalised_latency_s'] or float('nan'):.4f} s/token "
                      f"{point['errors'] or ''}", flush=True)
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            old = json.load(f)
        args.modes = [m for m in MODES if m in old["results"]]
        args.request_rates = old["request_rates"]
        args.num_requests = old["workload"]["num_requests"]
        order = sorted(old["servers"], key=lambda s: (s != "paxpage", s))  # json sorted them
        servers = {s: (old["servers"][s]["base_url"], old["servers"][s]["model"]) for s in order}
        results = {m: {s: old["results"][m][s] for s in order} for m in args.modes}
        return report(args, results, servers, old["workload"]["lengths"],
                      old["workload"]["prompt_tokens_by_tokenizer"])
    if args.lengths:
        lengths = wl.read_lengths(args.lengths)
    else:
        lengths = wl.sharegpt_lengths(args.num_requests, args.seed, tuple(args.prompt_range),
                                      tuple(args.output_range))
    args.num_requests = len(lengths)
    with contextlib.ExitStack() as stack:
        if threading_main():
            previous = signal.signal(signal.SIGTERM, _raise_interrupt)
            stack.callback(signal.signal, signal.SIGTERM, previous)
        hf_dir = None
        if not args.base_url:
            hf_dir = args.hf_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_serving_hf_"))
            print(f"HF copy of {args.model or 'SmolLM2-135M-Instruct (GGUF)'} in {hf_dir}", flush=True)
            from models.loading import default_model_path

            hf_dir = srv.write_hf_copy(args.model or default_model_path(), hf_dir)
        tokenizer = load_tokenizer(args.tokenizer or hf_dir or args.model)
        words = word_vocab(tokenizer)
        prompt_cache, real_lens = {}, {}

        def specs_for(system, mode, run_key, n):
            """Same prompts for every system in a given run; fresh ones for every run."""
            key = (mode, run_key)
            if key not in prompt_cache:
                draw = (lengths * n)[:n]  # the warm-up may ask for more than there are
                texts, lens = text_prompts(tokenizer, words, [p for p, _ in draw],
                                           seed=args.seed + 7919 * (len(prompt_cache) + 1))
                prompt_cache[key] = (texts, [o for _, o in draw])
                real_lens[key] = lens
            texts, outs = prompt_cache[key]
            model_id = servers[system][1]
            return [load.RequestSpec(request_body(system, mode, model_id, t, o), o) for t, o in zip(texts, outs)]

        servers = start_servers(args, stack, hf_dir)
        results = run(args, specs_for, servers)
    return report(args, results, servers, lengths, {f"{m}/{i}": v for (m, i), v in real_lens.items()})


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    from paxpage.process_tuning import tune_malloc

    tune_malloc()  # glibc keeps large freed buffers for reuse (paxpage/process_tuning.py)
    sys.exit(main())
