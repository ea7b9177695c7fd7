"""A live `hetero` server on a loopback port, in a background thread, for tests."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

import uvicorn

from hetero.core.config import EngineConfig
from hetero.engine import LLMEngine
from hetero.server import ServerSettings, build_app

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, app, port: int):
        self.app = app
        self.port = port
        self.base_url = f"http://{LOOPBACK}:{port}"

    @property
    def engine(self) -> LLMEngine:
        return self.app.state.async_engine.engine


@contextmanager
def live_server(
    model_dir, api_key: Optional[str] = None, proposer=None, settings: Optional[dict] = None, **engine_kwargs
) -> Iterator[LiveServer]:
    """`settings`: more `ServerSettings` fields (tool calling, ...)."""
    kwargs = {"dtype": "float32", "max_model_len": 256, **engine_kwargs}
    engine = LLMEngine(EngineConfig.from_kwargs(str(model_dir), **kwargs), proposer=proposer)
    app = build_app(engine, ServerSettings(served_model_names=["tiny"], api_key=api_key, shutdown_timeout=5.0, **(settings or {})))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=LOOPBACK, port=port, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield LiveServer(app, port)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
