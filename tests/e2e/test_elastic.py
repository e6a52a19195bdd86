"""Pools resized while serving, with no request lost. SmolLM2 on Ray (one attention service,
one MLP pool replica, one prefill replica, grpc transport) under a steady load of 8
concurrent greedy streams: mlp 1 -> 3 -> 1, prefill 1 -> 2 -> 1 and attention
1 -> 2 -> 3 -> 1 through the admin API and `splitstack scale`, and mlp 1 -> 2 -> 1 by the
autoscaler, with no failed request, every output the exact engine's, every KV block back,
and `GET /admin/pools` showing the members' states."""
from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time

import httpx
import pytest
import torch

from models import load_model
from services.cli import main as cli
from services.common.tokenizer import load_tokenizer
from services.deployment.autoscale import Autoscaler, Policy
from services.deployment.ray_cluster import ClusterConfig
from services.deployment.server import build_cluster
from services.engine import GenerationParams, LLMEngine
from tests.helpers.gateway import ZOO, migrations, running, stream_completion

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
LONG_TOKENS = 256         # outlives a drain started while it runs, idle fast machines included
STREAMS = 8


def prompt_ids():
    gen = torch.Generator().manual_seed(26)
    return [torch.randint(100, 20000, (n,), generator=gen).tolist() for n in (9, 33, 18, 25)]


@pytest.fixture(scope="module")
def reference():
    tok = load_tokenizer(ZOO)
    seqs = LLMEngine(load_model(ZOO)).generate(
        prompt_ids(), GenerationParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return [tok.decode(s.output_ids, skip_special_tokens=True) for s in seqs]


@pytest.fixture(scope="module")
def long_reference():
    tok = load_tokenizer(ZOO)
    seqs = LLMEngine(load_model(ZOO)).generate(
        prompt_ids()[:3], GenerationParams(max_tokens=LONG_TOKENS, ignore_eos=True))
    return [tok.decode(s.output_ids, skip_special_tokens=True) for s in seqs]


@pytest.fixture(scope="module")
def cluster(ray_session):
    config = ClusterConfig(model=str(ZOO), attention_shards=1, mlp_replicas=1,
                           prefill_replicas=1, transport="grpc", kv_cache_bytes=64 << 20,
                           max_num_seqs=8)
    app, cluster = build_cluster(config, served_name="smollm2-135m", max_replicas=4,
                                 drain_timeout_s=60.0)
    with running(app) as base:
        yield base, cluster, app
    cluster.shutdown()


class Load:
    """`STREAMS` clients, each streaming greedy completions back to back until `stop`."""

    def __init__(self, base: str):
        self.base, self.results, self.stop = base, [], threading.Event()
        self.paused = threading.Event()       # set: the clients send nothing new
        self.threads = [threading.Thread(target=self._client, args=(i,))
                        for i in range(STREAMS)]

    def _client(self, i: int) -> None:
        prompts = prompt_ids()
        n = i
        while not self.stop.is_set():
            if self.paused.is_set():
                time.sleep(0.02)
                continue
            k = n % len(prompts)
            n += 1
            text, error = stream_completion(self.base, prompts[k], MAX_TOKENS)
            self.results.append((k, text, error))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=180)

    def served_more(self, n: int, timeout: float = 120.0) -> None:
        """Wait until `n` more requests completed."""
        target = len(self.results) + n
        deadline = time.monotonic() + timeout
        while len(self.results) < target:
            assert time.monotonic() < deadline, "the load stalled"
            time.sleep(0.1)


def pool(base: str, name: str) -> dict:
    return next(p for p in httpx.get(base + "/admin/pools", timeout=30).json()["data"]
                if p["pool"] == name)


def settle(base: str, name: str, n: int, seen: set, timeout: float = 240.0) -> float:
    """Seconds until `name` has exactly `n` members, all ready; the states met on the way
    go into `seen`."""
    start = time.monotonic()
    while True:
        states = [m["state"] for m in pool(base, name)["members"]]
        seen.update(states)
        if states == ["ready"] * n:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, states
        time.sleep(0.2)


