"""A member's own /metrics (`MemberExporter`): its registry over real HTTP, every sample with
the member's label, on the port the environment sets, or on a free one when that is taken."""
from __future__ import annotations

import socket
import urllib.request

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from services.common.member_metrics import PORT_ENV, MemberExporter


def scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text.decode()) for s in fam.samples}


def test_every_sample_carries_the_member_label(monkeypatch):
    monkeypatch.delenv(PORT_ENV, raising=False)
    registry = CollectorRegistry()
    calls = Counter("x_calls", "calls", ["kind"], registry=registry)
    seconds = Histogram("x_seconds", "time", registry=registry, buckets=(0.5,))
    exporter = MemberExporter(registry)
    try:
        exporter.member = "10.0.0.7:5301"        # set once the gRPC address is known
        calls.labels("a").inc(3)
        seconds.observe(0.25)
        got = scrape(exporter.port)
    finally:
        exporter.close()
    member = ("member", "10.0.0.7:5301")
    assert got[("x_calls_total", (("kind", "a"), member))] == 3
    assert got[("x_seconds_bucket", (("le", "0.5"), member))] == 1
    assert got[("x_seconds_count", (member,))] == 1
    assert all(dict(labels).get("member") == "10.0.0.7:5301" for _, labels in got)


def test_the_set_port_is_used_and_a_taken_one_falls_back(monkeypatch):
    with socket.socket() as s:                   # a port free now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(PORT_ENV, str(port))
    first = MemberExporter(CollectorRegistry())
    try:
        second = MemberExporter(CollectorRegistry())   # a second member on this host
        try:
            assert first.port == port and second.port not in (0, port)
            scrape(second.port)
        finally:
            second.close()
    finally:
        first.close()
