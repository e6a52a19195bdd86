"""Stop strings (OpenAI's `stop`): where a generated text, fed piece by piece, ends, and which
of it may go out yet.

The text ends at the first stop string to *end* in it (the longest of those ending at the
same character), before that string, or after it with `include`. Found that way, the
answer does not depend on how the text was split into pieces (tokens).

Text that could still be the start of a stop string is held back and goes out once it
cannot be one, so a client never sees the first characters of a stop string that the next
token completes (vLLM holds back the same way). With `include` nothing needs holding: the
text goes out up to the stop string's end either way.

Each stop string is matched by a Knuth–Morris–Pratt automaton whose state is the length of
its longest prefix that the text fed so far ends with; a character costs amortized O(1) per
stop string, and the held text is the last `max(state)` characters:

    fed text   ... released ........ | held |
                                     └ the longest suffix that is a proper prefix of a stop
"""
from __future__ import annotations


class StopStrings:
    """One stream's stop strings. Not thread-safe: one per stream."""

    def __init__(self, stops: list[str], include: bool = False):
        """`include`: the text ends after the stop string rather than before it (vLLM's
        `include_stop_str_in_output`)."""
        self.stops = [s for s in stops if s]
        self.include = include
        self.fail = [_prefix_function(s) for s in self.stops]
        self.state = [0] * len(self.stops)   # per stop: its prefix the text ends with
        self.held = ""                        # fed, not released: may begin a stop string

    def feed(self, text: str, armed: bool = True) -> tuple[str, bool]:
        """`text`: the next piece of final text. Returns (the text that may go out now,
        True) when a stop string ends in `text`, the text then ending at it; else (the text
        that can no longer begin a stop string, False). Unless `armed` (`min_tokens` not
        reached), a stop string ending in `text` does not count, but its characters still
        count toward one that ends in a later piece."""
        if not self.stops:
            return text, False
        buf = self.held + text
        base = len(self.held)
        for i, ch in enumerate(text):
            end = base + i + 1               # buf[:end] has been fed
            hit = None
            for k, stop in enumerate(self.stops):
                q, fail = self.state[k], self.fail[k]
                while q and stop[q] != ch:
                    q = fail[q - 1]
                if stop[q] == ch:
                    q += 1
                if q == len(stop):
                    if armed and (hit is None or len(stop) > len(hit)):
                        hit = stop
                    q = fail[q - 1]
                self.state[k] = q
            if hit is not None:
                self.held = ""
                return buf[:end if self.include else end - len(hit)], True
        keep = 0 if self.include else max(self.state)
        out, self.held = buf[:len(buf) - keep], buf[len(buf) - keep:]
        return out, False

    def flush(self) -> str:
        """The held text, at the end of the stream (it can no longer become a stop)."""
        out, self.held = self.held, ""
        return out


def tag_start(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (and is shorter than it): the
    text a stream holds back until it knows whether the tag follows."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _prefix_function(s: str) -> list[int]:
    """KMP's failure table: `pi[j]` = length of the longest proper prefix of `s[:j + 1]`
    that is also its suffix."""
    pi = [0] * len(s)
    q = 0
    for j in range(1, len(s)):
        while q and s[q] != s[j]:
            q = pi[q - 1]
        if s[q] == s[j]:
            q += 1
        pi[j] = q
    return pi
