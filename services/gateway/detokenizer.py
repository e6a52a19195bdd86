"""Incremental detokenization: each generated token's text for O(1) decode work per token.

Decoding the whole output again at every step costs O(n²) in the output length. As vLLM's
`detokenize_incrementally` does, this decodes only a window of the last few tokens:

    ids   ... | prefix_offset ............ read_offset ............ len(ids)
                └── prefix_text (already sent) ──┘└── new tokens ──┘
                └──────────────────── window_text ──────────────────┘

The new text is `window_text[len(prefix_text):]`. The prefix tokens are decoded along with
the new ones because a token's text may depend on its left neighbour (SentencePiece drops the
leading space of the first token it decodes). A window text that ends in U+FFFD stops inside
a multi-byte character (a byte-level token may hold part of one): its new text stays
`pending` until a later token completes the character. When new text goes out, the offsets
move up: the new tokens become the next prefix, so a window is usually two or three tokens.

Contract: the texts `add` returns, followed by `pending` at the end of the stream, join to
exactly `tokenizer.decode(ids, skip_special_tokens=...)`. That holds for decoders whose text
beyond the prefix window does not depend on earlier tokens (byte-level BPE, SentencePiece);
`clean_up_tokenization_spaces` would break it, since it rewrites text across the cut.

Bytes that never complete a character keep the window growing until the text stops ending in
U+FFFD (random token ids can do that; real text resolves within one character, ≤ 4 bytes).
"""
from __future__ import annotations

_INCOMPLETE = "\ufffd"      # what decoding gives for the bytes of an unfinished character


class IncrementalDetokenizer:
    """One request's output text, token by token. Not thread-safe: one per stream."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # tokens whose text is empty whatever surrounds them: skipped special tokens
        self.skipped = _special_ids(tokenizer) if skip_special_tokens else frozenset()
        self.window: list[int] = []     # ids[prefix_offset:]
        self.read = 0                   # read_offset − prefix_offset
        self.prefix_text = ""           # window[:read] decoded
        self.pending = ""               # text of window[read:] not sent yet (an unfinished
        #                                 character's U+FFFD at its end), or ""

    def add(self, token: int) -> str:
        """Takes the next generated token; returns the text that is now final ("" while a
        character is incomplete)."""
        if token in self.skipped:
            return ""
        self.window.append(token)
        text = self._decode(self.window)
        if len(text) <= len(self.prefix_text) or text.endswith(_INCOMPLETE):
            self.pending = text[len(self.prefix_text):]
            return ""
        new = text[len(self.prefix_text):]
        self.window = self.window[self.read:]
        self.read = len(self.window)
        self.prefix_text = self._decode(self.window)
        self.pending = ""
        return new

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def _special_ids(tokenizer) -> frozenset[int]:
    """Ids that `decode(..., skip_special_tokens=True)` drops: the added tokens marked
    special (HF's `added_tokens_decoder`), else the tokenizer's `all_special_ids`."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if added:
        return frozenset(i for i, tok in added.items() if getattr(tok, "special", False))
    return frozenset(getattr(tokenizer, "all_special_ids", ()))
