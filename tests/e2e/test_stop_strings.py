"""Over HTTP with SmolLM2: a stop string that spans tokens ends the
answer before its first character, streamed or whole, and the finish reason and usage are
those of the tokens generated through the stop string."""
from __future__ import annotations

import pytest

from tests.helpers.gateway import MODEL, client, wait_idle

pytestmark = pytest.mark.slow

COUNT = "1, 2, 3, 4, 5,"
DIALOGUE = "A: hello\nB: hi\nA: how are you?\nB:"


def tokens_through(c, prompt: str, stop: str, max_tokens: int = 16) -> int:
    """How many tokens the unstopped greedy answer takes to complete `stop`."""
    resp = c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                temperature=0, logprobs=0)
    text = resp.choices[0].text
    end = text.index(stop) + len(stop)
    lp = resp.choices[0].logprobs
    return next(i + 1 for i, (at, tok) in enumerate(zip(lp.text_offset, lp.tokens))
                if at + len(tok) >= end)


@pytest.mark.parametrize("prompt,stop,answer", [
    (COUNT, "7, 8", " 6, "),                      # the issue's: was " 6, 7, "
    (DIALOGUE, "\nA:", " how are you?"),          # was " how are you?\nA"
])
def test_a_stop_string_over_several_tokens_leaks_none_of_it(server, prompt, stop, answer):
    base, gateway = server
    c = client(base)
    spent = tokens_through(c, prompt, stop)
    whole = c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                 stop=[stop])
    assert whole.choices[0].text == answer
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == spent
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                       temperature=0, stop=[stop], stream=True,
                                       stream_options={"include_usage": True}))
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert "".join(texts) == answer
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    eng = wait_idle(gateway)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_held_text_goes_out_when_it_cannot_be_a_stop(server):
    """"7, 9" starts like the answer's "7, 8": the held "7, " goes out once "8" comes."""
    base, _ = server
    c = client(base)
    plain = c.completions.create(model=MODEL, prompt=COUNT, max_tokens=10, temperature=0)
    held = c.completions.create(model=MODEL, prompt=COUNT, max_tokens=10, temperature=0,
                                stop=["7, 9"])
    assert held.choices[0].text == plain.choices[0].text
    assert held.choices[0].finish_reason == plain.choices[0].finish_reason == "length"
    streamed = list(c.completions.create(model=MODEL, prompt=COUNT, max_tokens=10,
                                         temperature=0, stop=["7, 9"], stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == plain.choices[0].text


def test_chat_stop_string_spanning_tokens(server):
    base, _ = server
    c = client(base)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    plain = c.chat.completions.create(model=MODEL, messages=question, max_tokens=30,
                                      temperature=0).choices[0].message.content
    assert plain == "The capital of France is Paris."
    for stream in (False, True):
        resp = c.chat.completions.create(model=MODEL, messages=question, max_tokens=30,
                                         temperature=0, stop=["of Fr"], stream=stream)
        text = ("".join(ch.choices[0].delta.content or "" for ch in resp if ch.choices)
                if stream else resp.choices[0].message.content)
        assert text == "The capital "
