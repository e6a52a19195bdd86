"""WAITING_FOR_REMOTE_KVS: a request whose prompt is prefilled elsewhere is in the scheduler
while it waits (no KV taken, nothing scheduled, `has_work` false), continues exactly when
the prompt arrives, and fails alone, without leaking a block, when that prefill fails, is
aborted or times out."""
from __future__ import annotations

import time

import pytest
import torch

from models import load_model
from services.engine import EngineConfig, GenerationParams, LLMEngine
from services.engine.sequence import Status

GREEDY = GenerationParams(max_tokens=8, ignore_eos=True)


class Pending:
    """A prefill in flight elsewhere, finished by the test."""

    def __init__(self):
        self.export = self.error = None
        self.cancelled = False

    def done(self) -> bool:
        return self.export is not None or self.error is not None

    def result(self):
        if self.error is not None:
            raise self.error
        return self.export

    def cancel(self) -> None:
        self.cancelled = True


@pytest.fixture
def model(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3_5")          # hybrid: KV and GDN states both travel
    return load_model(path)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_for(model, **config) -> LLMEngine:
    return LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4, **config))


def test_a_request_waits_in_the_scheduler_and_continues_exactly(model):
    ids = prompt(23, 1)
    want = engine_for(model).generate([ids], GREEDY)[0].output_ids
    replica = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64))
    rid = replica.add_request(ids, GenerationParams(max_tokens=1, ignore_eos=True,
                                                    export_prompt=True))
    export = next(o.export for o in replica.step() if o.seq_id == rid)
    engine = engine_for(model)
    pending = Pending()
    sid = engine.add_request(ids, GREEDY, remote=pending)
    other = engine.add_request(prompt(9, 2), GREEDY)            # runs meanwhile
    seq = engine.seqs[sid]
    assert seq.status is Status.WAITING_FOR_REMOTE_KVS and engine.scheduler.remote == [seq]
    for _ in range(3):
        outs = engine.step()
        assert [o.seq_id for o in outs] == [other] and not seq.block_table
    while not engine.seqs[other].finished:
        engine.step()
    assert engine.has_unfinished() and not engine.has_work()   # only the wait: idle
    pending.export = export
    assert engine.has_work()
    firsts = []
    while engine.has_unfinished():
        firsts += [o for o in engine.step() if o.seq_id == sid and o.queue_s is not None]
    assert seq.output_ids == want and seq.finish_reason == "length"
    # the wait for the prefill elsewhere counts as prefill, not as queueing
    (first,) = firsts
    assert seq.remote_s > 0 and first.prefill_s >= seq.remote_s
    assert first.queue_s == seq.scheduled_s - seq.arrival_s - seq.remote_s
    assert engine.blocks.num_free == engine.blocks.num_blocks
    engine.blocks.check()


@pytest.mark.parametrize("ending", ["failed", "aborted", "timed out"])
def test_a_request_whose_prefill_does_not_arrive_fails_alone(model, ending):
    engine = engine_for(model, remote_prefill_timeout_s=0.2 if ending == "timed out" else 60)
    pending = Pending()
    sid = engine.add_request(prompt(17, 3), GREEDY, remote=pending)
    other = engine.add_request(prompt(11, 4), GREEDY)
    engine.step()
    if ending == "failed":
        pending.error = ConnectionError("prefill-0 went away")
    elif ending == "aborted":
        assert engine.abort(sid)
    else:
        time.sleep(0.3)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    seq = engine.seqs[sid]
    assert seq.finished and engine.scheduler.remote == []
    if ending == "aborted":
        assert pending.cancelled and seq.finish_reason == "abort"
    else:
        error = next(o for o in outs if o.seq_id == sid)
        assert error.finish_reason == "error"
        assert ("went away" if ending == "failed" else "did not finish") in error.error
        assert pending.cancelled == (ending == "timed out")
    assert len(engine.seqs[other].output_ids) == GREEDY.max_tokens
    assert engine.blocks.num_free == engine.blocks.num_blocks
    engine.blocks.check()
