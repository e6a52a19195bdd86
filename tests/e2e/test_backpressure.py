"""Oversized bodies and abusive connections against a real `splitstack serve` process
(SmolLM2, embedded, loopback) with short timeouts, a small queue and a per-client
connection cap, because a server that tokenizes before it checks sizes can be stalled by
one client:

- a 20 MB body in flight leaves `/health` fast and the server's RSS near its
  baseline (the body is read, parsed and refused by its length alone, never tokenized);
- idle and slowloris connections are closed at the header timeout, a client's
  connections past the cap are refused, a trickled body gets 408, generation requests past
  the waiting-queue bound get 503 with Retry-After;
- the API key never reaches the server's log.

Timing checks take the median over several probes: the machine may be loaded.
"""
from __future__ import annotations

import json
import secrets
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.common import ROOT, ServeProcess, rss_mb
from tests.helpers.gateway import ZOO
from tests.helpers.raw_http import read_response

pytestmark = pytest.mark.slow

KEY = secrets.token_urlsafe(24)
AUTH = {"Authorization": f"Bearer {KEY}"}
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.5
CONNECTIONS_PER_CLIENT = 24
MAX_NUM_SEQS, MAX_WAITING = 2, 1


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ["--model", str(ZOO), "--served-model-name", "smollm2-135m",
             "--log-level", "info", "--max-body-bytes", str(32 << 20),
             "--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S),
             "--max-connections-per-client", str(CONNECTIONS_PER_CLIENT),
             "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING)]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with ServeProcess(flags, log, env={"SPLITSTACK_API_KEY": KEY}) as proc:
        yield proc


def complete(base: str, **body) -> httpx.Response:
    return httpx.post(base + "/v1/completions", headers=AUTH, timeout=120,
                      json={"model": "smollm2-135m", "prompt": "1, 2, 3,", **body})


def test_a_20mb_body_leaves_health_fast_and_memory_flat(server):
    """Finding 1: a 2 MB prompt stalled /health for 14.5 s (tokenized on the event loop);
    20 MB prompts grew RSS from 2.1 to 11.2 GB, for good."""
    assert complete(server.base, max_tokens=4).status_code == 200       # warm
    baseline = rss_mb(server.pid)
    sender = subprocess.Popen([sys.executable, "-m", "tests.helpers.raw_http",
                               str(server.port), KEY], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    latencies = []
    with httpx.Client() as client:
        while sender.poll() is None:
            start = time.perf_counter()
            assert client.get(server.base + "/health", timeout=30).status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.05)
    answers = [json.loads(line) for line in sender.stdout.read().splitlines()]
    after = rss_mb(server.pid)
    print(f"\n/health over {len(latencies)} probes during 3 x 20 MB bodies and a 40 MB one: "
          f"median {statistics.median(latencies) * 1e3:.1f} ms, max "
          f"{max(latencies) * 1e3:.1f} ms; RSS {baseline:.0f} -> {after:.0f} MB")
    assert sender.returncode == 0 and len(answers) == 4
    for status, payload in answers[:3]:
        assert status.startswith("HTTP/1.1 400") and json.loads(payload)["error"]["param"] \
            == "prompt"
    assert answers[3][0].startswith("HTTP/1.1 413")
    assert len(latencies) >= 5 and statistics.median(latencies) < 0.1
    assert after - baseline < 200
    assert complete(server.base, max_tokens=4).status_code == 200


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed `sock` (reading what it wrote first), or None."""
    start = time.perf_counter()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except OSError:
        pass
    return time.perf_counter() - start


def test_idle_and_slowloris_connections_are_closed(server):
    """Finding 6: 200 idle connections and 20 slowloris sockets were held for as long as
    the clients liked."""
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(10)]
    slow = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(10)]
    for s in slow:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")

    def trickle(s):       # one header byte every 0.2 s, for up to 10 s
        try:
            for _ in range(50):
                s.sendall(b"X")
                time.sleep(0.2)
        except OSError:
            pass
    with ThreadPoolExecutor(len(slow)) as pool:
        list(pool.map(lambda s: pool.submit(trickle, s), slow))
        waits = [closed_within(s, HEADER_TIMEOUT_S + 4) for s in idle + slow]
    for s in idle + slow:
        s.close()
    assert None not in waits, waits


def test_connections_past_the_per_client_cap_are_refused(server):
    held = [socket.create_connection(("127.0.0.1", server.port))
            for _ in range(CONNECTIONS_PER_CLIENT)]
    try:
        extra = socket.create_connection(("127.0.0.1", server.port))
        extra.settimeout(5)
        answer = extra.recv(4096)
        extra.close()
    finally:
        for s in held:
            s.close()
    assert answer.startswith(b"HTTP/1.1 429") and b"retry-after: 1" in answer
    assert b"too_many_connections" in answer
    time.sleep(0.2)
    assert httpx.get(server.base + "/health").status_code == 200


def test_a_trickled_body_is_408(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n"
                  + f"Authorization: Bearer {KEY}\r\n\r\n".encode() + b'{"model"')
        s.settimeout(BODY_TIMEOUT_S + 5)
        answer = read_response(s)
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer


def test_generation_past_the_waiting_bound_is_503_with_retry_after(server):
    """Finding 6: there was no cap on queued requests."""
    body = {"max_tokens": 48, "ignore_eos": True, "temperature": 0}
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: complete(server.base, **body), range(8)))
    statuses = sorted(r.status_code for r in responses)
    refused = [r for r in responses if r.status_code == 503]
    assert set(statuses) == {200, 503} and statuses.count(200) >= MAX_NUM_SEQS + MAX_WAITING
    assert all(r.headers["retry-after"] == "1" for r in refused)
    assert refused[0].json()["error"]["code"] == "server_overloaded"
    metrics = httpx.get(server.base + "/metrics").text
    assert 'splitstack_http_refusals_total{reason="queue_full"}' in metrics


def test_the_api_key_never_reaches_the_log(server):
    assert complete(server.base, max_tokens=2).status_code == 200
    assert httpx.post(server.base + "/v1/completions", headers=AUTH, content=b"{not json",
                      timeout=30).status_code == 400
    logs = server.logs()
    assert "POST /v1/completions" in logs          # the access log is there
    assert KEY not in logs
