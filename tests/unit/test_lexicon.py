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
          "Ġa", "Ġlist", "Ġin", "Ġplace", "Ġreturns", "ĠNone", "Ġkeys", "Ġvalues",
          "Ġyou", "Ġmay", "Ġcopy", "Ġsource", "Ġcode", "Ġwith", "Ġwritten", "Ġoffer", "Ġto"]
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


# a question too short to fill the query window: the window's other words are the
# haystack's last sentence, which a long haystack sentence elsewhere shares
LONG = ("_you _may _copy _the _source _code _with _a _written _offer _to _sort _a _list _in "
        "_place _and _keys _and _values _returns _None . ")
SHORT_NEEDLE = "_The _number _for _har bor _is _1234 567 . "
HAYSTACK_END = "_you _may _copy _the _source _code _with _a _written _offer _to _you . "
SHORT_QUESTION = "Ċ _What _is _the _number _for _har bor ? Ċ _The _number _for _har bor _is"


def short_question_prompt():
    """A prompt ending in SHORT_QUESTION after HAYSTACK_END, with LONG early on and
    SHORT_NEEDLE later -> (ids, tail, long_at, needle_at, needle rows); the tail holds the
    haystack's last sentence and the question."""
    end = "_sort _a _list . " + HAYSTACK_END + SHORT_QUESTION
    ids = ids_of(FILLER * 2 + LONG + FILLER * 2 + SHORT_NEEDLE + GAP + end)
    long_at = len(ids_of(FILLER * 2))
    needle_at = len(ids_of(FILLER * 2 + LONG + FILLER * 2))
    needle = list(range(needle_at, needle_at + len(ids_of(SHORT_NEEDLE))))
    return ids, len(ids_of(end)), long_at, needle_at, needle


def test_bm25_ranks_the_question_over_the_haystack_it_ends():
    ids, tail, long_at, needle_at, needle = short_question_prompt()
    p = len(ids) - tail
    # both are nominated: ≥ 4 shared words and a word seen once ("written", "harbor")
    by_start = {n.start: n for n in LEX.nominate(ids, p)}
    assert {long_at, needle_at} <= set(by_start)
    # the seed's order: the long sentence shares more rare words (source, code, written,
    # offer) with the haystack's end than the needle does with the question
    seed = LEX.nominate(ids, p, rank="shared")
    assert seed[0].start == long_at
    assert LEX.net(ids, p, cap=len(needle), rank="shared") == list(
        range(long_at, long_at + len(needle)))
    # BM25 with the query weighted toward the prompt's end puts the needle first
    assert LEX.nominate(ids, p)[0].start == needle_at
    assert LEX.net(ids, p, cap=len(needle)) == needle
    # unweighted (half_life 0), the long sentence's rare words win again
    assert LEX.nominate(ids, p, half_life=0)[0].start == long_at
    with pytest.raises(ValueError, match="rank"):
        LEX.nominate(ids, p, rank="tfidf")


def test_net_takes_a_long_sentences_rows_around_its_best_word():
    """A needle stated after an unpunctuated stretch shares one long sentence with it: the
    rows kept start `lead_rows` before the best-matching word, not at the sentence's start."""
    run_on = "_sort _a _list _in _place _returns _None _keys _and _values " * 6
    text = FILLER * 3 + run_on + SHORT_NEEDLE + GAP + SHORT_QUESTION
    ids = ids_of(text)
    p = len(ids) - len(ids_of(SHORT_QUESTION))
    start = len(ids_of(FILLER * 3))
    needle_at = start + len(ids_of(run_on))
    value = needle_at + 6                                   # "1234 567"
    (nom,) = LEX.nominate(ids, p)
    assert (nom.start, nom.end) == (start, needle_at + 9)
    # a word of the needle's (the filler never says "number", "harbor" or "is")
    assert needle_at < nom.anchor < value
    # from 4 rows before it, moved back to stay inside the sentence: its last 16 rows
    rows = LEX.net(ids, p, cap=100, sentence_rows=16, lead_rows=4)
    assert rows == list(range(nom.end - 16, nom.end))
    assert {value, value + 1} <= set(rows)
    # from the sentence's start, its first 16 rows miss the needle
    head = LEX.net(ids, p, cap=100, sentence_rows=16, lead_rows=10**6)
    assert head == list(range(start, start + 16)) and value not in head
    # a sentence no longer than sentence_rows is taken whole, from its start
    assert LEX.net(ids, p, cap=200, sentence_rows=80) == list(range(start, needle_at + 9))


def test_the_nets_order_reaches_the_probes_rows(tiny_fill):
    """`lexical_rank` picks which sentence the probe computes exactly: on a prompt whose
    question is short, the seed's order takes the haystack sentence, BM25 the needle."""
    from evals.catalog import make_arm

    model, maps = tiny_fill
    ids, tail, long_at, needle_at, needle = short_question_prompt()
    needle = set(needle)
    p = len(ids) - tail
    # the net's share holds the needle's 9 rows and no more; no attention rows beside it
    share = len(needle) / p
    exact_rows = {}
    for rank in ("bm25", "shared"):
        s = FillSettings(split=2, tail=tail, selector="probe", budget=share, lexical=share,
                         lexical_rank=rank)
        res = RidgeFill(model, maps, lexicon=LEX).prefill(ids, s)
        exact_rows[rank] = set(res.exact_rows[res.exact_rows < p].tolist())
    assert needle <= exact_rows["bm25"] and not needle & exact_rows["shared"]
    assert long_at in exact_rows["shared"]
    # the eval's arms: the probe ranks by BM25, `ridgefill+probe-shared` in the seed's order
    for name, rank in (("ridgefill+probe", "bm25"), ("ridgefill+probe-shared", "shared")):
        arm = make_arm(name, model, maps_dir=maps.path.parent, split=2, tail=tail, lexicon=LEX)
        assert arm.settings.lexical_rank == rank and arm.settings.selector == "probe"
