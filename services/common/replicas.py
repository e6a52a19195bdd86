"""The replicas of one pool as a client sees them: the routing, retry and membership loop
that the gateway's attention client, the attention service's prefill client and its pool
transport share.

- Routing: `order()` puts the replicas with the fewest calls in flight first, ties taken
  in turn (so an idle client goes round robin); a caller may move a preferred one forward.
- Retry: a caller tries them in that order until one answers, counting each retry
  (`retried`); what counts as "try the next one" is the caller's to say.
- Membership: `set(addresses)` replaces the list whole while calls run. A replica kept
  keeps its connection; a new one is opened (`open(address)`); a removed one stays
  `removed` until its last call ends (`end`), then is closed (`close(replica)`).

Thread-safe: one lock guards the list and the counts.
"""
from __future__ import annotations

import itertools
import threading
from typing import Callable, Generic, TypeVar

C = TypeVar("C")          # a connection: a channel and stubs, a pool object, a stream


class Replica(Generic[C]):
    def __init__(self, address: str, conn: C):
        self.address, self.conn = address, conn
        self.inflight = 0
        self.removed = False      # out of the set; closed once `inflight` is 0


class ReplicaSet(Generic[C]):
    def __init__(self, specs: list, open: Callable[[object], C],
                 close: Callable[[C], None] = lambda conn: None, what: str = "replica",
                 key: Callable[[object], str] = lambda spec: spec):
        """`specs`: how each replica is given (an address, or an in-process pool);
        `open(spec)` connects one, `close(conn)` releases it; `key(spec)` is what
        identifies it across `set` calls (its `address`); `what` names them in errors."""
        if not specs:
            raise ValueError(f"needs at least one {what}")
        self._open, self._close, self._key, self.what = open, close, key, what
        self._lock = threading.Lock()
        self._turn = itertools.count()
        self.replicas: list[Replica[C]] = [Replica(key(s), open(s)) for s in specs]
        self.retried = 0

    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self.replicas]

    def order(self, usable: Callable[[Replica[C]], bool] = lambda r: True) -> list[Replica[C]]:
        """The usable replicas, fewest calls in flight first, ties in turn."""
        with self._lock:
            replicas = [r for r in self.replicas if usable(r)]
            turn, n = next(self._turn), len(replicas)
            return [replicas[i] for i in sorted(range(n), key=lambda i: (
                replicas[i].inflight, (i - turn) % n))]

    def begin(self, replica: Replica[C]) -> bool:
        """Count a call on `replica`; False (nothing counted) when it left the set."""
        with self._lock:
            if replica.removed:
                return False
            replica.inflight += 1
            return True

    def end(self, replica: Replica[C]) -> None:
        with self._lock:
            replica.inflight -= 1
            done = replica.removed and replica.inflight == 0
        if done:
            self._close(replica.conn)

    def retry(self) -> None:
        with self._lock:
            self.retried += 1

    def set(self, specs: list) -> list[Replica[C]]:
        """Use `specs` from now on; returns the replicas that left (closed already when
        idle, else at the end of their last call)."""
        if not specs:
            raise ValueError(f"needs at least one {self.what}")
        with self._lock:
            current = {r.address: r for r in self.replicas}
            kept = [current.pop(self._key(s), None) for s in specs]
            self.replicas = [r if r is not None else Replica(self._key(s), self._open(s))
                             for s, r in zip(specs, kept)]
            idle = []
            for gone in current.values():
                gone.removed = True
                if gone.inflight == 0:
                    idle.append(gone)
        for gone in idle:
            self._close(gone.conn)
        return list(current.values())
