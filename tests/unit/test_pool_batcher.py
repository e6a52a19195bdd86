"""The pool batches concurrent calls from several callers into one forward per layer."""
from __future__ import annotations

import threading

import pytest
import torch

from kernels.sampling import SamplingParams
from models import load_model
from services.mlp_pool import MLPPool
from services.mlp_pool.batcher import BatchingPool


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_waiting_calls_run_as_one_forward_with_each_callers_rows(family, tiny_checkpoint):
    model = load_model(tiny_checkpoint(family)[0])
    pool = MLPPool(model)
    gen = torch.Generator().manual_seed(0)
    calls = [(torch.randn(n, model.config.hidden_size, generator=gen),
              torch.arange(n) + 7 * n) for n in (1, 3, 2)]
    results = [None] * len(calls)

    def call(i, layer):
        results[i] = batcher.stage(layer, *calls[i])

    kinds = {}                                         # a full-attention and a GDN layer
    for l in range(1, model.config.num_hidden_layers):
        kinds.setdefault(model.layer(l).kind, l)
    for layer in kinds.values():
        batcher = BatchingPool(pool, start=False)     # calls queue up until it starts
        threads = [threading.Thread(target=call, args=(i, layer)) for i in range(len(calls))]
        for t in threads:
            t.start()
        while len(batcher._pending) < len(calls):
            threading.Event().wait(0.01)
        batcher.thread.start()
        for t in threads:
            t.join(30)
        for (u, pos), got in zip(calls, results):
            want = pool.stage(layer, u, pos)
            for a, b in zip(
                    [got.z] + ([got.k, got.v] if got.gdn is None else list(got.gdn)),
                    [want.z] + ([want.k, want.v] if want.gdn is None else list(want.gdn))):
                assert a.shape == b.shape
                assert torch.allclose(a, b, atol=1e-5)
        assert batcher.batches == 1 and batcher.rows == 6          # one forward for all
        batcher.stop()


def test_final_calls_batch_and_errors_reach_every_caller(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama3")[0])
    pool = MLPPool(model)
    batcher = BatchingPool(pool)
    u = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    tokens, logprobs, logits = batcher.final(u, [SamplingParams()] * 2, [None, None])
    want = pool.final(u, [SamplingParams()] * 2, [None, None])
    assert torch.equal(tokens, want[0]) and torch.allclose(logits, want[2], atol=1e-5)
    with pytest.raises(Exception):
        batcher.stage(1, torch.zeros(2, 3), torch.arange(2))   # wrong hidden size
    assert batcher.stage(1, u, torch.arange(2)).z.shape == u.shape   # still serving


def test_a_lone_call_on_an_idle_pool_runs_on_its_callers_thread(tiny_checkpoint):
    """No hand-off to the compute thread and back for a lone call; calls that come while
    a forward runs still queue and run as the next batch, on the compute thread."""
    model = load_model(tiny_checkpoint("llama3")[0])
    pool = MLPPool(model)
    ran_on, release = [], threading.Event()
    stage = pool.stage

    def recording(layer, u, positions):
        ran_on.append(threading.current_thread().name)
        if len(ran_on) == 1:
            release.wait(30)                  # the first forward holds the pool
        return stage(layer, u, positions)

    pool.stage = recording
    batcher = BatchingPool(pool)
    u = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    first = threading.Thread(target=batcher.stage, args=(1, u, torch.arange(2)), name="caller-0")
    first.start()
    while not ran_on:
        threading.Event().wait(0.01)
    others = [threading.Thread(target=batcher.stage, args=(1, u[i:i + 1], torch.arange(1)),
                               name=f"caller-{i + 1}") for i in range(2)]
    for t in others:
        t.start()
    while len(batcher._pending) < 2:               # they queue behind the running forward
        threading.Event().wait(0.01)
    release.set()
    for t in [first] + others:
        t.join(30)
    assert ran_on == ["caller-0", batcher.thread.name]      # inline, then one batch of two
    assert batcher.batches == 2 and batcher.rows == 4
    while batcher._forward.locked():                        # the compute thread lets go
        threading.Event().wait(0.01)
    got = batcher.stage(1, u, torch.arange(2))
    assert ran_on[-1] == threading.current_thread().name     # idle again: inline
    assert torch.allclose(got.z, stage(1, u, torch.arange(2)).z, atol=1e-6)
    batcher.stop()
