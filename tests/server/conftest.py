"""Live servers for the HTTP tests: real uvicorn on 127.0.0.1 (ephemeral port) in a background
thread, one per model and configuration, shared by the whole test run.

- `tiny_server`: a tiny random llama without tokenizer (token-id prompts). One running sequence,
  one waiting at most, a 16k-token KV pool and an API key: the error, overload and disconnect
  checks, none of which needs real text.
- `smol_server`: SmolLM2-135M-Instruct (chat template, tokenizer) for text-level checks."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import save_tiny_hf

CLIENT_TIMEOUT = httpx.Timeout(180.0, connect=10.0)  # a first CPU step compiles for a while
TINY_KEY = "sk-tiny-test"
# A 16k-token pool (tiny pages are cheap) and a longer context: long requests run for seconds
# (a tiny step is ~1 ms), and a prompt can pass max_model_len yet never fit the pool.
TINY_PAGES, TINY_PAGE_SIZE, TINY_MAX_LEN = 1024, 16, 32768
LONG_TOKENS = 16000
SMOL_CONFIG = dict(num_pages=256, page_size=16, max_num_seqs=16)


class LiveServer:
    def __init__(self, engine, **app_kwargs):
        import uvicorn

        from paxpage.server import build_app

        self.engine = engine
        self.app = build_app(engine, **app_kwargs)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=kw.pop("timeout", CLIENT_TIMEOUT), **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.engine.shutdown()


def metrics(client: httpx.Client) -> dict[str, float]:
    """Unlabelled samples of /metrics by name (counters carry their _total suffix)."""
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    return {s.name: s.value for family in text_string_to_metric_families(r.text)
            for s in family.samples if not s.labels}


def wait_idle(client: httpx.Client, kv_idle: float | None = None, timeout: float = 10.0) -> dict[str, float]:
    """Polls /metrics until nothing runs or waits (and KV usage is back to kv_idle); fails after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(client)
        idle = m["paxpage_num_requests_running"] == 0 and m["paxpage_num_requests_waiting"] == 0
        if idle and (kv_idle is None or m["paxpage_kv_cache_usage_perc"] <= kv_idle + 1e-9):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout} s: {m}")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    import paxpage

    path = tmp_path_factory.mktemp("tiny_llama_serve")
    save_tiny_hf(path, "llama", max_position_embeddings=TINY_MAX_LEN)
    return paxpage.load(path)


@pytest.fixture(scope="session")
def tiny_server(tiny_model):
    import paxpage
    from paxpage.async_engine import AsyncEngine

    config = paxpage.EngineConfig(num_pages=TINY_PAGES, page_size=TINY_PAGE_SIZE, max_num_seqs=1,
                                  max_model_len=TINY_MAX_LEN)
    server = LiveServer(AsyncEngine(tiny_model, config, max_waiting_requests=1), served_model_name="tiny",
                        api_key=TINY_KEY)
    yield server
    server.stop()


@pytest.fixture
def tiny_client(tiny_server):
    with tiny_server.client(headers={"Authorization": f"Bearer {TINY_KEY}"}) as client:
        wait_idle(client)
        yield client
        wait_idle(client)  # leave it idle for the next test


@pytest.fixture
def fresh_tiny_server(tiny_model, request):
    """A tiny server of its own (four sequences, no key, no queue limit), for tests that break
    its engine or need several sequences at once; stall_timeout_s via indirect parametrisation."""
    import paxpage
    from paxpage.async_engine import AsyncEngine

    engine = AsyncEngine(tiny_model, paxpage.EngineConfig(num_pages=256, max_num_seqs=4, max_model_len=8192))
    server = LiveServer(engine, served_model_name="tiny", stall_timeout_s=getattr(request, "param", 300.0))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smol_config():
    import paxpage

    return paxpage.EngineConfig(**SMOL_CONFIG)


@pytest.fixture(scope="session")
def smol_server(smollm2, smol_config):
    from paxpage.async_engine import AsyncEngine

    server = LiveServer(AsyncEngine(smollm2, smol_config), served_model_name="smollm2")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smol_openai(smol_server):
    import openai

    with openai.OpenAI(base_url=f"{smol_server.base_url}/v1", api_key="unused", timeout=180.0,
                       max_retries=0) as client:
        yield client


@pytest.fixture
def smol_client(smol_server):
    with smol_server.client() as client:
        yield client
