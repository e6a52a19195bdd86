"""Elastic pools: each pool's desired size and its members, changed while serving.

A member's life, driven by one thread (the manager's) that compares each pool's members
with its desired count a few times a second:

    placed ─► pending ─► starting ─► ready ─────────────► draining ─► killed
              (no free   (loading,   (in routing)          (out of routing, finishing
               resource)  serving)                          what it has in flight)

Joining: a ready pool or prefill replica is handed to every ready attention service
(`Attention.UpdatePeers`, applied between two steps); a ready attention service gets the
current peers first, then the gateway routes new requests to it (`set_addresses`).
Lost: a ready member whose `Stats` go unanswered `LOST_AFTER_POLLS` times in a row (it
failed stop and exited, or its process died) leaves routing and is replaced at once.
Leaving (a smaller desired count, or SIGTERM to the member's process, which its `Stats`
report; see `services.common.sigterm`: then a replacement is placed as well): the member
leaves routing first, then finishes its work, and only then is its actor killed:
- mlp: the attention services closed their streams to it at a step boundary, so no stage
  call is in flight; killed once it reports no client and no call;
- prefill: killed once no `Prefill` call is in flight there;
- attention: killed once the gateway has no request streaming from it, or after
  `drain_timeout_s`; the requests still running then migrate (the gateway re-sends each,
  with its streamed tokens, to a live service).
A draining member that does not empty is killed after `drain_timeout_s`. Scaling down takes
members that are not ready first (they never joined routing), then the newest.

An `Autoscaler` (`services.deployment.autoscale`) may set the desired counts too, every
`policy.interval_s`, from the members' load; each change of a desired count is logged with
its reason and counted in `splitstack_scale_events_total`, and `splitstack_pool_replicas`
exports the members by state.

`scale` and `view` may be called from any thread (the gateway's event loop); they take the
lock and return at once. Placement and the members' RPCs go through a `Placement` (Ray:
`services.deployment.placement`), routing through a `Routing` (`members.ClusterRouting`).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import Counter, Gauge

from services.deployment.autoscale import Autoscaler, Window, bucket_counts, quantile_between
from services.gateway.admin import PoolError

log = logging.getLogger(__name__)

POOLS = ("attention", "mlp", "prefill")
STATES = ("pending", "starting", "ready", "draining")
# load figures that count up over a member's life: the autoscaler reads their change
CUMULATIVE = {"stage_s": "stage_s", "stage_calls": "stage_calls", "rows": "rows",
              "batches": "batches", "prefills": "prefilled"}
PREFIX = {"attention": "attention", "mlp": "pool", "prefill": "prefill"}   # member names


class MemberFailed(RuntimeError):
    """A member died before it served (its actor's constructor failed)."""


class Placement(Protocol):
    def place(self, pool: str, name: str, peers: dict[str, list[str]]):
        """Start a member; returns a handle for the other calls. `peers`: the ready
        members' addresses by pool (a new attention service starts with them)."""

    def poll(self, handle) -> tuple[str, str]:
        """("pending" | "starting", "") or ("ready", address); raises `MemberFailed`."""

    def stats(self, pool: str, address: str) -> dict:
        """The member's load (numbers by name); raises OSError when it does not answer."""

    def update_peers(self, address: str, mlp: list[str], prefill: list[str]) -> None:
        """Hand the attention service at `address` its pool and prefill replicas; returns
        once applied. Raises OSError when it does not answer."""

    def kill(self, handle) -> None: ...


class Routing(Protocol):
    """The gateway's side (`members.ClusterRouting`)."""

    def set_addresses(self, addresses: list[str]) -> None: ...

    def in_flight(self, address: str) -> int: ...


@dataclass
class Member:
    pool: str
    name: str
    handle: object
    state: str = "pending"
    address: str = ""
    metrics_port: int = 0               # its /metrics, on its address's host (0: not known)
    load: dict = field(default_factory=dict)
    since: float = field(default_factory=time.monotonic)     # when it entered `state`
    unanswered: int = 0                 # load polls in a row that got no answer

    def enter(self, state: str) -> None:
        self.state, self.since = state, time.monotonic()


class PoolMetrics:
    def __init__(self, registry):
        self.replicas = Gauge("splitstack_pool_replicas", "Members of each pool by state "
                              "(pending: waiting for a free resource)", ["pool", "state"],
                              registry=registry)
        self.scale_events = Counter("splitstack_scale_events_total", "Changes of a pool's "
                                    "desired size (reason: admin or autoscale)",
                                    ["pool", "direction", "reason"], registry=registry)
        self.up = {pool: Gauge(f"splitstack_{PREFIX[pool]}_up", f"1 while the {pool} member "
                               "answers the gateway's polls (one a second), else 0",
                               ["member"], registry=registry) for pool in POOLS}
        self.members_up: set[tuple[str, str]] = set()      # the (pool, member) series

    def export_up(self, up: dict[tuple[str, str], bool]) -> None:
        for pool, address in self.members_up - up.keys():
            self.up[pool].remove(address)
        for (pool, address), answers in up.items():
            self.up[pool].labels(address).set(answers)
        self.members_up = set(up)


class PoolManager:
    TICK_S = 0.2
    LOAD_EVERY_S = 1.0
    # a member out of routing is not judged idle before this: a call its clients chose
    # just before the change may not have reached it yet
    LEAVE_GRACE_S = 0.5
    RETRY_AFTER_FAILURE_S = 5.0
    # a ready member whose load polls (one a second) go unanswered this many times in a
    # row is taken for dead and replaced
    LOST_AFTER_POLLS = 3

    def __init__(self, placement: Placement, routing: Routing,
                 members: dict[str, list[Member]], max_replicas: int = 8,
                 drain_timeout_s: float = 30.0, fixed: dict[str, str] | None = None,
                 registry=None, autoscaler: Autoscaler | None = None, latency=()):
        """`members`: the deployment's ready members by pool (the starting point; their
        counts are the desired counts). `fixed`: pools this deployment cannot resize, with
        why (the pool inside the attention service under `local`, no prefill service).
        `registry`: where `splitstack_pool_replicas` and `splitstack_scale_events_total`
        go. `autoscaler` (`services.deployment.autoscale`) sets the desired counts of the
        pools it bounds every `policy.interval_s`; `latency`: the gateway's TTFT and ITL
        histograms, for its SLO signals."""
        self.placement, self.routing = placement, routing
        self.max_replicas, self.drain_timeout_s = max_replicas, drain_timeout_s
        self.fixed = dict(fixed or {})
        self.members = {p: list(members.get(p, [])) for p in POOLS}
        self.desired = {p: len(self.members[p]) for p in POOLS}
        self.failure: dict[str, tuple[float, str]] = {}      # pool -> (when, why)
        self._names = {p: itertools.count(len(self.members[p])) for p in POOLS}
        self._lock = threading.Lock()
        self.metrics = PoolMetrics(registry) if registry is not None else None
        self.autoscaler, self._latency = autoscaler, tuple(latency)
        self.last_decision: dict[str, str] = {}               # pool -> why, for the view
        self._window_at = time.monotonic()
        self._window_loads: dict[str, dict] = {}              # member name -> load then
        self._window_buckets = [bucket_counts(h) for h in self._latency]
        for pool, (low, high) in (autoscaler.bounds.items() if autoscaler else ()):
            if not low <= self.desired[pool] <= high:
                self._set_desired(pool, min(max(self.desired[pool], low), high), "autoscale",
                                  f"the autoscale bounds are {low}:{high}")
        self._export()
        self._published = self._routed()                     # what routing holds now
        self._loads_at = 0.0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pool-manager", daemon=True)
        self._thread.start()

    # ---- the admin API's side (any thread) --------------------------------------------
    def scale(self, pool: str, replicas: int) -> dict:
        if pool not in POOLS:
            raise PoolError(404, f"no pool {pool!r}; pools: {', '.join(POOLS)}", "pool",
                            "pool_not_found")
        if pool in self.fixed:
            raise PoolError(409, f"the {pool} pool cannot be resized: {self.fixed[pool]}",
                            "pool", "pool_fixed")
        if not isinstance(replicas, int) or isinstance(replicas, bool):
            raise PoolError(400, f"replicas must be an integer, got {replicas!r}", "replicas")
        if not 1 <= replicas <= self.max_replicas:
            raise PoolError(400, f"replicas must be in [1, {self.max_replicas}] (the "
                                 f"deployment's --max-replicas), got {replicas}", "replicas")
        self._set_desired(pool, replicas, "admin", "PUT /admin/pools")
        if self.autoscaler is not None:     # the autoscaler's cooldown starts now too
            self.autoscaler.changed_at[pool] = time.monotonic()
        self._wake.set()
        return self._pool_view(pool)

    def _set_desired(self, pool: str, replicas: int, reason: str, why: str) -> None:
        with self._lock:
            before = self.desired[pool]
            self.desired[pool] = replicas
            self.failure.pop(pool, None)
            if before != replicas:
                self.last_decision[pool] = f"{reason}: {before} -> {replicas} ({why})"
        if before == replicas:
            return
        log.info("pool %s: %d -> %d replicas (%s: %s)", pool, before, replicas, reason, why)
        if self.metrics is not None:
            direction = "up" if replicas > before else "down"
            self.metrics.scale_events.labels(pool, direction, reason).inc()

    def view(self) -> dict:
        return {"object": "list", "data": [self._pool_view(p) for p in POOLS]}

    def scrape_targets(self) -> list[dict]:
        """The members serving /metrics, in Prometheus' HTTP service discovery format:
        one target group per member, labelled with its pool."""
        with self._lock:
            return [{"targets": [f"{m.address.rsplit(':', 1)[0]}:{m.metrics_port}"],
                     "labels": {"pool": pool}}
                    for pool in POOLS for m in self.members[pool]
                    if m.address and m.metrics_port]

    def _pool_view(self, pool: str) -> dict:
        now = time.monotonic()
        with self._lock:
            out = {"pool": pool, "replicas": self.desired[pool], "min_replicas": 1,
                   "max_replicas": self.max_replicas, "scalable": pool not in self.fixed,
                   "members": [{"name": m.name, "state": m.state, "address": m.address,
                                "load": dict(m.load), "since_s": round(now - m.since, 3)}
                               for m in self.members[pool]]}
            if pool in self.fixed:
                out["reason"] = self.fixed[pool]
            if pool in self.failure:
                out["last_error"] = self.failure[pool][1]
            if self.autoscaler is not None and pool in self.autoscaler.bounds:
                low, high = self.autoscaler.bounds[pool]
                out["autoscale"] = {"min_replicas": low, "max_replicas": high}
            if pool in self.last_decision:
                out["last_change"] = self.last_decision[pool]
        return out

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- the manager's thread -----------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception:  # noqa: BLE001 — the loop must outlive one bad tick
                log.exception("pool membership: a reconcile step failed")
            self._wake.wait(self.TICK_S)
            self._wake.clear()

    def _tick(self) -> None:
        for pool in POOLS:
            self._advance(pool)
            self._resize(pool)
        self._publish()
        for pool in POOLS:
            self._finish_drains(pool)
        if time.monotonic() - self._loads_at >= self.LOAD_EVERY_S:
            self._loads_at = time.monotonic()
            for pool in POOLS:
                for m in list(self.members[pool]):
                    if m.state in ("ready", "draining"):
                        self._poll_load(m)
        self._autoscale()
        self._export()

    def _export(self) -> None:
        if self.metrics is None:
            return
        with self._lock:
            counts = {(p, s): 0 for p in POOLS for s in STATES}
            up = {}
            for pool in POOLS:
                for m in self.members[pool]:
                    counts[pool, m.state] += 1
                    if m.state in ("ready", "draining"):
                        up[pool, m.address] = m.unanswered == 0
        for (pool, state), n in counts.items():
            self.metrics.replicas.labels(pool, state).set(n)
        self.metrics.export_up(up)

    def _autoscale(self) -> None:
        """One autoscaler window: what each ready member did since the last (the change of
        its cumulative figures), the gateway's TTFT/ITL p95 over it, then its decisions."""
        now = time.monotonic()
        if self.autoscaler is None or now - self._window_at < self.autoscaler.policy.interval_s:
            return
        window = Window(now - self._window_at)
        self._window_at = now
        readings = {}
        with self._lock:
            for pool in POOLS:
                members = self.members[pool]
                window.busy[pool] = any(m.state != "ready" for m in members)
                window.members[pool] = []
                for m in (m for m in members if m.state == "ready"):
                    load, before = dict(m.load), self._window_loads.get(m.name, {})
                    readings[m.name] = {k: load[k] for k in CUMULATIVE if k in load}
                    for key, delta in CUMULATIVE.items():
                        if key in load:
                            load[delta] = load[key] - before.get(key, 0)
                    window.members[pool].append(load)
            desired = dict(self.desired)
        self._window_loads = readings
        buckets = [bucket_counts(h) for h in self._latency]
        if len(buckets) == 2:
            window.ttft_p95_s = quantile_between(self._window_buckets[0], buckets[0], 0.95)
            window.itl_p95_s = quantile_between(self._window_buckets[1], buckets[1], 0.95)
        self._window_buckets = buckets
        for d in self.autoscaler.decide(now, window, desired):
            self._set_desired(d.pool, d.replicas, "autoscale", d.why)

    def _advance(self, pool: str) -> None:
        """pending -> starting -> ready, or gone when it died starting."""
        for m in [m for m in self.members[pool] if m.state in ("pending", "starting")]:
            try:
                state, address = self.placement.poll(m.handle)
            except MemberFailed as err:
                log.error("pool %s: %s failed to start: %s", pool, m.name, err)
                with self._lock:
                    self.members[pool].remove(m)
                    self.failure[pool] = (time.monotonic(), f"{m.name}: {err}")
                continue
            if state != m.state:
                with self._lock:
                    m.address = address
                    m.enter(state)
                log.info("pool %s: %s %s%s", pool, m.name, state,
                         f" at {address}" if address else "")

    def _resize(self, pool: str) -> None:
        with self._lock:
            want = self.desired[pool]
            active = [m for m in self.members[pool] if m.state != "draining"]
            failed = self.failure.get(pool)
        if len(active) < want:
            if failed and time.monotonic() - failed[0] < self.RETRY_AFTER_FAILURE_S:
                return
            peers = self._ready()
            for _ in range(want - len(active)):
                name = f"{PREFIX[pool]}-{next(self._names[pool])}"
                try:
                    handle = self.placement.place(pool, name, peers)
                except Exception as err:  # noqa: BLE001 — shown in the view, retried later
                    log.error("pool %s: could not place %s: %s", pool, name, err)
                    with self._lock:
                        self.failure[pool] = (time.monotonic(), f"{name}: {err}")
                    return
                with self._lock:
                    self.members[pool].append(Member(pool, name, handle))
                log.info("pool %s: placed %s", pool, name)
        elif len(active) > want:
            order = {"pending": 0, "starting": 1, "ready": 2}
            victims = sorted(active, key=lambda m: (order[m.state], -m.since))
            for m in victims[:len(active) - want]:
                if m.state == "ready":
                    with self._lock:
                        m.enter("draining")
                    log.info("pool %s: draining %s", pool, m.name)
                else:                          # never joined routing
                    self._remove(m)

    def _ready(self) -> dict[str, list[str]]:
        """The addresses in routing by pool: the ready members, or, in a pool none of
        whose members is ready (its only one was told to leave, the successor is still
        starting), the leaving ones, until the successor is ready."""
        with self._lock:
            out = {}
            for p in POOLS:
                ready = [m.address for m in self.members[p] if m.state == "ready"]
                out[p] = ready or [m.address for m in self.members[p] if m.state == "draining"]
            return out

    def _has_ready(self, pool: str) -> bool:
        with self._lock:
            return any(m.state == "ready" for m in self.members[pool])

    def _routed(self) -> tuple:
        ready = self._ready()
        return tuple(tuple(ready[p]) for p in POOLS)

    def _publish(self) -> None:
        """Routing follows the ready members: peers to every ready attention service first,
        then the gateway's attention list (so a new service serves with current peers)."""
        routed = self._routed()
        if routed == self._published:
            return
        ready = self._ready()
        mlp = [] if "mlp" in self.fixed else ready["mlp"]
        for address in ready["attention"]:
            try:
                self.placement.update_peers(address, mlp, ready["prefill"])
            except OSError as err:        # a dead service: the gateway routes around it
                log.warning("pool membership: %s did not take its peers: %s", address, err)
        self.routing.set_addresses(ready["attention"])
        self._published = routed

    def _finish_drains(self, pool: str) -> None:
        for m in [m for m in self.members[pool] if m.state == "draining"]:
            waited = time.monotonic() - m.since
            if waited < min(self.LEAVE_GRACE_S, self.drain_timeout_s):
                continue
            if not self._has_ready(pool) and waited < self.drain_timeout_s:
                continue                    # it still serves until its successor is ready
            if self._has_ready(pool) and m.address in self._published[POOLS.index(pool)]:
                continue                    # marked draining after this tick's publish: it
                                            # leaves routing first (its moved requests count
                                            # as drained, not failed), then stops
            idle = self._idle(m)
            if idle and waited >= self.LEAVE_GRACE_S:
                self._remove(m)
                log.info("pool %s: %s drained and stopped", pool, m.name)
            elif not idle and waited >= self.drain_timeout_s:
                log.warning("pool %s: %s still busy after %.0f s; killed", pool, m.name,
                            self.drain_timeout_s)
                self._remove(m)

    def _idle(self, m: Member) -> bool:
        if m.pool == "attention":
            return self.routing.in_flight(m.address) == 0
        if not self._poll_load(m):
            return True                     # gone already: nothing in flight there
        return m.load.get("calls", 0) == 0 and m.load.get("clients", 0) == 0

    def _poll_load(self, m: Member) -> bool:
        try:
            load = self.placement.stats(m.pool, m.address)
        except OSError as err:
            m.unanswered += 1
            if m.state == "ready" and m.unanswered >= self.LOST_AFTER_POLLS:
                self._lost(m, err)
            return False
        m.unanswered = 0
        if m.pool == "attention":
            load["in_flight"] = self.routing.in_flight(m.address)
        told_to_leave = load.pop("draining", False)
        metrics_port = load.pop("metrics_port", 0)
        with self._lock:
            m.load, m.metrics_port = load, metrics_port
            if told_to_leave and m.state == "ready":
                m.enter("draining")       # out of routing now; `_resize` places a successor
                log.warning("pool %s: %s got SIGTERM: draining it, placing a replacement",
                            m.pool, m.name)
        return True

    def _lost(self, m: Member, err: OSError) -> None:
        """A ready member that stopped answering (it failed stop, or its process died):
        out of routing and gone; `_resize` places its replacement on the next tick. Its
        callers have moved on already (an attention service's requests migrated, a pool
        or prefill replica's calls were retried elsewhere)."""
        log.error("pool %s: %s stopped answering (%s); replacing it", m.pool, m.name, err)
        with self._lock:     # shown in the view; dated so that the replacement is not held
            self.failure[m.pool] = (time.monotonic() - self.RETRY_AFTER_FAILURE_S,
                                    f"{m.name} stopped answering: {err}")
        self._remove(m)

    def _remove(self, m: Member) -> None:
        self.placement.kill(m.handle)
        with self._lock:
            self.members[m.pool].remove(m)
        if m.pool == "attention":           # forget its endpoint once nothing streams
            self.routing.set_addresses(self._ready()["attention"])
