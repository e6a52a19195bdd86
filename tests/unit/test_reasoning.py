"""Reasoning parsers (`<think>…</think>` into reasoning_content), whole and streamed, and a
grammar that starts only once the model has finished thinking (`StructuredSpec.after`)."""
from __future__ import annotations

import pytest
import torch

from services.common.messages import GenerationParams, StructuredSpec
from services.common.tokenizer import eos_token_ids, load_tokenizer
from services.engine import EngineConfig, LLMEngine
from services.engine.structured import Grammars
from services.gateway.reasoning import PARSERS, ReasoningStream
from kernels.sampling import SamplingParams
from tests.helpers.gateway import ZOO

QWEN3, R1 = PARSERS["qwen3"], PARSERS["deepseek_r1"]


@pytest.mark.parametrize("fmt, text, want", [
    (QWEN3, "<think>\nadd them</think>\n\n3", ("\nadd them", "3")),
    (QWEN3, "3, no thinking", (None, "3, no thinking")),
    (QWEN3, "<think>cut off", ("cut off", "")),
    (R1, "add them</think>3", ("add them", "3")),
    (R1, "still thinking", ("still thinking", "")),
])
def test_whole_answers_split(fmt, text, want):
    assert fmt.split(text) == want


@pytest.mark.parametrize("fmt, text", [
    (QWEN3, "<think>\nadd them</think>\n\nThe sum is 3."), (QWEN3, "The sum is 3."),
    (QWEN3, "<thi is not a tag"), (R1, "add </thinking> them</think>3"), (QWEN3, "<think>x"),
])
@pytest.mark.parametrize("piece", [1, 2, 5, 100])
def test_streamed_answers_split_as_the_whole_ones(fmt, text, piece):
    stream = ReasoningStream(fmt)
    thought = content = ""
    for a in range(0, len(text), piece):
        t, c = stream.feed(text[a:a + piece])
        thought, content = thought + t, content + c
    t, c = stream.finish()
    thought, content = thought + t, content + c
    want_thought, want_content = fmt.split(text)
    assert (thought, content) == (want_thought or "", want_content)


@pytest.fixture(scope="module")
def engine():
    from models import load_model

    model = load_model(ZOO, dtype=torch.float32)
    tok = load_tokenizer(ZOO)
    return LLMEngine(model, EngineConfig(kv_cache_bytes=32 << 20),
                     eos_token_ids=eos_token_ids(ZOO),
                     grammars=Grammars(lambda: tok, model.config.vocab_size,
                                       eos_token_ids(ZOO))), tok


def greedy(n: int, spec=None) -> GenerationParams:
    return GenerationParams(max_tokens=n, structured=spec,
                            sampling=SamplingParams(temperature=0.0))


def test_the_grammar_waits_for_the_end_of_thinking(engine):
    eng, tok = engine
    prompt = tok("Count:", add_special_tokens=False)["input_ids"]
    spec = StructuredSpec("regex", "[0-9]{4}", "response_format", after="</think>")
    free = eng.generate([prompt], greedy(8))[0].output_ids
    waiting = eng.generate([prompt], greedy(8, spec))[0].output_ids
    assert waiting == free                      # no end tag yet: the row is not masked
    thought = tok("<think>ok</think>", add_special_tokens=False)["input_ids"]
    seq_id = eng.add_request(prompt, greedy(len(thought) + 8, spec), output_ids=thought)
    while eng.has_unfinished():
        eng.step()
    seq = eng.pop(seq_id)
    answer = tok.decode(seq.output_ids[len(thought):], skip_special_tokens=True)
    assert seq.finish_reason == "stop" and len(answer) == 4 and answer.isdigit()
