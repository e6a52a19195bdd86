"""The held-out retrieval families (evals/heldout): items of the asked token length,
deterministic by seed, one needle each where the family puts it; and nothing calibration or
distillation runs imports them."""
from __future__ import annotations

import random
from pathlib import Path

import grimp
import pytest

from evals.heldout.families import FAMILIES, make_family_item, make_family_items
from evals.heldout.texts import LICENSE_DIR, essay_sentences, long_documents, sources
from evals.run import EvalConfig, loss_corpus_for
from services.common.tokenizer import load_tokenizer

ZOO = Path(__file__).resolve().parents[2] / "models" / "zoo" / "smollm2-135m"
# what `splitstack calibrate` and `splitstack derive` run: the train side
UPSTREAM = ("tools.calibration", "tools.zoo", "tools.commands.calibrate",
            "tools.commands.derive", "tools.commands.convert_qfirst", "evals.tasks",
            "evals.corpus")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ZOO)


def needle_of(item, tok) -> str:
    """The decoded prompt around the asked needle (its first 60 tokens)."""
    pos = item.needle_positions[0]
    return tok.decode(item.prompt_ids[pos:pos + 60])


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("length", [1024, 2048, 4096])
def test_items_have_the_asked_length_and_one_needle(tok, family, length):
    items = make_family_items(family, tok, length, 4, seed=3)
    assert len(items) == 4
    positions = []
    for it in items:
        assert len(it.prompt_ids) == length and it.task == family
        text = tok.decode(it.prompt_ids)
        value = it.answers[0]
        # the needle states its value (the passkey twice), and nothing else does
        assert text.count(value) == (2 if family.startswith("passkey") else 1)
        assert value in needle_of(it, tok)
        positions.append(it.needle_positions[0])
    # depths spread from 5% to 95%: the needle moves through the haystack
    assert positions == sorted(positions) and positions[-1] - positions[0] > 0.6 * length


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_items_are_deterministic_by_seed(tok, family):
    a = make_family_items(family, tok, 1024, 3, seed=0)
    b = make_family_items(family, tok, 1024, 3, seed=0)
    c = make_family_items(family, tok, 1024, 3, seed=1)
    assert [i.prompt_ids for i in a] == [i.prompt_ids for i in b]
    assert [i.answers for i in a] != [i.answers for i in c]


def test_the_formats(tok):
    """Each family reads as the test it is written after."""
    passkey = tok.decode(make_family_items("passkey", tok, 1024, 1)[0].prompt_ids)
    assert passkey.startswith("There is an important info hidden inside a lot of irrelevant")
    assert passkey.count("The grass is green. The sky is blue.") > 10
    assert passkey.endswith("\nWhat is the pass key? The pass key is")
    noise = tok.decode(make_family_items("niah_single_1", tok, 1024, 1)[0].prompt_ids)
    assert "The sun is yellow." in noise and "special magic numbers for" in noise
    essay = tok.decode(make_family_items("niah_single_2", tok, 1024, 1)[0].prompt_ids)
    assert "The grass is green" not in essay
    assert "License" in essay or not LICENSE_DIR.is_dir()
    uuid_item = make_family_items("niah_single_3", tok, 1024, 1)[0]
    assert len(uuid_item.answers[0]) == 36 and uuid_item.answers[0].count("-") == 4
    chat = tok.decode(make_family_items("chat", tok, 1024, 1)[0].prompt_ids)
    assert chat.startswith("<|im_start|>system")
    assert "?<|im_end|>\n<|im_start|>assistant\nThe special magic number for " in chat
    assert chat.endswith(" mentioned in the provided text is")


def test_the_paragraph_needle_sits_inside_a_paragraph(tok):
    for it in make_family_items("paragraph", tok, 2048, 6, seed=2):
        text = tok.decode(it.prompt_ids)
        sentence = "For the record, the password of the "
        i = text.index(sentence)
        end = text.index(".", i) + 1
        # prose on both sides of it, no paragraph break next to it
        assert text[i - 1] == " " and text[i - 2] != "\n" and text[end] == " "
        assert text.count(sentence) == 1


def test_bad_requests_are_refused(tok):
    with pytest.raises(ValueError, match="unknown held-out family"):
        make_family_item("niah_multikey", tok, 1024, 0.5, random.Random(0))
    with pytest.raises(ValueError, match="too short"):
        make_family_item("niah_single_3", tok, 60, 0.5, random.Random(0))
    with pytest.raises(ValueError, match="unknown held-out families"):
        EvalConfig(families=("passkey", "needle"))
    with pytest.raises(ValueError, match="loss_corpus"):
        EvalConfig(loss_corpus="wiki")


def test_long_texts_are_long_and_named():
    docs = long_documents()
    counts = sources()
    assert counts["python-reference"] > 50            # ships with every CPython
    if LICENSE_DIR.is_dir():                          # Debian's base-files
        assert counts["licenses"] >= 10 and docs[0].name.startswith("common-licenses/")
    assert sum(len(d.text) > 35_000 for d in docs) >= 3   # 8K-token loss documents exist
    assert all(len(s.text.split()) >= 1 for s in essay_sentences())
    cfg = EvalConfig(lengths=(1024, 4096))
    assert "docstrings" in loss_corpus_for(cfg, 1024)
    assert "licenses" in loss_corpus_for(cfg, 4096)


def test_nothing_upstream_imports_the_held_out_families():
    graph = grimp.build_graph("tools", "evals", "services", "models", "kernels")
    held = {m for m in graph.modules if m.startswith("evals.heldout")}
    assert {"evals.heldout.families", "evals.heldout.texts"} <= held
    for module in UPSTREAM:
        reached = graph.find_upstream_modules(module, as_package=module == "tools.zoo")
        assert not reached & held, f"{module} imports {sorted(reached & held)}"
    # the check sees imports inside functions: the eval command does reach them
    assert "evals.heldout.families" in graph.find_upstream_modules("tools.commands.eval")
