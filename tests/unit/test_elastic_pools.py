"""Elastic pools without Ray: the pool manager's membership bookkeeping against a scripted
placement (join when ready, leave routing before draining, kill only once idle or timed out),
the admin API's refusals, readiness and the drain on SIGTERM, and a transport's replica list
changed between calls."""
from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest
import uvicorn

from services.common.tokenizer import load_tokenizer
from services.common.transport import LocalTransport
from services.deployment.pools import Member, MemberFailed, PoolManager
from services.gateway.app import build_app
from services.gateway.drain import DrainingServer
from services.gateway.gateway import Gateway
from tests.helpers.gateway import ZOO
from tests.helpers.held_engine import HeldEngine


class Handle:
    def __init__(self, pool, name, state="pending"):
        self.pool, self.name, self.state = pool, name, state
        self.address = f"{name}:1"
        self.load = {"calls": 0, "clients": 0}
        self.fail = False
        self.dead = False          # its process is gone: Stats go unanswered


class ScriptedPlacement:
    """Members move only when the test says so (`Handle.state`); records every call."""

    def __init__(self):
        self.handles: dict[str, Handle] = {}
        self.killed: list[str] = []
        self.peers: list[tuple[str, list[str], list[str]]] = []

    def place(self, pool, name, peers):
        self.handles[name] = Handle(pool, name)
        return self.handles[name]

    def poll(self, h):
        if h.fail:
            raise MemberFailed("out of memory")
        return h.state, (h.address if h.state == "ready" else "")

    def stats(self, pool, address):
        h = next(h for h in self.handles.values() if h.address == address)
        if h.dead:
            raise OSError(f"{address}: UNAVAILABLE")
        return dict(h.load)

    def update_peers(self, address, mlp, prefill):
        self.peers.append((address, list(mlp), list(prefill)))

    def kill(self, h):
        self.killed.append(h.name)


class Routing:
    def __init__(self):
        self.addresses, self.busy = [], {}

    def set_addresses(self, addresses):
        self.addresses = list(addresses)

    def in_flight(self, address):
        return self.busy.get(address, 0)


def until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached")


@pytest.fixture
def pools():
    placement, routing = ScriptedPlacement(), Routing()
    initial = {}
    for pool, name in (("attention", "attention-0"), ("mlp", "pool-0"),
                       ("prefill", "prefill-0")):
        h = placement.handles[name] = Handle(pool, name, "ready")
        initial[pool] = [Member(pool, name, h, state="ready", address=h.address)]
    routing.addresses = ["attention-0:1"]
    manager = PoolManager(placement, routing, initial, max_replicas=4, drain_timeout_s=30.0)
    manager.TICK_S = 0.01
    yield manager, placement, routing
    manager.close()


def states(manager, pool):
    return {m["name"]: m["state"] for m in next(p for p in manager.view()["data"]
                                              if p["pool"] == pool)["members"]}


def test_new_members_join_routing_only_when_ready(pools):
    manager, placement, routing = pools
    view = manager.scale("mlp", 3)
    assert view["replicas"] == 3
    until(lambda: states(manager, "mlp") == {"pool-0": "ready", "pool-1": "pending",
                                             "pool-2": "pending"})
    placement.handles["pool-1"].state = "starting"
    until(lambda: states(manager, "mlp")["pool-1"] == "starting")
    assert placement.peers == []              # nothing new is ready: routing unchanged
    placement.handles["pool-1"].state = placement.handles["pool-2"].state = "ready"
    until(lambda: set(states(manager, "mlp").values()) == {"ready"})
    until(lambda: placement.peers and len(placement.peers[-1][1]) == 3)
    address, mlp, prefill = placement.peers[-1]
    assert address == "attention-0:1" and mlp == ["pool-0:1", "pool-1:1", "pool-2:1"]
    assert prefill == ["prefill-0:1"]