def test_mlp_and_prefill_pools_resize_under_load(cluster, reference, ray_session):
    base, handles, _ = cluster
    seen: dict[str, set] = {"mlp": set(), "prefill": set()}
    timings = {}
    with Load(base) as load:
        load.served_more(STREAMS)
        r = httpx.put(base + "/admin/pools/mlp", json={"replicas": 3}, timeout=30)
        assert r.status_code == 202 and r.json()["replicas"] == 3
        timings["mlp 1->3"] = settle(base, "mlp", 3, seen["mlp"])
        load.served_more(STREAMS)
        # the new replicas serve stage calls: the attention service took them in
        assert all(c > 0 for c in ray_session.get([p.calls.remote() for p in handles.pools]))

        start = time.monotonic()
        assert cli(["scale", "prefill", "2", "--url", base, "--wait"]) == 0
        timings["prefill 1->2"] = time.monotonic() - start
        # the new replica is in routing once the attention service has applied its peer
        # list (between two steps): give the load until both replicas have prefilled
        deadline = time.monotonic() + 120
        while True:
            load.served_more(STREAMS)
            prefills = [m["load"].get("prefills", 0) for m in pool(base, "prefill")["members"]]
            if all(n > 0 for n in prefills) or time.monotonic() > deadline:
                break

        r = httpx.put(base + "/admin/pools/mlp", json={"replicas": 1}, timeout=30)
        assert r.status_code == 202
        timings["mlp 3->1"] = settle(base, "mlp", 1, seen["mlp"])
        load.served_more(STREAMS)
        r = httpx.put(base + "/admin/pools/prefill", json={"replicas": 1}, timeout=30)
        assert r.status_code == 202
        timings["prefill 2->1"] = settle(base, "prefill", 1, seen["prefill"])
        load.served_more(STREAMS)
    print("elastic timings (s):", {k: round(v, 1) for k, v in timings.items()},
          "requests:", len(load.results), "states seen:", seen)

    failed = [(k, err) for k, _, err in load.results if err is not None]
    assert failed == []
    assert all(text == reference[k] for k, text, _ in load.results)
    assert len(prefills) == 2 and all(n > 0 for n in prefills)    # both prefill replicas served
    assert seen["mlp"] >= {"starting", "ready"}        # loading weights takes seconds
    assert len(handles.pools) == 1 == len(handles.prefills)
    assert handles.starting == []
    for actor in handles.attention + handles.prefills:
        free, total = ray_session.get(actor.blocks.remote())
        assert free == total
    # the attention service dropped the removed replicas: one stream, one prefill replica
    members = {p["pool"]: p["members"] for p in
               httpx.get(base + "/admin/pools", timeout=30).json()["data"]}
    assert [m["address"] for m in members["mlp"]] == handles.pool_addresses
    assert [m["address"] for m in members["prefill"]] == handles.prefill_addresses
    until = time.monotonic() + 10
    while pool(base, "mlp")["members"][0]["load"].get("clients") != 1:
        assert time.monotonic() < until, pool(base, "mlp")
        time.sleep(0.2)


def test_attention_pool_resizes_under_load(cluster, reference, long_reference, ray_session):
    """1 -> 2 -> 3: each new service gets the current peers, then requests; 3 -> 1 with no
    time to drain: the leaving services' requests move to the one left and finish there
    unchanged."""
    base, handles, app = cluster
    backend = app.state.gateway.backend
    with Load(base) as load:
        load.served_more(STREAMS)
        start = time.monotonic()
        assert cli(["scale", "attention", "2", "--url", base, "--wait"]) == 0
        grown = time.monotonic() - start
        r = httpx.put(base + "/admin/pools/attention", json={"replicas": 3}, timeout=30)
        assert r.status_code == 202
        settle(base, "attention", 3, set())
        load.served_more(2 * STREAMS)
        members = pool(base, "attention")["members"]
        assert all(m["load"].get("steps", 0) > 0 for m in members), members
        addresses = [m["address"] for m in members]

        # Quiet the short load, then start one long stream per service (least-loaded
        # routing places each beside the others) and wait for their first text, so the
        # leaving services surely run a request when they are killed.
        load.paused.set()
        wait_for(lambda: sum(backend.in_flight(a) for a in addresses) == 0)
        long_results: list = [None] * len(addresses)
        long_threads, started = [], [threading.Event() for _ in addresses]
        for j in range(len(addresses)):
            def run(j=j):
                long_results[j] = stream_completion(base, prompt_ids()[j], LONG_TOKENS,
                                                    started[j])
            long_threads.append(threading.Thread(target=run))
            long_threads[-1].start()
            wait_for(lambda j=j: sum(backend.in_flight(a) for a in addresses) == j + 1)
        for event in started:
            assert event.wait(60)
        assert [backend.in_flight(a) for a in addresses] == [1, 1, 1]

        app.state.pools.drain_timeout_s = 0.0
        r = httpx.put(base + "/admin/pools/attention", json={"replicas": 1}, timeout=30)
        assert r.status_code == 202
        shrunk = settle(base, "attention", 1, set())
        load.paused.clear()
        load.served_more(STREAMS)
        for t in long_threads:
            t.join(timeout=180)
    app.state.pools.drain_timeout_s = 60.0
    print(f"attention 1->2: {grown:.1f}s, 3->1: {shrunk:.1f}s, requests: {len(load.results)}")
    assert [(k, err) for k, _, err in load.results if err is not None] == []
    assert all(text == reference[k] for k, text, _ in load.results)
    assert long_results == [(text, None) for text in long_reference]
    # every request on a killed service moved, labelled as drained (a request that ended
    # between its service leaving routing and the kill has nothing to move)
    drained, failed = migrations(base, "drain"), migrations(base, "failure")
    print(f"migrations: drain {drained:.0f}, failure {failed:.0f}")
    assert drained >= 1 and failed == 0
    assert len(handles.attention) == 1 and handles.attention_addresses == addresses[:1]
    free, total = ray_session.get(handles.attention[0].blocks.remote())
    assert free == total


