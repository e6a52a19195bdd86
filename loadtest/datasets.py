"""The datasets of `vllm bench serve --dataset-name` beside the built-in scenarios: each
turns a seed into `RequestSpec`s (prompt text and output length) for one endpoint.

- `random`: prompts of a drawn length in tokens (uniform on [L·(1−r), L·(1+r)] for
  `--random-input-len` L and `--random-range-ratio` r; the output the same way), written
  from the scenarios' vocabulary, each at most its length and within a sentence of it;
- `sharegpt`: a JSON list or JSONL file of `{"conversations": [{"from": "human" | "gpt",
  "value": ...}, ...]}`: the first human turn is the prompt, the gpt turn after it sets
  the output length (its token count, or `--sharegpt-output-len`); records are shuffled
  by the seed and, as vLLM does, skipped when the prompt or the reply is under 4 tokens
  (the reply's check only without a fixed output length), the prompt over 1,024, or both
  over 2,048 (or the context);
- `sonnet`: vLLM's "pick lines" prompt: lines of a text (by default `data/apache-2.0.txt`,
  the Apache License 2.0, the project's own licence) up to `--sonnet-input-len` tokens,
  the first `--sonnet-prefix-len` tokens' worth of lines shared by every prompt.

Token counts use the `count_tokens` function the scenarios use: the server's tokenizer,
or an estimate."""
from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.scenarios import CountTokens, RequestSpec, sized_text

DATASETS = ("builtin", "random", "sharegpt", "sonnet")   # builtin: the scenarios
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
SONNET_TEXT = Path(__file__).resolve().parent / "data" / "apache-2.0.txt"
SONNET_ASK = "Pick as many lines as you can from these lines:\n"
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048


@dataclass(frozen=True)
class DatasetConfig:
    name: str                              # random | sharegpt | sonnet
    num_requests: int
    seed: int = 0
    path: Path | None = None               # sharegpt: required; sonnet: SONNET_TEXT if None
    endpoint: str = "/v1/completions"
    max_model_len: int = 8192
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    sharegpt_output_len: int | None = None
    sonnet_input_len: int = 550
    sonnet_output_len: int = 150
    sonnet_prefix_len: int = 200
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict, hash=False)

    def __post_init__(self):
        if self.name not in DATASETS[1:]:
            raise ValueError(f"unknown dataset {self.name!r}; choose from "
                             f"{', '.join(DATASETS[1:])}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, "
                             f"got {self.endpoint!r}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be ≥ 1, got {self.num_requests}")
        if self.name == "sharegpt" and self.path is None:
            raise ValueError("the sharegpt dataset needs --dataset-path FILE")
        if self.path is not None and not Path(self.path).is_file():
            raise ValueError(f"dataset file not found: {self.path}")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError(f"random_range_ratio must be in [0, 1), "
                             f"got {self.random_range_ratio}")
        if self.sonnet_prefix_len > self.sonnet_input_len:
            raise ValueError(f"sonnet_prefix_len ({self.sonnet_prefix_len}) must be ≤ "
                             f"sonnet_input_len ({self.sonnet_input_len})")

    @property
    def label(self) -> str:
        return f"{self.name} ({Path(self.path).name})" if self.path else self.name

    def requests(self, count_tokens: CountTokens, point: int = 0,
                 log: Callable[[str], None] = lambda s: None) -> list[RequestSpec]:
        """`num_requests` specs for sweep point `point` (each point its own draw)."""
        rng = random.Random(f"{self.seed}-{point}")
        return {"random": random_requests, "sharegpt": sharegpt_requests,
                "sonnet": sonnet_requests}[self.name](self, count_tokens, rng, log)

    def spec(self, prompt: str, prompt_len: int, output_len: int) -> RequestSpec:
        text = ({"messages": [{"role": "user", "content": prompt}]}
                if self.endpoint.endswith("/chat/completions") else {"prompt": prompt})
        body = {**text, "max_tokens": output_len, "temperature": 0.0,
                **({"ignore_eos": True} if self.ignore_eos else {}), **self.extra_body}
        return RequestSpec(self.name, self.endpoint, body, prompt_len)


def length_range(length: int, ratio: float) -> tuple[int, int]:
    """vLLM's random lengths: [⌊L·(1−r)⌋, ⌊L·(1+r)⌋], at least 1."""
    return max(1, math.floor(length * (1 - ratio))), max(1, math.floor(length * (1 + ratio)))


