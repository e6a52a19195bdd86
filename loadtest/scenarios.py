"""The workloads: each scenario turns a seed into a list of `RequestSpec`s (an OpenAI
request body and the route it goes to). Prompts are text written from a fixed vocabulary
by a seeded generator, so the same seed gives the same prompts on every machine, with no
download. Where a prompt must hold a number of tokens (`long`, `shared-prefix`), it is
sized with a `count_tokens` function: the server's own `/tokenize` when it has one, else a
conservative estimate.

- `chat`: /v1/chat/completions, one short question, up to 64 output tokens;
- `long`: /v1/completions, 2,048 to 8,192 prompt tokens (within the context), 64 out;
- `shared-prefix`: /v1/completions, one of `num_prefixes` shared documents then a part of
  its own, `reuse_ratio` of the prompt shared, 32 out;
- `decode-heavy`: /v1/completions, one short instruction, 256 out with `ignore_eos`;
- `mix`: a draw per request: chat 40%, shared-prefix 30%, decode-heavy 20%, long 10%.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

SCENARIOS = ("chat", "long", "shared-prefix", "decode-heavy", "mix")
MIX = {"chat": 0.4, "shared-prefix": 0.3, "decode-heavy": 0.2, "long": 0.1}
OUTPUT_TOKENS = {"chat": 64, "long": 64, "shared-prefix": 32, "decode-heavy": 256}
LONG_TOKENS = (2048, 8192)
CONTEXT_SLACK = 16           # chat template and special tokens beyond the counted text

CountTokens = Callable[[str], int]

ADJECTIVES = ("quiet", "bright", "old", "narrow", "distant", "green", "heavy", "small",
              "northern", "silver", "hidden", "early", "gentle", "broken", "warm", "open",
              "empty", "busy", "ancient", "simple", "curious", "steady", "pale", "wide")
NOUNS = ("river", "city", "garden", "bridge", "market", "library", "harbor", "mountain",
         "station", "village", "forest", "engine", "letter", "window", "island", "road",
         "teacher", "farmer", "painter", "sailor", "clock", "lamp", "valley", "tower",
         "festival", "school", "kitchen", "museum", "orchard", "lighthouse", "storm", "map")
VERBS = ("crosses", "watches", "follows", "builds", "remembers", "opens", "carries",
         "describes", "visits", "repairs", "finds", "paints", "guards", "measures",
         "leaves", "joins", "reaches", "names", "counts", "shelters")
PLACES = ("by the sea", "in the morning", "after the rain", "near the old wall",
          "under the hill", "before winter", "across the square", "at the edge of town",
          "during the festival", "beside the canal")
TOPICS = ("how a lighthouse works", "why rivers bend", "the history of maps",
          "how bread rises", "what makes a good library", "how bridges carry weight",
          "why the sky is blue", "how clocks keep time", "the life of a farmer",
          "how storms form", "what a museum keeps", "how ships find a harbor")
ASKS = ("Explain {t} in a few sentences.", "Give three short facts about {t}.",
        "Write a short paragraph on {t}.", "What should a child know about {t}?",
        "Summarize {t} for a busy reader.")


@dataclass(frozen=True)
class RequestSpec:
    kind: str                # the scenario that made it (a `mix` draw names its own kind)
    path: str                # "/v1/completions" or "/v1/chat/completions"
    body: dict = field(hash=False)   # without "model" and "stream": the runner adds them
    prompt_len: int = 0      # prompt tokens as the dataset counted them (0: not counted)


@dataclass(frozen=True)
class ScenarioConfig:
    name: str
    num_requests: int
    seed: int = 0
    max_model_len: int = 8192
    max_tokens: int | None = None          # overrides every kind's output length
    reuse_ratio: float = 0.75              # shared-prefix: shared tokens / prompt tokens
    prefix_prompt_tokens: int = 1024       # shared-prefix: prompt length
    num_prefixes: int = 4                  # shared-prefix: distinct shared documents
    long_tokens: tuple[int, int] = LONG_TOKENS
    extra_body: dict = field(default_factory=dict, hash=False)

    def __post_init__(self):
        if self.name not in SCENARIOS:
            raise ValueError(f"unknown scenario {self.name!r}; choose from {', '.join(SCENARIOS)}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be ≥ 1, got {self.num_requests}")
        if not 0.0 <= self.reuse_ratio < 1.0:
            raise ValueError(f"reuse_ratio must be in [0, 1), got {self.reuse_ratio}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be ≥ 1, got {self.max_tokens}")
        lo, hi = self.long_tokens
        if not 0 < lo <= hi:
            raise ValueError(f"long_tokens must be 0 < low ≤ high, got {self.long_tokens}")

    def output_tokens(self, kind: str) -> int:
        return self.max_tokens or OUTPUT_TOKENS[kind]

    @property
    def label(self) -> str:
        return self.name

    def requests(self, count_tokens: CountTokens, point: int = 0,
                 log: Callable[[str], None] = lambda s: None) -> list[RequestSpec]:
        """The built-in dataset's interface (`loadtest.datasets.DatasetConfig.requests`)."""
        return build_requests(self, count_tokens, point)


