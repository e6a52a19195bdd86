"""Held-out retrieval families: task formats no calibration or distillation sees.

The train family is `evals.tasks` (what `splitstack calibrate` and `splitstack derive` may
use). These formats are written after published tests instead, on held-out text:

- `passkey` (Landmark Attention, LongLoRA): noise ("The grass is green. ..." repeated);
  "The pass key is N. Remember it. N is the pass key." on its own line; 5 digits.
- `passkey_essay`: the same pass key, its own sentences between two of an essay's
  (licence texts) instead of on a line in the noise.
- `niah_single_1` (RULER): the same noise; "One of the special magic numbers for K is: V.";
  7 digits.
- `niah_single_2` (RULER): essays (licence texts); the same needle at a sentence boundary.
- `niah_single_3` (RULER): essays; "One of the special magic uuids for K is: V."; a UUID.
- `paragraph`: essays; one plain sentence inside a paragraph, stated once; a word.
- `chat`: `niah_single_2` inside the model's chat template, the answer prefix starting
  the assistant's turn.

An item is exactly `context_len` tokens. The needle goes at the unit boundary (a noise
block, or a sentence) nearest `depth` of the haystack; the haystack before and after it are
tokenized as running text, and the text after it is cut to the length:

    [ head ][ haystack ... | NEEDLE | ... haystack (cut) ][ question + answer prefix ]
"""
from __future__ import annotations

import random
import uuid
from dataclasses import dataclass

from evals.heldout.texts import Sentence, essay_sentences
from evals.tasks import Item, chat_wrappers

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
                "memorize them. I will quiz you about the important information there.")
RULER_TASK = ("Some special magic {kind} are hidden within the following text. Make sure to "
              "memorize it. I will quiz you about the {kind} afterwards.")
# keys and word values share no word with the train family's (evals.tasks.KEYS, WORDS)
ADJECTIVES = ["abundant", "brittle", "crimson", "dusty", "eager", "fragile", "gentle", "hollow",
              "icy", "jagged", "lively", "mellow", "nimble", "obscure", "placid", "rustic"]
NOUNS = ["badger", "chimney", "dungeon", "furnace", "gazebo", "hammock", "igloo", "jetty",
         "kayak", "ladder", "mitten", "nozzle", "oyster", "parsnip", "quiver", "radish"]
VALUE_WORDS = ["alabaster", "buttercup", "cinnamon", "dandelion", "eucalyptus", "flamingo",
               "gondola", "hyacinth", "ibis", "juniper", "kumquat", "lavender", "magnolia",
               "nightingale", "oregano", "peppermint"]


@dataclass(frozen=True)
class Family:
    name: str
    haystack: str               # "noise" or "essay"
    answer_tokens: int          # generated per item
    chat: bool = False


FAMILIES = {f.name: f for f in (
    Family("passkey", "noise", 12),
    Family("passkey_essay", "essay", 12),
    Family("niah_single_1", "noise", 16),
    Family("niah_single_2", "essay", 16),
    Family("niah_single_3", "essay", 40),
    Family("paragraph", "essay", 12),
    Family("chat", "essay", 16, chat=True),
)}


@dataclass(frozen=True)
class Parts:
    head: str
    needle: str                 # with its surrounding whitespace
    tail: str
    value: str


def _key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _parts(family: Family, rng: random.Random, tokenizer) -> Parts:
    if family.name.startswith("passkey"):
        v = str(rng.randint(10_000, 99_999))
        sentences = f"The pass key is {v}. Remember it. {v} is the pass key."
        return Parts(PASSKEY_TASK + "\n",
                     f"\n{sentences}\n" if family.haystack == "noise" else f" {sentences}",
                     "\nWhat is the pass key? The pass key is", v)
    if family.name == "paragraph":
        k, v = rng.choice(NOUNS), rng.choice(VALUE_WORDS)
        return Parts("Read the following document. A question about it follows.\n\n",
                     f" For the record, the password of the {k} archive is {v}.",
                     f"\n\nQuestion: What is the password of the {k} archive?\n"
                     f"Answer: The password of the {k} archive is", v)
    kind = "uuids" if family.name == "niah_single_3" else "numbers"
    k = _key(rng)
    v = (str(uuid.UUID(int=rng.getrandbits(128), version=4)) if kind == "uuids"
         else str(rng.randint(1_000_000, 9_999_999)))
    before, after = "", " "                      # RULER: the answer prefix follows the question
    if family.chat:                              # ... or starts the assistant's turn
        before, after, _ = chat_wrappers(tokenizer)
        if not before:
            raise ValueError("family 'chat' needs a tokenizer with a chat template")
    question = f"What is the special magic {kind[:-1]} for {k} mentioned in the provided text?"
    prefix = f"The special magic {kind[:-1]} for {k} mentioned in the provided text is"
    return Parts(before + RULER_TASK.format(kind=kind) + "\n",
                 f" One of the special magic {kind} for {k} is: {v}.",
                 "\n" + question + after + prefix, v)


