"""`paxpage serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over `AsyncEngine`.

    app = build_app(engine, served_model_name="SmolLM2-135M-Instruct")

Files: protocol (request bodies), sampling (body -> SamplingParams), prompts (chat template,
token ids), tools + tool_parsers/ (tool calling in chat completions), dispatch (engine requests, client disconnects), chat_routes / completion_routes /
info_routes, sse, logprobs, metrics (Prometheus), auth (API key), errors (OpenAI error shape),
app (the factory), cli (the `serve` command)."""

__all__ = ["build_app"]


def __getattr__(name):  # lazy: `paxpage --help` registers the serve command without FastAPI or jax
    if name == "build_app":
        from paxpage.server.app import build_app

        return build_app
    raise AttributeError(f"module 'paxpage.server' has no attribute {name!r}")
