"""Dashboards and alerts are only as good as the counts: the gateway's request metrics count each request once, under its
real outcome. (`splitstack_requests_running` is the engine's scheduled count, read when
/metrics is scraped: tests/unit/test_engine_process.py, tests/e2e/test_metrics_counts.py.)

A played-back engine stands in for the model; the counts are read from the registry."""
from __future__ import annotations

import asyncio

import pytest

from services.common.messages import StepOutput
from services.common.tokenizer import load_tokenizer
from services.engine import GenerationParams
from services.gateway.gateway import Gateway
from services.gateway.protocol import APIError
from tests.helpers.gateway import ZOO
from tests.helpers.playback import PlaybackEngine


class FailingEngine(PlaybackEngine):
    """Plays back its tokens, then fails the request."""

    async def submit(self, prompt_ids, params):
        out: asyncio.Queue = asyncio.Queue()
        for t in self.tokens:
            out.put_nowait(StepOutput(0, t, -1.0, False, None))
        out.put_nowait(StepOutput(0, None, None, True, "abort", error="shard lost"))
        return 0, out


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ZOO)


def counts(gateway: Gateway) -> dict[str, float]:
    """`splitstack_requests_total` by status."""
    out = {}
    for metric in gateway.metrics.registry.collect():
        for s in metric.samples:
            if s.name == "splitstack_requests_total":
                out[s.labels["status"]] = s.value
    return {k: v for k, v in out.items() if v}


def served(tokenizer, engine, text=" 6, 7, 8, 9"):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    engine.tokens = ids
    return Gateway(engine, tokenizer, "m", 4096), GenerationParams(max_tokens=len(ids))


def test_a_stop_string_counts_as_stop_only(tokenizer):
    """It was counted under both `stop` and `abort`."""
    gateway, params = served(tokenizer, PlaybackEngine([]))

    async def run():
        return [d async for d in gateway.generate([1], params, ["7, 8"], 0.0)]

    assert asyncio.run(run())[-1].reason == "stop"
    assert gateway.backend.aborted == [0]              # the engine is told to let it go
    assert counts(gateway) == {"stop": 1}


def test_each_outcome_once(tokenizer):
    gateway, params = served(tokenizer, PlaybackEngine([]))

    async def run():
        whole = gateway.generate([1], params, [], 0.0)
        gone = gateway.generate([1], params, [], 0.0)
        one = gateway.generate([1], GenerationParams(max_tokens=1), [], 0.0)
        await anext(whole)
        await anext(gone)
        assert counts(gateway) == {}
        await gone.aclose()                            # the client hung up
        assert counts(gateway) == {"abort": 1}
        assert [d async for d in whole][-1].reason == "length"
        # a stream whose first delta is its last, closed there (a fan-out's first deltas)
        gateway.backend.tokens = gateway.backend.tokens[:1]
        assert (await anext(one)).reason == "length"
        await one.aclose()

    asyncio.run(run())
    assert counts(gateway) == {"length": 2, "abort": 1}
    assert gateway.backend.aborted == [0]               # only the one the client left


def test_a_failed_request_counts_as_error_only(tokenizer):
    gateway, params = served(tokenizer, FailingEngine([]))

    async def run():
        return [d async for d in gateway.generate([1], params, [], 0.0)]

    with pytest.raises(APIError, match="shard lost"):
        asyncio.run(run())
    assert counts(gateway) == {"error": 1}
    assert gateway.backend.aborted == []               # the engine had already let it go


def test_lengths_tpot_and_model_info(tokenizer):
    """vLLM's per-request histograms: a request's prompt and generated tokens when it ends,
    its mean time per output token when it finished with 2 tokens or more."""
    gateway, params = served(tokenizer, PlaybackEngine([]))
    prompt = [1, 2, 3, 4, 5]

    async def run():
        return [d async for d in gateway.generate(prompt, params, [], 0.0)]

    assert asyncio.run(run())[-1].reason == "length"
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for family in gateway.metrics.registry.collect() for s in family.samples}
    n = params.max_tokens
    assert n > 1
    assert got[("splitstack_request_prompt_tokens_sum", ())] == len(prompt)
    assert got[("splitstack_request_generation_tokens_sum", ())] == n
    assert got[("splitstack_request_generation_tokens_count", ())] == 1
    assert got[("splitstack_request_time_per_output_token_seconds_count", ())] == 1
    decode = got[("splitstack_request_decode_time_seconds_sum", ())]
    tpot = got[("splitstack_request_time_per_output_token_seconds_sum", ())]
    assert abs(tpot - decode / (n - 1)) < 1e-9
    info = [labels for (name, labels), v in got.items() if name == "splitstack_model_info"]
    assert len(info) == 1 and dict(info[0])["model"] == "m" \
        and dict(info[0])["max_model_len"] == "4096" and dict(info[0])["version"]
    assert got[("process_cpu_seconds_total", ())] > 0
