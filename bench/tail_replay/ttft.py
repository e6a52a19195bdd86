"""Tail-Replay TTFT: a prefix-cache hit vs a full prefill, measured in one run.

    python -m bench.tail_replay.ttft [--prefixes 2048,8192,16384] [--suffix 128]
                                    [--ratios 0.05,0.1] [--reps 5] [--threads 2]
                                    [--redis-url redis://127.0.0.1:6379/0 | --redis-url '']
                                    [--device cuda [--device-cache-bytes N]
                                     [--gdn-kernel triton] [--replay-graphs]]

Model: the `bench` Qwen3.5 hybrid config (3 Gated DeltaNet : 1 full attention, 8 layers)
with random fp32 weights, its context raised to fit the longest prompt. Each prompt is a
prefix of P tokens plus a new suffix of 128 tokens; TTFT is the time from `add_request` to
the first sampled token in the engine (no HTTP), median of `--reps` runs, each with a suffix
of its own so only the prefix is ever cached.

Arms, per prefix length:
- full prefill: the engine without a prefix cache;
- memory-tier hit for each r in `--ratios`, with and without the overlap (FA KV written on a
  worker thread while the replay runs) and the tail-FFN skip;
- Redis-tier hit (first r, overlap + skip): a fresh engine whose memory tier is empty, so
  every block comes from Redis (skipped when `--redis-url ''` or Redis is unreachable);
- device-tier hit (first r, overlap + skip) with `--device-cache-bytes N`: a cache with a
  device tier of N bytes, warmed by one untimed hit, so every timed hit reads its FA KV from
  device memory.

`--gdn-kernel triton` runs the chunked delta rule on the fused Triton kernels and
`--replay-graphs` the replay through CUDA graphs (both CUDA only; they set
`SPLITSTACK_GDN_KERNEL` and `SPLITSTACK_REPLAY_GRAPHS` for every arm).

Subnormal floats are flushed to zero as in the serving processes (`--keep-denormals`: kept).
Prints one table: TTFT, the speedup over the full prefill, and the mean replay and KV-copy
time of the hits (from the prefix cache's histograms).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

from models import load_model
from models.random_checkpoint import load_configs, save_random_checkpoint
from services.common.process import flush_denormals
from services.engine import EngineConfig, GenerationParams, LLMEngine
from services.prefix_cache import (PrefixCache, PrefixCacheConfig,
                                   PrefixCacheMetrics)

ONE = GenerationParams(max_tokens=1, ignore_eos=True)


def ttft_s(engine: LLMEngine, ids: list[int]) -> float:
    start = time.perf_counter()
    sid = engine.add_request(ids, ONE)
    while not engine.seqs[sid].output_ids:
        engine.step()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    engine.pop(sid)
    if engine.prefix is not None:
        engine.prefix.drain()            # the insert thread must not steal the next run's CPU
    return elapsed


def histogram(cache: PrefixCache) -> dict[str, tuple[float, float]]:
    """name -> (sum, count) of the replay and KV-copy histograms."""
    reg, out = cache.metrics.registry, {}
    for name in ("replay", "transfer"):
        base = f"splitstack_prefix_cache_{name}_seconds"
        out[name] = (reg.get_sample_value(base + "_sum") or 0.0,
                     reg.get_sample_value(base + "_count") or 0.0)
    return out


def mean_ms(before: dict, after: dict, name: str) -> float:
    (s0, n0), (s1, n1) = before[name], after[name]
    return 1000 * (s1 - s0) / (n1 - n0) if n1 > n0 else float("nan")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefixes", default="2048,8192,16384")
    parser.add_argument("--suffix", type=int, default=128)
    parser.add_argument("--ratios", default="0.05,0.1")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=2048, help="max_prefill_chunk")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the KV copy then "
                        "overlaps the replay on a side stream when overlap is on)")
    parser.add_argument("--keep-denormals", action="store_true",
                        help="compute with subnormal floats (the serving processes flush them "
                             "to zero, services/common/process.py)")
    parser.add_argument("--device-cache-bytes", type=int, default=0,
                        help="add a device-tier arm with a device tier of this many bytes")
    parser.add_argument("--gdn-kernel", choices=("torch", "triton"), default=None,
                        help="chunked delta-rule kernel (sets SPLITSTACK_GDN_KERNEL)")
    parser.add_argument("--replay-graphs", action="store_true",
                        help="replay through CUDA graphs (sets SPLITSTACK_REPLAY_GRAPHS=1)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.device_cache_bytes and args.device == "cpu":
        raise SystemExit("--device-cache-bytes needs --device cuda")
    if args.gdn_kernel:
        os.environ["SPLITSTACK_GDN_KERNEL"] = args.gdn_kernel
    if args.replay_graphs:
        os.environ["SPLITSTACK_REPLAY_GRAPHS"] = "1"
    flushed = not args.keep_denormals and flush_denormals()    # before any parallel op
    torch.set_num_threads(args.threads)
    prefixes = [int(p) for p in args.prefixes.split(",")]
    ratios = [float(r) for r in args.ratios.split(",")]
    longest = max(prefixes) + args.suffix + 16

    cfg = dict(load_configs("bench")["qwen3_5"],
               max_position_embeddings=max(4096, 1 << (longest - 1).bit_length()))
    tmp = Path(tempfile.mkdtemp())
    save_random_checkpoint(cfg, tmp, seed=0, std=0.02)
    model = load_model(tmp, device=args.device)
    shutil.rmtree(tmp, ignore_errors=True)
    engine_cfg = EngineConfig(block_size=16, num_blocks=2 * (-(-longest // 16)), max_num_seqs=2,
                              max_prefill_chunk=args.chunk, max_num_batched_tokens=args.chunk)
    redis_ok = bool(args.redis_url) and redis_reachable(args.redis_url)
    redis_prefix = f"splitstack-bench:{uuid.uuid4().hex}"
    gen = torch.Generator().manual_seed(0)

    def rand(n: int) -> list[int]:
        return torch.randint(0, cfg["vocab_size"], (n,), generator=gen).tolist()

    def cache(redis: bool = False, metrics: PrefixCacheMetrics | None = None,
              device_bytes: int = 0) -> PrefixCache:
        return PrefixCache(PrefixCacheConfig(
            namespace="bench-qwen3_5", block_size=16, capacity_bytes=8 << 30,
            redis_url=args.redis_url if redis else None, redis_prefix=redis_prefix,
            redis_timeout_s=5.0, device_capacity_bytes=device_bytes),
            metrics or PrefixCacheMetrics(), device=args.device if device_bytes else None)

    def timed(engine: LLMEngine, prefix: list[int]) -> float:
        return statistics.median(ttft_s(engine, prefix + rand(args.suffix))
                                 for _ in range(args.reps))

    where = (torch.cuda.get_device_name() if args.device == "cuda"
             else f"{args.threads} torch threads")
    print(f"Qwen3.5 bench config (random fp32), suffix {args.suffix} tokens, median of "
          f"{args.reps}, {where}, prefill chunk {args.chunk}, subnormals "
          f"{'flushed to zero' if flushed else 'kept'}, delta-rule kernel "
          f"{os.environ.get('SPLITSTACK_GDN_KERNEL', 'torch')}, replay CUDA graphs "
          f"{on(os.environ.get('SPLITSTACK_REPLAY_GRAPHS') == '1')}", flush=True)
    print("| prefix | arm | r | overlap | FFN skip | TTFT ms | speedup vs full | replay ms "
          "| KV copy ms |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    plain = LLMEngine(model, engine_cfg)
    ttft_s(plain, rand(64))                                    # warm-up, not timed
    try:
        for n in prefixes:
            prefix = rand(n)
            full = timed(plain, prefix)
            row(n, "full prefill", "", "", "", full, full, float("nan"), float("nan"))
            memory = cache()
            ttft_s(LLMEngine(model, engine_cfg, prefix_cache=memory), prefix)   # store it
            for r in ratios:
                for overlap, skip in ((False, False), (False, True), (True, False),
                                      (True, True)):
                    engine = LLMEngine(model, engine_cfg, prefix_cache=memory, replay_ratio=r,
                                       replay_overlap=overlap, ffn_skip=skip)
                    before = histogram(memory)
                    hit = timed(engine, prefix)
                    after = histogram(memory)
                    row(n, "hit, memory tier", f"{r:.0%}", on(overlap), on(skip), hit, full,
                        mean_ms(before, after, "replay"), mean_ms(before, after, "transfer"))
            if args.device_cache_bytes:
                tiered = cache(device_bytes=args.device_cache_bytes)
                ttft_s(LLMEngine(model, engine_cfg, prefix_cache=tiered), prefix)   # store it
                engine = LLMEngine(model, engine_cfg, prefix_cache=tiered,
                                   replay_ratio=ratios[0])
                ttft_s(engine, prefix + rand(args.suffix))     # promotes it to the device
                before = histogram(tiered)
                hit = timed(engine, prefix)
                after = histogram(tiered)
                row(n, "hit, device tier", f"{ratios[0]:.0%}", "on", "on", hit, full,
                    mean_ms(before, after, "replay"), mean_ms(before, after, "transfer"))
                tiered.close()
            if redis_ok:
                ttft_s(LLMEngine(model, engine_cfg, prefix_cache=cache(redis=True)), prefix)
                metrics, hits = PrefixCacheMetrics(), []
                for _ in range(args.reps):          # a fresh cache: its memory tier is empty
                    shared = cache(redis=True, metrics=metrics)
                    engine = LLMEngine(model, engine_cfg, prefix_cache=shared,
                                       replay_ratio=ratios[0])
                    hits.append(ttft_s(engine, prefix + rand(args.suffix)))
                    shared.close()
                after = histogram(shared)
                zero = {k: (0.0, 0.0) for k in after}
                row(n, "hit, Redis tier", f"{ratios[0]:.0%}", "on", "on",
                    statistics.median(hits), full, mean_ms(zero, after, "replay"),
                    mean_ms(zero, after, "transfer"))
    finally:
        if redis_ok:
            delete_keys(args.redis_url, redis_prefix)


def on(flag: bool) -> str:
    return "on" if flag else "off"


def row(n, arm, r, overlap, skip, t, full, replay, copy) -> None:
    print(f"| {n} | {arm} | {r} | {overlap} | {skip} | {1000 * t:.0f} | {full / t:.2f}x | "
          f"{fmt(replay)} | {fmt(copy)} |", flush=True)


def fmt(ms: float) -> str:
    return "" if ms != ms else f"{ms:.1f}"


def redis_reachable(url: str) -> bool:
    import redis
    try:
        redis.Redis.from_url(url, socket_timeout=2).ping()
        return True
    except (redis.exceptions.RedisError, OSError) as err:
        print(f"Redis at {url} unreachable ({err}); skipping the Redis-tier arm", file=sys.stderr)
        return False


def delete_keys(url: str, prefix: str) -> None:
    import redis
    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=f"{prefix}:*"))
    if keys:
        client.delete(*keys)


if __name__ == "__main__":
    main()
