"""Incremental detokenization with SmolLM2's byte-level tokenizer: the text sent over a
stream equals the whole output decoded at once, and costs O(n) decoded tokens, not O(n²);
the gateway's stop strings, fed piece by piece, end the text where a search of the whole
text does."""
from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from services.common.tokenizer import load_tokenizer
from services.engine import GenerationParams
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.gateway import Gateway
from tests.helpers.playback import PlaybackEngine

ZOO = Path(__file__).resolve().parents[2] / "models" / "zoo" / "smollm2-135m"

TEXTS = [
    "The capital of France is Paris. It has 2,140,526 inhabitants (2019).",
    "Привет, мир! Как дела? Ελληνικά: καλημέρα. עברית: שלום עולם. العربية: مرحبا بالعالم",
    "中文：你好，世界！日本語：こんにちは世界。한국어: 안녕하세요 세계. हिन्दी: नमस्ते दुनिया",
    "emoji 😀😃🎉 flags 🇫🇷🇯🇵 family 👨‍👩‍👧‍👦 skin 👍🏽 keycap 1️⃣ math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def f(x):\n\treturn {'a': [1, 2, 3]}  # tabs\tand  spaces   \r\n\n\n",
    "combining e\u0301 a\u0308 zero\u200bwidth nbsp\u00a0here ﬁ ligature ½ ∑ ≠ ∞ \ufeff bom",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ZOO)


class CountingTokenizer:
    """The tokenizer, counting `decode` calls and the tokens they decode."""

    def __init__(self, tokenizer):
        self.inner = tokenizer
        self.calls = self.tokens = self.longest = 0

    def decode(self, ids, **kw):
        self.calls += 1
        self.tokens += len(ids)
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def incremental(tokenizer, ids: list[int], skip: bool) -> str:
    detok = IncrementalDetokenizer(tokenizer, skip)
    return "".join(detok.add(t) for t in ids) + detok.pending


def random_text(rng: random.Random, n: int) -> str:
    """Code points from every plane that has characters: 1- to 4-byte UTF-8."""
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x6FF), (0x900, 0x97F), (0x3040, 0x30FF),
              (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x1D400, 0x1D7FF)]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


@pytest.mark.parametrize("skip", [True, False])
def test_text_streams_as_it_decodes_whole(tokenizer, skip):
    rng = random.Random(0)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": TEXTS[3]}],
                                         add_generation_prompt=True, tokenize=False)
    for text in [*TEXTS, chat, *(random_text(rng, rng.randint(1, 80)) for _ in range(40))]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert incremental(tokenizer, ids, skip) == tokenizer.decode(
            ids, skip_special_tokens=skip), text


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_ids_stream_as_they_decode_whole(tokenizer, skip):
    """Any ids, special tokens and bytes that never complete a character included."""
    rng = random.Random(1)
    special = sorted(tokenizer.added_tokens_decoder)
    for _ in range(300):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tokenizer))
               for _ in range(rng.randint(1, 60))]
        assert incremental(tokenizer, ids, skip) == tokenizer.decode(
            ids, skip_special_tokens=skip), ids


def test_a_character_waits_for_its_last_byte(tokenizer):
    """'é' split into its two byte tokens: nothing goes out until the second one comes."""
    vocab = tokenizer.get_vocab()
    first, second = vocab["Ã"], vocab["©"]      # byte-level spellings of 0xC3, 0xA9
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(vocab["ca"]) == "ca"
    assert detok.add(first) == "" and detok.pending == "\ufffd"
    assert detok.add(second) == "é" and detok.pending == ""


def long_ids(tokenizer, n: int) -> list[int]:
    rng = random.Random(2)
    text = " ".join(rng.choice(TEXTS) for _ in range(4 * n // 20 + 1))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) >= n
    return ids[:n]


def test_a_2000_token_stream_decodes_O_n_tokens(tokenizer):
    n = 2000
    ids = long_ids(tokenizer, n)
    counting = CountingTokenizer(tokenizer)
    assert incremental(counting, ids, True) == tokenizer.decode(ids, skip_special_tokens=True)
    # at most two calls per token, each over a few tokens (one character's worth at most)
    assert counting.calls <= 2 * n
    assert counting.longest <= 8
    assert counting.tokens <= 8 * n
    # the same bound fails decoding the whole output at every step: n(n + 1)/2 tokens
    whole = CountingTokenizer(tokenizer)
    for k in range(1, n + 1):
        whole.decode(ids[:k], skip_special_tokens=True)
    assert whole.tokens == n * (n + 1) // 2 > 8 * n


def generate(tokenizer, tokens, stops=(), min_tokens=0, include=False, skip=True):
    """The gateway's deltas for a request that generates `tokens`."""
    gateway = Gateway(PlaybackEngine(tokens), tokenizer, "m", 4096)
    params = GenerationParams(max_tokens=len(tokens), min_tokens=min_tokens)

    async def run():
        return [d async for d in gateway.generate([1], params, list(stops), 0.0, include,
                                                  skip)]

    return asyncio.run(run())


def reference(tokenizer, tokens, stops, min_tokens, include, skip):
    """(text sent, finish reason, tokens generated) from the whole output decoded at once:
    the text ends at the first stop string to end after the text of the first `min_tokens`
    tokens (the longest of those ending at one character), before it (after it with
    `include`); the count is the token that completed it. No part of a stop string is sent,
    since a client that sees one cannot take it back."""
    detok, ends, total = IncrementalDetokenizer(tokenizer, skip), [], 0
    for t in tokens:                       # final text after each token
        total += len(detok.add(t))
        ends.append(total)
    text = tokenizer.decode(tokens, skip_special_tokens=skip)
    ends[-1] = len(text)
    floor = ends[min_tokens - 1] if min_tokens else 0
    hits = [(at + len(s), -len(s), at) for s in stops
            if s and (at := text.find(s, max(0, floor - len(s) + 1))) >= 0]
    if not hits:
        return text, "length", len(tokens)
    end, _, at = min(hits)
    return (text[:end if include else at], "stop",
            next(k for k, e in enumerate(ends, 1) if e >= end))


def test_gateway_stream_of_2000_tokens_decodes_O_n_tokens(tokenizer):
    n = 2000
    ids = long_ids(tokenizer, n)
    counting = CountingTokenizer(tokenizer)
    deltas = generate(counting, ids)
    assert "".join(d.text for d in deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert deltas[-1].reason == "length" and deltas[-1].n == n
    assert counting.tokens <= 8 * n and counting.longest <= 8


def test_stop_strings_end_the_text_where_a_whole_text_search_does(tokenizer):
    rng = random.Random(3)
    for _ in range(60):
        text = rng.choice(TEXTS) + " " + rng.choice(TEXTS)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:rng.randint(5, 40)]
        whole = tokenizer.decode(ids)
        stops = []
        for _ in range(rng.randint(1, 3)):      # pieces of the text, and a miss
            at = rng.randrange(len(whole))
            stops.append(whole[at:at + rng.randint(1, 6)])
        stops.append("never in it")
        min_tokens = rng.choice([0, 0, 2, 5])
        include = rng.random() < 0.5
        deltas = generate(tokenizer, ids, stops, min_tokens, include)
        got = ("".join(d.text for d in deltas), deltas[-1].reason, deltas[-1].n)
        assert got == reference(tokenizer, ids, stops, min_tokens, include, True), (
            text, stops, min_tokens, include)
