"""Stop strings (OpenAI's `stop`): where a generated text, fed piece by piece, ends.

Each piece is searched together with the last `longest stop − 1` characters fed before it, so
a stop string split across pieces is found, and a step costs O(piece + longest stop) rather
than O(text). The text before a stop string goes out as it comes; a stop string that starts
in text already sent cuts nothing from it.
"""
from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str], include: bool = False):
        """`include`: the text ends after the stop string rather than before it (vLLM's
        `include_stop_str_in_output`)."""
        self.stops = [s for s in stops if s]
        self.include = include
        self.keep = max(map(len, self.stops), default=1) - 1
        self.tail = ""          # the last `keep` characters fed

    def feed(self, text: str, unfinished: str = "", armed: bool = True) -> tuple[str, bool]:
        """`text`: the next piece of final text; `unfinished`: text after it that may still
        change (an incomplete character's U+FFFD), searched but not kept. Returns (the part
        of `text + unfinished` that is output, True) when the earliest stop string ends in
        them, else (`text`, False). Unless `armed` (`min_tokens` not reached), a stop string
        ending here does not count."""
        if armed and self.stops:
            window = self.tail + text + unfinished
            hits = [(at, s) for s in self.stops
                    if (at := window.find(s, max(0, len(self.tail) - len(s) + 1))) >= 0]
            if hits:
                at, stop = min(hits)
                end = at + (len(stop) if self.include else 0) - len(self.tail)
                return (text + unfinished)[:max(0, end)], True
        if self.keep:
            self.tail = (self.tail + text)[-self.keep:]
        return text, False
