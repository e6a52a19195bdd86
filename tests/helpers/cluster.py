"""Driving a deployed cluster (Ray actors serving gRPC) over the `Attention` gRPC API."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from services.common.codec import params_to_proto
from services.common.pb import splitstack_pb2_grpc as pb_grpc
from services.engine import GenerationParams

PARAMS = GenerationParams(max_tokens=8, ignore_eos=True)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (6, 27, 11, 18)]


def generate(address: str, ids: list[int], params: GenerationParams = PARAMS):
    """(tokens, events) of one request over the attention service's gRPC stream."""
    with grpc.insecure_channel(address) as channel:
        events = list(pb_grpc.AttentionStub(channel).Generate(params_to_proto(ids, params)))
    return [e.token for e in events if e.has_token], events


def run_concurrently(address: str, all_ids) -> list[list[int]]:
    with ThreadPoolExecutor(len(all_ids)) as ex:
        return list(ex.map(lambda ids: generate(address, ids)[0], all_ids))


def assert_no_leaks(ray, cluster) -> None:
    for actor in cluster.attention:
        free, total = ray.get(actor.blocks.remote())
        assert free == total
