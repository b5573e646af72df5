"""`paxpage serve`: load a model, start the engine loop, serve HTTP with uvicorn until SIGINT /
SIGTERM. On a signal the engine is shut down at once (live requests end), then uvicorn closes
connections, waiting at most --graceful-timeout seconds for them."""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import threading

from paxpage import attention_impl
from paxpage.embedding import POOLING_CHOICES
from paxpage.server.reasoning import PARSERS
from paxpage.server.tool_parsers import PARSERS as TOOL_PARSERS


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    s = subparsers.add_parser("serve", help="serve an OpenAI-compatible HTTP API (loopback by default)")
    s.add_argument("--model", default=None, help="GGUF file, HF dir or paxpage.save dir (default: SmolLM2)")
    s.add_argument("--quantization", default=None, choices=["none", "gguf", "int8"],
                   help="weights: default keeps a GGUF's own quantisation; none = float; int8 = per channel")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    s.add_argument("--served-model-name", default=None, help="the model id clients use (default: the model's name)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $PAXPAGE_API_KEY, if set)")
    s.add_argument("--metrics-without-key", action="store_true",
                   help="with --api-key, let /metrics answer without the key (default: it needs it)")
    s.add_argument("--allowed-origin", action="append", default=None, metavar="ORIGIN",
                   help="let browsers on ORIGIN call the API (CORS; repeat for several, '*' for any); "
                        "default: no CORS headers")
    s.add_argument("--max-request-bytes", type=int, default=None,
                   help="bodies past this size get 413 (default: 16 MiB)")
    s.add_argument("--max-waiting-requests", type=int, default=None,
                   help="past this many waiting requests new ones get 503 + Retry-After (default: no limit)")
    s.add_argument("--restart-on-error", action=argparse.BooleanOptionalAction, default=True,
                   help="after a failed engine step (its live requests get an error), rebuild the engine "
                        "and go on serving (default: on)")
    s.add_argument("--max-restarts-per-minute", type=int, default=3,
                   help="past this many rebuilds in a minute the engine stays down (/health says why)")
    s.add_argument("--grammar-timeout", type=float, default=10.0,
                   help="seconds a structured-output grammar may take to compile (off the engine "
                        "thread); past it the request gets 400")
    s.add_argument("--stall-timeout", type=float, default=None,
                   help="/health answers 503 when live requests make no progress this many seconds")
    s.add_argument("--graceful-timeout", type=float, default=5.0,
                   help="on SIGINT/SIGTERM, seconds to let open connections finish")
    s.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how tool calls are read from the model's text (default: from the chat template; "
                        "openai: gpt-oss's harmony messages, with --reasoning-parser gpt_oss)")
    s.add_argument("--reasoning-parser", default=None, choices=sorted(PARSERS),
                   help="split the model's <think>...</think> text (gpt_oss: its harmony analysis channel) "
                        "into reasoning_content (default: no split, it stays in the answer)")
    s.add_argument("--pooling", default="last", choices=list(POOLING_CHOICES),
                   help="how /v1/embeddings pools the last layer's hidden states (after the final norm): "
                        "the last token's or the mean of all, L2-normalised unless -unnormalized "
                        "(default: last, as vLLM for decoder embedding models)")
    s.add_argument("--max-stored-responses", type=int, default=1000,
                   help="/v1/responses answers kept in memory for previous_response_id; the oldest "
                        "are dropped first (0: keep none)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    e = s.add_argument_group("engine options (see paxpage.EngineConfig)")
    e.add_argument("--page-size", type=int, default=None)
    e.add_argument("--num-pages", type=int, default=None)
    e.add_argument("--kv-cache-bytes", type=int, default=None)
    e.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="GPU / TPU: fraction of device memory to fill; the KV cache gets what the "
                        "weights and a step leave (default 0.9; CPU: a fixed 1 GiB cache)")
    e.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (HF PEFT directories) clients pick with the request's model field")
    e.add_argument("--max-loras", type=int, default=None,
                   help="adapter slots in one step (default with --lora-modules: their number, at most 8)")
    e.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank (default 16)")
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    e.add_argument("--batch-invariant", action="store_true",
                   help="a request's tokens bitwise the same whatever shares its step")
    e.add_argument("--kv-cache-dtype", default=None, choices=["auto", "int8", "fp8"],
                   help="KV cache storage: the model's dtype (auto), or int8 / fp8 with per-token scales")
    e.add_argument("--attention-impl", default=None, choices=list(attention_impl.NAMES),
                   help="; ".join(f"{i.name}: {i.summary}" for i in attention_impl.REGISTRY.values()))
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--no-chunked-prefill", action="store_true")
    e.add_argument("--no-async-scheduling", action="store_true",
                   help="read each step's tokens before scheduling the next (default: the next step is "
                        "scheduled while one is in flight)")
    e.add_argument("--tensor-parallel-size", type=int, default=None, help="devices each replica's weights and KV split over")
    e.add_argument("--data-parallel-size", type=int, default=None, help="engine replicas behind the server")
    e.add_argument("--enable-expert-parallel", action="store_true",
                   help="a MoE model's routed experts split whole over the tensor-parallel devices")
    p = e.add_mutually_exclusive_group()
    p.add_argument("--precompile", action="store_true", default=None,
                   help="compile every step shape before listening, so no request meets a compile "
                        "(the default on one host; SmolLM2 on a 2-core CPU: about 2 minutes the first "
                        "time, seconds once the executable cache holds them)")
    p.add_argument("--no-precompile", dest="precompile", action="store_false", default=None,
                   help="compile each step shape when a step first needs it: a faster first start, "
                        "but the requests in that step wait for the compile")
    e.add_argument("--no-executable-cache", action="store_true",
                   help="do not keep compiled steps in paxpage's cache directory (paxpage/exec_cache.py)")
    s.set_defaults(func=run_serve)
    return s


