"""A request resumed elsewhere with the tokens it already generated (`add_request(...,
output_ids=...)`, what migration sends) continues exactly as the uninterrupted run: greedy
and seeded, with penalties, min_tokens and max_tokens, on the monolithic and the Q-First
engine."""
from __future__ import annotations

import pytest
import torch

from kernels.sampling import SamplingParams
from models import load_model
from services.attention.runner import qfirst_engine
from services.common.messages import RequestError
from services.deployment.transports import make_transport
from services.engine import EngineConfig, GenerationParams, LLMEngine
from services.mlp_pool import MLPPool

CASES = {
    "greedy": GenerationParams(max_tokens=14, ignore_eos=True),
    "seeded": GenerationParams(max_tokens=14, ignore_eos=True, sampling=SamplingParams(
        temperature=0.9, top_p=0.95, seed=5)),
    "penalties": GenerationParams(max_tokens=14, ignore_eos=True, min_tokens=10,
                                  sampling=SamplingParams(temperature=0.7, seed=9,
                                                          repetition_penalty=1.4,
                                                          frequency_penalty=0.6)),
}


def prompts():
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (9, 30, 17)]


def engines(model):
    yield "monolithic", LLMEngine(model, EngineConfig(max_prefill_chunk=8))
    yield "qfirst", qfirst_engine(model, make_transport("local", [MLPPool(model)]),
                                  num_shards=2, block_size=4, num_blocks=64,
                                  max_prefill_chunk=8)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_resumed_request_continues_like_the_uninterrupted_run(family, case, tiny_checkpoint):
    path, _ = tiny_checkpoint(family)
    model = load_model(path)
    params = CASES[case]
    ref = [s.output_ids for s in LLMEngine(model).generate(prompts(), params)]
    if case != "greedy":        # the seed really matters: another seed, other tokens
        other = GenerationParams(max_tokens=14, ignore_eos=True, sampling=SamplingParams(
            temperature=0.9, top_p=0.95, seed=6))
        assert [s.output_ids for s in LLMEngine(model).generate(prompts(), other)] != ref
    for name, engine in engines(model):
        for cut in (1, 9):
            ids = [engine.add_request(p, params, output_ids=r[:cut])
                   for p, r in zip(prompts(), ref)]
            while engine.has_unfinished():
                engine.step()
            got = [engine.pop(i) for i in ids]
            assert [s.output_ids for s in got] == ref, (name, cut)
            assert all(s.finish_reason == "length" for s in got)
        engine.blocks.check()
        assert engine.blocks.num_free == engine.blocks.num_blocks


def test_resume_is_checked(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")
    engine = LLMEngine(load_model(path))
    params = GenerationParams(max_tokens=4)
    with pytest.raises(RequestError, match="nothing left to generate"):
        engine.add_request([1, 2], params, output_ids=[3, 4, 5, 6])
    with pytest.raises(RequestError, match=r"output_ids: token ids must be integers"):
        engine.add_request([1, 2], params, output_ids=[3, 10**7])
    assert not engine.seqs
