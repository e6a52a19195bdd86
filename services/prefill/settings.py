"""RidgeFill's per-prompt settings and their validation.

`FillSettings` says how one prompt is prefilled: the split S, the exact tail T, the fill
(ridge maps, identity or none), the selector of exact prefix rows and its budget, and the
corrections (key / value magnitude rescale, terminal-state correction). `validate` runs
before any work, since request fields arrive as untyped JSON.
"""
from __future__ import annotations

from dataclasses import dataclass

FILLS = ("ridge", "identity", "none")
SELECTORS = ("none", "attention", "question-blind", "protected", "probe", "random")
LEXICAL_RANKS = ("bm25", "shared")      # services.prefill.lexicon.RANKS


class FillError(ValueError):
    """Settings the prefill refuses before doing any work."""


@dataclass(frozen=True)
class FillSettings:
    split: int                   # S; S = L disables the fill
    tail: int                    # T exact trailing rows; T ≥ N disables the fill
    fill: str = "ridge"          # ridge | identity (POP) | none (an eval arm: keys left out)
    selector: str = "none"
    budget: float = 0.1          # share of prefix rows the selector computes exactly
    value_rescale: int = 0       # c: tail rows measuring the per-KV-head value scale (0: off)
    key_rescale: int | bool = 0  # c: tail rows measuring a per-KV-head key scale (0: off);
                                 # True: the value_rescale rows (keys and values both)
    terminal_correction: bool = False
    seed: int = 0                # the random selector's seed
    sink_rows: int = 0           # first rows always exact, outside the budget (attention sinks;
                                 # a ridge fill also keeps those its maps were fitted without)
    query_rows: int = 64         # attention / question-blind selectors' query rows
    probe_rows: int = 256        # probe selector's rows
    lexical: float = 0.05        # probe: share of prefix rows reserved within the budget for
                                 # the lexical net's sentences (seed 000's 27B probe: 5%)
    lexical_rank: str = "bm25"   # the net's order: bm25 (recency-weighted query) | shared
                                 # (the seed's: most shared rare words, then shared words)

    def validate(self, num_layers: int) -> None:
        """Every field's type and range (request fields arrive as JSON: a string, null or
        boolean where a number belongs is refused here, not met later as a TypeError)."""
        if not _is_int(self.split) or not 1 <= self.split <= num_layers:
            raise FillError(f"split must be an integer in 1..{num_layers - 1} (or {num_layers} "
                            f"to disable the fill), got {self.split!r}")
        _check_int("tail", self.tail, 0)
        if not isinstance(self.fill, str) or self.fill not in FILLS:
            raise FillError(f"fill must be one of {FILLS}, got {self.fill!r}")
        if not isinstance(self.selector, str) or self.selector not in SELECTORS:
            raise FillError(f"selector must be one of {SELECTORS}, got {self.selector!r}")
        if not _is_share(self.budget):
            raise FillError(f"selector budget is a share of prefix rows in [0, 1], "
                            f"got {self.budget!r}")
        _check_int("value_rescale", self.value_rescale, 0)
        if self.key_rescale is True and not self.value_rescale:
            raise FillError("key_rescale = true uses the value_rescale rows: set value_rescale "
                            "= c > 0, or give key_rescale its own row count")
        if not isinstance(self.key_rescale, bool) and not (
                _is_int(self.key_rescale) and self.key_rescale >= 0):
            raise FillError(f"key_rescale must be an integer ≥ 0 or true, "
                            f"got {self.key_rescale!r}")
        if not isinstance(self.terminal_correction, bool):
            raise FillError(f"terminal_correction must be true or false, "
                            f"got {self.terminal_correction!r}")
        _check_int("seed", self.seed, None)
        _check_int("sink_rows", self.sink_rows, 0)
        _check_int("query_rows", self.query_rows, 1)
        _check_int("probe_rows", self.probe_rows, 1)
        if not _is_share(self.lexical):
            raise FillError(f"lexical is a share of prefix rows in [0, 1], got {self.lexical!r}")
        if not isinstance(self.lexical_rank, str) or self.lexical_rank not in LEXICAL_RANKS:
            raise FillError(f"lexical_rank must be one of {LEXICAL_RANKS}, "
                            f"got {self.lexical_rank!r}")

    @property
    def key_rescale_rows(self) -> int:
        """c of the key magnitude rescale (0: off)."""
        return self.value_rescale if self.key_rescale is True else int(self.key_rescale)

    def enabled(self, num_layers: int, n: int) -> bool:
        return self.split < num_layers and self.tail < n

    def prefix_end(self, n: int) -> int:
        """P: rows < P may be filled (the tail keeps at least the last row exact)."""
        return n - max(1, self.tail)

    def budget_rows(self, p: int) -> int:
        """How many of the P prefix rows the selector computes exactly."""
        return int(round(self.budget * p)) if self.selector != "none" else 0

    def compute_share(self, num_layers: int, n: int) -> float:
        """r = S/L + (1 − S/L)·E/N: the share of exact prefill's layer passes still run, with
        E the rows that run every layer: the tail T, plus a selector's budget of the prefix
        (`protected` may pick fewer). Layer passes only: maps, filled rows' GDN state
        updates and the probe's sweep are not counted."""
        if not self.enabled(num_layers, n):
            return 1.0
        s = self.split / num_layers
        p = self.prefix_end(n)
        return s + (1 - s) * (n - p + self.budget_rows(p)) / n


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_share(v) -> bool:
    """A number in [0, 1] (NaN fails the comparison)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0


def _check_int(name: str, v, low: int | None) -> None:
    if not _is_int(v) or (low is not None and v < low):
        bound = "an integer" if low is None else f"an integer ≥ {low}"
        raise FillError(f"{name} must be {bound}, got {v!r}")
