"""The autoscaler without Ray: `--autoscale` parsing, the per-pool decisions from a window of
load, cooldown and bounds, the p95 read from histogram deltas, and the pool manager acting on
the decisions with `splitstack_pool_replicas` and `splitstack_scale_events_total` exported."""
from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from services.cli.serve_args import FlagError, ServeArgs
from services.deployment.autoscale import (AutoscaleError, Autoscaler, Policy, Window,
                                           bucket_counts, histogram_totals, parse_autoscale,
                                           quantile_between)
from services.deployment.pools import Member, PoolManager
from tests.unit.test_elastic_pools import Handle, Routing, ScriptedPlacement, until


def test_parse_autoscale():
    assert parse_autoscale("attention=1:4, mlp=2:3") == {"attention": (1, 4), "mlp": (2, 3)}
    for bad, says in (("mlp=1", "POOL=MIN:MAX"), ("gpu=1:2", "no pool 'gpu'"),
                      ("mlp=1:2,mlp=1:3", "given twice"), ("mlp=a:2", "integers"),
                      ("mlp=3:2", "MAX is under MIN"), ("prefill=0:2", "at least 1"),
                      ("", "names no pool")):
        with pytest.raises(AutoscaleError, match=says):
            parse_autoscale(bad)


def test_serve_flags_check_the_autoscaler():
    assert ServeArgs().autoscaler() is None
    a = ServeArgs(disaggregated=True, autoscale="mlp=1:3", slo_itl_ms=200.0,
                  autoscale_interval=5.0)
    scaler = a.autoscaler()
    assert scaler.bounds == {"mlp": (1, 3)} and scaler.policy.slo_itl_s == 0.2
    assert scaler.policy.interval_s == 5.0
    for kwargs, says in (({"autoscale": "mlp=1:3"}, "Ray deployment"),
                         ({"disaggregated": True, "autoscale": "mlp=1:9"}, "--max-replicas"),
                         ({"disaggregated": True, "autoscale": "mlp=2"}, "POOL=MIN:MAX")):
        with pytest.raises(FlagError, match=says):
            ServeArgs(**kwargs)


def test_the_objectives_are_the_slo_flags_with_or_without_the_autoscaler():
    """One setting: the objectives the gateway exports (the rules and dashboards read them)
    are the autoscaler's targets; without --autoscale they are still exported."""
    objectives = ServeArgs(slo_ttft_ms=500.0).gateway_options()["objectives"]
    assert (objectives.ttft_s, objectives.itl_s) == (0.5, 0.2)      # ITL: the default
    a = ServeArgs(disaggregated=True, autoscale="prefill=1:3", slo_ttft_ms=750.0)
    assert a.gateway_options()["objectives"].ttft_s == a.autoscaler().policy.slo_ttft_s == 0.75


def window(pool, *members, seconds=10.0, **kw):
    return Window(seconds, {pool: list(members)}, **kw)


def test_attention_follows_kv_usage_and_waiting_requests():
    scaler = Autoscaler({"attention": (1, 3)}, Policy(cooldown_s=0))
    up = scaler.decide(0, window("attention", {"kv_usage": 0.9, "waiting": 0}),
                       {"attention": 1})
    assert [(d.replicas, d.direction) for d in up] == [(2, "up")] and "KV usage 90%" in up[0].why
    up = scaler.decide(1, window("attention", {"kv_usage": 0.5, "waiting": 3}),
                       {"attention": 2})
    assert up[0].replicas == 3 and "3 requests waiting" in up[0].why
    # at the maximum: no decision; the middle band: no change
    assert scaler.decide(2, window("attention", {"kv_usage": 0.95}), {"attention": 3}) == []
    assert scaler.decide(3, window("attention", {"kv_usage": 0.5}), {"attention": 2}) == []
    down = scaler.decide(4, window("attention", {"kv_usage": 0.1}, {"kv_usage": 0.2}),
                         {"attention": 2})
    assert [(d.replicas, d.direction) for d in down] == [(1, "down")]


def test_cooldown_and_a_pool_in_motion_hold_decisions():
    scaler = Autoscaler({"prefill": (1, 4)}, Policy(cooldown_s=30))
    busy = window("prefill", {"waiting": 4, "calls": 2})
    assert len(scaler.decide(100, busy, {"prefill": 1})) == 1
    assert scaler.decide(110, busy, {"prefill": 2}) == []             # cooling down
    busy.busy["prefill"] = True                                       # a member starting
    assert scaler.decide(140, busy, {"prefill": 2}) == []
    busy.busy["prefill"] = False
    assert scaler.decide(140, busy, {"prefill": 2})[0].replicas == 3
    idle = window("prefill", {"waiting": 0, "calls": 0, "prefilled": 0})
    assert scaler.decide(200, idle, {"prefill": 3})[0].direction == "down"


