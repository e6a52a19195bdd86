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

from collections import Counter
from dataclasses import dataclass

from services.prefill.maps import WORD_START

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

    def net(self, ids: list[int], p: int, cap: int, *, query_tokens: int = 64,
            min_shared: int = 4, max_count: int = 2, sentence_rows: int = 80) -> list[int]:
        """Rows (sorted) of the nominated prefix sentences, at most `cap` of them. `p`: the
        prefix end (rows ≥ p are exact anyway); the query is the whole prompt's last
        `query_tokens` content tokens, and sentences reaching into it are not nominated
        (with a short tail they would share every word with it)."""
        if cap <= 0 or p <= 0:
            return []
        words = self.words(ids)
        content = [i for i, t in enumerate(ids) if 0 <= t < len(self.letters) and self.letters[t]]
        q0 = content[-query_tokens] if len(content) >= query_tokens else (
            content[0] if content else len(ids))
        query = {w for w, first in words if first >= q0}
        counts = Counter(w for w, first in words if first < p)
        rare = {w for w, c in counts.items() if c <= max_count}
        # sentences of the prefix: [start, end) cut after every sentence-ending token
        bounds, start = [], 0
        for i in range(p):
            if 0 <= ids[i] < len(self.ends_sentence) and self.ends_sentence[ids[i]]:
                bounds.append((start, i + 1))
                start = i + 1
        if start < p:
            bounds.append((start, p))
        nominated, j = [], 0
        prefix_words = [(w, first) for w, first in words if first < p]
        for a, b in bounds:
            sentence = set()
            while j < len(prefix_words) and prefix_words[j][1] < b:
                sentence.add(prefix_words[j][0])
                j += 1
            shared = sentence & query
            # a sentence inside the query window matches itself: the net looks before it
            if b <= q0 and len(shared) >= min_shared and sentence & rare:
                nominated.append((-len(shared & rare), -len(shared), a, b))
        rows: list[int] = []
        for _, _, a, b in sorted(nominated):
            rows += range(a, min(b, a + sentence_rows, a + cap - len(rows)))
            if len(rows) >= cap:
                break
        return sorted(rows)
