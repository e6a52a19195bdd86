"""Q-first wiring: layer l's query reads the previous feed-forward's input (seed 003, §6)."""
from __future__ import annotations

import pytest
import torch

from models import load_model
from services.attention.runner import qfirst_engine
from services.deployment.transports import make_transport
from services.engine import GenerationParams, LLMEngine
from services.mlp_pool import MLPPool
from tests.helpers.checkpoints import qfirst_copy

PARAMS = GenerationParams(max_tokens=10, ignore_eos=True, return_logits=True)


@pytest.fixture(params=["qwen3", "qwen3_5"])
def models(request, tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint(request.param)
    return load_model(path), load_model(qfirst_copy(path, tmp_path / "qfirst"))


def test_qfirst_forward_reads_the_previous_mlp_input(models):
    standard, qfirst = models
    assert qfirst.config.wiring == "qfirst"
    ids = torch.randint(0, 1024, (2, 40), generator=torch.Generator().manual_seed(0))
    out = qfirst.forward(ids)
    assert (out - standard.forward(ids)).abs().max() > 1e-2       # the wiring is real
    # hand-composed: q of layer l > 0 from h_{l-1} (before its MLP), keys from x_l
    from kernels.attention.naive import attention_lse

    pos = torch.arange(40).expand(2, 40)
    x, h = qfirst.embed(ids), None
    for l in range(qfirst.config.num_hidden_layers):
        if qfirst.layer(l).kind == "full_attention":
            k, v = qfirst.attn_key_value(l, qfirst.norm_in(l, x), pos)
            q, gate = qfirst.attn_query(l, qfirst.norm_in(l, x if l == 0 else h), pos)
            h = qfirst.attn_output(l, x, attention_lse(q, k, v)[0], gate)
        else:
            inp = qfirst.gdn_inputs(l, x)
            h = qfirst.gdn_output(l, x, qfirst.gdn_mix(l, inp)[0], inp.z)
        x = qfirst.mlp(l, h)
    assert (qfirst.final(x) - out).abs().max().item() <= 1e-4


def test_engine_and_disaggregated_match_qfirst_forward(models):
    _, qfirst = models
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (6, 25, 13)]
    ref = LLMEngine(qfirst).generate(prompts, PARAMS)
    for seq in ref:                                   # the engine against the full forward
        full = qfirst.forward(torch.tensor([seq.tokens[:-1]]))[0][len(seq.prompt_ids) - 1:]
        assert (torch.stack(seq.logits) - full).abs().max().item() <= 1e-4
    # one step of whole prompts, then chunks of 8 beside decode rows (the early sweep of
    # the decode rows and the prefill rows' causal sweep in the same layer)
    for config in ({}, {"max_prefill_chunk": 8, "max_num_batched_tokens": 12}):
        service = qfirst_engine(qfirst, make_transport("local", [MLPPool(qfirst)]),
                                num_shards=2, block_size=4, num_blocks=64, wiring="qfirst",
                                **config)
        got = service.generate(prompts, PARAMS)
        for r, s in zip(got, ref):
            assert r.output_ids == s.output_ids
            assert (torch.stack(r.logits) - torch.stack(s.logits)).abs().max().item() <= 1e-4


def test_service_refuses_standard_wiring_for_a_qfirst_checkpoint(models):
    _, qfirst = models
    with pytest.raises(ValueError, match="trained for 'qfirst'"):
        qfirst_engine(qfirst, make_transport("local", [MLPPool(qfirst)]), wiring="standard")
