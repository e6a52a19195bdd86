"""The routing the pool manager changes in the Ray deployment: `ClusterRouting`, the
attention services the gateway's client routes to. (Each member exports its own metrics
where it runs, `services.common.member_metrics`; the pool manager exports whether each one
answers.)"""
from __future__ import annotations

from services.attention.client import AttentionClient
from services.common.grpc_security import INSECURE, GrpcSecurity


class ClusterRouting:
    """What the pool manager changes (`services.deployment.pools.Routing`)."""

    def __init__(self, client: AttentionClient):
        self.client = client

    def set_addresses(self, addresses: list[str]) -> None:
        self.client.set_addresses(addresses)

    def in_flight(self, address: str) -> int:
        return self.client.in_flight(address)


def cluster_client(addresses: list[str], registry, security: GrpcSecurity = INSECURE
                   ) -> tuple[AttentionClient, ClusterRouting]:
    """The gateway's client of the attention services, its metrics in `registry`, and the
    routing the pool manager changes."""
    client = AttentionClient(addresses, registry, security)
    return client, ClusterRouting(client)
