"""A real uvicorn server on a free loopback port, serving SmolLM2 through the gateway."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from services.deployment.server import build_embedded

ZOO = Path(__file__).resolve().parents[2] / "models" / "zoo" / "smollm2-135m"


@contextlib.contextmanager
def running(app):
    """Serve `app` with uvicorn on a free loopback port; yields the base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    try:
        yield base
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        app.state.gateway.backend.shutdown()


@pytest.fixture(scope="session")
def server():
    app = build_embedded(ZOO, served_name="smollm2-135m")
    with running(app) as base:
        yield base, app.state.gateway
