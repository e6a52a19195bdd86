"""splitstack vs HF transformers vs llama.cpp on the same checkpoint, CPU, side by side.

Every engine runs in its own worker process (bench/peers/worker.py), loaded once; the rounds
interleave the engines, so each sees the same machine state, and the figures are medians
over the rounds. Same workload everywhere: token-id prompts (seeded), greedy, no EOS stop.

    make bench-peers                   # once: llama.cpp + its F32/BF16 GGUFs into .peers/
    python -m bench.peers.run [--repeats 5] [--threads 2] [--engines ...]
    python -m bench.peers.run --served [--concurrency 1,4,16]   # HTTP servers, loadtest

Offline columns (tok/s): prefill of one --prompt-len prompt (time to its first token);
decode at batch 1 and 8 (--new-tokens each after a --decode-prompt-len prompt, time from
the first token to the last). Ratios are against llama.cpp's BF16 GGUF. It also checks that
every engine produced the same greedy tokens as splitstack fp32 at batch 1.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import MODEL, ROOT, tree_rss_mb
from kernels.native import cpu_flags
from services.cli.argtypes import resolve_dtype
from services.cli.serve_args import ServeArgs

PEERS = ROOT / ".peers"
ENGINES = {   # name -> (python, worker args)
    "splitstack fp32": (sys.executable, ["splitstack", str(MODEL), "float32"]),
    "splitstack bf16": (sys.executable, ["splitstack", str(MODEL), "bfloat16"]),
    "splitstack bf16 --compile": (sys.executable,
                                  ["splitstack", str(MODEL), "bfloat16", "compile"]),
    "splitstack bf16 int8": (sys.executable, ["splitstack", str(MODEL), "bfloat16", "int8"]),
    "splitstack bf16 int8 --compile": (sys.executable, ["splitstack", str(MODEL), "bfloat16",
                                                        "int8", "compile"]),
    "splitstack fp32 int8": (sys.executable, ["splitstack", str(MODEL), "float32", "int8"]),
    "splitstack fp32 --compile": (sys.executable,
                                  ["splitstack", str(MODEL), "float32", "compile"]),
    "splitstack fp32 int8 --compile": (sys.executable, ["splitstack", str(MODEL), "float32",
                                                        "int8", "compile"]),
    "HF transformers fp32": (sys.executable, ["hf", str(MODEL), "float32"]),
    "HF transformers bf16": (sys.executable, ["hf", str(MODEL), "bfloat16"]),
    "llama.cpp F32 GGUF": (str(PEERS / "venv/bin/python"),
                           ["llama.cpp", str(PEERS / "smollm2-135m-f32.gguf")]),
    "llama.cpp BF16 GGUF": (str(PEERS / "venv/bin/python"),
                            ["llama.cpp", str(PEERS / "smollm2-135m-bf16.gguf")]),
}
REFERENCE = "llama.cpp BF16 GGUF"
# what `splitstack serve --dtype auto` picks on this machine
SERVED_DTYPE = {"bfloat16": "bf16", "float32": "fp32"}.get(resolve_dtype("auto", False), "fp32")


class Worker:
    def __init__(self, name: str, threads: int):
        python, args = ENGINES[name]
        if name.startswith("llama.cpp"):
            args = [*args, str(threads)]
        env = dict(os.environ, PEERS_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
        self.name = name
        self.proc = subprocess.Popen([python, "-m", "bench.peers.worker", *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, cwd=ROOT)
        self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: worker exited ({self.proc.wait()})")
        return json.loads(line)

    def generate(self, prompts, new_tokens) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "new_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(n)]


def offline(args) -> None:
    names = [n for n in ENGINES if n in args.engines]
    missing = [n for n in names if not Path(ENGINES[n][0]).exists()
               or (n.startswith("llama") and not Path(ENGINES[n][1][1]).exists())]
    if missing:
        sys.exit(f"not installed: {', '.join(missing)} (run `make bench-peers`)")
    workers = [Worker(n, args.threads) for n in names]
    long_prompt = prompts(1, args.prompt_len, 0)
    b1, b8 = prompts(1, args.decode_prompt_len, 1), prompts(8, args.decode_prompt_len, 2)
    for w in workers:                                        # warm-up
        w.generate(long_prompt, 1), w.generate(b8, 4)
    runs: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "b1": [], "b8": []}
                                               for n in names}
    tokens: dict[str, list] = {}
    for r in range(args.repeats):
        for w in workers if r % 2 == 0 else workers[::-1]:
            out = w.generate(long_prompt, 1)
            runs[w.name]["prefill"].append(args.prompt_len / out["first"])
            out = w.generate(b1, args.new_tokens)
            runs[w.name]["b1"].append((args.new_tokens - 1) / (out["total"] - out["first"]))
            tokens[w.name] = out["tokens"]
            out = w.generate(b8, args.new_tokens)
            runs[w.name]["b8"].append(8 * (args.new_tokens - 1) / (out["total"] - out["first"]))
        print(f"round {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    for w in workers:
        w.close()
    med = {n: {k: statistics.median(v) for k, v in cols.items()} for n, cols in runs.items()}
    ref = med.get(REFERENCE)
    print(f"# peers, offline: {args.repeats} interleaved rounds, median (min-max) tok/s, "
          f"{args.threads} threads")
    print(f"# machine: {cpu_line()}")
    print(f"# prefill: 1 x {args.prompt_len} tokens; decode: {args.new_tokens} tokens after "
          f"{args.decode_prompt_len}-token prompts; ratios vs {REFERENCE}")
    print("| engine | prefill | decode b1 | decode b8 | same greedy tokens as splitstack fp32 |")
    print("|---|---|---|---|---|")
    base = tokens.get("splitstack fp32")
    for n in names:
        cells = []
        for k in ("prefill", "b1", "b8"):
            v = runs[n][k]
            cell = f"{med[n][k]:.1f} ({min(v):.0f}-{max(v):.0f})"
            if ref and n != REFERENCE:
                cell += f" **{med[n][k] / ref[k]:.2f}x**"
            cells.append(cell)
        same = "-" if base is None else ("yes" if tokens[n] == base else
                                         f"first diff at {first_diff(tokens[n][0], base[0])}")
        print(f"| {n} | " + " | ".join(cells) + f" | {same} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"medians": med, "runs": runs}, indent=1))


SERVERS = {   # name -> command line (PORT filled in)
    "splitstack": [sys.executable, "-m", "services.cli", "serve", "--model", str(MODEL),
                   "--host", "127.0.0.1", "--port", "{port}", "--log-level", "warning"],
    "splitstack int8 --compile": [sys.executable, "-m", "services.cli", "serve", "--model",
                                  str(MODEL), "--host", "127.0.0.1", "--port", "{port}",
                                  "--log-level", "warning", "--quantization", "int8",
                                  "--compile"],
    "splitstack Q-First": [sys.executable, "-m", "services.cli", "serve", "--model", str(MODEL),
                           "--host", "127.0.0.1", "--port", "{port}", "--log-level", "warning",
                           "--attention-shards", "1", "--mlp-replicas", "1"],
    "splitstack Q-First int8": [sys.executable, "-m", "services.cli", "serve", "--model",
                                str(MODEL), "--host", "127.0.0.1", "--port", "{port}",
                                "--log-level", "warning", "--attention-shards", "1",
                                "--mlp-replicas", "1", "--quantization", "int8"],
    "splitstack --engine-process": [sys.executable, "-m", "services.cli", "serve", "--model",
                                    str(MODEL), "--host", "127.0.0.1", "--port", "{port}",
                                    "--log-level", "warning", "--engine-process"],
    "splitstack --compile --engine-process": [
        sys.executable, "-m", "services.cli", "serve", "--model", str(MODEL), "--host",
        "127.0.0.1", "--port", "{port}", "--log-level", "warning", "--compile",
        "--engine-process"],
    "splitstack int8 --compile --engine-process": [
        sys.executable, "-m", "services.cli", "serve", "--model", str(MODEL), "--host",
        "127.0.0.1", "--port", "{port}", "--log-level", "warning", "--quantization", "int8",
        "--compile", "--engine-process"],
    # `make run` (the prefix cache keeps each chat's system prompt, as llama-server's slots do)
    "splitstack --compile --engine-process --prefix-cache": [
        sys.executable, "-m", "services.cli", "serve", "--model", str(MODEL), "--host",
        "127.0.0.1", "--port", "{port}", "--log-level", "warning", "--compile",
        "--engine-process", "--prefix-cache"],
    "splitstack int8 --compile --engine-process --prefix-cache": [
        sys.executable, "-m", "services.cli", "serve", "--model", str(MODEL), "--host",
        "127.0.0.1", "--port", "{port}", "--log-level", "warning", "--quantization", "int8",
        "--compile", "--engine-process", "--prefix-cache"],
    # llama.cpp's own server, parallel slots and continuous batching (`make bench-peers`)
    "llama-server": [str(PEERS / "llama-server/bin/llama-server"), "-m",
                     str(PEERS / "smollm2-135m-bf16.gguf"), "--host", "127.0.0.1", "--port",
                     "{port}", "-c", "{context}", "-np", "{slots}", "-cb", "--log-disable"],
    "llama-server F32": [str(PEERS / "llama-server/bin/llama-server"), "-m",
                         str(PEERS / "smollm2-135m-f32.gguf"), "--host", "127.0.0.1", "--port",
                         "{port}", "-c", "{context}", "-np", "{slots}", "-cb", "--log-disable"],
    "llama-server Q8_0": [str(PEERS / "llama-server/bin/llama-server"), "-m",
                          str(PEERS / "smollm2-135m-q8_0.gguf"), "--host", "127.0.0.1",
                          "--port", "{port}", "-c", "{context}", "-np", "{slots}", "-cb",
                          "--log-disable"],
    # llama-cpp-python's server: one slot (a footnote; what a Python user might pick)
    "llama.cpp server": [str(PEERS / "venv/bin/python"), "-m", "llama_cpp.server", "--model",
                         str(PEERS / "smollm2-135m-bf16.gguf"), "--host", "127.0.0.1",
                         "--port", "{port}", "--n_ctx", "8192", "--n_batch", "512",
                         "--interrupt_requests", "False"],   # else a new request cuts the last
}


# Q-First with its attention service reaching the pool over gRPC, not the same-host link
SERVERS["splitstack Q-First gRPC"] = SERVERS["splitstack Q-First"]
SERVER_ENV = {"splitstack Q-First gRPC": {"SPLITSTACK_LOCAL_LINK": "0"}}   # name -> its env


def offline_twin(server: str) -> str | None:
    """The offline engine (ENGINES) with a splitstack server's precision and modes (its
    `--dtype auto` resolved for this machine): its batch-1 step time, measured in the same
    run, is what serving adds to."""
    if not server.startswith("splitstack") or "Q-First" in server:
        return None
    return (f"splitstack {SERVED_DTYPE}" + (" int8" if "int8" in server else "")
            + (" --compile" if "--compile" in server else ""))


def served_threads() -> int:
    """The torch threads `splitstack serve` gives the embedded engine here."""
    return ServeArgs().torch_threads


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url}: not ready after {timeout:.0f} s")


def wait_compiled(url: str, timeout: float = 900.0) -> None:
    """Until a `--compile` server's decode graphs are built (they build while it serves
    eagerly): the figures are of the compiled steps."""
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=10).text
        pending = [line for line in text.splitlines()
                   if line.startswith('splitstack_compiled_decode_buckets{state="pending"}')]
        if not pending or float(pending[0].split()[-1]) == 0:
            return
        time.sleep(2)
    raise RuntimeError(f"{url}: decode graphs not built after {timeout:.0f} s")


def served(args) -> None:
    """Both servers up at once (idle ones cost nothing), then the same closed-loop load
    against each in turn, `args.repeats` rounds; medians of the rounds."""
    import tempfile
    out_dir = Path(tempfile.mkdtemp(prefix="peers-served-"))
    procs, urls, idle = {}, {}, {}
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), RAY_USAGE_STATS_ENABLED="0",
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled",
               TOKENIZERS_PARALLELISM="false")     # Ray on loopback (the Q-First server)
    try:
        for i, (name, cmd) in enumerate((n, c) for n, c in SERVERS.items() if n in args.servers):
            port = args.port + i
            slots = max(args.concurrency)       # one llama-server slot per client
            cmd = [c.replace("{port}", str(port)).replace("{slots}", str(slots))
                   .replace("{context}", str(2048 * slots)) for c in cmd]
            if name == "llama.cpp server":
                cmd += ["--n_threads", str(args.threads), "--n_threads_batch", str(args.threads)]
            elif name.startswith("llama-server"):
                cmd += ["-t", str(args.threads), "-tb", str(args.threads)]
                if "Q8_0" in name and "amx_int8" in cpu_flags():
                    # ggml's AMX product of repacked Q8_0 weights crashes at load on this
                    # kind of host (ggml-org/llama.cpp#20824): the weights stay as loaded
                    cmd += ["--no-repack"]
            procs[name] = subprocess.Popen(cmd, cwd=ROOT,
                                           env=dict(env, **SERVER_ENV.get(name, {})),
                                           stdout=subprocess.DEVNULL,
                                           stderr=open(out_dir / f"{i}.log", "w"))
            urls[name] = f"http://127.0.0.1:{port}"
        for name, proc in procs.items():
            wait_ready(urls[name], proc)
            if "--compile" in SERVERS[name]:
                wait_compiled(urls[name])
            time.sleep(3)
            idle[name] = tree_rss_mb(proc.pid)
        points: dict[str, dict[int, list[dict]]] = {n: {} for n in procs}
        twins = {offline_twin(n) for n in procs} - {None}
        # the twins run with the served engine's torch threads (`splitstack serve` leaves
        # one core to the front end), so the overhead compares like with like
        workers = {t: Worker(t, served_threads()) for t in sorted(twins)}
        b1 = prompts(1, args.decode_prompt_len, 1)
        for w in workers.values():
            w.generate(b1, 4)                                    # warm-up
        step_ms: dict[str, list[float]] = {t: [] for t in workers}
        for r in range(args.repeats):
            for t, w in workers.items():          # the engines' own batch-1 step, this round
                out = w.generate(b1, args.max_tokens)
                step_ms[t].append(1e3 * (out["total"] - out["first"]) / (args.max_tokens - 1))
            for name in (list(procs) if r % 2 == 0 else list(procs)[::-1]):
                dest = out_dir / f"{name.split()[0]}-{r}"
                subprocess.run([sys.executable, "-m", "loadtest", "--url", urls[name],
                                "--scenario", args.scenario, "--concurrency",
                                ",".join(map(str, args.concurrency)), "--num-requests",
                                str(args.num_requests), "--max-tokens", str(args.max_tokens),
                                "--max-seconds", "300", "--out", str(dest), "--no-progress"],
                               cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
                for point in json.loads((dest / "result.json").read_text())["points"]:
                    points[name].setdefault(point["max_concurrency"], []).append(point)
            print(f"round {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)
        time.sleep(5)
        after = {name: tree_rss_mb(proc.pid) for name, proc in procs.items()}
        for w in workers.values():
            w.close()
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    med = lambda pts, key: statistics.median(p[key] for p in pts)   # noqa: E731
    print(f"# peers, served: `{args.scenario}` scenario, closed loop, {args.num_requests} "
          f"requests per point, at most {args.max_tokens} output tokens, greedy; "
          f"{args.repeats} rounds, medians; {args.threads} threads")
    print(f"# machine: {cpu_line()}")
    print("ratios: output tok/s against " + ", ".join(
        f"{n}: {reference(n, procs)}" for n in procs if reference(n, procs) not in (None, n)))
    print("| server | concurrency | output tok/s | TTFT p50 / p99 ms | ITL p50 ms | failed |")
    print("|---|---|---|---|---|---|")
    for name in procs:
        ref = reference(name, procs)
        for c in args.concurrency:
            pts = points[name][c]
            tput = med(pts, "output_throughput")
            ratio = ""
            if ref and name != ref and points.get(ref, {}).get(c):
                ratio = f" **{tput / med(points[ref][c], 'output_throughput'):.2f}x**"
            print(f"| {name} | {c} | {tput:.1f}{ratio} | {med(pts, 'p50_ttft_ms'):.0f} / "
                  f"{med(pts, 'p99_ttft_ms'):.0f} | {med(pts, 'p50_itl_ms'):.1f} | "
                  f"{sum(p['failed'] for p in pts)} |")
    if 1 in args.concurrency and step_ms:
        print("serving overhead: served ITL p50 at 1 client minus the same engine's offline "
              f"batch-1 step at the served {served_threads()} torch thread(s) (median of the "
              "rounds), ms")
        print("| server | served ITL p50 | offline step | overhead |")
        print("|---|---|---|---|")
        for name in procs:
            twin = offline_twin(name)
            if twin is None:
                continue
            itl, step = med(points[name][1], "p50_itl_ms"), statistics.median(step_ms[twin])
            print(f"| {name} | {itl:.1f} | {step:.1f} ({twin}) | {itl - step:+.1f} |")
    print("| server | RSS MiB, idle at start | RSS MiB, idle after the load |")
    print("|---|---|---|")
    for name, mib in idle.items():
        print(f"| {name} | {mib:.0f} | {after[name]:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"points": points, "offline_step_ms": step_ms,
                                               "idle_rss_mib": idle,
                                               "idle_after_load_rss_mib": after},
                                              indent=1))


def reference(name: str, servers) -> str | None:
    """The peer a server is compared with, at matched precision: llama-server on the Q8_0
    GGUF for int8 weights, else on the GGUF of `--dtype auto`'s choice here (BF16 on a CPU
    with native bf16, F32 elsewhere); llama-cpp-python's server when no llama-server runs."""
    peer = ("llama-server Q8_0" if "int8" in name else
            "llama-server" if SERVED_DTYPE == "bf16" else "llama-server F32")
    for candidate in (peer, "llama-server", "llama.cpp server"):
        if candidate in servers:
            return candidate
    return None


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def cpu_line() -> str:
    model = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip()
                     for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    flags = " ".join(sorted(f for f in cpu_flags()
                            if f.startswith(("avx512", "amx", "avx2", "fma"))))
    return f"{model}, {os.cpu_count()} cores; {flags}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--engines", type=lambda s: [e.strip() for e in s.split(",")],
                    default=list(ENGINES), help="comma-separated, of: " + ", ".join(ENGINES))
    ap.add_argument("--json", help="also write the raw figures here")
    served_args = ap.add_argument_group("--served: HTTP servers under `splitstack loadtest`")
    served_args.add_argument("--served", action="store_true")
    served_args.add_argument("--concurrency", default=[1, 4, 16],
                             type=lambda s: [int(c) for c in s.split(",")])
    served_args.add_argument("--scenario", default="chat")
    served_args.add_argument("--num-requests", type=int, default=48)
    served_args.add_argument("--max-tokens", type=int, default=64)
    served_args.add_argument("--port", type=int, default=18600)
    served_args.add_argument("--servers", default=["splitstack", "llama-server"],
                             type=lambda s: [e.strip() for e in s.split(",")],
                             help="comma-separated, of: " + ", ".join(SERVERS))
    args = ap.parse_args()
    served(args) if args.served else offline(args)


if __name__ == "__main__":
    main()