def test_mlp_busy_share_and_latency_against_its_idle_baseline():
    scaler = Autoscaler({"mlp": (1, 4)}, Policy(cooldown_s=0, busy_high=0.8, busy_low=0.25))
    quiet = {"stage_s": 0.5, "stage_calls": 100, "rows": 100, "batches": 100}   # 5 ms, 5%
    assert scaler.decide(0, window("mlp", quiet), {"mlp": 2})[0].direction == "down"
    assert scaler.baseline_s == pytest.approx(0.005)
    slow = {"stage_s": 2.0, "stage_calls": 100, "rows": 800, "batches": 100}    # 20 ms, 20%
    up = scaler.decide(1, window("mlp", slow), {"mlp": 1})
    assert up[0].direction == "up" and "4.0x its idle baseline" in up[0].why
    assert "8.0 rows a batch" in up[0].why
    saturated = {"stage_s": 9.0, "stage_calls": 1500, "rows": 1500, "batches": 1500}
    up = scaler.decide(2, window("mlp", saturated), {"mlp": 2})
    assert up[0].replicas == 3 and "busy 90%" in up[0].why


def test_slo_targets_add_members():
    scaler = Autoscaler({"prefill": (1, 2), "attention": (1, 2)},
                        Policy(cooldown_s=0, slo_ttft_s=0.5, slo_itl_s=0.1))
    w = Window(10, {"prefill": [{"waiting": 0, "calls": 0, "prefilled": 5}],
                    "attention": [{"kv_usage": 0.5}]}, ttft_p95_s=0.9, itl_p95_s=0.25)
    why = {d.pool: d.why for d in scaler.decide(0, w, {"prefill": 1, "attention": 1})}
    assert why == {"prefill": "TTFT p95 900 ms over the 500 ms SLO",
                   "attention": "ITL p95 250 ms over the 100 ms SLO"}


def test_p95_from_histogram_deltas():
    registry = CollectorRegistry()
    h = Histogram("t_seconds", "t", buckets=(0.1, 0.2, 0.5, 1.0), registry=registry)
    for _ in range(50):
        h.observe(0.05)                      # before the window: must not count
    before = bucket_counts(h)
    assert quantile_between(before, bucket_counts(h), 0.95) is None
    for v in [0.15] * 90 + [0.7] * 10:
        h.observe(v)
    p95 = quantile_between(before, bucket_counts(h), 0.95)
    assert 0.5 < p95 < 1.0                   # in the bucket holding the slowest 10%
    assert histogram_totals(generate_latest(registry).decode(), "t_seconds") == (
        pytest.approx(50 * 0.05 + 90 * 0.15 + 10 * 0.7), 150)


def test_pool_manager_acts_on_decisions_and_exports_them(caplog):
    placement, routing = ScriptedPlacement(), Routing()
    h = placement.handles["pool-0"] = Handle("mlp", "pool-0", "ready")
    h.load = {"calls": 0, "clients": 1, "stage_s": 0.0, "stage_calls": 0, "rows": 0,
              "batches": 0}
    registry = CollectorRegistry()
    scaler = Autoscaler({"mlp": (1, 2)}, Policy(interval_s=0.2, cooldown_s=0.5))
    caplog.set_level(logging.INFO, logger="services.deployment.pools")
    manager = PoolManager(placement, routing,
                          {"mlp": [Member("mlp", "pool-0", h, state="ready",
                                          address=h.address)]},
                          max_replicas=4, registry=registry, autoscaler=scaler)
    manager.TICK_S = manager.LOAD_EVERY_S = 0.02
    try:
        # a burst: the replica computes 0.19 s of every 0.2 s
        def burst():
            h.load = dict(h.load, stage_s=h.load["stage_s"] + 0.19,
                          stage_calls=h.load["stage_calls"] + 10)
            return "pool-1" in placement.handles
        until(burst, timeout=10)
        placement.handles["pool-1"].state = "ready"
        placement.handles["pool-1"].load = dict(h.load, clients=0)
        text = lambda: generate_latest(registry).decode()     # noqa: E731
        until(lambda: 'splitstack_pool_replicas{pool="mlp",state="ready"} 2.0' in text())
        assert ('splitstack_scale_events_total{direction="up",pool="mlp",reason="autoscale"} '
                '1.0') in text()
        # idle: back to the minimum once the cooldown passed, and never below it
        until(lambda: placement.killed == ["pool-1"], timeout=10)
        assert 'direction="down",pool="mlp",reason="autoscale"} 1.0' in text()
        view = next(p for p in manager.view()["data"] if p["pool"] == "mlp")
        assert view["autoscale"] == {"min_replicas": 1, "max_replicas": 2}
        assert view["last_change"].startswith("autoscale: 2 -> 1 (every replica busy under")
        assert manager.desired["mlp"] == 1
        logged = [r.getMessage() for r in caplog.records if "autoscale:" in r.getMessage()]
        assert "1 -> 2 replicas (autoscale: a replica busy" in logged[0]
        # an admin change is counted with its own reason
        manager.scale("mlp", 2)
        assert 'direction="up",pool="mlp",reason="admin"} 1.0' in text()
    finally:
        manager.close()