def engine_config_from_args(args: argparse.Namespace):
    """EngineConfig from the flags that were given (ValueError names a bad one)."""
    from paxpage.config import EngineConfig

    kw = {name: getattr(args, name) for name in ("page_size", "num_pages", "kv_cache_bytes", "gpu_memory_utilization", "max_num_seqs",
                                                 "max_num_batched_tokens", "max_model_len", "dtype", "kv_cache_dtype",
                                                 "attention_impl", "tensor_parallel_size", "data_parallel_size",
                                                 "max_loras", "max_lora_rank")
          if getattr(args, name, None) is not None}
    modules = lora_modules(getattr(args, "lora_modules", None))
    if modules and "max_loras" not in kw:
        kw["max_loras"] = min(len(modules), 8)
    if getattr(args, "batch_invariant", False):
        kw["batch_invariant"] = True
    if getattr(args, "enable_expert_parallel", False):
        kw["enable_expert_parallel"] = True
    if args.no_prefix_caching:
        kw["enable_prefix_caching"] = False
    if args.no_chunked_prefill:
        kw["enable_chunked_prefill"] = False
    if getattr(args, "no_async_scheduling", False):
        kw["async_scheduling"] = False
    # None: run_serve precompiles on one host (serving_precompile)
    if getattr(args, "precompile", None) is not None:
        kw["precompile"] = args.precompile
    if not getattr(args, "no_executable_cache", True):
        from paxpage.exec_cache import default_directory

        kw["executable_cache_dir"] = default_directory()
    return EngineConfig(**kw)


def lora_modules(values: list[str] | None) -> dict[str, str]:
    """--lora-modules NAME=PATH ... as {name: path}; ValueError names a malformed or repeated one."""
    modules: dict[str, str] = {}
    for value in values or ():
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH entries, got {value!r}")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules


def default_model_name(source: str | None) -> str:
    """SmolLM2-135M-Instruct for the default GGUF; otherwise the file or directory name."""
    if source is None:
        from models.loading import default_model_path

        source = default_model_path()
    name = os.path.basename(os.path.normpath(os.fspath(source)))
    if name.endswith(".gguf"):
        name = name[: -len(".gguf")].split(".")[0]  # drop the quantisation suffix (.Q4_1)
    return name


def serving_precompile(config, process_count: int):
    """The server compiles every step shape before it listens unless told not to: a compile met
    under load stalls every running stream for as long as it takes (0.3-1 s a shape on a 2-core
    CPU, against steps of tens of ms), and Poisson traffic meets shapes one at a time for minutes.
    The executable cache (on by default) makes every start after the first take seconds. Not
    across processes, where precompile is not supported yet."""
    if config.precompile is None and process_count == 1:
        return dataclasses.replace(config, precompile=True)
    return config


