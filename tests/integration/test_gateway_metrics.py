"""The gateway's `/metrics` re-exports an in-process pool's metrics (`--transport local`):
the attention service serves them on `Stats`, the cluster backend labels them with the
service's address."""
from __future__ import annotations

import asyncio
import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from models import load_model
from services.attention.server import serve_attention
from services.attention.runner import qfirst_engine
from services.deployment.transports import make_transport
from services.deployment.members import cluster_client
from services.mlp_pool import MLPPool
from services.mlp_pool.metrics import MeteredPool, PoolMetrics
from tests.helpers.pools import PARAMS, prompts

pytestmark = pytest.mark.slow


def test_local_pool_metrics_reach_the_gateway(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3_5")
    model = load_model(path)
    pool_registry = CollectorRegistry()
    pool = MeteredPool(MLPPool(model), PoolMetrics(pool_registry))
    service = qfirst_engine(model, make_transport("local", [pool]), block_size=4,
                            num_blocks=64)
    got = service.generate(prompts(), PARAMS)
    assert all(len(r.output_ids) == PARAMS.max_tokens for r in got)
    steps = sum(len(r.output_ids) for r in got)
    server, address, loop = serve_attention(service, transport="local", registry=pool_registry)
    gateway_registry = CollectorRegistry()
    backend, _ = cluster_client([address], gateway_registry)
    try:
        asyncio.run(backend.refresh())
        text = generate_latest(gateway_registry).decode()
    finally:
        backend.shutdown()
        server.stop(0)
        loop.shutdown()
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
    assert f'splitstack_attention_up{{{label}}} 1.0' in text