def test_leaving_members_drain_before_they_are_killed(pools):
    manager, placement, routing = pools
    manager.scale("mlp", 3)
    until(lambda: len(placement.handles) == 5)
    for name in ("pool-1", "pool-2"):
        placement.handles[name].state = "ready"
    until(lambda: set(states(manager, "mlp").values()) == {"ready"})
    placement.handles["pool-2"].load = {"calls": 1, "clients": 1}   # still busy
    manager.scale("mlp", 1)
    until(lambda: "pool-1" in placement.killed)
    # the busy one left routing first (the attention service got the shorter list) and
    # stays until it is idle
    assert placement.peers[-1][1] == ["pool-0:1"]
    assert states(manager, "mlp") == {"pool-0": "ready", "pool-2": "draining"}
    placement.handles["pool-2"].load = {"calls": 0, "clients": 0}
    until(lambda: "pool-2" in placement.killed)
    assert states(manager, "mlp") == {"pool-0": "ready"}


@pytest.mark.parametrize("pool, name, address", [("mlp", "pool-0", "pool-0:1"),
                                                  ("attention", "attention-0", "attention-0:1")])
def test_a_ready_member_that_stops_answering_is_replaced(pools, pool, name, address):
    """A member that failed stop (or whose process died) leaves routing and is killed
    after LOST_AFTER_POLLS unanswered load polls, and a replacement is placed; the
    desired count does not change."""
    manager, placement, routing = pools
    manager.LOAD_EVERY_S = 0.01
    placement.handles[name].dead = True
    successor = f"{name.rsplit('-', 1)[0]}-1"
    until(lambda: name in placement.killed and successor in placement.handles)
    assert manager.view()["data"][("attention", "mlp", "prefill").index(pool)]["replicas"] == 1
    assert name not in states(manager, pool) and states(manager, pool)[successor] == "pending"
    assert "stopped answering" in next(p for p in manager.view()["data"]
                                       if p["pool"] == pool)["last_error"]
    placement.handles[successor].state = "ready"
    until(lambda: states(manager, pool) == {successor: "ready"})
    if pool == "attention":
        until(lambda: routing.addresses == [f"{successor}:1"])
    else:
        until(lambda: placement.peers and placement.peers[-1][1] == [f"{successor}:1"])
    assert address not in routing.addresses


def test_only_unanswered_polls_in_a_row_count(pools):
    """An answered poll resets the count: a member that misses a poll now and then (a
    busy host) stays."""
    manager, placement, routing = pools
    manager.close()                       # the polls below are the only ones
    member = manager.members["mlp"][0]
    h = placement.handles["pool-0"]
    for dead in [True] * (manager.LOST_AFTER_POLLS - 1) + [False] + \
            [True] * (manager.LOST_AFTER_POLLS - 1):
        h.dead = dead
        assert manager._poll_load(member) is not dead
    assert placement.killed == [] and member in manager.members["mlp"]
    h.dead = True
    manager._poll_load(member)
    assert placement.killed == ["pool-0"] and manager.members["mlp"] == []


def test_each_member_answering_is_exported_and_its_metrics_listed_for_discovery():
    """`splitstack_<pool>_up{member}` follows the load polls (0 once one goes unanswered,
    gone with the member), and `scrape_targets` lists each member whose `Stats` gave a
    metrics port, at its gRPC host, in Prometheus' HTTP service discovery format."""
    from prometheus_client import CollectorRegistry

    placement, routing, registry = ScriptedPlacement(), Routing(), CollectorRegistry()
    initial = {}
    for pool, name, port in (("attention", "attention-0", 9401), ("mlp", "pool-0", 9402),
                             ("prefill", "prefill-0", 0)):
        h = placement.handles[name] = Handle(pool, name, "ready")
        h.load["metrics_port"] = port
        initial[pool] = [Member(pool, name, h, state="ready", address=h.address)]
    manager = PoolManager(placement, routing, initial, registry=registry)
    manager.close()                       # the polls below are the last ones
    up = lambda kind, member: registry.get_sample_value(f"splitstack_{kind}_up",  # noqa: E731
                                                        {"member": member})
    assert (up("attention", "attention-0:1"), up("pool", "pool-0:1")) == (1, 1)
    for pool in initial.values():
        manager._poll_load(pool[0])
    assert manager.scrape_targets() == [
        {"targets": ["attention-0:9401"], "labels": {"pool": "attention"}},
        {"targets": ["pool-0:9402"], "labels": {"pool": "mlp"}}]   # the prefill has none
    placement.handles["pool-0"].dead = True
    manager._poll_load(manager.members["mlp"][0])
    manager._export()
    assert up("pool", "pool-0:1") == 0 and up("prefill", "prefill-0:1") == 1
    for _ in range(manager.LOST_AFTER_POLLS - 1):
        manager._poll_load(manager.members["mlp"][0])
    manager._export()
    assert placement.killed == ["pool-0"] and up("pool", "pool-0:1") is None
    assert [t["labels"]["pool"] for t in manager.scrape_targets()] == ["attention"]


