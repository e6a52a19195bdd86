"""Batches concurrent pool calls from many callers (attention services) into one forward.

Stage calls that are waiting when the compute thread comes free are grouped by layer and
run as one `MLPPool.stage` over their rows concatenated; `final` calls likewise. Nothing
waits for a batch to fill: a lone call runs at once, and calls that arrive during a forward
form the next batch, as in continuous batching. Every row's result is what the pool would
have returned for it alone (rows do not interact in a stage), so batching is invisible to
the callers except in time.

Once started, a lone call on an idle pool (nothing queued, no forward running) runs on its
caller's thread instead: with one attention service per replica, each of a token's ~31 calls would
otherwise wait for the compute thread to wake and then wake its caller back.

Contract: `stage` / `final` may be called from any number of threads; one forward runs at a
time (on this object's compute thread, or inline on a lone caller's). An exception in a
batched forward is raised in every caller of that batch.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from concurrent.futures import Future

import torch

from models.gdn import GDNInputs
from services.mlp_pool.metrics import PoolMetrics
from services.common.messages import StageOutput
from services.mlp_pool.pool import MLPPool


class BatchingPool:
    def __init__(self, pool: MLPPool, start: bool = True, metrics: PoolMetrics | None = None):
        """`metrics`: stage latency and batch size of every forward it runs."""
        self.pool = pool
        self.metrics = metrics
        self.name = pool.name
        self.batches = 0            # forwards run
        self.rows = 0               # rows served
        self._pending: list[tuple] = []
        self._cv = threading.Condition()
        self._forward = threading.Lock()      # one forward at a time, on whichever thread
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name=f"{pool.name}-batcher",
                                       daemon=True)
        if start:
            self.thread.start()

    @property
    def calls(self) -> int:
        return self.pool.calls

    # ---- callers ------------------------------------------------------------------------
    def _enqueue(self, key, args) -> Future:
        fut: Future = Future()
        if self.thread.is_alive() and self._forward.acquire(blocking=False):
            try:
                with self._cv:
                    lone = not self._pending
                if lone:                       # idle: run it here, no hand-off
                    self._run_batch(key, [(args, fut)])
                    return fut
            finally:
                self._forward.release()
        with self._cv:
            self._pending.append((key, args, fut))
            self._cv.notify()
        return fut

    def stage(self, layer: int, u: torch.Tensor, positions: torch.Tensor) -> StageOutput:
        return self._enqueue(("stage", layer), (u, positions)).result()

    def final(self, u: torch.Tensor, params, generators, histories=None):
        return self._enqueue(("final",), (u, params, generators, histories)).result()

    def score(self, u: torch.Tensor, targets: torch.Tensor, k: int):
        return self._enqueue(("score", k), (u, targets)).result()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()

    # ---- compute thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
            with self._forward:       # after a caller's inline forward: all that came during it
                with self._cv:
                    pending, self._pending = self._pending, []
                groups = defaultdict(list)
                for key, args, fut in pending:
                    groups[key].append((args, fut))
                for key, calls in groups.items():
                    self._run_batch(key, calls)

    def _run_batch(self, key, calls) -> None:
        try:
            self._run(key, calls)
        except Exception as exc:  # noqa: BLE001 — every caller of the batch sees it
            if self.metrics is not None:
                self.metrics.failures.inc()
            for _, fut in calls:
                if not fut.done():
                    fut.set_exception(exc)

    def _run(self, key, calls) -> None:
        start = time.perf_counter()
        sizes = [args[0].shape[0] for args, _ in calls]
        u = torch.cat([args[0] for args, _ in calls])
        self.batches += 1
        self.rows += u.shape[0]
        if key[0] == "stage":
            out = self.pool.stage(key[1], u, torch.cat([args[1] for args, _ in calls]))
            parts = _split_stage(out, sizes)
        elif key[0] == "score":
            out = self.pool.score(u, torch.cat([args[1] for args, _ in calls]), key[1])
            parts = list(zip(*(t.split(sizes) for t in out)))
        else:
            params = [p for args, _ in calls for p in args[1]]
            gens = [g for args, _ in calls for g in args[2]]
            histories = [h for args, _ in calls for h in (args[3] or [None] * len(args[1]))]
            tokens, logprobs, logits = self.pool.final(u, params, gens, histories)
            parts = list(zip(tokens.split(sizes), logprobs.split(sizes), logits.split(sizes)))
        if self.metrics is not None:
            self.metrics.observe(key[0], time.perf_counter() - start, u.shape[0], len(calls))
        for (_, fut), part in zip(calls, parts):
            fut.set_result(part)


def _split_stage(out: StageOutput, sizes: list[int]) -> list[StageOutput]:
    z = out.z.split(sizes)
    if out.gdn is not None:
        gdn = [t.split(sizes) for t in out.gdn]
        return [StageOutput(z[i], gdn=GDNInputs(*(t[i] for t in gdn)))
                for i in range(len(sizes))]
    k, v = out.k.split(sizes), out.v.split(sizes)
    return [StageOutput(z[i], k[i], v[i]) for i in range(len(sizes))]