def sentences(rng: random.Random):
    """An endless stream of short sentences from the fixed vocabulary."""
    while True:
        a, b = rng.choice(ADJECTIVES), rng.choice(ADJECTIVES)
        n1, n2, n3 = rng.choice(NOUNS), rng.choice(NOUNS), rng.choice(NOUNS)
        yield (f"The {a} {n1} {rng.choice(VERBS)} the {b} {n2} {rng.choice(PLACES)}, "
               f"and the {n3} {rng.choice(VERBS)} it.")


def sized_text(rng: random.Random, tokens: int, count_tokens: CountTokens) -> str:
    """About `tokens` tokens of text, never more (by `count_tokens`): whole sentences from
    `rng`, trimmed until they fit."""
    stream = sentences(rng)
    pool: list[str] = []
    n = max(1, tokens // 16)                 # a sentence is about 16 tokens
    for _ in range(6):
        while len(pool) < n:
            pool.append(next(stream))
        got = count_tokens(" ".join(pool[:n]))
        if got <= tokens and (tokens - got) <= 24:
            break
        n = max(1, int(n * tokens / max(got, 1)) - (1 if got > tokens else 0))
    while n > 1 and count_tokens(" ".join(pool[:n])) > tokens:
        n -= 1
    return " ".join(pool[:n])


class Builder:
    """Makes the specs of one scenario; `rng` draws everything per request."""

    def __init__(self, cfg: ScenarioConfig, count_tokens: CountTokens):
        self.cfg, self.count = cfg, count_tokens
        self.rng = random.Random(cfg.seed)
        self._prefixes: list[str] | None = None

    def body(self, kind: str, **fields) -> dict:
        return {"max_tokens": self.cfg.output_tokens(kind), "temperature": 0.0, **fields,
                **self.cfg.extra_body}

    def chat(self) -> RequestSpec:
        ask = self.rng.choice(ASKS).format(t=self.rng.choice(TOPICS))
        return RequestSpec("chat", "/v1/chat/completions",
                           self.body("chat", messages=[{"role": "user", "content": ask}]))

    def decode_heavy(self) -> RequestSpec:
        prompt = (f"Write a long story about a {self.rng.choice(ADJECTIVES)} "
                  f"{self.rng.choice(NOUNS)} {self.rng.choice(PLACES)}.\n\n")
        return RequestSpec("decode-heavy", "/v1/completions",
                           self.body("decode-heavy", prompt=prompt, ignore_eos=True))

    def long(self) -> RequestSpec:
        lo, hi = self.cfg.long_tokens
        room = self.cfg.max_model_len - self.cfg.output_tokens("long") - CONTEXT_SLACK
        hi = min(hi, room)
        if hi < lo:
            raise ValueError(f"the long scenario needs {lo} prompt tokens + "
                             f"{self.cfg.output_tokens('long')} output tokens, more than the "
                             f"context length {self.cfg.max_model_len}")
        target = self.rng.randint(lo, hi)
        text = sized_text(random.Random(self.rng.getrandbits(64)), target, self.count)
        return RequestSpec("long", "/v1/completions",
                           self.body("long", prompt=text + "\n\nIn one sentence, the text says"))

    def prefixes(self) -> list[str]:
        if self._prefixes is None:        # from the base seed: every sweep point shares them
            shared = int(self.cfg.prefix_prompt_tokens * self.cfg.reuse_ratio)
            base = random.Random(f"prefix-{self.cfg.seed}")
            self._prefixes = [sized_text(random.Random(base.getrandbits(64)), shared,
                                         self.count) if shared else ""
                              for _ in range(self.cfg.num_prefixes)]
        return self._prefixes

    def shared_prefix(self) -> RequestSpec:
        prefix = self.rng.choice(self.prefixes())
        own = self.cfg.prefix_prompt_tokens - int(self.cfg.prefix_prompt_tokens
                                                  * self.cfg.reuse_ratio)
        suffix = sized_text(random.Random(self.rng.getrandbits(64)), max(own, 1), self.count)
        prompt = (prefix + "\n\n" if prefix else "") + suffix + "\n\nQuestion: what happens next?"
        return RequestSpec("shared-prefix", "/v1/completions",
                           self.body("shared-prefix", prompt=prompt))

    def one(self, kind: str) -> RequestSpec:
        return getattr(self, kind.replace("-", "_"))()


def build_requests(cfg: ScenarioConfig, count_tokens: CountTokens,
                   point: int = 0) -> list[RequestSpec]:
    """`cfg.num_requests` specs for sweep point `point`. Points draw different requests from
    the same seed (a prefix cache warmed by one point must not turn the next one's prompts
    into whole-prompt hits); the shared prefixes are the same at every point."""
    builder = Builder(cfg, count_tokens)
    builder.rng = random.Random(f"{cfg.seed}-{point}")
    kinds, weights = list(MIX), list(MIX.values())
    out = []
    for _ in range(cfg.num_requests):
        kind = builder.rng.choices(kinds, weights)[0] if cfg.name == "mix" else cfg.name
        out.append(builder.one(kind))
    return out


def estimate_tokens(text: str) -> int:
    """A conservative count for servers without /tokenize: 1.5 tokens a word (SmolLM2's
    tokenizer makes about 1.2 of this vocabulary's words)."""
    return int(len(text.split()) * 1.5) + 8