def test_scale_down_takes_members_that_never_joined_first(pools):
    manager, placement, _ = pools
    manager.scale("prefill", 3)
    until(lambda: len(states(manager, "prefill")) == 3)
    placement.handles["prefill-1"].state = "starting"
    until(lambda: states(manager, "prefill")["prefill-1"] == "starting")
    manager.scale("prefill", 2)
    until(lambda: placement.killed == ["prefill-2"])        # pending: killed at once
    manager.scale("prefill", 1)
    until(lambda: placement.killed == ["prefill-2", "prefill-1"])
    assert states(manager, "prefill") == {"prefill-0": "ready"}


def test_attention_service_leaves_gateway_routing_then_waits_for_its_requests(pools):
    manager, placement, routing = pools
    manager.scale("attention", 2)
    until(lambda: "attention-1" in placement.handles)
    placement.handles["attention-1"].state = "ready"
    until(lambda: routing.addresses == ["attention-0:1", "attention-1:1"])
    # the new service got its peers before the gateway routed to it
    assert placement.peers[-1][0] == "attention-1:1"
    routing.busy["attention-1:1"] = 2
    manager.scale("attention", 1)
    until(lambda: routing.addresses == ["attention-0:1"])
    time.sleep(0.1)
    assert "attention-1" not in placement.killed
    routing.busy["attention-1:1"] = 0
    until(lambda: "attention-1" in placement.killed)


def test_drain_timeout_kills_a_busy_member(pools):
    manager, placement, _ = pools
    manager.drain_timeout_s = 0.2
    manager.scale("mlp", 2)
    until(lambda: "pool-1" in placement.handles)
    placement.handles["pool-1"].state = "ready"
    until(lambda: states(manager, "mlp").get("pool-1") == "ready")
    placement.handles["pool-1"].load = {"calls": 3, "clients": 1}
    manager.scale("mlp", 1)
    until(lambda: "pool-1" in placement.killed)


def test_a_member_that_fails_to_start_is_reported_and_replaced_later(pools):
    manager, placement, _ = pools
    manager.RETRY_AFTER_FAILURE_S = 0.3
    manager.scale("mlp", 2)
    until(lambda: "pool-1" in placement.handles)
    placement.handles["pool-1"].fail = True
    mlp = lambda: next(p for p in manager.view()["data"] if p["pool"] == "mlp")  # noqa: E731
    until(lambda: "out of memory" in mlp().get("last_error", ""))
    assert [m["name"] for m in mlp()["members"]] == ["pool-0"]
    until(lambda: "pool-2" in placement.handles)            # tried again after the pause


# ---- the admin API -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ZOO)


def app_with(tokenizer, pools=None, api_key=None, engine=None, admin_key=None):
    app = build_app(Gateway(engine or HeldEngine(), tokenizer, "m", 512), api_key=api_key,
                    admin_key=admin_key)
    if pools is not None:
        app.state.pools = pools
    return app


def call(app, method, path, **kwargs):
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.request(method, path, **kwargs)
    return asyncio.run(run())


