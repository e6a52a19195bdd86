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
    def __init__(self, replicas: list):
        if not replicas:
            raise ValueError("a transport needs at least one pool replica")
        self.replicas = list(replicas)
        self._next = 0
        self.retries = 0

    @abstractmethod
    def _invoke(self, replica, method: str, *args):
        """Run `method(*args)` on `replica` and return its result."""

    def set_replicas(self, replicas: list) -> None:
        """Use `replicas` from the next call on (elastic pools). Contract: called from the
        thread that makes the calls, between calls (the attention service's step loop,
        between steps), so no call is in flight on a removed replica. Replicas already in
        use (same `_key`) keep their connection; new ones are opened, removed ones closed."""
        if not replicas:
            raise ValueError("a transport needs at least one pool replica")
        current = {self._key(r): r for r in self.replicas}
        updated = []
        for r in replicas:
            kept = current.pop(self._key(r), None)
            updated.append(kept if kept is not None else self._open(r))
        self.replicas = updated
        for gone in current.values():
            self._close(gone)
        self._next %= len(self.replicas)

    def _key(self, replica):
        """What identifies a replica across `set_replicas` calls."""
        return getattr(replica, "name", replica)

    def _open(self, replica):
        """The connected replica for `replica` as `set_replicas` was given it."""
        return replica

    def _close(self, replica) -> None:
        """Release what `_open` made (a stream, a channel)."""

    def call(self, method: str, *args):
        """Round-robin over replicas; on failure, retry each other replica once."""
        n = len(self.replicas)
        errors = []
        for attempt in range(n):
            replica = self.replicas[(self._next + attempt) % n]
            try:
                result = self._invoke(replica, method, *args)
                self._next = (self._next + attempt + 1) % n
                return result
            except Exception as exc:  # a dead or failing replica: try the next one
                self.retries += 1
                errors.append(f"{getattr(replica, 'name', replica)}: {exc}")
                log.warning("pool call %s failed on %s (%s), retrying", method,
                            getattr(replica, "name", replica), exc)
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
