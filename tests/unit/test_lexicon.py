"""The probe's lexical net: words, sentence nomination, and its place in the probe's rows."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from services.prefill.lexicon import Lexicon
from services.prefill.ridgefill import RidgeFill
from services.prefill.settings import FillError, FillSettings

# a byte-level-BPE-like vocabulary: "Ġ" marks a word start, "Ċ" a line break
PIECES = ["<|endoftext|>", "<|im_start|>", ".", "?", ":", "Ċ", "Ġ1234", "567",
          "ĠThe", "Ġthe", "Ġspecial", "Ġmagic", "Ġnumber", "Ġfor", "Ġhar", "bor", "Ġis",
          "ĠRemember", "Ġit", "Ġcopper", "ĠWhat", "Ġlists", "Ġand", "Ġdicts", "Ġsort",
          "Ġa", "Ġlist", "Ġin", "Ġplace", "Ġreturns", "ĠNone", "Ġkeys", "Ġvalues"]
VOCAB = 1024                       # the tiny checkpoints' vocabulary; ids past PIECES: no text


class FakeTokenizer:
    all_special_ids = [0, 1]

    def __len__(self):
        return len(PIECES)

    def convert_ids_to_tokens(self, ids):
        return [PIECES[i] for i in ids]


LEX = Lexicon.from_tokenizer(FakeTokenizer(), VOCAB)


def ids_of(text: str) -> list[int]:
    """Space-separated pieces (without the Ġ of word starts, which `_` marks) -> ids."""
    out = []
    for w in text.split():
        piece = "Ġ" + w[1:] if w.startswith("_") else w
        out.append(PIECES.index(piece))
    return out


FILLER = "_sort _a _list _in _place . _returns _None . _keys _and _values . "
NEEDLE = ("_The _special _magic _number _for _har bor _is : _1234 567 . _Remember _it . "
          "_1234 567 _is _the _special _magic _number _for _har bor . ")
DISTRACTOR = "_The _special _magic _number _for _copper _is : _1234 567 . "
GAP = FILLER * 8          # keeps the needles out of the query window (the last 64 content tokens)
QUESTION = "Ċ _What _is _the _special _magic _number _for _har bor ? Ċ _The _special _magic " \
           "_number _for _har bor _is"


def test_lexicon_reads_pieces_words_and_sentence_ends():
    assert LEX.vocab_size == VOCAB
    assert LEX.letters[PIECES.index("ĠThe")] == "the" and LEX.letters[PIECES.index(":")] == ""
    assert LEX.ends_sentence[PIECES.index(".")] and LEX.ends_sentence[PIECES.index("Ċ")]
    assert not LEX.ends_sentence[PIECES.index("Ġis")] and LEX.special == {0, 1}
    assert LEX.letters[900] == "" and not LEX.ends_sentence[900]       # past the tokenizer
    words = LEX.words(ids_of("_The _har bor _is : _1234 567 ."))
    # word pieces join ("har"+"bor"), case folds, digits and punctuation are no words
    assert words == [("the", 0), ("harbor", 1), ("is", 3)]


def test_net_nominates_the_asked_needle_before_distractors_and_filler():
    text = FILLER * 3 + DISTRACTOR + FILLER * 2 + NEEDLE + GAP + QUESTION
    ids = ids_of(text)
    p = len(ids) - len(ids_of(QUESTION))
    needle_at = len(ids_of(FILLER * 3 + DISTRACTOR + FILLER * 2))
    distractor_at = len(ids_of(FILLER * 3))
    first = list(range(needle_at, needle_at + 12))           # "The special ... 567 ."
    second = list(range(needle_at + 15, needle_at + 26))     # "1234 567 is ... harbor ."
    rows = LEX.net(ids, p, cap=100)
    # both needle statements (they share ≥ 4 words with the question and "harbor" is rare);
    # the distractor shares the frame and holds a rare word ("copper"), so it comes too;
    # filler sentences share nothing
    assert set(first) | set(second) <= set(rows)
    assert set(range(distractor_at, distractor_at + 11)) <= set(rows)
    assert len(rows) == 23 + 11
    # under a cap, sentences sharing the rare key ("harbor") come first
    assert LEX.net(ids, p, cap=23) == sorted(first + second)
    assert LEX.net(ids, p, cap=5) == first[:5]
    # "Remember it." shares nothing; at most `sentence_rows` rows per sentence
    assert LEX.net(ids, p, cap=100, sentence_rows=4) == sorted(
        first[:4] + second[:4] + list(range(distractor_at, distractor_at + 4)))
    assert LEX.net(ids, p, cap=0) == [] and LEX.net(ids, 0, cap=10) == []


def test_net_wants_four_shared_words_and_a_rare_one():
    frequent = (NEEDLE * 3) + GAP + QUESTION                   # "harbor" now appears 6 times
    ids = ids_of(frequent)
    p = len(ids) - len(ids_of(QUESTION))
    assert LEX.net(ids, p, cap=100) == []                      # no rare word anywhere
    assert LEX.net(ids, p, cap=100, max_count=6) != []
    short = ids_of(FILLER * 3 + "_The _special _har bor . " + GAP + QUESTION)
    p = len(short) - len(ids_of(QUESTION))
    assert LEX.net(short, p, cap=100) == []                    # 3 shared words only
    assert LEX.net(short, p, cap=100, min_shared=3) == [len(ids_of(FILLER * 3)) + i
                                                         for i in range(5)]


@pytest.fixture(scope="module")
def tiny_fill(tmp_path_factory, tiny_configs):
    from models import load_model
    from models.random_checkpoint import save_random_checkpoint
    from services.prefill.maps import RidgeMaps
    from tools.calibration import CalibConfig, calibrate

    cfg = dict(tiny_configs["llama3"], num_hidden_layers=4)
    path = tmp_path_factory.mktemp("lexicon")
    save_random_checkpoint(cfg, path, seed=3, std=0.1)
    model = load_model(path)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 1000, (200,), generator=g).tolist() for _ in range(6)]
    calibrate(model, iter(docs), CalibConfig(splits=(2,), max_len=128, heldout_docs=2,
                                             sink_rows=0), path / "maps", log=lambda *_: None)
    return model, RidgeMaps(path / "maps", model, 2)


def test_probe_takes_the_nets_rows_within_its_budget(tiny_fill):
    model, maps = tiny_fill
    ids = ids_of(FILLER * 12 + NEEDLE + FILLER * 5) + [1] + ids_of(FILLER * 5 + QUESTION)
    special = len(ids_of(FILLER * 12 + NEEDLE + FILLER * 5))       # <|im_start|>
    tail = len(ids_of(QUESTION)) + 8
    p = len(ids) - tail
    s = FillSettings(split=2, tail=tail, selector="probe", budget=0.25, lexical=0.2)
    budget = s.budget_rows(p)
    needle = LEX.net(ids, p, cap=100)
    assert len(needle) == 23 and 23 <= int(round(0.2 * p)) <= budget

    with pytest.raises(FillError, match="tokenizer"):
        RidgeFill(model, maps).prefill(ids, s)
    plain = RidgeFill(model, maps).prefill(ids, dataclasses.replace(s, lexical=0))
    res = RidgeFill(model, maps, lexicon=LEX).prefill(ids, s)
    rows = res.exact_rows[res.exact_rows < p].tolist()
    # the nominated sentences, the rest of the budget by attention, the special row on top
    assert set(needle) <= set(rows) and special in rows
    assert budget <= len(rows) <= budget + 1
    attention_only = plain.exact_rows[plain.exact_rows < p].tolist()
    assert len(attention_only) == budget and not set(needle) <= set(attention_only)
    # a lexical share of 0 is the attention ranking alone, lexicon or not
    again = RidgeFill(model, maps, lexicon=LEX).prefill(ids, dataclasses.replace(s, lexical=0))
    assert again.exact_rows.tolist() == plain.exact_rows.tolist()
    with pytest.raises(FillError, match="lexical"):
        FillSettings(split=2, tail=8, selector="probe", lexical=1.5).validate(4)


def test_net_skips_sentences_inside_the_query_window():
    """With a short tail the sentences just before the question fall in the prefix and in
    the query window at once; they would share every word with it."""
    text = FILLER * 6 + NEEDLE + FILLER * 6 + "_keys _and _values _har bor . " + QUESTION
    ids = ids_of(text)
    p = len(ids) - len(ids_of(QUESTION))
    rows = LEX.net(ids, p, cap=200)
    needle_at = len(ids_of(FILLER * 6))
    assert rows == list(range(needle_at, needle_at + 12)) + list(range(needle_at + 15,
                                                                       needle_at + 26))
