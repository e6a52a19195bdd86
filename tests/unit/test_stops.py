"""Stop strings that span tokens must not leak their start.

`StopStrings` fed any split of a text ends it where a search of the whole text does, and
holds back exactly the text that could still begin a stop string; through the gateway
(SmolLM2's tokenizer, the incremental detokenizer) no delta ever carries the start of a stop
string, streamed or whole, and the finish reason and token count stay right.
"""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from services.common.tokenizer import load_tokenizer
from services.engine import GenerationParams
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.gateway import Gateway
from services.gateway.stops import StopStrings
from tests.helpers.gateway import ZOO
from tests.helpers.playback import PlaybackEngine

# few characters, so that stop strings overlap each other and the text often
ALPHABET = "ab7, 8\nA:"
texts = st.text(ALPHABET, max_size=5)


def first_stop(text: str, floor: int, stops: list[str]) -> tuple[int, int] | None:
    """The reference: (start, end) of the first stop string to end after `floor` in the
    whole text, the longest of those ending at one character; None when there is none."""
    hits = [(at + len(s), -len(s), at) for s in stops
            if s and (at := text.find(s, max(0, floor - len(s) + 1))) >= 0]
    if not hits:
        return None
    end, _, at = min(hits)
    return at, end


def whole_text_stop(text: str, floor: int, stops: list[str],
                    include: bool) -> tuple[str, bool]:
    """The text as it ends: before the first stop string (after it with `include`)."""
    hit = first_stop(text, floor, stops)
    if hit is None:
        return text, False
    return text[:hit[1] if include else hit[0]], True


def longest_stop_start(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)) + 1)
                if text.endswith(s[:k])), default=0)


def run_pieces(pieces: list[str], unarmed: int, stops: list[str], include: bool):
    """Feeds `pieces` (the first `unarmed` ones before `min_tokens`); returns the text that
    went out and whether a stop string ended it, checking the held text after each piece."""
    stop = StopStrings(stops, include)
    out, fed = [], ""
    for i, piece in enumerate(pieces):
        text, stopped = stop.feed(piece, armed=i >= unarmed)
        out.append(text)
        if stopped:
            return "".join(out), True
        fed += piece
        keep = 0 if include else longest_stop_start(fed, [s for s in stops if s])
        assert stop.held == fed[len(fed) - keep:]            # exactly what may begin a stop
        assert "".join(out) == fed[:len(fed) - keep]         # all the rest went out
    return "".join(out) + stop.flush(), False


@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(texts, max_size=8), stops=st.lists(texts, max_size=3),
       unarmed=st.integers(0, 3), include=st.booleans())
@example(pieces=[" 6", ",", " 7", ",", " 8"], stops=["7, 8"], unarmed=0, include=False)
@example(pieces=["ab"], stops=["ab", "b"], unarmed=0, include=False)
@example(pieces=["a", "a", "a"], stops=["aa"], unarmed=2, include=False)
def test_any_split_ends_where_the_whole_text_does(pieces, stops, unarmed, include):
    floor = len("".join(pieces[:unarmed]))
    assert run_pieces(pieces, unarmed, stops, include) == whole_text_stop(
        "".join(pieces), floor, stops, include)


@given(text=st.text(ALPHABET, max_size=30), stops=st.lists(texts, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8), include=st.booleans())
@settings(max_examples=300, deadline=None)
def test_the_answer_does_not_depend_on_the_split(text, stops, cuts, include):
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert run_pieces(pieces, 0, stops, include) == run_pieces(list(text), 0, stops, include)


def test_the_issues_examples():
    stop = StopStrings(["7, 8"])
    sent = [stop.feed(p)[0] for p in [" 6", ",", " ", "7", ",", " "]]
    assert "".join(sent) == " 6, " and stop.held == "7, "
    assert stop.feed("8") == ("", True)
    stop = StopStrings(["\nA:"])
    assert stop.feed("B.\n") == ("B.", False)
    assert stop.feed("A") == ("", False) and stop.feed(":") == ("", True)
    stop = StopStrings(["\nA:"])          # held text goes out once it cannot be a stop
    assert stop.feed("B.\n") == ("B.", False) and stop.feed("AB") == ("\nAB", False)


# ---- through the gateway: SmolLM2's tokens, the incremental detokenizer ------------------

@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ZOO)


def deltas(tokenizer, tokens, stops, min_tokens=0, include=False):
    gateway = Gateway(PlaybackEngine(tokens), tokenizer, "m", 4096)
    params = GenerationParams(max_tokens=len(tokens), min_tokens=min_tokens)

    async def run():
        return [d async for d in gateway.generate([1], params, stops, 0.0, include)]

    return asyncio.run(run()), gateway


def test_a_stop_string_split_over_tokens_sends_none_of_it(tokenizer):
    """The issue's example: " 6, 7, 8" with stop "7, 8" gives " 6, ", and no delta ever
    carried "7"; the finish reason is "stop" and the count has every token generated."""
    ids = tokenizer(" 6, 7, 8, 9", add_special_tokens=False)["input_ids"]
    assert len(ids) >= 6                   # "7, 8" spans several tokens
    got, gateway = deltas(tokenizer, ids, ["7, 8"])
    assert "".join(d.text for d in got) == " 6, "
    assert all("7" not in d.text for d in got)
    last = got[-1]
    through_8 = len(tokenizer(" 6, 7, 8", add_special_tokens=False)["input_ids"])
    assert last.reason == "stop" and last.n == through_8
    got, _ = deltas(tokenizer, tokenizer("Q: 1\nA: 2\nA: 3", add_special_tokens=False)[
        "input_ids"], ["\nA:"])
    assert "".join(d.text for d in got) == "Q: 1" and got[-1].reason == "stop"


WORDS = [" 1", ",", " 2", "\n", "A", ":", " é", "日本", " the", "7", " 8", "😀"]


@settings(max_examples=150, deadline=None)
@given(words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=14),
       stop_at=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 6)), max_size=3),
       min_tokens=st.integers(0, 4), include=st.booleans())
def test_gateway_deltas_end_where_the_whole_output_does(tokenizer, words, stop_at,
                                                        min_tokens, include):
    """Random token splits (SmolLM2's own) and stop strings taken from the output: the
    deltas join to the whole-text answer, the reason and token count are the ones of the
    token that completed the stop string."""
    ids = tokenizer("".join(words), add_special_tokens=False)["input_ids"]
    whole = tokenizer.decode(ids)
    stops = [whole[a % len(whole):a % len(whole) + n] for a, n in stop_at] + ["never"]
    min_tokens = min(min_tokens, len(ids))
    detok, ends, total = IncrementalDetokenizer(tokenizer), [], 0
    for t in ids:                          # final text after each token
        total += len(detok.add(t))
        ends.append(total)
    ends[-1] = len(whole)
    floor = ends[min_tokens - 1] if min_tokens else 0
    hit = first_stop(whole, floor, stops)
    got, gateway = deltas(tokenizer, ids, stops, min_tokens, include)
    if hit is None:
        assert "".join(d.text for d in got) == whole
        assert got[-1].reason == "length" and got[-1].n == len(ids)
        assert gateway.backend.aborted == []
        return
    at, end = hit
    assert "".join(d.text for d in got) == whole[:end if include else at]
    assert got[-1].reason == "stop"
    assert got[-1].n == next(k for k, e in enumerate(ends, 1) if e >= end)
    # the engine let go of it unless the stop string ended with its last token
    assert gateway.backend.aborted == ([0] if got[-1].n < len(ids) else [])
