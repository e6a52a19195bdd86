"""Timing probes and cache filling for `bench/qfirst/overlap.py`.

The probes subclass or wrap the real components and only add `time.perf_counter()` around
calls, into a `Clock` the benchmark swaps per wiring. `python -m bench.qfirst.probes DIR`
is the pool process: a timed `MLPPool` behind `serve_pool` with one torch thread; it prints
its address, then answers every line on stdin with its clock (JSON) and starts it over.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.common import ROOT
from models import load_model
from services.attention.shard import KVShard
from services.common.transport import Pending
from services.mlp_pool import MLPPool


class Clock:
    """Seconds and counts accumulated by name; `take` returns them and starts over."""

    def __init__(self):
        self.s, self.n = defaultdict(float), defaultdict(int)

    def add(self, name: str, seconds: float) -> None:
        self.s[name] += seconds
        self.n[name] += 1

    def take(self) -> dict:
        out = {k: {"s": self.s[k], "n": self.n[k]} for k in self.s}
        self.s.clear()
        self.n.clear()
        return out


class TimedPool(MLPPool):
    """The pool's own compute per stage call ("pool"), without transport."""

    def __init__(self, model, clock: Clock):
        super().__init__(model)
        self.clock = clock

    def stage(self, *args):
        t = time.perf_counter()
        out = super().stage(*args)
        self.clock.add("pool", time.perf_counter() - t)
        return out


class TimedShard(KVShard):
    """The cache sweep per call ("sweep")."""

    def __init__(self, *args, clock: Clock):
        super().__init__(*args)
        self.clock = clock

    def sweep(self, *args):
        t = time.perf_counter()
        out = super().sweep(*args)
        self.clock.add("sweep", time.perf_counter() - t)
        return out


class TimedTransport:
    """Wraps a transport. Per stage call: "send" (the cache side handing it over), "wait"
    (blocked on its result; under q-first, what the sweep did not cover) and "roundtrip"
    (from send to result); per step: "final" (the sampling call)."""

    def __init__(self, inner, clock: Clock):
        self.inner, self.clock = inner, clock

    def submit(self, method, *args):
        sent = time.perf_counter()
        pending = self.inner.submit(method, *args)
        self.clock.add("send", time.perf_counter() - sent)

        def fetch():
            t = time.perf_counter()
            out = pending.result()
            done = time.perf_counter()
            self.clock.add("wait", done - t)
            self.clock.add("roundtrip", done - sent)
            return out
        return Pending(fetch)

    def call(self, method, *args):
        t = time.perf_counter()
        out = self.inner.call(method, *args)
        self.clock.add(method, time.perf_counter() - t)
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


class PoolProcess:
    """The pool in a child process (this file as a script); `take()` returns its clock."""

    def __init__(self, model_dir: str, dtype: str = "float32"):
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.qfirst.probes", model_dir,
                                      dtype], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.address = self.proc.stdout.readline().strip()
        if not self.address:
            raise RuntimeError("the pool process did not start")

    def take(self) -> dict:
        self.proc.stdin.write("take\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def fill_random(t: torch.Tensor, seed: int = 0) -> None:
    """Write N(0, 1) values into all of `t`, tiling one 16 MB draw (fast, finite)."""
    flat = t.view(-1)
    tile = torch.randn(1 << 22, generator=torch.Generator().manual_seed(seed)).to(t.dtype)
    for i in range(0, flat.numel(), tile.numel()):
        n = min(tile.numel(), flat.numel() - i)
        flat[i:i + n].copy_(tile[:n])


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def kv_bytes(cfg, tokens: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return (2 * len(cfg.full_attention_layers) * cfg.num_key_value_heads * cfg.head_dim
            * elem * tokens)


def wiring_checkpoint(src: str, dst: Path, wiring: str) -> Path:
    """`src` with "splitstack_wiring" set (weights linked, not copied)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f.resolve())
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg["splitstack_wiring"] = wiring
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def serve(model_dir: str, dtype: str = "float32") -> None:
    from services.mlp_pool.grpc_server import serve_pool

    torch.set_num_threads(1)
    clock = Clock()
    server, address = serve_pool(TimedPool(load_model(model_dir, dtype=getattr(torch, dtype)),
                                           clock))
    print(address, flush=True)
    for _ in sys.stdin:
        print(json.dumps(clock.take()), flush=True)
    server.stop(0)


if __name__ == "__main__":
    serve(*sys.argv[1:3])
