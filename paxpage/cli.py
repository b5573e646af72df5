"""Command line: `paxpage generate "What is the capital of France?"`, `paxpage cache info`, `paxpage docs`.

A user's mistake (a bad value, a missing file) prints one line, `paxpage: error: <message>`, and
exits with status 2; `paxpage --debug ...` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

# Commands that run a model in this process, which paxpage then owns: glibc's malloc thresholds
# are raised for them (paxpage/process_tuning.py), never on import of the library.
_OWNS_PROCESS = ("generate", "serve", "bench")
# The name `generate --lora PATH` loads its adapter under.
LORA_NAME = "lora"
# Packages whose own exception classes are messages for users, whatever their base class.
_OWN_PACKAGES = ("paxpage", "models", "pallas_kernels")


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def _generate(args: argparse.Namespace) -> int:
    import paxpage
    from paxpage import multihost, xla_cache

    # Only the options given: the model's own sampling defaults fill the others.
    given = {name: getattr(args, name) for name in ("temperature", "top_p", "top_k", "seed")
             if getattr(args, name) is not None}
    # Checked before the model loads, so a bad value fails in a second, not after the load.
    params = paxpage.SamplingParams(max_tokens=args.max_tokens, **given)
    from paxpage.exec_cache import default_directory

    config = paxpage.EngineConfig(tensor_parallel_size=args.tensor_parallel_size,
                                  data_parallel_size=args.data_parallel_size,
                                  kv_cache_dtype=args.kv_cache_dtype,
                                  batch_invariant=args.batch_invariant,
                                  enable_expert_parallel=args.enable_expert_parallel,
                                  executable_cache_dir=default_directory())
    from paxpage import kv_sizing

    kv_sizing.claim_client_memory(config.gpu_memory_utilization)  # before jax starts its GPU client
    multi = multihost.initialize(args.coordinator_address, args.num_processes, args.process_id,
                                 peer_timeout_s=args.peer_timeout)
    xla_cache.enable_unless_executable_cache(config, multi)
    model = paxpage.load(args.model, quantization=args.quantization)
    if args.lora is not None:  # every prompt runs with it: one slot, the adapter's own rank
        model.load_lora(LORA_NAME, args.lora)
        config = dataclasses.replace(config, max_loras=1, max_lora_rank=model.loras[LORA_NAME].rank)
    if "temperature" not in given and model.config.generation.temperature is None:
        params = params.replace(temperature=0.0)  # greedy unless the model recommends otherwise
    if multi and not multihost.is_leader():  # a follower: runs process 0's steps, prints nothing
        model.engine(config).runner.follow()
        return 0
    try:
        return _answer(args, model, params, config)
    finally:
        if multi:
            model.engine(config).runner.stop_followers()


def _answer(args: argparse.Namespace, model, params, config) -> int:
    import paxpage

    lora = LORA_NAME if args.lora is not None else None
    prompts = args.prompts or [
        "What is the capital of France?",
        "Give me three tips for staying healthy.",
        "Write a haiku about the sea.",
    ]
    # Instruct models answer chats; --raw sends the text as it is.
    inputs = prompts if args.raw else [[{"role": "user", "content": p}] for p in prompts]
    if args.stream:
        current, counts = None, [0] * len(prompts)
        for delta in paxpage.stream(model, inputs, sampling_params=params, engine_config=config,
                                    lora=lora):
            if delta.index != current:
                current = delta.index
                print(f"\n>>> {prompts[delta.index]}\n", end="", flush=True)
            print(delta.text, end="", flush=True)
            counts[delta.index] += len(delta.token_ids)
            if delta.finish_reason is not None:
                print(f"\n[{delta.finish_reason}, {_tokens(counts[delta.index])}]", flush=True)
                current = None
        print()
        return 0
    outputs = paxpage.generate(model, inputs, sampling_params=params, engine_config=config, lora=lora)
    for prompt, out in zip(prompts, outputs):
        print(f">>> {prompt}\n{out.text.strip()}\n[{out.finish_reason}, {_tokens(len(out.token_ids))}]\n")
    return 0


def _megabytes(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:.1f} MB"


def _cache(args: argparse.Namespace) -> int:
    from models import cache

    root = cache.cache_dir()
    if args.action == "clear":
        count, freed = cache.clear_cache()
        print(f"removed {count} item{'' if count == 1 else 's'} ({_megabytes(freed)}) from {root}")
        return 0
    items = cache.list_cache()
    print(f"cache directory: {root} (set PAXPAGE_CACHE_DIR to move it; `paxpage cache clear` empties it)")
    models = [i for i in items if i.kind == "model"]
    print(f"converted models: {len(models)}")
    for item in models:
        print(f"  {_megabytes(item.num_bytes):>10}  {item.state:<22}  {item.source or item.path}")
    partial = [i for i in items if i.kind == "partial"]
    if partial:
        print(f"unfinished writes: {len(partial)} ({_megabytes(sum(i.num_bytes for i in partial))})")
    xla = sum(i.num_bytes for i in items if i.kind == "xla")
    print(f"XLA compilation cache: {_megabytes(xla)}")  # with the executable cache (exec_cache.py) and native kernels
    print(f"total: {_megabytes(sum(i.num_bytes for i in items))}")
    return 0


BENCH_SCRIPTS = {"throughput": "bench_throughput.py", "memory": "bench_memory.py", "step": "bench_step.py",
                 "serving": "bench_serving.py", "window": "bench_window.py"}


def _bench(args: argparse.Namespace) -> int:
    import pathlib
    import runpy

    script = BENCH_SCRIPTS[args.which]

    path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / script
    if not path.exists():
        print(f"benchmark script {path} not found (run from a source checkout)", file=sys.stderr)
        return 2
    sys.argv = [str(path), *args.rest]
    runpy.run_path(str(path), run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paxpage", description="paged-KV LLM inference in JAX")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate answers to prompts")
    g.add_argument("prompts", nargs="*", help="prompts (default: three examples)")
    g.add_argument("--model", default=None, help="GGUF file, HF dir or paxpage.save dir (default: SmolLM2)")
    g.add_argument("--quantization", default=None, choices=["none", "gguf", "int8"],
                   help="weights: default keeps a GGUF's own quantisation; none = float; int8 = per channel")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=None,
                   help="default: the model's generation config, else 0 (greedy)")
    g.add_argument("--top-p", type=float, default=None, help="default: the model's, else 1")
    g.add_argument("--top-k", type=int, default=None, help="default: the model's, else -1 (off)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="send prompts as plain text, not as a chat")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--batch-invariant", action="store_true",
                   help="a request's tokens bitwise the same whatever shares its step")
    g.add_argument("--lora", default=None, metavar="PATH",
                   help="a LoRA adapter (HF PEFT directory) every prompt runs with (docs/lora.md)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                   help="KV cache storage: the model's dtype (auto), or int8 / fp8 with per-token scales")
    p = g.add_argument_group("parallelism (docs/parallelism.md)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="devices the weights and KV split over")
    p.add_argument("--data-parallel-size", type=int, default=1, help="engine replicas")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="a MoE model's routed experts split whole over the tensor-parallel devices")
    p.add_argument("--coordinator-address", default=None,
                   help="multi-host: process 0's HOST:PORT (or PAXPAGE_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: processes (or PAXPAGE_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this one's id (or PAXPAGE_PROCESS_ID)")
    p.add_argument("--peer-timeout", type=float, default=None,
                   help="multi-host: seconds of silence after which a peer process counts as lost (default 5)")
    g.set_defaults(func=_generate)
    b = sub.add_parser("bench", help=f"run a benchmark script ({' | '.join(BENCH_SCRIPTS)})")
    b.add_argument("which", choices=list(BENCH_SCRIPTS))
    rest = b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the script")
    rest.required = False  # else a bare `paxpage bench` claims `rest` is required too
    b.set_defaults(func=_bench)
    c = sub.add_parser("cache", help="show or empty the cache of converted models and compiled steps")
    c.add_argument("action", choices=["info", "clear"])
    c.set_defaults(func=_cache)
    from paxpage.server.cli import add_serve_parser
    add_serve_parser(sub)
    from paxpage.docs_cli import add_docs_parser
    add_docs_parser(sub)
    args = parser.parse_args(argv)
    if args.command in _OWNS_PROCESS:
        from paxpage import process_tuning

        process_tuning.tune_malloc()  # large freed buffers stay in the process (module doc)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("paxpage: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug or not _is_user_error(e):
            raise
        print(f"paxpage: error: {_one_line(e)}", file=sys.stderr)
        return 2


def _is_user_error(e: Exception) -> bool:
    """Bad values and missing files, and the exception classes paxpage defines itself."""
    if isinstance(e, (ValueError, TypeError, FileNotFoundError)):
        return True
    return type(e).__module__.split(".")[0] in _OWN_PACKAGES


def _one_line(e: Exception) -> str:
    if isinstance(e, FileNotFoundError) and e.filename is not None:
        message = f"{e.strerror}: {e.filename}"
    else:
        message = str(e) or type(e).__name__
    return " ".join(message.split())


if __name__ == "__main__":
    sys.exit(main())
