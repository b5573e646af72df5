"""Command line: `paxpage generate "What is the capital of France?"`."""

from __future__ import annotations

import argparse
import sys


def _generate(args: argparse.Namespace) -> int:
    import paxpage
    from paxpage import xla_cache

    xla_cache.enable()
    model = paxpage.load(args.model)
    prompts = args.prompts or [
        "What is the capital of France?",
        "Give me three tips for staying healthy.",
        "Write a haiku about the sea.",
    ]
    # Instruct models answer chats; --raw sends the text as it is.
    inputs = prompts if args.raw else [[{"role": "user", "content": p}] for p in prompts]
    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed)
    if args.stream:
        current = None
        for delta in paxpage.stream(model, inputs, **kwargs):
            if delta.index != current:
                current = delta.index
                print(f"\n>>> {prompts[delta.index]}\n", end="", flush=True)
            print(delta.text, end="", flush=True)
        print()
        return 0
    for prompt, out in zip(prompts, paxpage.generate(model, inputs, **kwargs)):
        print(f">>> {prompt}\n{out.text.strip()}\n[{out.finish_reason}, {len(out.token_ids)} tokens]\n")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import runpy

    script = {"throughput": "bench_throughput.py", "memory": "bench_memory.py",
              "serving": "bench_serving.py"}[args.which]
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / script
    if not path.exists():
        print(f"benchmark script {path} not found (run from a source checkout)", file=sys.stderr)
        return 2
    sys.argv = [str(path), *args.rest]
    runpy.run_path(str(path), run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paxpage", description="paged-KV LLM inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate answers to prompts")
    g.add_argument("prompts", nargs="*", help="prompts (default: three examples)")
    g.add_argument("--model", default=None, help="GGUF file, HF dir or paxpage.save dir (default: SmolLM2)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="send prompts as plain text, not as a chat")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.set_defaults(func=_generate)
    b = sub.add_parser("bench", help="run a benchmark script (throughput | memory | serving)")
    b.add_argument("which", choices=["throughput", "memory", "serving"])
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=_bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
