"""Over HTTP with SmolLM2: `/metrics` scraped before and after
requests counts each request once under its outcome, and `splitstack_requests_running`
reads 0 once the server is idle."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.gateway import MODEL, client, wait_idle

pytestmark = pytest.mark.slow


def scrape(base: str) -> dict[str, float]:
    """requests_total by status, and requests_running."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        for s in family.samples:
            if s.name == "splitstack_requests_total":
                out[s.labels["status"]] = s.value
            elif s.name == "splitstack_requests_running":
                out["running"] = s.value
    return out


def added(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in after
            if k != "running" and after[k] != before.get(k, 0.0)}


def test_a_stop_string_request_counts_once_and_running_returns_to_zero(server):
    base, gateway = server
    c = client(base)
    wait_idle(gateway)
    before = scrape(base)
    resp = c.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=16,
                                temperature=0, stop=["7, 8"])
    assert resp.choices[0].finish_reason == "stop"
    wait_idle(gateway)
    after = scrape(base)
    assert added(before, after) == {"stop": 1}          # was stop 1 and abort 1
    assert after["running"] == 0                        # was 1


def test_every_outcome_once(server):
    """A length finish, an n = 2 stream whose first deltas are its last, and a stream the
    client leaves."""
    base, gateway = server
    c = client(base)
    wait_idle(gateway)
    before = scrape(base)
    c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3,
                         extra_body={"ignore_eos": True})
    list(c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1, n=2,
                              stream=True))
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 500, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        assert any(next(lines).startswith("data: ") for _ in range(4))
        assert scrape(base)["running"] == 1
    wait_idle(gateway)
    after = scrape(base)
    assert added(before, after) == {"length": 3, "abort": 1}
    assert after["running"] == 0
