"""TTFT through the HTTP gateway: prefix-cache hit and RidgeFill vs plain exact prefill.

One uvicorn server on loopback serves a real checkpoint (default: SmolLM2-135M) with the
prefix cache on; each request streams (`stream: true`) and TTFT is the time to the first
SSE chunk that carries text, measured by the client. Per repetition, three requests share a
long document prefix and each ends with a new question:

    miss    a prefix the cache has never seen (full prefill)
    hit     the same prefix again with another question (prefix-cache hit)
    ridge   (with --maps) an unseen prefix, prefill_mode ridgefill

Prints median TTFTs over `--reps`, the ratios, and the hit tokens `/metrics` counted.

With `--cluster` the same runs against the disaggregated deployment on Ray (one attention
service, one pool replica over grpc, one prefill replica with the prefix cache), and a
second deployment without a prefill replica adds the arm

    pool    an unseen prefix prefilled by the attention service through the pool

(both deployments up at once, their requests alternated within each repetition).

    python -m bench.serving.gateway_ttft [--model models/zoo/smollm2-135m] [--prefix-tokens 1500]
                                 [--reps 5] [--maps DIR --split 15] [--cluster]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext

import httpx
import torch

from bench.common import MODEL
from evals.corpus import documents
from services.deployment.server import build_embedded
from services.prefill.service import PrefillConfig
from tests.e2e.conftest import running


def ttft(base: str, model: str, prompt: str, **extra) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "stream": True, **extra}
    start = time.perf_counter()
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - start
    raise RuntimeError("no token streamed")


def counter(base: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in httpx.get(base + "/metrics").text
               .splitlines() if line.startswith(name))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--prefix-tokens", type=int, default=1500)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--maps", help="RidgeFill maps directory (adds the `ridge` arm)")
    ap.add_argument("--split", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads (embedded engine; each Ray actor with --cluster)")
    ap.add_argument("--cluster", action="store_true",
                    help="the disaggregated deployment on Ray instead of the embedded engine")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prefill = PrefillConfig(maps_dir=args.maps, split=args.split) if args.maps else None
    plain = None
    if args.cluster:
        from services.deployment.ray_cluster import ClusterConfig, init_ray
        from services.deployment.build import EngineOptions
        from services.deployment.server import build_cluster

        init_ray()
        options = EngineOptions(prefill=prefill, prefix_cache_bytes=1 << 30)
        app, cluster = build_cluster(ClusterConfig(model=args.model, threads=args.threads,
                                                   prefill_replicas=1, prefill=options),
                                     served_name="bench")
        plain, plain_cluster = build_cluster(ClusterConfig(model=args.model,
                                                           threads=args.threads),
                                             served_name="bench")
    else:
        app = build_embedded(args.model, served_name="bench", prefill=prefill,
                             prefix_cache_bytes=1 << 30)
    tok = app.state.gateway.tokenizer
    words = " ".join(d.text for d in documents("eval")).split()
    docs = [" ".join(words[i * 3000:(i + 1) * 3000]) for i in range(3 * args.reps + 2)]
    prefixes = [tok.decode(tok(d)["input_ids"][:args.prefix_tokens]) for d in docs]
    times = {"miss": [], "hit": [], "ridge": [], "pool": []}
    with running(app) as base, running(plain) if plain is not None else nullcontext() as pbase:
        ttft(base, "bench", prefixes[-1] + "\nQ: warm-up?\nA:")
        if pbase is not None:
            ttft(pbase, "bench", prefixes[-2] + "\nQ: warm-up?\nA:")
        hits0 = counter(base, "splitstack_prefix_cache_hit_tokens_total")
        for i in range(args.reps):
            p = prefixes[i]
            if pbase is not None:
                times["pool"].append(ttft(pbase, "bench", prefixes[2 * args.reps + i]
                                          + "\nQ: What is this about?\nA:"))
            times["miss"].append(ttft(base, "bench", p + "\nQ: What is this about?\nA:"))
            times["hit"].append(ttft(base, "bench", p + "\nQ: Summarise it.\nA:"))
            if args.maps:
                times["ridge"].append(ttft(base, "bench", prefixes[args.reps + i]
                                           + "\nQ: What is this about?\nA:",
                                           prefill_mode="ridgefill"))
        hit_tokens = counter(base, "splitstack_prefix_cache_hit_tokens_total") - hits0
    if args.cluster:
        cluster.shutdown()
        plain_cluster.shutdown()
    med = {k: statistics.median(v) for k, v in times.items() if v}
    where = ("disaggregated on Ray: miss / hit / ridge via the prefill replica, pool = "
             "prefilled by the attention service through the pool" if args.cluster
             else "embedded engine")
    print(f"prefix {args.prefix_tokens} tokens, median of {args.reps} (client-side TTFT, "
          f"streaming, loopback; {where})")
    print("| request | TTFT (s) | vs miss |\n|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.3f} | {med['miss'] / v:.2f}× |")
    print(f"prefix-cache hit tokens counted in /metrics: {hit_tokens:.0f} "
          f"({hit_tokens / args.reps:.0f} per hit request)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
