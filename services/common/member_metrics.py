"""A member's own /metrics: each attention service, MLP pool replica and prefill replica of
the Ray deployment serves its registry over HTTP where it runs, every sample labelled with
the `member` it is (its gRPC address), so that Prometheus scrapes each one directly (a
PodMonitor on the Ray worker pods; locally the targets the gateway lists at
`/admin/scrape-targets`) and the gateway's /metrics never calls a member.

The port is `SPLITSTACK_MEMBER_METRICS_PORT` when set (the chart sets it on the worker pods,
one member to a pod), else any free one; a member whose set port is taken (several on one
host) takes a free one and says so. Its `Stats` reply carries the port it got.
"""
from __future__ import annotations

import logging
import os

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import Metric

log = logging.getLogger(__name__)

PORT_ENV = "SPLITSTACK_MEMBER_METRICS_PORT"


class MemberExporter:
    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1"):
        """Serve `registry` on `host`; `member` (the label's value) is set once the
        member's gRPC address is known, before it joins routing."""
        self.registry, self.member = registry, ""
        exposed = CollectorRegistry()
        exposed.register(self)
        wanted = int(os.environ.get(PORT_ENV) or 0)
        try:
            self.server, _ = start_http_server(wanted, host, registry=exposed)
        except OSError as err:
            if not wanted:
                raise
            log.warning("%s=%d is taken on %s (%s): serving /metrics on a free port",
                        PORT_ENV, wanted, host, err)
            self.server, _ = start_http_server(0, host, registry=exposed)
        self.port: int = self.server.server_port

    def collect(self):
        for fam in self.registry.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples = [s._replace(labels={**s.labels, "member": self.member})
                           for s in fam.samples]
            yield out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
