"""Q-first vs standard wiring: per-token decode latency with the MLP pool in another process.

    python bench/qfirst_overlap.py [--model DIR] [--contexts 512,2048] [--batches 1,4]
                                   [--steps 8] [--repeats 3]

The pool runs in a separate process behind gRPC (one persistent stream); the attention
service (cache side) runs here. Both use one thread each, so on 2 cores they can overlap.
Under q-first wiring the cache side sends u, sweeps its KV while the pool computes, and only
the combine waits; under standard wiring it waits for z before it can form q. The same
weights are used with the wiring flag flipped (latency only; a q-first model would be
converted by fine-tuning Wq). Prints ms/token for both, their ratio (median of N), and the
exact single-process engine for reference.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models import load_model  # noqa: E402
from services.attention.service import AttentionService  # noqa: E402
from services.attention.shard import KVShard  # noqa: E402
from services.common.transport import make_transport  # noqa: E402
from services.engine import EngineConfig, GenerationParams, LLMEngine  # noqa: E402

POOL = """
import sys, time, torch
torch.set_num_threads(1)
from models import load_model
from services.mlp_pool import MLPPool
from services.mlp_pool.grpc_server import serve_pool
server, address = serve_pool(MLPPool(load_model(sys.argv[1])))
print(address, flush=True)
time.sleep(3600)
"""


def decode_ms(service_or_engine, prompts, steps: int) -> float:
    params = GenerationParams(max_tokens=steps + 1, ignore_eos=True)
    ids = [service_or_engine.add_request(p, params) for p in prompts]
    service_or_engine.step()                                  # prefill (not timed)
    start = time.perf_counter()
    for _ in range(steps):
        service_or_engine.step()
    elapsed = time.perf_counter() - start
    for i in ids:
        if isinstance(service_or_engine, LLMEngine):
            service_or_engine.pop(i)
        else:
            service_or_engine.requests.pop(i)
    return elapsed / steps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/zoo/smollm2-135m")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    variants = {}
    for wiring in ("standard", "qfirst"):
        d = tmp / wiring
        shutil.copytree(args.model, d)
        cfg = json.loads((d / "config.json").read_text())
        cfg["splitstack_wiring"] = wiring
        (d / "config.json").write_text(json.dumps(cfg))
        variants[wiring] = d
    pools = {}
    for wiring, d in variants.items():
        proc = subprocess.Popen([sys.executable, "-c", POOL, str(d)], cwd=ROOT,
                                stdout=subprocess.PIPE, text=True)
        pools[wiring] = (proc, proc.stdout.readline().strip())
    try:
        models = {w: load_model(d) for w, d in variants.items()}
        print("| cached tokens | batch | standard ms/tok | q-first ms/tok | q-first/standard "
              "| engine ms/tok |")
        print("|---|---|---|---|---|---|")
        for ctx in map(int, args.contexts.split(",")):
            for batch in map(int, args.batches.split(",")):
                gen = torch.Generator().manual_seed(ctx + batch)
                prompts = [torch.randint(0, 49000, (ctx,), generator=gen).tolist()
                           for _ in range(batch)]
                times = {"standard": [], "qfirst": [], "engine": []}
                for _ in range(args.repeats):
                    for wiring, model in models.items():
                        shard = KVShard(model.config, 0, 1, -(-ctx * batch // 16) + 8 * batch,
                                        16, model.dtype)
                        service = AttentionService(
                            model, [shard], make_transport("grpc", [pools[wiring][1]]),
                            wiring=wiring, max_num_seqs=batch)
                        times[wiring].append(decode_ms(service, prompts, args.steps))
                    engine = LLMEngine(models["standard"], EngineConfig(
                        max_num_batched_tokens=ctx * batch, max_prefill_chunk=ctx))
                    times["engine"].append(decode_ms(engine, prompts, args.steps))
                med = {k: statistics.median(v) for k, v in times.items()}
                print(f"| {ctx} | {batch} | {med['standard']:.1f} | {med['qfirst']:.1f} | "
                      f"{med['qfirst'] / med['standard']:.2f}x | {med['engine']:.1f} |",
                      flush=True)
    finally:
        for proc, _ in pools.values():
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
