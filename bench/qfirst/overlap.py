"""Q-first vs standard wiring: per-token decode latency with the MLP pool in another process.

    python -m bench.qfirst.overlap [--model DIR] [--contexts 1024,8192,32768] [--batches 1,8]
                                   [--transports local,grpc,nccl] [--steps 7] [--warmup 2]
                                   [--engine-threads 2] [--out bench/results/qfirst/qfirst_overlap.json]

Where things run (docs/design/qfirst.md, docs/architecture.md):
- `grpc`: the pool (`MLPPool` behind `serve_pool`, as deployed: its cross-client batcher
  sees one client here) runs in a child process with one torch thread; the attention
  service (cache side) runs here with one torch thread, so on two cores q-first's sweep
  runs while the pool computes the feed-forward. One pool process serves both wirings: a
  pool stage is the same computation under either.
- `local`: the pool in this process; `submit` runs the call at once, so nothing overlaps.
  It is the baseline the breakdown needs.
- `nccl`: GPU actors only; skipped with a note (this benchmark's pool is a CPU process).
- mono: the exact single-process engine (`LLMEngine`) with --engine-threads torch threads
  (default 2: the two cores the two processes use between them).

The cache is filled, not prefilled: prefilling 32K tokens takes far too long on a CPU and
SmolLM2 has 8K positions, so this measures time only. Each request's KV blocks are reserved
and written with random finite values (N(0, 1), fp32 like the model): a scheduler hook admits
each request with `context` tokens cached, as a prefix-cache hit would, in the Q-First
engines (both wirings over one shared cache) and in the monolithic one. Positions past max_position_embeddings only lengthen the rotary table. The q-first
service loads the checkpoint marked "splitstack_wiring": "qfirst" (same weights; a
converted Wq changes quality, not time). A point whose KV does not fit in free memory, less
--mem-slack GiB, is skipped with a note (32K x 8 needs 11.3 GiB).

The two wirings decode in alternating steps over the same cache, so a load drifting on the
machine hits both alike; each reports the median of --steps steps after --warmup. Per
transport the table gives ms/token for both wirings and their ratio, the engine and the
disaggregated q-first against it, and per stage (standard wiring): the cache-side sweep, the
pool's own compute (timed inside the pool process), the transport (round trip less pool
compute), what q-first still waits for after its sweep, and the cache side's remaining work.
Per batch it then finds the crossover context, where the sweep takes as long as the pool
stage (interpolated from the measured sweeps), and measures there too. JSON goes to --out.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.qfirst.probes import (Clock, PoolProcess, TimedPool, TimedShard,
                                 TimedTransport, available_bytes, fill_random, kv_bytes,
                                 wiring_checkpoint)
from models import load_model
from services.attention.runner import qfirst_engine
from services.deployment.transports import make_transport
from services.engine import EngineConfig, GenerationParams, LLMEngine

BLOCK = 16
GiB = 1 << 30
WIRINGS = ("standard", "qfirst")


def step(engine, wiring: str) -> None:
    for out in engine.step():
        if out.finished:
            raise RuntimeError(f"{wiring} decode ended: {out.finish_reason} {out.error}")


def decode_engine(model, transport, shard, ctx: int, batch: int, total: int, wiring: str):
    """A Q-First engine over `shard` whose `batch` requests have `ctx` tokens cached (a
    scheduler hook, as a prefix-cache hit admits them) and have computed the last prompt
    token: from here every step decodes."""
    engine = qfirst_engine(model, transport, wiring=wiring, shards=[shard], config=EngineConfig(
        block_size=BLOCK, num_blocks=shard.kv.shape[3], max_num_seqs=batch,
        max_num_batched_tokens=max(batch, 16), max_prefill_chunk=16, max_model_len=total))
    engine.scheduler.cached_tokens = lambda seq: len(seq.prompt_ids) - 1
    params = GenerationParams(max_tokens=total - ctx - 1, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([1] * (ctx + 1), params)
    step(engine, wiring)
    return engine


def run_wirings(engines: dict, shard, ctx: int, batch: int, args, pool_take) -> dict:
    """Decode steps of both wirings, alternating (and alternating which goes first). Both
    engines hold the same block tables over the same shard; each writes its own next
    positions, which only changes random cache contents."""
    fill_random(shard.kv)
    clocks = {w: Clock() for w in engines}
    times, pool = defaultdict(list), defaultdict(float)
    for i in range(args.warmup + args.steps):
        for w in (WIRINGS if i % 2 == 0 else WIRINGS[::-1]):
            shard.clock = engines[w].runner.pool.clock = clocks[w]
            pool_take()
            t = time.perf_counter()
            step(engines[w], w)
            t = time.perf_counter() - t
            took = pool_take().get("pool", {"s": 0.0})["s"]
            if i == args.warmup - 1:
                clocks[w].take()
            if i >= args.warmup:
                times[w].append(t)
                pool[w] += took
    cfg = engines["standard"].model.config
    n_fa, stages = len(cfg.full_attention_layers), cfg.num_hidden_layers
    out = {}
    for w in engines:
        c = {k: v["s"] / args.steps * 1e3 for k, v in clocks[w].take().items()}  # ms/step
        mean = statistics.mean(times[w]) * 1e3
        out[w] = {"ms_per_token": statistics.median(times[w]) * 1e3,
                  "step_ms": [t * 1e3 for t in times[w]],
                  "sweep_ms": c.get("sweep", 0.0) / n_fa,
                  "pool_ms": pool[w] / args.steps * 1e3 / stages,
                  **{f"{k}_ms": c.get(k, 0.0) / stages for k in ("send", "wait", "roundtrip")},
                  "final_ms": c.get("final", 0.0),
                  # the cache side's own work: projections, combine, append, bookkeeping
                  "rest_ms": (mean - c.get("final", 0.0) - c.get("sweep", 0.0)
                              - c.get("send", 0.0) - c.get("wait", 0.0)) / stages}
    return out


def run_engine(model, ctx: int, batch: int, args) -> dict:
    """The exact engine over a cache filled the same way (random, `ctx` tokens each)."""
    total = ctx + 1 + args.warmup + args.steps + 1
    engine = LLMEngine(model, EngineConfig(
        block_size=BLOCK, num_blocks=batch * -(-total // BLOCK), max_num_seqs=batch,
        max_num_batched_tokens=max(batch, 16), max_prefill_chunk=16, max_model_len=total))
    engine.scheduler.cached_tokens = lambda seq: len(seq.prompt_ids) - 1
    params = GenerationParams(max_tokens=total - ctx - 1, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([1] * (ctx + 1), params)
    torch.set_num_threads(args.engine_threads)
    try:
        engine.step()                 # admits all with `ctx` cached; computes the last token
        fill_random(engine.cache.kv)
        times = []
        for _ in range(args.warmup + args.steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(1)
    times = times[args.warmup:]
    return {"ms_per_token": statistics.median(times) * 1e3, "step_ms": [t * 1e3 for t in times]}


def measure(ctx: int, batch: int, args, models: dict, transports: dict) -> dict | None:
    cfg, dtype = models["standard"].config, models["standard"].dtype
    total = ctx + 1 + args.warmup + args.steps + 2     # the last step must not end them
    blocks = batch * -(-total // BLOCK)
    need, free = kv_bytes(cfg, blocks * BLOCK, dtype), available_bytes()
    if need + args.mem_slack * GiB > free:
        print(f"  skipped: context {ctx} batch {batch} needs {need / GiB:.1f} GiB of KV, "
              f"{free / GiB:.1f} GiB is free and {args.mem_slack} GiB is kept", flush=True)
        return None
    print(f"context {ctx} batch {batch} ({need / GiB:.2f} GiB of KV)", flush=True)
    shard = TimedShard(cfg, 0, 1, blocks, BLOCK, dtype, clock=Clock())
    point = {"context": ctx, "batch": batch, "kv_gib": need / GiB, "transports": {}}
    for name, (transport, pool_take) in transports.items():
        engines = {w: decode_engine(models[w], TimedTransport(transport, Clock()), shard, ctx,
                                    batch, total, w) for w in WIRINGS}
        point["transports"][name] = run_wirings(engines, shard, ctx, batch, args, pool_take)
        del engines
    del shard
    gc.collect()
    point["mono"] = run_engine(models["standard"], ctx, batch, args)
    gc.collect()
    return point


def summarize(point: dict, name: str) -> dict:
    std, qf = point["transports"][name]["standard"], point["transports"][name]["qfirst"]
    mono = point["mono"]["ms_per_token"]
    return {"context": point["context"], "batch": point["batch"],
            "crossover": point.get("crossover", False),
            "standard_ms": std["ms_per_token"], "qfirst_ms": qf["ms_per_token"],
            "qfirst_speedup": std["ms_per_token"] / qf["ms_per_token"],
            "mono_ms": mono, "disagg_speedup_vs_mono": mono / qf["ms_per_token"],
            "sweep_ms": std["sweep_ms"], "pool_ms": std["pool_ms"],
            "transport_ms": std["roundtrip_ms"] - std["pool_ms"],
            "qfirst_wait_ms": qf["wait_ms"], "rest_ms": std["rest_ms"]}


def crossover_context(rows: list[dict]) -> int | None:
    """Context where sweep − pool (per stage) crosses zero: linear between the two measured
    contexts around the crossing, or extrapolated from the nearest two."""
    pts = sorted((r["context"], r["sweep_ms"] - r["pool_ms"]) for r in rows)
    if len(pts) < 2:
        return None
    pairs = list(zip(pts, pts[1:]))
    (x0, y0), (x1, y1) = next(((a, b) for a, b in pairs if a[1] <= 0 <= b[1]),
                              pairs[0] if pts[0][1] > 0 else pairs[-1])
    if y1 == y0:
        return None
    ctx = x0 - y0 * (x1 - x0) / (y1 - y0)
    return max(BLOCK, int(round(ctx / BLOCK)) * BLOCK)


def find_crossover(points: list[dict], batch: int, ref: str, args, models, transports):
    """Measure at the interpolated crossover; once more if the sweep there is off the pool
    by more than 25% (with that point in the interpolation). The last try is marked."""
    mine = [p for p in points if p["batch"] == batch]
    for _ in range(2):
        ctx = crossover_context([summarize(p, ref) for p in mine])
        if ctx is None:
            return
        print(f"crossover for batch {batch}: context {ctx} (interpolated from {ref} sweeps)",
              flush=True)
        p = next((p for p in mine if p["context"] == ctx), None)
        if p is None:
            p = measure(ctx, batch, args, models, transports)
            if p is None:
                return
            points.append(p)
            mine.append(p)
        for q in mine:
            q.pop("crossover", None)
        p["crossover"] = True
        r = summarize(p, ref)
        if 0.8 <= r["sweep_ms"] / r["pool_ms"] <= 1.25:
            return


def print_table(points: list[dict], name: str) -> None:
    print(f"\n### transport: {name}\n")
    print("| context | batch | standard ms/tok | q-first ms/tok | q-first speedup | mono ms/tok "
          "| disagg speedup vs mono | sweep ms/stage | pool ms/stage | transport ms/stage "
          "| q-first wait ms/stage | rest ms/stage |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p in sorted(points, key=lambda p: (p["batch"], p["context"])):
        r = summarize(p, name)
        print(f"| {r['context']}{' (crossover)' if r['crossover'] else ''} | {r['batch']} | "
              f"{r['standard_ms']:.1f} | {r['qfirst_ms']:.1f} | {r['qfirst_speedup']:.2f}x | "
              f"{r['mono_ms']:.1f} | {r['disagg_speedup_vs_mono']:.2f}x | {r['sweep_ms']:.2f} | "
              f"{r['pool_ms']:.2f} | {r['transport_ms']:.2f} | {r['qfirst_wait_ms']:.2f} | "
              f"{r['rest_ms']:.2f} |")


def verdict(points: list[dict], name: str) -> dict:
    rows = [summarize(p, name) for p in points]
    cross = [r["qfirst_speedup"] for r in rows if r["crossover"]]
    out = {"lowest_speedup": min(r["qfirst_speedup"] for r in rows),
           "crossover_speedups": cross,
           "never_slower": all(r["qfirst_speedup"] >= 1.0 for r in rows),
           "crossover_at_least_1.3x": bool(cross) and all(s >= 1.3 for s in cross)}
    speedups = (f"q-first speedup at the crossover "
                f"{', '.join(f'{s:.2f}x' for s in cross) or '-'}; lowest anywhere "
                f"{out['lowest_speedup']:.2f}x")
    if name == "local":   # one process: the pool call runs inline, nothing can overlap
        print(f"local: {speedups} (in-process reference: the targets apply to separate "
              f"processes; this spread is the noise floor)")
        return out
    print(f"{name}: {speedups} (target >= 1.30x at the crossover: "
          f"{'PASS' if out['crossover_at_least_1.3x'] else 'FAIL'}; never slower: "
          f"{'PASS' if out['never_slower'] else 'FAIL'})")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/zoo/smollm2-135m")
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--transports", default="local,grpc,nccl")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--engine-threads", type=int, default=2)
    parser.add_argument("--mem-slack", type=float, default=2.0, help="GiB to leave free")
    parser.add_argument("--no-crossover", action="store_true")
    parser.add_argument("--out", default="bench/results/qfirst/qfirst_overlap.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = [n for n in args.transports.split(",") if n]
    if "nccl" in names:
        names.remove("nccl")
        print("nccl: skipped: " + ("no CUDA device here" if not torch.cuda.is_available() else
              "it joins GPU pool actors (services/deployment/ray_cluster.py); this benchmark's "
              "pool is a CPU process"))
    load = os.getloadavg()
    print(f"{os.cpu_count()} CPUs, load average {load[0]:.2f} (quiet machine: near 0), "
          f"{available_bytes() / GiB:.1f} GiB free", flush=True)
    tmp = Path(tempfile.mkdtemp())
    models = {w: load_model(wiring_checkpoint(args.model, tmp / w, w)) for w in WIRINGS}
    transports, proc = {}, None
    try:
        for name in names:
            if name == "local":
                clock = Clock()
                transports[name] = (make_transport("local", [TimedPool(models["standard"],
                                                                       clock)]), clock.take)
            elif name == "grpc":
                proc = PoolProcess(str(tmp / "standard"))
                transports[name] = (make_transport("grpc", [proc.address]), proc.take)
            else:
                raise SystemExit(f"unknown transport {name!r}")
        if not transports:
            raise SystemExit("no transport to measure")
        ref = "grpc" if "grpc" in transports else names[0]
        points = []
        for batch in map(int, args.batches.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                p = measure(ctx, batch, args, models, transports)
                points += [p] if p else []
            if not args.no_crossover:
                find_crossover(points, batch, ref, args, models, transports)
        for name in transports:
            print_table(points, name)
        print()
        results = {"args": vars(args), "torch": torch.__version__, "cpus": os.cpu_count(),
                   "load_average": {"start": load, "end": os.getloadavg()}, "points": points,
                   "summary": {n: [summarize(p, n) for p in points] for n in transports},
                   "verdict": {n: verdict(points, n) for n in transports if points}}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(f"\nload average at the end {os.getloadavg()[0]:.2f}; wrote {args.out}")
    finally:
        for transport, _ in transports.values():
            for replica in transport.replicas:
                getattr(replica, "close", lambda: None)()
        if proc is not None:
            proc.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