def run_serve(args: argparse.Namespace) -> int:
    """Bad options raise ValueError before the model loads (paxpage.cli prints it on one line)."""
    config = engine_config_from_args(args)
    api_key = args.api_key if args.api_key is not None else (os.environ.get("PAXPAGE_API_KEY") or None)
    if not args.grammar_timeout > 0:
        raise ValueError(f"--grammar-timeout must be > 0, got {args.grammar_timeout}")
    if args.max_restarts_per_minute < 0:
        raise ValueError(f"--max-restarts-per-minute must be >= 0, got {args.max_restarts_per_minute}")
    if args.max_stored_responses < 0:
        raise ValueError(f"--max-stored-responses must be >= 0, got {args.max_stored_responses}")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")

    from paxpage.server.limits import RequestLimits

    limits = RequestLimits(**({"max_request_bytes": args.max_request_bytes}
                              if args.max_request_bytes is not None else {}))
    from paxpage import kv_sizing

    kv_sizing.claim_client_memory(config.gpu_memory_utilization)  # before jax starts its GPU client

    import jax
    import uvicorn

    import paxpage
    from paxpage import process_tuning, xla_cache
    from paxpage.async_engine import AsyncEngine
    from paxpage.server.app import DEFAULT_STALL_TIMEOUT_S, build_app

    config = serving_precompile(config, jax.process_count())
    xla_cache.enable_unless_executable_cache(config)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))  # before loading: a taken port fails fast
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    sock.listen(2048)  # clients that connect before uvicorn runs wait in the backlog
    model = paxpage.load(args.model, dtype=config.dtype, quantization=args.quantization)
    served_name = args.served_model_name or default_model_name(args.model)
    for name, path in lora_modules(args.lora_modules).items():
        if name == served_name:
            raise ValueError(f"--lora-modules name {name!r} is the base model's served name")
        model.load_lora(name, path)
    if config.precompile:
        print("paxpage serve: compiling every step shape before listening (minutes the first time, "
              "seconds once the executable cache holds them; --no-precompile skips it)", flush=True)
    engine = AsyncEngine(model, config, max_waiting_requests=args.max_waiting_requests,
                         # a multi-host engine's followers cannot rebuild in step with it
                         restart_on_error=args.restart_on_error and jax.process_count() == 1,
                         max_restarts_per_minute=args.max_restarts_per_minute,
                         grammar_timeout_s=args.grammar_timeout)
    process_tuning.freeze_startup_heap()  # collections never walk the start-up heap again (module doc)
    try:
        app = build_app(engine, served_model_name=served_name,
                        api_key=api_key,
                        stall_timeout_s=args.stall_timeout if args.stall_timeout is not None
                        else DEFAULT_STALL_TIMEOUT_S, tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser, max_stored_responses=args.max_stored_responses,
                        limits=limits, metrics_need_key=not args.metrics_without_key,
                        cors_origins=args.allowed_origin, pooling=args.pooling)
        server = _Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.graceful_timeout,
                                        access_log=args.log_level == "debug"), engine)
        host, port = sock.getsockname()[:2]
        print(f"paxpage serve: {engine.engine.describe_kv_cache()}", flush=True)
        print(f"paxpage serve: {engine.engine.describe_memory()}", flush=True)
        defaults = model.config.generation.sampling_defaults()
        if defaults:
            print("paxpage serve: the model's generation config sets "
                  + ", ".join(f"{k}={v:g}" for k, v in defaults.items())
                  + "; requests that do not set these fields use them", flush=True)
        if engine.engine.precompiled is not None:
            shapes, seconds = engine.engine.precompiled
            cache = getattr(getattr(engine.engine, "runner", None), "exec_cache", None)
            loaded = (f" ({cache.stats['loaded']} executables loaded, {cache.stats['compiled']} compiled; "
                      f"executable cache {cache.directory})" if cache is not None else "")
            print(f"paxpage serve: compiled {shapes} step shapes in {seconds:.0f} s{loaded}", flush=True)
        print(f"paxpage serve: {app.state.paxpage.served_model_name} on http://{host}:{port}"
              f"{' (API key required)' if api_key else ''}", flush=True)
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
    return 0


def _uvicorn_server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """Stops the engine as soon as a signal arrives, so streams end instead of holding
        the graceful shutdown open."""

        def __init__(self, config, engine):
            super().__init__(config)
            self._engine = engine

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                threading.Thread(target=self._engine.shutdown, name="paxpage-engine-shutdown",
                                 daemon=True).start()
            super().handle_exit(sig, frame)

    return Server


def _Server(config, engine):  # noqa: N802 - a factory that keeps uvicorn's import lazy
    return _uvicorn_server_class()(config, engine)
