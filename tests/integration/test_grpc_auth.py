"""The internal gRPC ports must not accept anyone who can reach them: with a token set, the
attention, MLP pool, prefill and prefix-cache servers refuse every call that lacks it
(UNAUTHENTICATED), while every client channel (the pool transport, the prefill client and
its probes, the gateway's grpc.aio backend) carries it; the same over TLS with a
self-signed certificate made here."""
from __future__ import annotations

import asyncio
import datetime
import ipaddress
import secrets

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from prometheus_client import CollectorRegistry

from models import load_model
from services.attention.runner import qfirst_engine
from services.attention.server import serve_attention
from services.common.codec import params_to_proto
from services.common.grpc_security import GrpcSecurity
from services.common.pb import splitstack_pb2 as pb
from services.common.pb import splitstack_pb2_grpc as pb_grpc
from services.deployment.transports import make_transport
from services.deployment.build import EngineOptions, build_engine
from services.engine import GenerationParams, LLMEngine
from services.attention.client import AttentionClient
from services.mlp_pool import MLPPool
from services.mlp_pool.grpc_server import serve_pool
from services.prefill.client import PrefillClient
from services.prefill.server import serve_prefill
from tests.helpers.prefill import prompts

pytestmark = pytest.mark.slow

PARAMS = GenerationParams(max_tokens=6, ignore_eos=True)


@pytest.fixture
def stack(tiny_checkpoint):
    """start(security) -> a pool replica, two prefill replicas with prefix caches and an
    attention service using both, every server and channel under `security`."""
    started = []

    def start(security: GrpcSecurity):
        path, _ = tiny_checkpoint("llama3")
        model = load_model(path)
        pool, pool_address = serve_pool(MLPPool(model, "pool-0"), security=security)
        started.append((pool, None))
        prefill_addresses, prefill_engines = [], []
        for i in range(2):
            registry = CollectorRegistry()
            engine, service = build_engine(model, path, EngineOptions(
                kv_cache_bytes=8 << 20, prefix_cache_bytes=16 << 20), registry)
            server, address, loop = serve_prefill(engine, registry,
                                                  name=f"prefill-{i}", security=security)
            started.append((server, loop))
            prefill_addresses.append(address)
            prefill_engines.append(engine)
        client = PrefillClient(prefill_addresses, model.config, model.dtype,
                               cache_aware=True, security=security)
        engine = qfirst_engine(model, make_transport("grpc", [pool_address], security),
                               num_shards=2, block_size=4, num_blocks=64)
        server, att_address, loop = serve_attention(engine, prefill=client,
                                                    security=security)
        started.append((server, loop))
        return {"model": model, "pool": pool_address, "prefill": prefill_addresses,
                "attention": att_address, "client": client, "engines": prefill_engines}

    yield start
    for server, loop in started:
        server.stop(0)
        if loop is not None:
            loop.shutdown()


def calls_without_the_token(s: dict, channel) -> dict:
    """One call of each kind to every service over `channel(address)`; the callables."""
    pool = pb_grpc.MLPPoolStub(channel(s["pool"]))
    prefill = pb_grpc.PrefillStub(channel(s["prefill"][0]))
    probe = pb_grpc.PrefixCacheStub(channel(s["prefill"][0]))
    attention = pb_grpc.AttentionStub(channel(s["attention"]))
    request = params_to_proto(prompts()[0], PARAMS)
    return {
        "pool.Stats": lambda: pool.Stats(pb.Empty(), timeout=5),
        "pool.Calls": lambda: next(iter(pool.Calls(iter([pb.PoolRequest(id=1)]), timeout=5))),
        "prefill.Stats": lambda: prefill.Stats(pb.Empty(), timeout=5),
        "prefix.Probe": lambda: probe.Probe(pb.ProbeRequest(tokens=[1, 2, 3]), timeout=5),
        "attention.Health": lambda: attention.Health(pb.Empty(), timeout=5),
        "attention.Generate": lambda: next(iter(attention.Generate(request, timeout=5))),
    }


def assert_refused(calls: dict, code=grpc.StatusCode.UNAUTHENTICATED) -> None:
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == code, name
        if code == grpc.StatusCode.UNAUTHENTICATED:
            assert "token" in err.value.details(), name


def generate_through_gateway_backend(s: dict, security: GrpcSecurity) -> list[list[int]]:
    """The gateway's grpc.aio client: each prompt's tokens."""
    async def run():
        backend = AttentionClient([s["attention"]], security=security)
        out = []
        for p in prompts():
            _, queue = await backend.submit(p, PARAMS)
            tokens = []
            while True:
                step = await asyncio.wait_for(queue.get(), 60)
                assert step.error is None
                if step.token is not None:
                    tokens.append(step.token)
                if step.finished:
                    break
            out.append(tokens)
        await backend.refresh()          # Stats of the attention service and the peers
        return out
    return asyncio.run(run())


def test_every_service_refuses_calls_without_the_token(stack):
    token = secrets.token_urlsafe(16)
    security = GrpcSecurity(token=token)
    s = stack(security)
    assert_refused(calls_without_the_token(s, grpc.insecure_channel))
    wrong = GrpcSecurity(token=token + "x")
    assert_refused(calls_without_the_token(s, wrong.channel))

    ref = [r.output_ids for r in LLMEngine(s["model"]).generate(prompts(), PARAMS)]
    assert generate_through_gateway_backend(s, security) == ref
    # the prefix-cache probes carried the token: a prompt now cached is found on a replica
    for engine in s["engines"]:
        engine.prefix.drain()
    assert max(s["client"]._resident(prompts()[1])) > 0


def self_signed(tmp_path) -> dict[str, str]:
    """A CA and a server certificate it signed for 127.0.0.1 / localhost, as PEM files."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "splitstack test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .sign(ca_key, hashes.SHA256()))
    files = {"ca": ca.public_bytes(serialization.Encoding.PEM),
             "cert": cert.public_bytes(serialization.Encoding.PEM),
             "key": key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())}
    out = {}
    for name, data in files.items():
        (tmp_path / f"{name}.pem").write_bytes(data)
        out[name] = str(tmp_path / f"{name}.pem")
    return out


def test_tls_with_a_self_signed_certificate(stack, tmp_path):
    pem = self_signed(tmp_path)
    (tmp_path / "token").write_text(secrets.token_urlsafe(16) + "\n")
    security = GrpcSecurity.load(token_file=str(tmp_path / "token"), cert=pem["cert"],
                                 key=pem["key"], ca=pem["ca"], env={})
    assert security.tls and security.token and "\n" not in security.token
    s = stack(security)
    # a plaintext client cannot talk to a TLS port; a TLS client without the token is refused
    assert_refused(calls_without_the_token(s, grpc.insecure_channel),
                   code=grpc.StatusCode.UNAVAILABLE)
    tls_only = GrpcSecurity(cert_chain=security.cert_chain, private_key=security.private_key,
                            root_ca=security.root_ca)
    assert_refused(calls_without_the_token(s, tls_only.channel))
    ref = [r.output_ids for r in LLMEngine(s["model"]).generate(prompts(), PARAMS)]
    assert generate_through_gateway_backend(s, security) == ref
