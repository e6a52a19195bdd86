"""The members' side of the gateway's /metrics in the Ray deployment, and the routing the
pool manager changes.

`MemberMetrics` keeps, per attention service, its up / KV / running / waiting gauges and
retry counters (from the stats `AttentionClient.refresh` polls), and polls the prefill and
pool replicas' own stats; what those processes export (prefill and prefix-cache metrics,
pool stage latency and batch size) is re-exported under their own names with a `member`
label (`RemoteMetrics`), so dashboards need no second scrape target. `ClusterRouting` is
what the pool manager changes: the attention services the client routes to, and the peers
whose metrics are polled.
"""
from __future__ import annotations

import asyncio

import grpc
from prometheus_client import Gauge

from services.attention.client import AttentionClient, Channel
from services.common.grpc_security import INSECURE, GrpcSecurity
from services.common.reexport import ReExported
from services.common.pb import splitstack_pb2 as pb
from services.common.pb import splitstack_pb2_grpc as pb_grpc
from services.gateway.metrics import PolledCounter

STUBS = {"prefill": pb_grpc.PrefillStub, "pool": pb_grpc.MLPPoolStub}


class RemoteMetrics(ReExported):
    """Other services' metrics (their Prometheus text, as polled), each sample labelled
    with the `member` it came from (its address)."""


class MemberMetrics:
    def __init__(self, registry, security: GrpcSecurity = INSECURE,
                 prefill_addresses: list[str] = (), pool_addresses: list[str] = ()):
        """`registry`: the gateway's; `prefill_addresses`, `pool_addresses`: replicas whose
        metrics are polled and re-exported."""
        self.security = security
        self.remote = RemoteMetrics()
        registry.register(self.remote)
        self.peers: list[tuple[str, Channel]] = []
        self.set_peers(list(prefill_addresses), list(pool_addresses))
        self.peer_up = {kind: Gauge(f"splitstack_{kind}_up",
                                    f"1 while the {kind} replica answers, else 0",
                                    ["member"], registry=registry) for kind in STUBS}
        self.gauges = {
            name: Gauge(f"splitstack_attention_{name}", doc, ["member"], registry=registry)
            for name, doc in (
                ("up", "1 while the attention service answers, else 0"),
                ("kv_cache_usage_ratio", "Fraction of KV blocks in use, fullest shard"),
                ("requests_running", "Requests decoding on the attention service"),
                ("requests_waiting", "Requests waiting for KV on the attention service"))}
        self.polled = Gauge("splitstack_members_polled_timestamp_seconds", "When the last "
                            "finished poll of the members' stats and metrics began (Unix "
                            "time)", registry=registry)
        self.retries = {
            name: PolledCounter(f"splitstack_attention_{name}", doc, ["member"], registry)
            for name, doc in (
                ("pool_retries", "Pool calls the attention service retried elsewhere"),
                ("prefill_retries", "Prefill calls made again on another prefill replica"))}

    async def observe(self, services: dict[str, bool], polled: dict[str, pb.AttentionStats],
                      began: float):
        """The attention services (address -> answers) and the stats polled from the live
        ones in the poll that `began` (Unix time); then every peer is polled."""
        for address, up in services.items():
            self.gauges["up"].labels(address).set(up)
        for address, st in polled.items():
            for name, value in (("kv_cache_usage_ratio", st.kv_usage),
                                ("requests_running", st.running),
                                ("requests_waiting", st.waiting)):
                self.gauges[name].labels(address).set(value)
            self.retries["pool_retries"].set((address,), st.pool_retries)
            self.retries["prefill_retries"].set((address,), st.prefill_retries)
        for address in services:       # each one's own metrics: its engine's, a local pool's
            st = polled.get(address)
            if st is not None and st.metrics:
                self.remote.latest[address] = st.metrics
            else:
                self.remote.latest.pop(address, None)
        async def poll(kind: str, ch: Channel) -> None:
            try:
                st = await ch.connect().Stats(pb.Empty(), timeout=2.0)
            except grpc.aio.AioRpcError:
                up = False
                self.remote.latest.pop(ch.address, None)
            else:
                up = True
                self.remote.latest[ch.address] = st.metrics
            self.peer_up[kind].labels(ch.address).set(up)

        await asyncio.gather(*(poll(kind, ch) for kind, ch in self.peers))
        self.polled.set(began)

    def set_peers(self, prefill_addresses: list[str], pool_addresses: list[str]) -> None:
        """The prefill and pool replicas whose metrics are polled (any thread)."""
        current = {(kind, ch.address): ch for kind, ch in self.peers}
        self.peers = [(kind, current.pop((kind, a), None) or Channel(a, self.security,
                                                                     STUBS[kind]))
                      for kind, addresses in (("prefill", prefill_addresses),
                                              ("pool", pool_addresses))
                      for a in addresses]
        for kind, address in current:
            self.forget(kind, address)

    def forget(self, kind: str, address: str) -> None:
        """Drop a member's series: its gauges and re-exported metrics."""
        self.remote.latest.pop(address, None)
        for gauge in (self.gauges.values() if kind == "attention" else [self.peer_up[kind]]):
            try:
                gauge.remove(address)
            except KeyError:
                pass


class ClusterRouting:
    """What the pool manager changes (`services.deployment.pools.Routing`)."""

    def __init__(self, client: AttentionClient, members: MemberMetrics):
        self.client, self.members = client, members

    def set_addresses(self, addresses: list[str]) -> None:
        self.client.set_addresses(addresses)

    def set_peers(self, prefill_addresses: list[str], pool_addresses: list[str]) -> None:
        self.members.set_peers(prefill_addresses, pool_addresses)

    def in_flight(self, address: str) -> int:
        return self.client.in_flight(address)


def cluster_client(addresses: list[str], registry, security: GrpcSecurity = INSECURE,
                   prefill_addresses: list[str] = (),
                   pool_addresses: list[str] = ()) -> tuple[AttentionClient, ClusterRouting]:
    """The gateway's client of the attention services, with the members' metrics in
    `registry`, and the routing the pool manager changes."""
    members = MemberMetrics(registry, security, prefill_addresses, pool_addresses)
    client = AttentionClient(addresses, registry, security, members)
    return client, ClusterRouting(client, members)
