"""A real uvicorn server on a free loopback port, serving SmolLM2 through the gateway."""
from __future__ import annotations

import pytest

from services.deployment.server import build_embedded
from tests.helpers.gateway import ZOO, running


@pytest.fixture(scope="session")
def server():
    app = build_embedded(ZOO, served_name="smollm2-135m")
    with running(app) as base:
        yield base, app.state.gateway
