"""The prefill service: per-request exact or RidgeFill prefill, written into the decode side.

Server flags give the defaults (`PrefillConfig`); a request may override them with the
OpenAI extra fields `prefill_mode` and `ridgefill` ({split, tail, selector, budget, ...}).
`resolve` turns both into `FillSettings` (or None for the engine's own exact prefill) and
checks them against the prompt before any work starts; `prefill` runs it and returns the
KV, GDN states and logits that the engine (or the attention service) stores.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from models.model import CausalLM
from services.common.messages import PREFILL_MODES
from services.prefill.fill_layers import FILL_DTYPES, FillLayers, parse_fill_dtype
from services.prefill.lexicon import Lexicon
from services.prefill.maps import MapsError, RidgeMaps, load_unigram
from services.prefill.ridgefill import PrefillResult, RidgeFill
from services.prefill.settings import FillError, FillSettings

OVERRIDABLE = ("split", "tail", "fill", "selector", "budget", "value_rescale", "key_rescale",
               "terminal_correction", "seed", "sink_rows", "lexical", "lexical_rank")


@dataclass(frozen=True)
class PrefillConfig:
    mode: str = "exact"
    maps_dir: str | None = None
    resident: bool = True            # maps in memory, or streamed one layer at a time
    split: int | None = None         # default: half depth
    tail: int = 256
    selector: str = "none"
    budget: float = 0.1
    value_rescale: int = 0
    key_rescale: int = 0
    terminal_correction: bool = False
    lexical: float = 0.05            # the probe's lexical-net share (needs the tokenizer)
    lexical_rank: str = "bm25"       # the net's order (settings.LEXICAL_RANKS)
    fill_dtype: str = "model"        # filled rows' map and projections: model | bfloat16

    def __post_init__(self):
        if self.mode not in PREFILL_MODES:
            raise FillError(f"prefill mode must be one of {PREFILL_MODES}, got {self.mode!r}")
        if self.fill_dtype not in FILL_DTYPES:
            raise FillError(f"fill dtype must be one of {sorted(FILL_DTYPES)}, "
                            f"got {self.fill_dtype!r}")


class PrefillService:
    def __init__(self, model: CausalLM, config: PrefillConfig = PrefillConfig(), metrics=None,
                 lexicon: Lexicon | None = None):
        self.model = model
        self.lexicon = lexicon              # the probe's lexical net (from the tokenizer)
        self.config = config
        self.metrics = metrics
        self.L = model.config.num_hidden_layers
        self._maps: dict[int, RidgeMaps] = {}
        self._lock = threading.Lock()
        self.fill_layers = FillLayers(model, parse_fill_dtype(config.fill_dtype))
        self.unigram = self.token_class = None
        if config.maps_dir:
            if not Path(config.maps_dir).is_dir():
                raise MapsError(f"maps directory {config.maps_dir} does not exist")
            if (Path(config.maps_dir) / "unigram.safetensors").exists():
                self.unigram, self.token_class = load_unigram(config.maps_dir, model)
        self.default = FillSettings(split=config.split or self.L // 2, tail=config.tail,
                                    selector=config.selector, budget=config.budget,
                                    value_rescale=config.value_rescale,
                                    key_rescale=config.key_rescale,
                                    terminal_correction=config.terminal_correction,
                                    lexical=config.lexical,
                                    lexical_rank=config.lexical_rank)
        # fail at startup, not on the first request: the defaults serve every request that
        # asks for RidgeFill, also when exact is the server's default mode
        if config.mode == "ridgefill" or config.maps_dir:
            self.default.validate(self.L)
            self.maps(self.default.split)

    def maps(self, split: int) -> RidgeMaps | None:
        if not self.config.maps_dir:
            return None
        with self._lock:
            if split not in self._maps:
                self._maps[split] = RidgeMaps(self.config.maps_dir, self.model, split,
                                              resident=self.config.resident,
                                              dtype=self.fill_layers.dtype)
            return self._maps[split]

    def resolve(self, mode: str | None, overrides: dict | None, n: int) -> FillSettings | None:
        """Request fields (a `PrefillRequest`'s, whose mode is one of PREFILL_MODES) ->
        settings (None: exact). Raises FillError / MapsError."""
        mode = mode or self.config.mode
        if mode == "exact":
            if overrides:
                raise FillError("ridgefill settings given with prefill_mode 'exact'")
            return None
        if overrides is not None and not isinstance(overrides, dict):
            raise FillError("ridgefill must be an object of settings")
        overrides = dict(overrides or {})
        unknown = set(overrides) - set(OVERRIDABLE)
        if unknown:
            raise FillError(f"unknown ridgefill settings {sorted(unknown)}; "
                            f"allowed: {list(OVERRIDABLE)}")
        s = dataclasses.replace(self.default, **overrides)
        if s.fill == "none":
            raise FillError("fill 'none' leaves keys missing; it is an evaluation arm only")
        self.check(s, n)
        return s

    def check(self, s: FillSettings, n: int) -> None:
        s.validate(self.L)
        if s.enabled(self.L, n) and (s.fill == "ridge" or s.terminal_correction):
            if self.maps(s.split) is None:
                raise FillError("RidgeFill needs calibrated maps; start the server with --maps")
        self._fill(s).check(s, n)

    def _fill(self, s: FillSettings) -> RidgeFill:
        maps = self.maps(s.split) if s.enabled(self.L, 1 << 30) else None
        return RidgeFill(self.model, maps, self.unigram, self.token_class,
                         lexicon=self.lexicon, fill_layers=self.fill_layers)

    def prefill(self, ids: list[int], s: FillSettings, n_logits: int = 1) -> PrefillResult:
        start = time.perf_counter()
        res = self._fill(s).prefill(ids, s, n_logits)
        if self.metrics is not None:
            self.metrics.observe_prefill(len(ids), res.num_filled, time.perf_counter() - start)
        return res

