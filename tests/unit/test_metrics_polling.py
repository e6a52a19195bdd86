"""A scrape of the gateway's /metrics never waits on the members: a backend that polls other
processes (the Ray deployment's attention client) is refreshed in the background while the
server runs, and /metrics reads what the last poll saw; a backend in this process (or its
engine process) is refreshed by each scrape."""
from __future__ import annotations

import asyncio
import time

from starlette.testclient import TestClient

from services.common.tokenizer import load_tokenizer
from services.gateway.app import build_app
from services.gateway.gateway import Gateway
from tests.helpers.gateway import ZOO
from tests.helpers.held_engine import HeldEngine


class PolledEngine(HeldEngine):
    """Its first refresh answers; every later one hangs, as a poll of a member that stopped
    answering would (until its RPC timeout)."""

    def __init__(self, poll_interval_s):
        super().__init__()
        self.poll_interval_s = poll_interval_s
        self.refreshes = 0

    async def refresh(self):
        self.refreshes += 1
        if self.refreshes > 1:
            await asyncio.sleep(3600)

    def kv_usage(self):
        return 0.25 if self.refreshes else 0.0


def test_a_polled_backend_is_refreshed_beside_the_scrapes_not_by_them():
    engine = PolledEngine(poll_interval_s=0.01)
    app = build_app(Gateway(engine, load_tokenizer(ZOO), "m", 512))
    with TestClient(app) as client:
        deadline = time.monotonic() + 30
        while engine.refreshes < 2 and time.monotonic() < deadline:   # the 2nd one hangs
            time.sleep(0.01)
        assert engine.refreshes == 2
        for _ in range(3):
            r = client.get("/metrics")
            assert r.status_code == 200
            assert "splitstack_kv_cache_usage_ratio 0.25" in r.text   # the first poll's
        assert engine.refreshes == 2             # no scrape called it, none waited on it


def test_an_unpolled_backend_is_refreshed_by_each_scrape():
    engine = PolledEngine(poll_interval_s=None)
    app = build_app(Gateway(engine, load_tokenizer(ZOO), "m", 512))
    with TestClient(app) as client:
        assert client.get("/metrics").status_code == 200
        assert engine.refreshes == 1


def test_attention_services_are_polled_at_once_and_the_poll_is_stamped():
    """Three attention services whose stats answer only once all three were asked: a poll
    that asked them one after another would never finish. The poll's start is exported,
    and the load figures are the fullest service's and the sums."""
    from prometheus_client import CollectorRegistry

    from services.attention.client import AttentionClient
    from services.common.pb import splitstack_pb2 as pb

    class Stub:
        def __init__(self, address, asked, everyone, running):
            self.address, self.asked, self.everyone = address, asked, everyone
            self.running = running

        async def Stats(self, request, timeout):      # noqa: N802 — the gRPC stub's name
            self.asked.append(self.address)
            if len(self.asked) == 3:
                self.everyone.set()
            await self.everyone.wait()
            return pb.AttentionStats(running=self.running, waiting=1,
                                     kv_usage=self.running / 10)

    async def run():
        registry = CollectorRegistry()
        client = AttentionClient(["a:1", "a:2", "a:3"], registry)
        asked, everyone = [], asyncio.Event()
        for i, r in enumerate(client.set.replicas):
            stub = Stub(r.address, asked, everyone, running=i + 1)
            r.conn.connect = lambda stub=stub: stub
        before = time.time()
        await asyncio.wait_for(client.refresh(), 30)
        return registry, client, asked, before

    registry, client, asked, before = asyncio.run(run())
    assert sorted(asked) == ["a:1", "a:2", "a:3"]
    assert (client.num_running(), client.num_waiting(), client.kv_usage()) == (6, 3, 0.3)
    stamp = registry.get_sample_value("splitstack_members_polled_timestamp_seconds")
    assert before <= stamp <= time.time()
