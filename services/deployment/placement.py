"""`RayPlacement`: the pool manager's members as Ray actors, and their gRPC probes.

A member is `pending` while Ray has not placed its actor (no free unit of its pool's custom
resource: on Kubernetes the signal KubeRay's autoscaler acts on), `starting` while the
actor loads its weights, and ready once it serves (its `address()` answered). The
deployment's `Cluster` lists follow: placed handles are appended, killed ones removed, so
`Cluster.shutdown` ends every member.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc

from services.common.pb import splitstack_pb2 as pb
from services.common.pb import splitstack_pb2_grpc as pb_grpc
from services.deployment.autoscale import histogram_totals
from services.deployment.pools import POOLS, Member, MemberFailed
from services.deployment.ray_cluster import (Cluster, place_attention, place_pool,
                                             place_prefill)

RPC_TIMEOUT_S = 5.0
PEERS_TIMEOUT_S = 60.0       # UpdatePeers waits for the step in progress to end


@dataclass(eq=False)
class RayMember:
    pool: str
    actor: object
    ready: object            # ObjectRef of `actor.address()`; None: placed by `deploy`
    address: str = ""


def _actor_pid(actor) -> int:
    """The worker process of `actor` (0 while Ray has not placed it); from the GCS actor
    table, which needs no dashboard."""
    from ray._private import state

    info = state.actors(actor_id=actor._actor_id.hex())
    return int(info.get("Pid") or 0)


class RayPlacement:
    def __init__(self, cluster: Cluster):
        self.cluster, self.config = cluster, cluster.config
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def members(self) -> dict[str, list[Member]]:
        """The deployment's members as placed by `deploy`, all ready."""
        c = self.cluster
        out = {p: [] for p in POOLS}
        for pool, handles, addresses, prefix in (
                ("attention", c.attention, c.attention_addresses, "attention"),
                ("mlp", c.pools, c.pool_addresses, "pool"),
                ("prefill", c.prefills, c.prefill_addresses, "prefill")):
            for i, (actor, address) in enumerate(zip(handles, addresses)):
                out[pool].append(Member(pool, f"{prefix}-{i}",
                                        RayMember(pool, actor, None, address),
                                        state="ready", address=address))
        return out

    def _lists(self, pool: str) -> tuple[list, list[str]]:
        c = self.cluster
        return {"attention": (c.attention, c.attention_addresses),
                "mlp": (c.pools, c.pool_addresses),
                "prefill": (c.prefills, c.prefill_addresses)}[pool]

    def place(self, pool: str, name: str, peers: dict[str, list[str]]) -> RayMember:
        if pool == "mlp":
            actor = place_pool(self.config, name)
        elif pool == "prefill":
            actor = place_prefill(self.config, name)
        else:
            actor = place_attention(self.config, name, [], peers["mlp"], peers["prefill"], [])
        self.cluster.starting.append(actor)
        return RayMember(pool, actor, actor.address.remote())

    def poll(self, member: RayMember) -> tuple[str, str]:
        import ray

        done, _ = ray.wait([member.ready], timeout=0)
        if not done:
            try:
                return ("starting" if _actor_pid(member.actor) else "pending"), ""
            except Exception:  # noqa: BLE001 — the table's shape is Ray's: assume placed
                return "starting", ""
        try:
            address = ray.get(member.ready)
        except Exception as err:  # noqa: BLE001 — RayActorError and what the actor raised
            self.kill(member)
            raise MemberFailed(str(err).splitlines()[0]) from err
        member.address = address
        self.cluster.starting.remove(member.actor)
        actors, addresses = self._lists(member.pool)
        actors.append(member.actor)
        addresses.append(address)
        return "ready", address

    def kill(self, member: RayMember) -> None:
        import ray

        ray.kill(member.actor, no_restart=True)
        actors, addresses = self._lists(member.pool)
        if member.actor in self.cluster.starting:
            self.cluster.starting.remove(member.actor)
        elif member.actor in actors:
            index = actors.index(member.actor)
            actors.pop(index)
            addresses.pop(index)
        with self._lock:
            channel = self._channels.pop(member.address, None)
        if channel is not None:
            channel.close()

    # ---- gRPC -------------------------------------------------------------------------
    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = self.config.security.channel(address)
            return self._channels[address]

    def stats(self, pool: str, address: str) -> dict:
        channel = self._channel(address)
        try:
            if pool == "mlp":
                st = pb_grpc.MLPPoolStub(channel).Stats(pb.Empty(), timeout=RPC_TIMEOUT_S)
                stage_s, stage_calls = histogram_totals(st.metrics,
                                                        "splitstack_pool_stage_seconds")
                rows, batches = histogram_totals(st.metrics, "splitstack_pool_batch_rows")
                return {"clients": st.clients, "calls": st.calls, "stage_s": stage_s,
                        "stage_calls": stage_calls, "rows": rows, "batches": batches,
                        "draining": st.draining, "metrics_port": st.metrics_port}
            if pool == "prefill":
                st = pb_grpc.PrefillStub(channel).Stats(pb.Empty(), timeout=RPC_TIMEOUT_S)
                return {"calls": st.calls, "waiting": st.waiting, "prefills": st.prefills,
                        "draining": st.draining, "metrics_port": st.metrics_port}
            st = pb_grpc.AttentionStub(channel).Stats(pb.Empty(), timeout=RPC_TIMEOUT_S)
            return {"running": st.running, "waiting": st.waiting,
                    "kv_usage": round(st.kv_usage, 4), "steps": st.steps,
                    "draining": st.draining, "metrics_port": st.metrics_port}
        except grpc.RpcError as err:
            raise OSError(f"{address}: {err.code().name}") from err

    def update_peers(self, address: str, mlp: list[str], prefill: list[str]) -> None:
        stub = pb_grpc.AttentionStub(self._channel(address))
        try:
            stub.UpdatePeers(pb.Peers(pool_addresses=mlp, prefill_addresses=prefill),
                             timeout=PEERS_TIMEOUT_S)
        except grpc.RpcError as err:
            raise OSError(f"{address}: {err.code().name}: {err.details()}") from err
