"""RULER-style synthetic retrieval over held-out natural text.

An item is a haystack of `context_len` tokens with needle sentences inserted at a relative
`depth`, followed by a question and an answer prefix the model completes:

    [ filler ... NEEDLE ... filler ][ question + answer prefix ]
    |<------------- prompt, N tokens ---------------------------->|
    |<------ filled region: positions < N − T ------>|<-- tail T -->|

Each item records where its needles sit, so results split into filled-region and tail items.
Tasks: `single` (one key, one number), `multikey` (several keys, one asked), `multivalue`
(one key, several numbers, all asked), `word` (one key, one word value), `code` (one key, a
serial code of letter and digit groups; not in the default set). Needles state the value
twice; with `once`, other wordings state it once.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

TASKS = ("single", "multikey", "multivalue", "word")       # the default set
ALL_TASKS = TASKS + ("code",)

KEYS = ["harbor", "lantern", "meadow", "copper", "violet", "glacier", "orchard", "falcon",
        "saffron", "quartz", "willow", "ember", "canyon", "marble", "thistle", "cobalt"]
WORDS = ["pelican", "turnip", "sonnet", "walrus", "trumpet", "biscuit", "volcano", "pyramid",
         "lobster", "cactus", "anchor", "kettle", "raccoon", "saddle", "tornado", "zeppelin"]

# (needle, question, answer prefix); {k} key, {v} value, {kind} "number" or "word".
# Needles state the value twice (the classic passkey form): measured on SmolLM2-135M at 2K,
# single-needle retrieval rose from 62% (one statement) to 100% with it.
TEMPLATES = [
    ("The special magic {kind} for {k} is: {v}. Remember it. {v} is the special magic "
     "{kind} for {k}.",
     "What is the special magic {kind} for {k}?",
     "The special magic {kind} for {k} is"),
    ("The pass {kind} of the {k} project is {v}. Remember it. {v} is the pass {kind} of the "
     "{k} project.",
     "What is the pass {kind} of the {k} project?",
     "The pass {kind} of the {k} project is"),
    ("One of the special magic {kind}s for {k} is: {v}. Remember it. {v} is one of the "
     "special magic {kind}s for {k}.",
     "What are all the special magic {kind}s for {k}?",
     "The special magic {kind}s for {k} are"),
]
# Needles that state the value once, in other wordings (`make_item(..., once=True)`).
ONCE_TEMPLATES = [
    ("The pass {kind} of the {k} project is {v}.",
     "What is the pass {kind} of the {k} project?",
     "The pass {kind} of the {k} project is"),
    ("For the {k} account, the access {kind} is {v}.",
     "What is the access {kind} for the {k} account?",
     "The access {kind} for the {k} account is"),
]
INSTRUCTION = ("Some special magic values are hidden inside the following text. "
               "Make sure to memorize them. I will quiz you about them afterwards.\n\n")


@dataclass
class Item:
    task: str
    context_len: int
    depth: float
    prompt_ids: list[int]
    answers: list[str]                     # every value must appear in the completion
    needle_positions: list[int] = field(default_factory=list)   # token index of each needle

    def in_filled_region(self, tail_len: int) -> bool:
        """All needles lie before the exact tail (the last `tail_len` prompt tokens)."""
        cut = len(self.prompt_ids) - tail_len
        return all(p < cut for p in self.needle_positions)

    def score(self, completion: str) -> float:
        return sum(a in completion for a in self.answers) / len(self.answers)


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _code(rng: random.Random) -> str:
    """A serial code: 2 to 5 groups of 3 to 8 lower-case letters and digits, dash-joined."""
    chars = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "-".join("".join(rng.choice(chars) for _ in range(rng.randint(3, 8)))
                    for _ in range(rng.randint(2, 5)))


VALUES = {"number": _number, "word": lambda rng: rng.choice(WORDS), "code": _code}


def chat_wrappers(tokenizer) -> tuple[str, str, str]:
    """(before user text, between user text and answer, marker) from the chat template, or
    empty strings for a model without one. The answer prefix is put in the assistant turn."""
    if not getattr(tokenizer, "chat_template", None):
        return "", "", ""
    marker = "\x00USER\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}],
                                         add_generation_prompt=True, tokenize=False)
    before, after = text.split(marker)
    return before, after, marker


def make_item(task: str, tokenizer, filler_ids: list[int], context_len: int, depth: float,
              rng: random.Random, template: int, chat: bool = False,
              once: bool = False) -> Item:
    """Build one item; `filler_ids` is tokenized haystack text (long enough for the context).
    By default the item is a plain completion (as RULER prompts base models); with `chat`
    the text is the user turn of the model's chat template and the answer prefix starts the
    assistant turn (SmolLM2-135M retrieves less reliably that way). With `once`, the needle
    states the value once (`ONCE_TEMPLATES`; not for `multivalue`)."""
    if task not in ALL_TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {ALL_TASKS}")
    kind = task if task in VALUES else "number"
    keys = rng.sample(KEYS, 4 if task == "multikey" else 1)
    key = keys[0]
    if task == "multivalue":
        needle_t, question_t, prefix_t = TEMPLATES[2]
        values = [_number(rng) for _ in range(3)]
        needles = [needle_t.format(kind=kind, k=key, v=v) for v in values]
    else:
        needle_t, question_t, prefix_t = (ONCE_TEMPLATES if once else TEMPLATES)[template % 2]
        values = [VALUES[kind](rng)]
        needles = [needle_t.format(kind=kind, k=key, v=values[0])]
        needles += [needle_t.format(kind=kind, k=k, v=VALUES[kind](rng)) for k in keys[1:]]
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    before, after, _ = chat_wrappers(tokenizer) if chat else ("", "", "")
    head = encode(before + INSTRUCTION)
    tail = encode("\n\n" + question_t.format(kind=kind, k=key) + (after or "\n")
                  + prefix_t.format(kind=kind, k=key))
    needle_ids = [encode(" " + n + " ") for n in needles]
    budget = context_len - len(head) - len(tail) - sum(len(n) for n in needle_ids)
    if budget <= 0:
        raise ValueError(f"context_len={context_len} is too short for task {task!r}")
    start = rng.randrange(0, max(1, len(filler_ids) - budget))
    filler = filler_ids[start:start + budget]
    # the asked needle goes at `depth`; distractors / extra values spread after it
    spots = [int(depth * budget)] + sorted(rng.randrange(0, budget) for _ in needle_ids[1:])
    order = sorted(range(len(needle_ids)), key=lambda i: spots[i])
    ids, positions, cursor = list(head), [0] * len(needle_ids), 0
    for i in order:
        ids += filler[cursor:spots[i]]
        cursor = spots[i]
        if i == 0 or task == "multivalue":
            positions[i] = len(ids)
        ids += needle_ids[i]
    ids += filler[cursor:] + tail
    asked = [positions[0]] if task != "multivalue" else positions
    return Item(task, context_len, depth, ids, values, asked)


def make_items(task: str, tokenizer, filler_ids: list[int], context_len: int, n: int,
               seed: int = 0, chat: bool = False) -> list[Item]:
    """n items with depths spread evenly over [0.05, 0.95] and templates alternating."""
    rng = random.Random(f"{task}-{context_len}-{seed}")
    depths = [0.05 + 0.9 * i / max(1, n - 1) for i in range(n)]
    return [make_item(task, tokenizer, filler_ids, context_len, d, rng, i, chat)
            for i, d in enumerate(depths)]
