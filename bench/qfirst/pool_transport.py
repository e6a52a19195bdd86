"""Per-stage cost of the pool transports: one decode step's pool calls, in process, over
gRPC, and over the same-host link.

    python -m bench.qfirst.pool_transport [--model DIR] [--batch 1,8] [--repeats 5]

Runs the Q-First stage calls of one decode step (L stages + final) for `batch` rows through
an in-process pool (`local`), through a pool server on loopback over its gRPC stream
(`grpc`, with SPLITSTACK_LOCAL_LINK=0 on the client) and over its same-host link (`link`,
the `grpc` transport's choice on one host), the three alternating, median of N steps, and
prints each one's overhead per stage over `local`.
"""
from __future__ import annotations

import argparse
import os
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
    os.environ["SPLITSTACK_LOCAL_LINK"] = "0"          # read when a replica is opened
    grpc_only = make_transport("grpc", [address])
    os.environ["SPLITSTACK_LOCAL_LINK"] = "1"
    transports = {"local": make_transport("local", [MLPPool(model)]), "grpc": grpc_only,
                  "link": make_transport("grpc", [address])}
    print("| batch | local ms/step | grpc ms/step | link ms/step | grpc overhead ms/stage | "
          "link overhead ms/stage |")
    print("|---|---|---|---|---|---|")
    for batch in map(int, args.batch.split(",")):
        samples = {name: [] for name in transports}
        for name, t in transports.items():
            one_step(t, model, batch)
        for _ in range(args.repeats):
            for name, t in transports.items():
                samples[name].append(one_step(t, model, batch))
        ms = {name: statistics.median(v) * 1000 for name, v in samples.items()}
        over = {name: (ms[name] - ms["local"]) / stages for name in ("grpc", "link")}
        print(f"| {batch} | {ms['local']:.1f} | {ms['grpc']:.1f} | {ms['link']:.1f} | "
              f"{over['grpc']:.2f} | {over['link']:.2f} |")
    server.stop(0)


if __name__ == "__main__":
    main()
