"""schemathesis against both deployments, each behind the HTTP server `splitstack serve`
runs (guarded h11, body and queue limits, an API key): a bounded budget of generated
requests per operation of `/openapi.json` (positive and negative), with every check that
holds for this API. Afterwards: no 5xx, `/health` answers, nothing holds KV blocks, and
(Ray) the internal gRPC ports refuse calls without the deployment's token and no log
holds the API key or the token.

The served model is a 2-layer random llama with SmolLM2's tokenizer and a 256-token
context: fast enough that any request the fuzzer makes valid generates quickly.

Valid cases name the served model (a random name is only ever a 404). Checks left out,
and why:
- positive_data_acceptance: a body the schema allows may still be refused by meaning
  (max_tokens past the context, best_of below n): 4xx is right;
- use_after_free, ensure_resource_availability: no resource is created or deleted;
- ignored_auth: the document declares no security scheme (the API key is checked by a
  middleware, and every case here sends it);
- max_response_time: a timing, which a loaded 2-core machine breaks without telling
  anything about the API.
"""
from __future__ import annotations

import collections
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import checks

from models.random_checkpoint import load_configs, save_random_checkpoint
from services.common.grpc_security import GrpcSecurity
from services.common.pb import splitstack_pb2 as pb
from services.common.pb import splitstack_pb2_grpc as pb_grpc
from services.deployment.ray_cluster import ClusterConfig
from services.deployment.server import build_cluster, build_embedded
from services.gateway.http_server import server_config
from services.gateway.limits import HttpLimits
from tests.helpers.gateway import ZOO

pytestmark = pytest.mark.slow

BUDGET = 150                  # generated requests per deployment
KEY = secrets.token_urlsafe(24)
TOKEN = secrets.token_urlsafe(24)
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = HttpLimits(header_timeout_s=5.0, body_timeout_s=5.0)
CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
          checks.content_type_conformance, checks.response_headers_conformance,
          checks.response_schema_conformance, checks.negative_data_rejection,
          checks.missing_required_header, checks.unsupported_method]
statuses = {"embedded": collections.Counter(), "ray": collections.Counter()}


@pytest.fixture(scope="module")
def fuzz_model(tmp_path_factory) -> Path:
    config = dict(load_configs("tiny")["llama3"], vocab_size=49152, hidden_size=64,
                  intermediate_size=128, head_dim=16, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("fuzz-model")
    save_random_checkpoint(config, path, seed=4, std=0.1)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        if (ZOO / name).exists():
            shutil.copy(ZOO / name, path / name)
    return path


def serve_in_thread(app):
    """`app` behind `splitstack serve`'s HTTP server on a free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(server_config(app, "127.0.0.1", port, LIMITS, "warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return base, server, thread
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError("the gateway did not come up")


@pytest.fixture(scope="module")
def embedded(fuzz_model):
    app = build_embedded(fuzz_model, served_name="fuzz", api_key=KEY, limits=LIMITS)
    base, server, thread = serve_in_thread(app)
    yield base, app
    server.should_exit = True
    thread.join(timeout=10)
    app.state.gateway.backend.shutdown()


@pytest.fixture(scope="module")
def ray_deployed(ray_session, fuzz_model):
    config = ClusterConfig(model=str(fuzz_model), kv_cache_bytes=8 << 20, max_num_seqs=8,
                           security=GrpcSecurity(token=TOKEN))
    app, cluster = build_cluster(config, served_name="fuzz", api_key=KEY, limits=LIMITS)
    base, server, thread = serve_in_thread(app)
    yield base, app, cluster
    server.should_exit = True
    thread.join(timeout=10)
    cluster.shutdown()


def served_model(case):
    """A valid case names the served model (a random name is only ever a 404)."""
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = "fuzz"
    if case.path_parameters and "model" in case.path_parameters:
        case.path_parameters["model"] = "fuzz"
    return case


def fuzz(base: str, deployment: str) -> None:
    """Every operation of the served OpenAPI document, positive and negative cases, the
    budget split evenly; each response through `CHECKS`."""
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    weights = [3 if op.body else 1 for op in operations]       # bodies have more to explore
    started = time.perf_counter()
    for operation, weight in zip(operations, weights):
        per = max(1, BUDGET * weight // (2 * sum(weights)))
        for mode in schemathesis.GenerationMode:
            strategy = operation.as_strategy(generation_mode=mode)
            if mode is schemathesis.GenerationMode.POSITIVE:
                strategy = strategy.map(served_model)

            @given(case=strategy)
            @settings(max_examples=per, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case):
                response = case.call(headers=AUTH, timeout=60)
                statuses[deployment][response.status_code] += 1
                case.validate_response(response, checks=CHECKS)
            try:
                run()
            except Unsatisfiable:       # no invalid request exists (no parameters, no body)
                assert mode is schemathesis.GenerationMode.NEGATIVE
    print(f"\n{deployment}: {len(operations)} operations, "
          f"{sum(statuses[deployment].values())} cases in "
          f"{time.perf_counter() - started:.1f} s, statuses "
          f"{dict(sorted(statuses[deployment].items()))}")


def test_fuzz_embedded(embedded):
    fuzz(embedded[0], "embedded")


def test_embedded_after_fuzzing(embedded):
    base, app = embedded
    assert statuses["embedded"] and not [s for s in statuses["embedded"] if s >= 500]
    assert httpx.get(base + "/health").status_code == 200
    engine = app.state.gateway.backend.engine
    for _ in range(100):
        if not engine.has_unfinished():
            break
        time.sleep(0.1)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_fuzz_ray(ray_deployed):
    fuzz(ray_deployed[0], "ray")


def test_ray_after_fuzzing(ray_deployed, ray_session):
    base, app, cluster = ray_deployed
    assert statuses["ray"] and not [s for s in statuses["ray"] if s >= 500]
    assert httpx.get(base + "/health").status_code == 200
    deadline = time.time() + 20
    while True:
        blocks = ray_session.get([a.blocks.remote() for a in cluster.attention])
        if all(free == total for free, total in blocks) or time.time() > deadline:
            break
        time.sleep(0.2)
    assert all(free == total for free, total in blocks)
    # every internal port refuses a caller without the token
    for address, stub in ([(a, pb_grpc.AttentionStub) for a in cluster.attention_addresses]
                          + [(a, pb_grpc.MLPPoolStub) for a in cluster.pool_addresses]):
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                stub(channel).Stats(pb.Empty(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_no_log_holds_a_secret(ray_deployed, caplog, capfd):
    """The gateway's log (this process) and every Ray process's log files."""
    base, _, _ = ray_deployed
    httpx.post(base + "/v1/completions", headers=AUTH, timeout=60,
               json={"model": "fuzz", "prompt": "hi", "max_tokens": 2})
    httpx.post(base + "/v1/completions", headers={"Authorization": "Bearer wrong"},
               json={"model": "fuzz", "prompt": "hi"}, timeout=60)
    out, err = capfd.readouterr()
    texts = [out, err, caplog.text]
    logs = Path(os.environ.get("TMPDIR", tempfile.gettempdir())) / "splitstack-ray"
    files = [p for p in logs.glob("session_latest/logs/**/*") if p.is_file()]
    assert files
    texts += [p.read_text(errors="replace") for p in files]
    for secret in (KEY, TOKEN):
        assert not any(secret in t for t in texts)
    assert TOKEN not in repr(GrpcSecurity(token=TOKEN))
