"""OpenAI `logprobs` objects from the engine's per-token (token, log-prob, alternatives).

Every generated token gets one entry, in order, as `usage.completion_tokens` counts them: the
end-of-turn token and the tokens of a stop string included (vLLM does the same). Log-probs are
those of the model distribution, before temperature and top-k / top-p.

- completions (`logprobs: k`): the legacy object, `tokens`, `token_logprobs`, `top_logprobs`
  (the k most likely tokens and the sampled one, so up to k + 1 per position) and
  `text_offset` (each token's start in the completion text);
- chat (`logprobs: true`, `top_logprobs: k`): `content`, one object per token with its
  `bytes` and the k most likely alternatives.
"""
from __future__ import annotations

from kernels.sampling import TokenLogprob

# JSON has no -inf: a token the model cannot produce is reported at vLLM's floor
_FLOOR = -9999.0


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE (GPT-2) spells each byte as one printable character: bytes that are
    printable Latin-1 stand for themselves, the other 68 are shifted to 256 and up. Returns
    the inverse, character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


class TokenText:
    """A tokenizer's text and bytes of single tokens, cached.

    A token of a byte-level vocabulary may hold part of a multi-byte character: its text is
    then U+FFFD, but its `bytes` are the token's own, so a client can join the bytes of
    consecutive tokens into the character (what OpenAI's `bytes` field is for)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        byte_level = backend is not None and "ByteLevel" in repr(backend.decoder)
        self.alphabet = _byte_level_alphabet() if byte_level else None
        self.added = set(tokenizer.get_added_vocab().values())
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token: int) -> str:
        if token not in self._text:
            self._text[token] = self.tokenizer.decode([token])    # special tokens spelled out
        return self._text[token]

    def bytes(self, token: int) -> list[int]:
        if token not in self._bytes:
            piece = None
            if self.alphabet is not None and token not in self.added:
                piece = self.tokenizer.convert_ids_to_tokens(token)
            if piece is not None and all(c in self.alphabet for c in piece):
                self._bytes[token] = [self.alphabet[c] for c in piece]
            else:
                self._bytes[token] = list(self.text(token).encode("utf-8"))
        return self._bytes[token]


def _lp(value: float) -> float:
    return max(float(value), _FLOOR)


def completion_logprobs(words: TokenText, entries: list[TokenLogprob],
                        offset: int = 0) -> tuple[dict, int]:
    """The legacy completions object for `entries`, whose first token starts at `offset` of
    the text; also returns the offset after the last token (for the next chunk). With
    `echo` the prompt's tokens come first, the very first with null log-probs."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        text = words.text(e.token)
        top = None
        if e.logprob is not None:
            top = {words.text(t): _lp(lp) for t, lp in e.top}
            top.setdefault(text, _lp(e.logprob))      # the chosen token is always listed
        out["tokens"].append(text)
        out["token_logprobs"].append(None if e.logprob is None else _lp(e.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset


def chat_logprobs(words: TokenText, entries: list[TokenLogprob]) -> dict:
    def item(token: int, logprob: float) -> dict:
        return {"token": words.text(token), "logprob": _lp(logprob),
                "bytes": words.bytes(token)}

    return {"content": [{**item(e.token, e.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries],
            "refusal": None}
