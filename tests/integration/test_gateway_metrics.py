"""An attention service serves its own /metrics where it runs (`MemberExporter`): its
in-process pool's series (`--transport local`) and its own load, each sample labelled with
the service's address, and its `Stats` say on which port; the gateway's registry keeps only
its own series."""
from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from models import load_model
from services.attention.server import serve_attention
from services.attention.runner import qfirst_engine
from services.common.member_metrics import MemberExporter
from services.common.pb import splitstack_pb2 as pb
from services.common.pb import splitstack_pb2_grpc as pb_grpc
from services.deployment.transports import make_transport
from services.deployment.members import cluster_client
from services.mlp_pool import MLPPool
from services.mlp_pool.metrics import MeteredPool, PoolMetrics
from tests.helpers.pools import PARAMS, prompts

pytestmark = pytest.mark.slow


def test_an_attention_service_serves_its_pools_and_its_own_series(tiny_checkpoint):
    import grpc

    path, _ = tiny_checkpoint("qwen3_5")
    model = load_model(path)
    registry = CollectorRegistry()
    pool = MeteredPool(MLPPool(model), PoolMetrics(registry))
    service = qfirst_engine(model, make_transport("local", [pool]), block_size=4,
                            num_blocks=64)
    got = service.generate(prompts(), PARAMS)
    assert all(len(r.output_ids) == PARAMS.max_tokens for r in got)
    steps = sum(len(r.output_ids) for r in got)
    exporter = MemberExporter(registry)
    server, address, loop = serve_attention(service, transport="local", registry=registry,
                                            metrics_port=exporter.port)
    exporter.member = address
    gateway_registry = CollectorRegistry()
    backend, _ = cluster_client([address], gateway_registry)
    try:
        with grpc.insecure_channel(address) as channel:
            stats = pb_grpc.AttentionStub(channel).Stats(pb.Empty(), timeout=10)
        text = urllib.request.urlopen(f"http://127.0.0.1:{stats.metrics_port}/metrics",
                                      timeout=10).read().decode()
        asyncio.run(backend.refresh())
        gateway = generate_latest(gateway_registry).decode()
    finally:
        backend.shutdown()
        server.stop(0)
        loop.shutdown()
        exporter.close()
    assert stats.metrics_port == exporter.port
    label = f'member="{address}"'
    stage = re.search(rf'^splitstack_pool_stage_seconds_count\{{kind="stage",{label}\}} (\S+)$',
                      text, re.M)
    final = re.search(rf'^splitstack_pool_stage_seconds_count\{{kind="final",{label}\}} (\S+)$',
                      text, re.M)
    # one final stage per decode step (batched over the running requests), and one stage
    # call per layer for each of those steps
    assert final and 0 < float(final.group(1)) <= steps
    assert stage and float(stage.group(1)) == float(final.group(1)) * model.config.num_hidden_layers
    rows = re.search(rf'^splitstack_pool_batch_rows_sum\{{{label}\}} (\S+)$', text, re.M)
    assert rows and float(rows.group(1)) > 0
    for line in (f'splitstack_attention_requests_running{{{label}}} 0.0',
                 f'splitstack_attention_kv_cache_usage_ratio{{{label}}} 0.0',
                 f'splitstack_attention_pool_retries_total{{{label}}} 0.0'):
        assert line in text
    # the gateway polls the service's load for routing, and exports none of its series
    assert "splitstack_pool_stage_seconds" not in gateway and "member=" not in gateway
    assert re.search(r"^splitstack_members_polled_timestamp_seconds \d", gateway, re.M)
