"""What several benchmarks and the end-to-end tests share: the repository root, the default
model, `splitstack serve` in a subprocess, and the memory of a process tree read from /proc."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]           # the repository
MODEL = ROOT / "models" / "zoo" / "smollm2-135m"
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0"}


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
    except (OSError, StopIteration):
        return 0.0          # gone, or a zombie


KV_MAP_MIN_BYTES = 64 << 20     # strictly more: glibc's per-thread malloc arenas are 64 MiB


def kv_map_mb(pid: int) -> float:
    """Resident MB of a process's KV caches: its anonymous mappings of over 64 MiB. The
    caches are lazily backed memory maps (`services.engine.kv_cache.lazy_zeros`) whose
    resident part grows with the blocks first written, up to the configured budget; serving
    processes put every malloc on the heap (`services.common.process`), so nothing else
    maps that much anonymous memory."""
    total, size, anonymous = 0, 0, False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split()
                if "-" in head[0] and not line.endswith(":\n") and len(head) >= 5 \
                        and not head[0].endswith(":"):
                    anonymous = len(head) == 5
                elif head[0] == "Size:":
                    size = int(head[1]) << 10
                elif head[0] == "Rss:" and anonymous and size > KV_MAP_MIN_BYTES:
                    total += int(head[1])
    except OSError:
        return 0.0
    return total / 1024


def tree_pids(root: int) -> set[int]:
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        children = [c for c, pp in parent.items() if pp == p and c not in tree]
        tree.update(children)
        frontier += children
    return tree


def tree_rss_mb(root: int) -> float:
    """RSS of `root` and every process under it."""
    return sum(rss_mb(p) for p in tree_pids(root))


def memory(root: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """(RSS of the server, of its process tree), and the same without the KV caches' maps."""
    tree = tree_pids(root)
    rss = rss_mb(root), sum(rss_mb(p) for p in tree)
    kv = kv_map_mb(root), sum(kv_map_mb(p) for p in tree)
    return rss, (rss[0] - kv[0], rss[1] - kv[1])


class ServeProcess:
    """`splitstack serve FLAGS` in a subprocess on a free loopback port, its output in
    `log_path`; ready once /health answers. `env`: added to this process's environment."""

    def __init__(self, flags: list[str], log_path: str | Path, env: dict | None = None,
                 startup_s: float = 600):
        self.flags, self.log_path, self.startup_s = list(flags), Path(log_path), startup_s
        self.env = {**os.environ, **RAY_ENV, "TOKENIZERS_PARALLELISM": "false", **(env or {})}

    def __enter__(self) -> ServeProcess:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", "--host", "127.0.0.1", "--port",
             str(self.port), *self.flags], cwd=ROOT, env=self.env, stdout=self.log,
            stderr=subprocess.STDOUT)
        deadline = time.time() + self.startup_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"splitstack serve exited {self.proc.returncode}:\n"
                                   + self.log_path.read_text()[-3000:])
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError("splitstack serve did not come up in time")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def logs(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")
