"""Per-stage cost of the pool transports: one decode step's pool calls, local vs gRPC.

    python -m bench.qfirst.pool_transport [--model DIR] [--batch 1,8] [--repeats 5]

Runs the Q-First stage calls of one decode step (L stages + final) for `batch` rows through
an in-process pool (`local`) and through a gRPC pool server on loopback (`grpc`, one
persistent stream), median of N steps, and prints the per-stage transport overhead.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels.sampling import SamplingParams
from models import load_model
from services.deployment.transports import make_transport
from services.mlp_pool import MLPPool
from services.mlp_pool.grpc_server import serve_pool


def one_step(transport, model, batch: int) -> float:
    h = model.config.hidden_size
    pos = torch.full((batch,), 100)
    start = time.perf_counter()
    transport.call("stage", 0, torch.randint(0, 1000, (batch,)), pos)
    for layer in range(1, model.config.num_hidden_layers):
        transport.call("stage", layer, torch.randn(batch, h), pos)
    transport.call("final", torch.randn(batch, h), [SamplingParams()] * batch, [None] * batch,
                   None)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/zoo/smollm2-135m")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = load_model(args.model)
    stages = model.config.num_hidden_layers + 1
    server, address = serve_pool(MLPPool(model))
    transports = {"local": make_transport("local", [MLPPool(model)]),
                  "grpc": make_transport("grpc", [address])}
    print("| batch | local ms/step | grpc ms/step | grpc/local | grpc overhead ms/stage |")
    print("|---|---|---|---|---|")
    for batch in map(int, args.batch.split(",")):
        times = {}
        for name, t in transports.items():
            one_step(t, model, batch)
            times[name] = statistics.median(one_step(t, model, batch)
                                            for _ in range(args.repeats))
        over = (times["grpc"] - times["local"]) / stages * 1000
        print(f"| {batch} | {times['local'] * 1000:.1f} | {times['grpc'] * 1000:.1f} | "
              f"{times['grpc'] / times['local']:.2f}x | {over:.2f} |")
    server.stop(0)


if __name__ == "__main__":
    main()
