"""Data-plane transports between the cache side and the MLP pool.

`Transport.call(replica, method, *args)` runs one stage call on a pool replica and returns its
result. `local` calls the replica object in-process (zero copy); `grpc_transport` and
`nccl_transport` reach replicas in other processes; a deployment picks one by name
(`services.deployment.transports`). A replica that raises is retried on the next one:
the pool holds no state, so a retry is always safe.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod

from services.common.replicas import ReplicaSet

log = logging.getLogger(__name__)


class PoolUnavailable(RuntimeError):
    pass


class Pending:
    """A started pool call; `result()` waits for it."""

    def __init__(self, fetch):
        self._fetch = fetch

    def result(self):
        return self._fetch()


class Transport(ABC):
    """Round robin over the pool replicas (`ReplicaSet`); a call that fails on one is made
    again on each other one once."""

    # True: `submit` returns while the call runs, and several submitted calls may be in
    # flight at once (their results fetched in the order they were sent)
    pipelines = False

    def __init__(self, replicas: list):
        self.set = ReplicaSet(list(replicas), self._open, self._close, "pool replica",
                              key=self._key)

    @property
    def replicas(self) -> list:
        return [r.conn for r in self.set.replicas]

    @property
    def retries(self) -> int:
        return self.set.retried

    @abstractmethod
    def _invoke(self, replica, method: str, *args):
        """Run `method(*args)` on `replica` and return its result."""

    def set_replicas(self, replicas: list) -> None:
        """Use `replicas` from the next call on (elastic pools). Contract: called from the
        thread that makes the calls, between calls (the attention service's step loop,
        between steps), so no call is in flight on a removed replica. Replicas already in
        use (same `_key`) keep their connection; new ones are opened, removed ones closed."""
        self.set.set(list(replicas))

    @staticmethod
    def _key(replica) -> str:
        """What identifies a replica across `set_replicas` calls."""
        return getattr(replica, "name", replica)

    def _open(self, replica):
        """The connected replica for `replica` as `set_replicas` was given it."""
        return replica

    def _close(self, replica) -> None:
        """Release what `_open` made (a stream, a channel)."""

    def next_replica(self):
        """The replica a call starting now goes to first."""
        return self.set.order()[0].conn

    def call(self, method: str, *args):
        errors = []
        for replica in self.set.order():
            try:
                return self._invoke(replica.conn, method, *args)
            except Exception as exc:  # a dead or failing replica: try the next one
                self.set.retry()
                errors.append(f"{replica.address}: {exc}")
                log.warning("pool call %s failed on %s (%s), retrying", method,
                            replica.address, exc)
        raise PoolUnavailable("every MLP pool replica failed: " + "; ".join(errors))

    def submit(self, method: str, *args) -> Pending:
        """Start `method(*args)` and return a `Pending`. Here the call runs at once (no
        overlap); a transport with an asynchronous channel overrides this so the cache side
        can sweep while the pool computes (q-first wiring)."""
        result = self.call(method, *args)
        return Pending(lambda: result)


class LocalTransport(Transport):
    def _invoke(self, replica, method, *args):
        return getattr(replica, method)(*args)