def _units(family: Family, rng: random.Random):
    """An endless stream of haystack units, from a random sentence for essays."""
    if family.haystack == "noise":
        while True:
            yield Sentence(NOISE, False)
    sentences = essay_sentences()
    i = rng.randrange(len(sentences))
    while True:
        yield sentences[i % len(sentences)]
        i += 1


def _join(units: list[Sentence], lead: bool) -> str:
    """Running text of `units`; with `lead`, the first one keeps its separator too."""
    out = []
    for j, u in enumerate(units):
        if j or lead:
            out.append("\n\n" if u.paragraph_start else " ")
        out.append(u.text)
    return "".join(out)


def make_family_item(name: str, tokenizer, context_len: int, depth: float, rng: random.Random,
                     attempts: int = 20) -> Item:
    """One item of family `name`, exactly `context_len` tokens; the needle sits within 10%
    of the haystack from `depth`, and its value occurs in the prompt only where the needle
    states it (drawn again otherwise)."""
    family = FAMILIES.get(name)
    if family is None:
        raise ValueError(f"unknown held-out family {name!r}; choose from {sorted(FAMILIES)}")
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    for _ in range(attempts):
        parts = _parts(family, rng, tokenizer)
        head, needle, tail = encode(parts.head), encode(parts.needle), encode(parts.tail)
        budget = context_len - len(head) - len(needle) - len(tail)
        if budget < 16:
            raise ValueError(f"context_len={context_len} is too short for family {name!r}")
        built = _assemble(family, rng, encode, head, needle, tail, budget, depth,
                          lead=not parts.needle.endswith("\n"))
        if built is None:
            continue
        ids, pos = built
        text = tokenizer.decode(ids)
        if (text.count(parts.value) == parts.needle.count(parts.value)
                and text.count(parts.needle.strip()) == 1):
            return Item(name, context_len, depth, ids, [parts.value], [pos])
    raise ValueError(f"family {name!r}: no item with its needle near depth {depth:.2f} and "
                     f"its value stated once in {attempts} draws")


def _assemble(family, rng, encode, head, needle, tail, budget, depth, lead):
    units, counts, stream = [], [], _units(family, rng)
    while sum(counts) < budget + 32:
        u = next(stream)
        units.append(u)
        counts.append(len(encode(" " + u.text)))
    target, total, best = depth * budget, 0, None
    for k in range(1, len(units)):               # boundary before units[k]
        total += counts[k - 1]
        if total > budget - 8:
            break
        if family.name == "paragraph" and (units[k].paragraph_start
                                           or units[k - 1].paragraph_start):
            continue                # inside a paragraph, after its second sentence at least
        if best is None or abs(total - target) < abs(best[1] - target):
            best = (k, total)
    if best is None or abs(best[1] - target) > 0.1 * budget:
        return None                 # no fitting boundary near the depth in this stretch
    k = best[0]
    before = encode(_join(units[:k], lead=False)) if k else []
    if len(before) > budget:
        before = before[:budget]
    after = encode(_join(units[k:], lead=lead))
    while len(before) + len(after) < budget:      # merges made the estimate short
        units.append(next(stream))
        after = encode(_join(units[k:], lead=lead))
    after = after[:budget - len(before)]
    return head + before + needle + after + tail, len(head) + len(before)


def make_family_items(name: str, tokenizer, context_len: int, n: int,
                      seed: int = 0) -> list[Item]:
    """n items with depths spread evenly over [0.05, 0.95], deterministic by seed."""
    rng = random.Random(f"heldout-{name}-{context_len}-{seed}")
    depths = [0.05 + 0.9 * i / max(1, n - 1) for i in range(n)]
    return [make_family_item(name, tokenizer, context_len, d, rng) for d in depths]
