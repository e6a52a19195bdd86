"""Where a request's time goes: a request's queue, prefill and decode stages, measured by the engine and
the gateway, and its outcome by finish reason (`splitstack_request_*_time_seconds`,
`splitstack_requests_finished_total`, `splitstack_requests_waiting`)."""
from __future__ import annotations

import asyncio

import pytest

from models import load_model
from services.attention.server import _stage_times as attention_stage_times
from services.common.messages import StepOutput
from services.common.pb import splitstack_pb2 as pb
from services.common.tokenizer import load_tokenizer
from services.engine import EngineConfig, GenerationParams, LLMEngine
from services.attention.client import _stage_times as event_stage_times
from services.gateway.gateway import Gateway
from services.gateway.metrics import FINISH_REASONS
from services.gateway.protocol import APIError
from tests.helpers.gateway import ZOO
from tests.helpers.playback import PlaybackEngine


def test_the_first_token_of_each_request_carries_its_queue_and_prefill_times(tiny_checkpoint):
    """One seat: the second request waits in the queue until the first has finished, so it
    is first scheduled after the first one's last token."""
    path, _ = tiny_checkpoint("llama3")
    engine = LLMEngine(load_model(path), EngineConfig(block_size=4, num_blocks=32,
                                                      max_num_seqs=1))
    params = GenerationParams(max_tokens=3, ignore_eos=True)
    a, b = engine.add_request(list(range(1, 9)), params), engine.add_request([5, 6, 7], params)
    outputs: dict[int, list[StepOutput]] = {a: [], b: []}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.seq_id].append(out)
    for seq_id, outs in outputs.items():
        assert [o.token is not None for o in outs] == [True] * 3
        first, rest = outs[0], outs[1:]
        assert first.queue_s is not None and first.queue_s >= 0
        assert first.prefill_s is not None and first.prefill_s >= 0
        assert all(o.queue_s is None and o.prefill_s is None for o in rest)
        seq = engine.seqs[seq_id]
        assert first.queue_s == seq.scheduled_s - seq.arrival_s
        assert first.prefill_s == seq.first_token_s - seq.scheduled_s
    # b waited for a's seat: scheduled only after a's first (and last) token
    assert engine.seqs[b].scheduled_s >= engine.seqs[a].first_token_s
    assert outputs[b][0].queue_s >= engine.seqs[a].first_token_s - engine.seqs[b].arrival_s


def test_stage_times_cross_the_attention_services_stream():
    out = StepOutput(0, 5, -0.1, False, None, queue_s=0.25, prefill_s=1.5)
    fields = attention_stage_times(out)
    assert fields == {"queue_s": 0.25, "prefill_s": 1.5}
    event = pb.GenerateEvent(has_token=True, token=5, **fields)
    assert event_stage_times(pb.GenerateEvent.FromString(event.SerializeToString())) == fields
    later = StepOutput(0, 6, -0.1, False, None)
    assert attention_stage_times(later) == {}
    assert event_stage_times(pb.GenerateEvent(has_token=True, token=6)) == {}
    # a measured 0.0 is still a measurement
    assert event_stage_times(pb.GenerateEvent(queue_s=0.0, prefill_s=0.0)) == {
        "queue_s": 0.0, "prefill_s": 0.0}


class TimedPlayback(PlaybackEngine):
    """Plays back its tokens; the first carries the engine's queue and prefill times."""

    def outputs(self):
        first, *rest = super().outputs()
        first.queue_s, first.prefill_s = 0.25, 0.5
        return [first, *rest]


class FailingPlayback(PlaybackEngine):
    async def submit(self, prompt_ids, params):
        out: asyncio.Queue = asyncio.Queue()
        out.put_nowait(StepOutput(0, self.tokens[0], -1.0, False, None))
        out.put_nowait(StepOutput(0, None, None, True, "error", error="shard lost"))
        return 0, out


def sample(gateway: Gateway, name: str, **labels) -> float | None:
    for metric in gateway.metrics.registry.collect():
        for s in metric.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ZOO)


def generate(gateway: Gateway, n: int):
    async def run():
        return [d async for d in gateway.generate([1], GenerationParams(max_tokens=n), [], 0.0)]
    return asyncio.run(run())


def test_the_gateway_observes_each_stage_once_and_counts_the_finish_reason(tokenizer):
    ids = tokenizer(" 6, 7, 8, 9", add_special_tokens=False)["input_ids"]
    gateway = Gateway(TimedPlayback(ids), tokenizer, "m", 4096)
    for reason in FINISH_REASONS:       # exported from the start, at 0
        assert sample(gateway, "splitstack_requests_finished_total", reason=reason) == 0
    assert sample(gateway, "splitstack_requests_waiting") == 0
    generate(gateway, len(ids))
    assert sample(gateway, "splitstack_request_queue_time_seconds_count") == 1
    assert sample(gateway, "splitstack_request_queue_time_seconds_sum") == 0.25
    assert sample(gateway, "splitstack_request_prefill_time_seconds_sum") == 0.5
    assert sample(gateway, "splitstack_request_decode_time_seconds_count") == 1
    assert sample(gateway, "splitstack_e2e_request_latency_seconds_count") == 1
    assert sample(gateway, "splitstack_requests_finished_total", reason="length") == 1
    assert sample(gateway, "splitstack_requests_total", status="length") == 1


def test_a_failed_request_counts_as_error_without_a_decode_time(tokenizer):
    ids = tokenizer(" 6, 7", add_special_tokens=False)["input_ids"]
    gateway = Gateway(FailingPlayback(ids), tokenizer, "m", 4096)
    with pytest.raises(APIError):
        generate(gateway, 4)
    assert sample(gateway, "splitstack_requests_finished_total", reason="error") == 1
    assert sample(gateway, "splitstack_request_decode_time_seconds_count") == 0
    # a backend that does not report engine times: TTFT only
    assert sample(gateway, "splitstack_time_to_first_token_seconds_count") == 1
    assert sample(gateway, "splitstack_request_queue_time_seconds_count") == 0