def random_requests(cfg: DatasetConfig, count: CountTokens, rng: random.Random,
                    log) -> list[RequestSpec]:
    lo_in, hi_in = length_range(cfg.random_input_len, cfg.random_range_ratio)
    lo_out, hi_out = length_range(cfg.random_output_len, cfg.random_range_ratio)
    if hi_in + hi_out > cfg.max_model_len:
        raise ValueError(f"random prompts up to {hi_in} tokens and outputs up to {hi_out} "
                         f"exceed the context length {cfg.max_model_len}")
    out = []
    for _ in range(cfg.num_requests):
        n_in, n_out = rng.randint(lo_in, hi_in), rng.randint(lo_out, hi_out)
        text = sized_text(random.Random(rng.getrandbits(64)), n_in, count)
        out.append(cfg.spec(text, count(text), n_out))
    return out


def load_conversations(path: Path) -> list[tuple[str, str]]:
    """(first human turn, the gpt turn after it) of every ShareGPT record of a JSON list
    or a JSONL file; records without both are left out."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
        records = data if isinstance(data, list) else [data]
    except ValueError:
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except ValueError as exc:
                    raise ValueError(f"{path}:{n}: not JSON: {exc}") from None
    pairs = []
    for record in records:
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(turns, list):
            continue
        roles = [t.get("from") if isinstance(t, dict) else None for t in turns]
        if "human" not in roles:
            continue
        first = roles.index("human")
        reply = next((t for t, r in zip(turns[first + 1:], roles[first + 1:]) if r == "gpt"),
                     None)
        if reply is not None:
            pairs.append((str(turns[first].get("value", "")), str(reply.get("value", ""))))
    return pairs


def sharegpt_fits(prompt_len: int, output_len: int, fixed_output: bool,
                  max_model_len: int) -> bool:
    """vLLM's `is_valid_sequence`, and within the server's context."""
    if prompt_len < SHAREGPT_MIN_LEN or (not fixed_output and output_len < SHAREGPT_MIN_LEN):
        return False
    total = prompt_len + output_len
    return (prompt_len <= SHAREGPT_MAX_PROMPT and total <= SHAREGPT_MAX_TOTAL
            and total <= max_model_len)


def sharegpt_requests(cfg: DatasetConfig, count: CountTokens, rng: random.Random,
                      log) -> list[RequestSpec]:
    pairs = load_conversations(cfg.path)
    if not pairs:
        raise ValueError(f"{cfg.path}: no record has a human turn followed by a gpt turn")
    rng.shuffle(pairs)
    out = []
    for prompt, reply in pairs:
        prompt_len = count(prompt)
        output_len = cfg.sharegpt_output_len or count(reply)
        if sharegpt_fits(prompt_len, output_len, cfg.sharegpt_output_len is not None,
                         cfg.max_model_len):
            out.append(cfg.spec(prompt, prompt_len, output_len))
            if len(out) == cfg.num_requests:
                return out
    if not out:
        raise ValueError(f"{cfg.path}: no conversation passes the length filter")
    log(f"{cfg.path}: {len(out)} conversations pass the length filter, fewer than "
        f"{cfg.num_requests} requests: they are sent again, in turn")
    return [out[i % len(out)] for i in range(cfg.num_requests)]


def sonnet_requests(cfg: DatasetConfig, count: CountTokens, rng: random.Random,
                    log) -> list[RequestSpec]:
    lines = [ln.strip() + "\n" for ln in Path(cfg.path or SONNET_TEXT).read_text().splitlines()
             if ln.strip()]
    ask_len = count(SONNET_ASK)
    if cfg.sonnet_input_len <= ask_len:
        raise ValueError(f"sonnet_input_len must exceed the instruction's {ask_len} tokens, "
                         f"got {cfg.sonnet_input_len}")
    per_line = count("".join(lines)) / len(lines)
    n_input = round((cfg.sonnet_input_len - ask_len) / per_line)
    n_prefix = min(max(round((cfg.sonnet_prefix_len - ask_len) / per_line), 0), len(lines))
    prefix = "".join(lines[:n_prefix])
    out, tries = [], 0
    while len(out) < cfg.num_requests:     # vLLM draws again when a prompt comes out long
        tries += 1
        if tries > 50 * cfg.num_requests:
            raise ValueError(f"no prompt of ≤ {cfg.sonnet_input_len} tokens in {tries} draws "
                             f"from {cfg.path or SONNET_TEXT}")
        prompt = SONNET_ASK + prefix + "".join(rng.choices(lines, k=max(n_input - n_prefix, 0)))
        prompt_len = count(prompt)
        if prompt_len <= cfg.sonnet_input_len:
            out.append(cfg.spec(prompt, prompt_len, cfg.sonnet_output_len))
    return out