@pytest.mark.parametrize("pool,body,status,param", [
    ("gpu", {"replicas": 2}, 404, "pool"),
    ("mlp", {"replicas": -1}, 400, "replicas"),
    ("mlp", {"replicas": 0}, 400, "replicas"),
    ("mlp", {"replicas": 5}, 400, "replicas"),         # over --max-replicas (4)
    ("mlp", {"replicas": 2.5}, 400, "replicas"),
    ("mlp", {"replicas": "2"}, 400, "replicas"),
    ("mlp", {"replicas": True}, 400, "replicas"),
    ("mlp", {}, 400, "replicas"),
    ("mlp", {"replicas": 2, "extra": 1}, 400, "extra"),
    ("prefill", {"replicas": 2}, 409, "pool"),          # fixed in this deployment
])
def test_bad_scale_requests_are_4xx_with_an_openai_error(tokenizer, pool, body, status, param):
    manager = PoolManager(ScriptedPlacement(), Routing(), {}, max_replicas=4,
                          fixed={"prefill": "no prefill service"})
    try:
        r = call(app_with(tokenizer, manager, api_key="k"), "PUT", f"/admin/pools/{pool}",
                 json=body, headers={"Authorization": "Bearer k"})
    finally:
        manager.close()
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_admin_routes_need_the_api_key_and_list_every_member(tokenizer, pools):
    manager, _, _ = pools
    app = app_with(tokenizer, manager, api_key="k")
    for method, path, body in (("GET", "/admin/pools", None),
                               ("PUT", "/admin/pools/mlp", {"replicas": 2}),
                               ("GET", "/admin/scrape-targets", None)):
        r = call(app, method, path, json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert manager.desired["mlp"] == 1
    r = call(app, "PUT", "/admin/pools/mlp", json={"replicas": 2},
             headers={"Authorization": "Bearer k"})
    assert r.status_code == 202 and r.json()["replicas"] == 2
    listed = call(app, "GET", "/admin/pools", headers={"Authorization": "Bearer k"}).json()
    by_pool = {p["pool"]: p for p in listed["data"]}
    assert set(by_pool) == {"attention", "mlp", "prefill"}
    assert by_pool["attention"]["members"][0] == {
        "name": "attention-0", "state": "ready", "address": "attention-0:1",
        "load": by_pool["attention"]["members"][0]["load"],
        "since_s": by_pool["attention"]["members"][0]["since_s"]}
    assert by_pool["mlp"]["replicas"] == 2 and by_pool["mlp"]["max_replicas"] == 4


@pytest.mark.parametrize("api_key", ["client", None])
def test_the_admin_routes_take_their_own_key(tokenizer, pools, api_key):
    """With --admin-api-key, the client key opens /v1/ and not /admin/, the admin key
    /admin/ and not /v1/ (with no client key, /v1/ stays open)."""
    manager, _, _ = pools
    app = app_with(tokenizer, manager, api_key=api_key, admin_key="operator")

    def bearer(key):
        return {"Authorization": f"Bearer {key}"}

    for key in (api_key, None):
        r = call(app, "PUT", "/admin/pools/mlp", json={"replicas": 2},
                 headers=bearer(key) if key else {})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert manager.desired["mlp"] == 1                    # nothing changed
    r = call(app, "PUT", "/admin/pools/mlp", json={"replicas": 2}, headers=bearer("operator"))
    assert r.status_code == 202 and manager.desired["mlp"] == 2
    assert call(app, "GET", "/v1/models", headers=bearer("operator")).status_code == \
        (401 if api_key else 200)
    if api_key:
        assert call(app, "GET", "/v1/models", headers=bearer(api_key)).status_code == 200
    assert call(app, "GET", "/metrics").status_code == 200       # scrapers need no key


def test_the_embedded_deployment_has_no_pools(tokenizer):
    r = call(app_with(tokenizer), "GET", "/admin/pools")
    assert r.status_code == 404 and r.json()["error"]["code"] == "no_pools"
    r = call(app_with(tokenizer), "GET", "/admin/scrape-targets")    # Prometheus' HTTP SD
    assert r.status_code == 200 and r.json() == []                   # no member to scrape
    doc = call(app_with(tokenizer), "GET", "/openapi.json").json()["paths"]
    assert {"400", "401", "404", "409"} <= set(doc["/admin/pools/{pool}"]["put"]["responses"])
    assert "503" in doc["/ready"]["get"]["responses"]


# ---- readiness and the drain ---------------------------------------------------------
def test_draining_turns_readiness_false_refuses_new_requests_and_lets_running_finish(
        tokenizer):
    engine = HeldEngine()
    app = app_with(tokenizer, engine=engine)
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True}

    async def run():
        engine.hold = asyncio.Event()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            before = await client.get("/ready")
            running = asyncio.ensure_future(client.post("/v1/completions", json=body))
            while engine.submitted < 1:
                await asyncio.sleep(0.01)
            app.state.drain.begin()                        # what SIGTERM does
            ready, health = await client.get("/ready"), await client.get("/health")
            refused = await client.post("/v1/completions", json=body)
            held = app.state.drain.in_flight
            engine.hold.set()
            done = await running
            return before, ready, health, refused, held, done
    before, ready, health, refused, held, done = asyncio.run(run())
    assert before.status_code == 200 and before.json() == {"status": "ready"}
    assert ready.status_code == 503 and ready.json() == {"status": "draining"}
    assert health.status_code == 200                      # liveness is not readiness
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "draining"
    assert held == 1 and app.state.drain.in_flight == 0
    assert done.status_code == 200 and done.text.rstrip().endswith("data: [DONE]")


