"""The disaggregated deployment on real Ray actors: attention services and MLP pool replicas
each serving gRPC on loopback, driven over the `Attention` gRPC API."""
from __future__ import annotations

import re

import grpc
import httpx
import pytest

from models import load_model
from services.common.pb import splitstack_pb2 as pb
from services.common.pb import splitstack_pb2_grpc as pb_grpc
from services.deployment.ray_cluster import ClusterConfig, deploy
from services.engine import GenerationParams, LLMEngine
from tests.helpers.checkpoints import qfirst_copy
from tests.helpers.cluster import PARAMS, assert_no_leaks, generate, prompts, run_concurrently


@pytest.mark.slow
@pytest.mark.parametrize("family,transport", [("qwen3_next", "grpc"), ("llama3", "local")])
def test_ray_cluster_matches_exact_engine(family, transport, tiny_checkpoint, ray_session):
    path, _ = tiny_checkpoint(family)
    ref = [s.output_ids for s in LLMEngine(load_model(path)).generate(prompts(), PARAMS)]
    cluster = deploy(ClusterConfig(model=str(path), attention_shards=1, mlp_replicas=2,
                                   transport=transport, kv_splits=3, block_size=4,
                                   kv_cache_bytes=1 << 20))
    try:
        got = run_concurrently(cluster.attention_addresses[0], prompts())
        assert got == ref
        assert_no_leaks(ray_session, cluster)
        if transport == "grpc":       # both replicas served stages, from their own processes
            calls = ray_session.get([p.calls.remote() for p in cluster.pools])
            assert all(c > 0 for c in calls)
        address = cluster.attention_addresses[0]
        with grpc.insecure_channel(address) as channel:
            stats = pb_grpc.AttentionStub(channel).Stats(pb.Empty())
        assert stats.blocks_free == stats.blocks_total and stats.transport == transport
        # the service's own /metrics, served where it runs, at the port its Stats give
        host = address.rsplit(":", 1)[0]
        text = httpx.get(f"http://{host}:{stats.metrics_port}/metrics", timeout=30).text
        member = f'member="{address}"'
        if transport == "local":      # the in-process pool's metrics are the service's
            stages = re.search(rf'^splitstack_pool_stage_seconds_count\{{kind="stage",{member}\}} '
                               r'(\S+)$', text, re.M)
            assert stages and float(stages.group(1)) > 0
        else:                         # the pool replicas export theirs themselves
            assert "splitstack_pool_stage_seconds" not in text
        # the engine's own series, from the attention service's process
        assert re.search(rf"^splitstack_iteration_tokens_count\{{{member}\}} (\S+)$", text,
                         re.M)
        assert f"splitstack_num_preemptions_total{{{member}}}" in text
    finally:
        cluster.shutdown()


@pytest.mark.slow
def test_refused_request_and_wiring(tiny_checkpoint, ray_session, tmp_path):
    path, _ = tiny_checkpoint("qwen3_5")
    qpath = qfirst_copy(path, tmp_path / "qfirst")
    ref = [s.output_ids for s in LLMEngine(load_model(qpath)).generate(prompts()[:2], PARAMS)]
    cluster = deploy(ClusterConfig(model=str(qpath), transport="grpc"))   # checkpoint wiring
    try:
        address = cluster.attention_addresses[0]
        assert run_concurrently(address, prompts()[:2]) == ref
        _, events = generate(address, [])                      # empty prompt: refused
        assert events[0].refused and events[0].error_field == "prompt"
        _, events = generate(address, [1, 2], GenerationParams(max_tokens=10 ** 6))
        assert events[0].refused and events[0].error_field == "max_tokens"
        assert run_concurrently(address, prompts()[:1]) == ref[:1]   # still serving
    finally:
        cluster.shutdown()
    with pytest.raises(Exception, match="trained for 'qfirst'"):
        deploy(ClusterConfig(model=str(qpath), wiring="standard", transport="grpc"))


def test_bad_cluster_settings_are_refused():
    with pytest.raises(ValueError, match="needs --gpu"):
        ClusterConfig(model="unused", transport="nccl")
    with pytest.raises(ValueError, match="transport"):
        ClusterConfig(model="unused", transport="carrier-pigeon")
    with pytest.raises(ValueError, match="attention_shards"):
        ClusterConfig(model="unused", attention_shards=0)
    from services.deployment.build import EngineOptions
    from services.prefill.service import PrefillConfig

    with pytest.raises(ValueError, match="prefill-replicas"):    # the cache lives there
        ClusterConfig(model="unused", prefill=EngineOptions(prefix_cache_bytes=1 << 20))
    with pytest.raises(ValueError, match="prefill-replicas"):
        ClusterConfig(model="unused", prefill=EngineOptions(prefill=PrefillConfig(maps_dir="m")))
    with pytest.raises(ValueError, match="prefill_replicas"):
        ClusterConfig(model="unused", prefill_replicas=-1)
    ClusterConfig(model="unused", prefill_replicas=1,
                  prefill=EngineOptions(prefix_cache_bytes=1 << 20))


def test_serve_refuses_bad_prefill_flags_before_starting_anything(capsys):
    from services.cli import main

    assert main(["serve", "--prefill-replicas", "0", "--prefix-cache"]) == 2
    assert "prefill-replicas" in capsys.readouterr().err
    assert main(["serve", "--attention-shards", "1", "--redis-url", "redis://x"]) == 2
    assert "need --prefix-cache" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--prefill-replicas", "1", "--replay-ratio", "3"])
    assert exc.value.code == 2 and "argument --replay-ratio" in capsys.readouterr().err


@pytest.mark.slow
def test_wildcard_binds_are_advertised_as_the_node_ip(ray_session):
    from services.deployment.ray_cluster import _advertised

    assert _advertised("127.0.0.1:5000") == "127.0.0.1:5000"
    host, port = _advertised("0.0.0.0:5000").rsplit(":", 1)
    assert port == "5000" and host == ray_session.util.get_node_ip_address() != "0.0.0.0"
