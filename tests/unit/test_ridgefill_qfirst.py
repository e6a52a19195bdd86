"""RidgeFill under the Q-First runner: an attention service holding the whole model (the
`local` transport) prefills with the same RidgeFill service as the embedded engine, and its
prompt is installed into the KV shards the way a prefill replica's is. The fill, and so
every decoded token and logit, equals the embedded engine's."""
from __future__ import annotations

import pytest
import torch

from services.attention.runner import qfirst_engine
from services.common.messages import PrefillRequest
from services.deployment.transports import make_transport
from services.engine import EngineConfig, GenerationParams, LLMEngine
from services.mlp_pool import MLPPool
from services.prefill.service import PrefillConfig, PrefillService
from tests.helpers.ridgefill import prompt

PARAMS = GenerationParams(max_tokens=6, ignore_eos=True, return_logits=True)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_qfirst_fill_equals_the_embedded_fill(family, four_layer):
    model, maps_dir = four_layer(family)
    svc = PrefillService(model, PrefillConfig(mode="ridgefill", maps_dir=str(maps_dir),
                                              split=1, tail=12, selector="attention"))
    prompts = [prompt(130, seed=8), prompt(100, seed=10)]
    embedded = LLMEngine(model, EngineConfig(block_size=16, num_blocks=48),
                         prefill_service=svc)
    qfirst = qfirst_engine(model, make_transport("local", [MLPPool(model)]), num_shards=2,
                           block_size=8, num_blocks=48, prefill_service=svc)
    want = embedded.generate(prompts, PARAMS)
    got = qfirst.generate(prompts, PARAMS)
    for w, g in zip(want, got):
        assert w.fill is not None and g.fill == w.fill        # resolved once, the same way
        assert g.output_ids == w.output_ids
        assert (torch.stack(g.logits) - torch.stack(w.logits)).abs().max().item() <= 1e-4
    assert all(bool(shard.kv.any()) for shard in qfirst.runner.shards)
    # the fill is not exact prefill: exact decode logits differ from the filled ones
    exact = qfirst.generate(prompts, GenerationParams(
        max_tokens=6, ignore_eos=True, return_logits=True, prefill=PrefillRequest("exact")))
    assert exact[0].fill is None
    assert (torch.stack(exact[0].logits) - torch.stack(got[0].logits)).abs().max() > 1e-3
    for engine in (embedded, qfirst):
        engine.blocks.check()
        assert engine.blocks.num_free == engine.blocks.num_blocks
