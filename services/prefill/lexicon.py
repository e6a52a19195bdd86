"""The probe's lexical net (seed 000, "Which rows to compute exactly", the 27B probe).

Besides the rows the probe ranks by attention, "lexical-net rows are reserved within the
budget up to 5%. The lexical net nominates sentences that share 4 or more words with the
last 64 content tokens of the prompt and contain a word appearing at most twice in the
whole prefix (up to the first 80 rows per sentence)." Special tokens go outside the budget.

The net works on token ids with a per-token table built once from the tokenizer
(`Lexicon.from_tokenizer`): a token's lower-cased letters (empty unless it is all letters),
whether it starts a word (a space marker), whether it ends a sentence (., !, ? or a line
break) and whether it is a special token. A word is a run of letter tokens that starts with
a word-start token or after a non-letter one; content tokens are letter tokens.

Nominated sentences are taken best first: most shared words that are also rare, then most
shared words, then position. On the retrieval items this is what puts the asked needle's
sentences in the exact rows; a distractor needle shares the sentence frame but not the key.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from services.prefill.maps import WORD_START
from services.prefill.settings import LEXICAL_RANKS

LINE_BREAKS = ("Ċ", "\n", "<0x0A>")
WORD_MARKS = WORD_START + LINE_BREAKS[:2]      # a token after a space or a line break
SENTENCE_ENDS = ".!?"


@dataclass(frozen=True)
class Lexicon:
    letters: tuple[str, ...]          # lower-cased letters of an all-letter token, else ""
    starts_word: tuple[bool, ...]
    ends_sentence: tuple[bool, ...]
    special: frozenset[int]

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int) -> "Lexicon":
        pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
        pieces += [None] * (vocab_size - len(pieces))     # ids past the tokenizer: no text
        letters, starts, ends = [], [], []
        for piece in pieces:
            piece = piece or ""
            body = piece.lstrip("".join(WORD_MARKS))
            letters.append(body.lower() if body.isalpha() else "")
            starts.append(piece.startswith(WORD_MARKS))
            ends.append(any(c in body for c in SENTENCE_ENDS)
                        or any(b in piece for b in LINE_BREAKS))
        special = frozenset(i for i in getattr(tokenizer, "all_special_ids", []) or []
                            if 0 <= i < vocab_size)
        return cls(tuple(letters), tuple(starts), tuple(ends), special)

    @property
    def vocab_size(self) -> int:
        return len(self.letters)

    def words(self, ids: list[int]) -> list[tuple[str, int]]:
        """(word, its first row) for every word of `ids`, in order."""
        out, word, first = [], "", 0
        for i, t in enumerate(ids):
            piece = self.letters[t] if 0 <= t < len(self.letters) else ""
            if piece and word and not self.starts_word[t]:
                word += piece
                continue
            if word:
                out.append((word, first))
            word, first = piece, i
        if word:
            out.append((word, first))
        return out

    def special_rows(self, ids: list[int], p: int) -> list[int]:
        return [i for i in range(p) if ids[i] in self.special]

    def nominate(self, ids: list[int], p: int, *, query_tokens: int = 64, min_shared: int = 4,
                 max_count: int = 2, rank: str = "bm25", k1: float = 1.2, b: float = 0.75,
                 half_life: float = 16.0) -> list[Nomination]:
        """The nominated prefix sentences, best first. `p`: the prefix end (rows ≥ p are
        exact anyway); the query is the whole prompt's last `query_tokens` content tokens,
        and sentences reaching into it are not nominated (with a short tail they would
        share every word with it).

        A sentence is nominated when it shares `min_shared` words with the query and holds
        a word seen at most `max_count` times in the prefix (the seed's rule). `rank`:

            bm25    Okapi BM25 over the prefix's sentences (idf from how many sentences
                    hold a word; term counts saturated by `k1` and normalised by sentence
                    length with `b`), each query word weighted 2^(−d / half_life), d the
                    distance of its last occurrence from the prompt's end in content
                    tokens (half_life 0: unweighted)
            shared  the seed's order: most shared rare words, then most shared words

        The query window is mostly haystack when the question is short: unweighted, long
        haystack sentences sharing its stop words and a rare word outrank the needle."""
        if p <= 0:
            return []
        if rank not in LEXICAL_RANKS:
            raise ValueError(f"rank must be one of {LEXICAL_RANKS}, got {rank!r}")
        words = self.words(ids)
        content = [i for i, t in enumerate(ids) if 0 <= t < len(self.letters) and self.letters[t]]
        q0 = content[-query_tokens] if len(content) >= query_tokens else (
            content[0] if content else len(ids))
        left = {row: len(content) - 1 - k for k, row in enumerate(content)}
        weight = {w: 2.0 ** (-left.get(first, 0) / half_life) if half_life > 0 else 1.0
                  for w, first in words if first >= q0}        # the last occurrence wins
        counts = Counter(w for w, first in words if first < p)
        rare = {w for w, c in counts.items() if c <= max_count}
        # sentences of the prefix: [start, end) cut after every sentence-ending token, each
        # with its words' counts and first rows
        bounds, start = [], 0
        for i in range(p):
            if 0 <= ids[i] < len(self.ends_sentence) and self.ends_sentence[ids[i]]:
                bounds.append((start, i + 1))
                start = i + 1
        if start < p:
            bounds.append((start, p))
        sentences, j = [], 0
        prefix_words = [(w, first) for w, first in words if first < p]
        for a, b_ in bounds:
            bag, at = Counter(), {}
            while j < len(prefix_words) and prefix_words[j][1] < b_:
                w, first = prefix_words[j]
                bag[w] += 1
                at.setdefault(w, first)
                j += 1
            sentences.append((a, b_, bag, at))
        df = Counter(w for _, _, bag, _ in sentences for w in bag)
        n_sent = len(sentences)
        avg_len = sum(sum(bag.values()) for _, _, bag, _ in sentences) / max(1, n_sent)
        out = []
        for a, b_, bag, at in sentences:
            shared = bag.keys() & weight.keys()
            # a sentence inside the query window matches itself: the net looks before it
            if b_ > q0 or len(shared) < min_shared or not bag.keys() & rare:
                continue
            idf = {w: math.log(1 + (n_sent - df[w] + 0.5) / (df[w] + 0.5)) for w in shared}
            if rank == "shared":
                score = len(shared & rare) + len(shared) / (len(weight) + 1)
                best = lambda w: (w in rare, idf[w])                  # noqa: E731
            else:
                norm = k1 * (1 - b + b * sum(bag.values()) / max(avg_len, 1e-9))
                part = {w: weight[w] * idf[w] * bag[w] * (k1 + 1) / (bag[w] + norm)
                        for w in shared}
                score = sum(part.values())
                best = part.get
            # the best-matching word anchors a long sentence's rows (`net`)
            anchor = at[max(sorted(shared), key=best)]
            out.append(Nomination(score, len(shared), a, b_, anchor))
        return sorted(out, key=lambda n: (-n.score, -n.shared, n.start))

    def net(self, ids: list[int], p: int, cap: int, *, sentence_rows: int = 80,
            lead_rows: int = 8, **nominate) -> list[int]:
        """Rows (sorted) of the nominated prefix sentences (`nominate`), best first, at most
        `sentence_rows` of each and `cap` in all. A sentence longer than `sentence_rows`
        gives the rows from `lead_rows` before its best-matching word on (a needle stated
        after an unpunctuated stretch shares a sentence with it), else from its start."""
        if cap <= 0:
            return []
        rows: list[int] = []
        for nom in self.nominate(ids, p, **nominate):
            a = nom.start
            if nom.end - nom.start > sentence_rows:
                a = max(nom.start, min(nom.anchor - lead_rows, nom.end - sentence_rows))
            rows += range(a, min(nom.end, a + sentence_rows, a + cap - len(rows)))
            if len(rows) >= cap:
                break
        return sorted(rows)



@dataclass(frozen=True)
class Nomination:
    """A prefix sentence the lexical net nominates: rows [start, end), its score under the
    ranking, how many query words it shares, and the row of its best-matching word."""
    score: float
    shared: int
    start: int
    end: int
    anchor: int
