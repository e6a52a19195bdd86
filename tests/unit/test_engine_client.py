"""The gateway backends implement every `EngineClient` method with the protocol's
parameters, and as coroutines exactly where the protocol has them."""
from __future__ import annotations

import inspect

import pytest

from services.engine.backend import EngineBackend
from services.engine.process import EngineProcess
from services.engine.protocol import EngineClient
from services.attention.client import AttentionClient

MEMBERS = sorted(EngineClient.__abstractmethods__)


def test_the_protocol_is_what_the_gateway_calls():
    assert MEMBERS == ["abort", "healthy", "kv_usage", "num_running", "refresh", "submit"]


@pytest.mark.parametrize("cls", [EngineBackend, EngineProcess, AttentionClient])
@pytest.mark.parametrize("name", MEMBERS)
def test_backend_implements_the_protocol(cls, name):
    assert issubclass(cls, EngineClient) and not cls.__abstractmethods__
    want, got = getattr(EngineClient, name), getattr(cls, name)
    assert not getattr(got, "__isabstractmethod__", False)
    assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want)
    assert parameters(got) == parameters(want)


def parameters(method) -> list[tuple]:
    """Name, kind, default and annotation of each parameter. Returns are not compared: one
    may say more than the protocol's (AttentionClient.refresh returns the stats it polled)."""
    return [(p.name, p.kind, p.default, p.annotation)
            for p in inspect.signature(method).parameters.values()]