def test_sigterm_drains_until_empty_or_the_timeout(tokenizer):
    app = app_with(tokenizer)
    drain = app.state.drain
    server = DrainingServer(uvicorn.Config(app), drain, timeout_s=0.3)

    def tick():
        return asyncio.run(server.on_tick(1))
    assert not tick()
    drain.in_flight = 1
    server.handle_exit(signal.SIGTERM, None)
    assert drain.draining and not server.should_exit and not tick()
    drain.in_flight = 0
    assert tick() and server.should_exit                  # empty: shut down
    server = DrainingServer(uvicorn.Config(app_with(tokenizer)), app.state.drain, 0.3)
    app.state.drain.in_flight = 1                          # busy, but out of time
    time.sleep(0.3)
    assert asyncio.run(server.on_tick(1))


# ---- the transport's replicas ---------------------------------------------------------
class Replica:
    def __init__(self, name):
        self.name, self.calls, self.closed = name, 0, False

    def stage(self):
        self.calls += 1
        return self.name


class ClosingTransport(LocalTransport):
    def _close(self, replica):
        replica.closed = True


def test_set_replicas_keeps_the_kept_opens_the_new_and_closes_the_removed():
    a, b, c = Replica("a"), Replica("b"), Replica("c")
    t = ClosingTransport([a, b])
    assert [t.call("stage") for _ in range(3)] == ["a", "b", "a"]
    t.set_replicas([b, c])
    assert t.replicas[0] is b and a.closed and not b.closed
    assert sorted(t.call("stage") for _ in range(4)) == ["b", "b", "c", "c"]
    with pytest.raises(ValueError):
        t.set_replicas([])


def test_a_member_told_to_leave_drains_and_is_replaced(pools):
    """SIGTERM to a replica's process shows in its stats: out of routing at once, a
    successor placed (the desired count is unchanged), the member killed once idle."""
    manager, placement, routing = pools
    placement.handles["pool-0"].load = {"calls": 1, "clients": 1, "draining": True}
    until(lambda: states(manager, "mlp").get("pool-0") == "draining")
    until(lambda: "pool-1" in placement.handles)
    assert manager.desired["mlp"] == 1 and "pool-0" not in placement.killed
    # idle, but the only member: it keeps serving until its successor is ready
    placement.handles["pool-0"].load = {"calls": 0, "clients": 0, "draining": True}
    time.sleep(2 * manager.LEAVE_GRACE_S)
    assert placement.killed == [] and placement.peers == []       # routing unchanged
    assert manager._ready()["mlp"] == ["pool-0:1"]
    placement.handles["pool-0"].load = {"calls": 1, "clients": 1, "draining": True}
    placement.handles["pool-1"].state = "ready"
    until(lambda: placement.peers and placement.peers[-1][1] == ["pool-1:1"])
    placement.handles["pool-0"].load = {"calls": 0, "clients": 0, "draining": True}
    until(lambda: placement.killed == ["pool-0"])
    assert states(manager, "mlp") == {"pool-1": "ready"}
