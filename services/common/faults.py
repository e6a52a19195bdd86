"""Fault injection for tests and chaos drills: `SPLITSTACK_FAULT_INJECT`.

    SPLITSTACK_FAULT_INJECT="engine_step:40"                  # embedded: the 40th step raises
    SPLITSTACK_FAULT_INJECT="engine_step:30@attention-0,pool_call:500@pool-1"

Each comma-separated entry `POINT:N[@MEMBER]` makes the Nth pass through POINT raise
`InjectedFault` (once), in every process, or only in the member named MEMBER (a Ray
deployment's `attention-0`, `pool-1`, `prefill-0`, ...). The points:

- `engine_step`: the step loop, before the Nth step, outside the runner: the engine fails
  stop (every request it holds fails, the process reports dead and exits);
- `pool_call`: an MLP pool replica's Nth stage call: the replica fails stop (the call
  fails, its attention services retry elsewhere, the process exits and is replaced);
- `prefill`: a prefill replica's Nth `Prefill` call, the same way.

The setting is read once where a process starts (`FaultPlan.from_env`, or the deployment's
`ClusterConfig.fault_inject`, which the gateway reads and hands to every member it places).
Unset, each `FaultPoint.hit` is one attribute test.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

ENV = "SPLITSTACK_FAULT_INJECT"
POINTS = ("engine_step", "pool_call", "prefill")


class InjectedFault(RuntimeError):
    """Raised at a fault point by `SPLITSTACK_FAULT_INJECT`."""


class FaultPoint:
    """Counts passes through one point and raises on the armed one (thread-safe)."""

    def __init__(self, point: str, at: int | None):
        self.point, self.at = point, at
        self.passes = 0
        self._lock = threading.Lock()

    def hit(self) -> None:
        if self.at is None:
            return
        with self._lock:
            self.passes += 1
            fire = self.passes == self.at
        if fire:
            raise InjectedFault(f"{ENV}: injected fault at {self.point} pass {self.at}")


@dataclass(frozen=True)
class FaultPlan:
    """The armed points of one process: point -> the pass that raises."""
    at: dict[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str | None, member: str | None = None) -> "FaultPlan":
        """The entries of `spec` that apply to `member` (all unscoped ones, and those
        scoped `@member`). Raises ValueError naming a malformed entry."""
        at = {}
        for entry in (e.strip() for e in (spec or "").split(",")):
            if not entry:
                continue
            target, scope = entry, None
            if "@" in entry:
                target, scope = entry.split("@", 1)
                if not scope:
                    raise ValueError(f"{ENV}: {entry!r} names no member after '@'")
            point, _, count = target.partition(":")
            if point not in POINTS:
                raise ValueError(f"{ENV}: unknown point {point!r} in {entry!r}; points: "
                                 f"{', '.join(POINTS)}")
            if not count.isdigit() or int(count) < 1:
                raise ValueError(f"{ENV}: {entry!r} needs POINT:N with N >= 1")
            if scope is None or scope == member:
                at[point] = int(count)
        return cls(at)

    @classmethod
    def from_env(cls, member: str | None = None) -> "FaultPlan":
        return cls.parse(os.environ.get(ENV), member)

    def point(self, name: str) -> FaultPoint:
        if name not in POINTS:
            raise ValueError(f"unknown fault point {name!r}")
        return FaultPoint(name, self.at.get(name))

    def __bool__(self) -> bool:
        return bool(self.at)


NO_FAULTS = FaultPlan()