def test_autoscaler_follows_a_burst_then_idle(cluster, reference, caplog):
    """mlp autoscaled within 1:2 on its replicas' own stage-time histograms: up during a
    burst of streams, back to 1 once idle, each change logged and counted with why."""
    base, _, app = cluster
    manager = app.state.pools
    caplog.set_level(logging.INFO, logger="services.deployment.pools")
    # thresholds a CPU replica's share of busy time crosses under this load and not idle
    manager.autoscaler = Autoscaler({"mlp": (1, 2)}, Policy(interval_s=1.0, cooldown_s=3.0,
                                                             busy_high=0.02, busy_low=0.01))
    try:
        with Load(base) as load:
            wait_for(lambda: pool(base, "mlp")["replicas"] == 2, timeout=120)
            settle(base, "mlp", 2, set())
            load.served_more(STREAMS)
        wait_for(lambda: [m["state"] for m in pool(base, "mlp")["members"]] == ["ready"],
                 timeout=120)
    finally:
        manager.autoscaler = None
    assert [(k, err) for k, _, err in load.results if err is not None] == []
    assert all(text == reference[k] for k, text, _ in load.results)
    text = httpx.get(base + "/metrics", timeout=30).text
    for direction in ("up", "down"):
        assert re.search(rf'^splitstack_scale_events_total\{{direction="{direction}",'
                         rf'pool="mlp",reason="autoscale"\}} [1-9]', text, re.M), direction
    assert re.search(r'^splitstack_pool_replicas\{pool="mlp",state="ready"\} 1\.0$', text, re.M)
    assert pool(base, "mlp")["last_change"].startswith("autoscale: 2 -> 1 (every replica busy")
    logged = [r.getMessage() for r in caplog.records if "(autoscale:" in r.getMessage()]
    assert any("1 -> 2 replicas (autoscale: a replica busy" in m for m in logged), logged


def test_sigterm_to_pool_and_prefill_replicas_loses_nothing(cluster, reference, ray_session):
    """Kubernetes stopping a worker pod: SIGTERM to an MLP pool replica's and then a prefill
    replica's process under load. Each leaves routing, a replacement serves, and it is
    stopped once idle: no request fails and every output is the exact engine's."""
    base, handles, _ = cluster
    swapped = {}
    with Load(base) as load:
        load.served_more(STREAMS)
        for name, actors in (("mlp", handles.pools), ("prefill", handles.prefills)):
            (old,) = [m["address"] for m in pool(base, name)["members"]]
            pid = ray_session.get(actors[0].pid.remote())
            os.kill(pid, signal.SIGTERM)
            seen: set = set()

            def replaced():
                members = pool(base, name)["members"]
                seen.update(m["state"] for m in members)
                return [m["state"] for m in members] == ["ready"] and \
                    members[0]["address"] != old
            wait_for(replaced, timeout=180)
            swapped[name] = seen
            load.served_more(STREAMS)
    assert [(k, err) for k, _, err in load.results if err is not None] == []
    assert all(text == reference[k] for k, text, _ in load.results)
    for name, seen in swapped.items():
        assert "draining" in seen, (name, seen)
    assert len(handles.pools) == 1 == len(handles.prefills)
    free, total = ray_session.get(handles.attention[0].blocks.remote())
    assert free == total


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_admin_refusals_over_http(cluster):
    base, _, _ = cluster
    for name, body, status in (("gpu", {"replicas": 1}, 404), ("mlp", {"replicas": -1}, 400),
                               ("mlp", {"replicas": 5}, 400), ("mlp", {"replicas": "2"}, 400)):
        r = httpx.put(f"{base}/admin/pools/{name}", json=body, timeout=30)
        assert r.status_code == status and r.json()["error"]["message"], r.text
    assert cli(["scale", "mlp", "9", "--url", base]) == 1
    assert httpx.get(base + "/ready").json() == {"status": "ready"}
