"""RidgeFill calibration (research tooling, beside the serving path): streamed statistics,
the closed-form ridge solve, λ on held-out documents, and the maps file the prefill service
loads (`services.prefill.maps`).

For a split S and every upper layer l > S, with X the split-layer states x_S and Y_l the
inputs x_l of layer l (rows = tokens, centred by their means):

    A_l = Y_lᵀX (XᵀX + αI)⁻¹,   b_l = μ_l − A_l μ_S,   α = λ·tr(XᵀX)/d_in

(layer S itself reads x_S exactly and needs no map). Two departures from the paper's plain
map, both recorded in the maps' metadata: the first `sink_rows` rows of every calibration
sequence stay out of the sums (fills keep them exact), and with `context_rows` c > 0 the
input X is [x_S[t], x_S[t−1], …, x_S[t−c]]. Only the float64 sums Σx, Σxxᵀ, Σy_l, Σx y_lᵀ,
Σ‖y_l‖² and the row count are kept, so any amount of text streams through in constant
memory and a new λ re-solves from the saved sums without re-reading.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models.model import CausalLM
from services.prefill.capture import exact_pass
from services.prefill.maps import (WORD_START, MapsError, RidgeMaps, check_split,
                                   context_features, model_fingerprint, upper_layers)
from services.prefill.ridgefill import RidgeFill
from services.prefill.settings import FillSettings

LAMBDA_GRID = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
MAP_DTYPES = ("bf16", "int8")


# ---- statistics -------------------------------------------------------------------------
@dataclass
class Moments:
    """Shifted sums over n rows, float64: with x' = x − cx and y' = y − cy (fixed reference
    vectors taken from the first rows, so the sums never cancel catastrophically),
    Σx', Σx'x'ᵀ and per target layer Σy', Σx'y'ᵀ, Σ‖y'‖². Each chunk's products are formed
    in fp32 (at most max_len rows) and added into the float64 sums. x has `d_in` features
    (default d; more with context rows), every y has d."""
    d: int
    layers: tuple[int, ...]
    n: int = 0
    cx: torch.Tensor = None
    sx: torch.Tensor = None
    sxx: torch.Tensor = None
    cy: dict[int, torch.Tensor] = field(default_factory=dict)
    sy: dict[int, torch.Tensor] = field(default_factory=dict)
    sxy: dict[int, torch.Tensor] = field(default_factory=dict)
    syy: dict[int, float] = field(default_factory=dict)
    d_in: int | None = None

    def __post_init__(self):
        if self.d_in is None:
            self.d_in = self.d
        if self.sx is None:
            z = lambda *shape: torch.zeros(*shape, dtype=torch.float64)  # noqa: E731
            self.cx, self.sx, self.sxx = z(self.d_in), z(self.d_in), z(self.d_in, self.d_in)
            for l in self.layers:
                self.cy[l], self.sy[l], self.sxy[l] = z(self.d), z(self.d), z(self.d_in, self.d)
                self.syy[l] = 0.0

    def add(self, x: torch.Tensor, ys: dict[int, torch.Tensor]) -> None:
        """x [n, d] split states, ys {l: [n, d]} the same rows' inputs of layer l."""
        first = self.n == 0
        if first:
            self.cx = x.double().mean(0).cpu()
        xs = x.float() - self.cx.to(x.device, torch.float32)
        self.n += x.shape[0]
        self.sx += xs.sum(0).double().cpu()
        self.sxx += (xs.T @ xs).double().cpu()
        for l in self.layers:
            if first:
                self.cy[l] = ys[l].double().mean(0).cpu()
            y = ys[l].float() - self.cy[l].to(x.device, torch.float32)
            self.sy[l] += y.sum(0).double().cpu()
            self.sxy[l] += (xs.T @ y).double().cpu()
            self.syy[l] += float((y.double() ** 2).sum())

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.cx": self.cx, f"{prefix}.sx": self.sx, f"{prefix}.sxx": self.sxx,
               f"{prefix}.n": torch.tensor([self.n], dtype=torch.float64)}
        for l in self.layers:
            out[f"{prefix}.cy.{l}"] = self.cy[l]
            out[f"{prefix}.sy.{l}"] = self.sy[l]
            out[f"{prefix}.sxy.{l}"] = self.sxy[l]
            out[f"{prefix}.syy.{l}"] = torch.tensor([self.syy[l]], dtype=torch.float64)
        return out

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], prefix: str, d: int,
                     layers: tuple[int, ...]) -> "Moments":
        return cls(d, layers, int(t[f"{prefix}.n"][0]), t[f"{prefix}.cx"], t[f"{prefix}.sx"],
                   t[f"{prefix}.sxx"], {l: t[f"{prefix}.cy.{l}"] for l in layers},
                   {l: t[f"{prefix}.sy.{l}"] for l in layers},
                   {l: t[f"{prefix}.sxy.{l}"] for l in layers},
                   {l: float(t[f"{prefix}.syy.{l}"][0]) for l in layers},
                   d_in=t[f"{prefix}.cx"].numel())


def solve(m: Moments, lam: float) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The ridge maps {l: (A [d_out, d_in], b [d_out])} in float64."""
    mx = m.sx / m.n                                                     # mean of x'
    cxx = m.sxx - m.n * torch.outer(mx, mx)
    alpha = lam * float(torch.trace(cxx)) / m.d_in
    chol = torch.linalg.cholesky(cxx + alpha * torch.eye(m.d_in, dtype=torch.float64))
    maps = {}
    for l in m.layers:
        my = m.sy[l] / m.n
        cxy = m.sxy[l] - m.n * torch.outer(mx, my)                     # [d_in, d_out]
        a = torch.cholesky_solve(cxy, chol).T                           # [d_out, d_in]
        maps[l] = (a, (m.cy[l] + my) - a @ (m.cx + mx))
    return maps


def heldout_error(maps, h: Moments) -> float:
    """Mean over layers of Σ‖y − (Ax + b)‖² / Σ‖y − ȳ‖² on held-out rows (from sums only):
    in shifted terms the residual is y' − (A x' + b') with b' = b + A cx − cy."""
    errs = []
    for l, (a, b) in maps.items():
        b2 = b + a @ h.cx - h.cy[l]
        sq = (h.syy[l] - 2 * (float(torch.sum(a.T * h.sxy[l])) + float(b2 @ h.sy[l]))
              + float(torch.sum((a @ h.sxx) * a)) + 2 * float(b2 @ (a @ h.sx))
              + h.n * float(b2 @ b2))
        var = h.syy[l] - float(h.sy[l] @ h.sy[l]) / h.n
        errs.append(sq / max(var, 1e-30))
    return sum(errs) / len(errs) if errs else 0.0


def pick_lambda(fit: Moments, held: Moments, grid=LAMBDA_GRID) -> tuple[float, dict[float, float]]:
    scores = {lam: heldout_error(solve(fit, lam), held) for lam in grid}
    return min(scores, key=scores.get), scores


# ---- calibration pass -------------------------------------------------------------------
@dataclass(frozen=True)
class CalibConfig:
    splits: tuple[int, ...]
    max_len: int = 2048
    heldout_docs: int = 5
    map_dtype: str = "bf16"
    lam: float | None = None        # None: pick from LAMBDA_GRID on the held-out documents
    # The first rows of every calibration sequence stay out of the sums, and fills keep them
    # exact. The attention-sink row carries massive activations (SmolLM2-135M: ‖x_0‖ ≈ 22,000
    # against a median of 150 at layer 15): its square outweighs the rest of a 2K-token
    # sequence ten times over, so with it the fit and λ's held-out score serve that one row.
    sink_rows: int = 4
    # Previous rows' split states fed to the map beside the row's own (0: the paper's map,
    # x̂_l = A_l x_S; c: x̂_l = A_l [x_S[t], x_S[t−1], …, x_S[t−c]] + b_l).
    context_rows: int = 0


def calibrate(model: CausalLM, token_docs, cfg: CalibConfig, out_dir: str | Path,
              log=print, token_class: torch.Tensor | None = None) -> dict:
    """Stream `token_docs` (an iterable of token-id lists) through the exact model once,
    accumulating every split's sums; the first `heldout_docs` documents are held out for λ.
    Writes stats, maps and unigram counts to `out_dir`; returns a summary."""
    L, d = model.config.num_hidden_layers, model.config.hidden_size
    for s in cfg.splits:
        check_split(L, s)
    if cfg.map_dtype not in MAP_DTYPES:
        raise MapsError(f"map dtype must be one of {MAP_DTYPES}, got {cfg.map_dtype!r}")
    if not isinstance(cfg.sink_rows, int) or cfg.sink_rows < 0:
        raise MapsError(f"sink_rows must be an integer ≥ 0, got {cfg.sink_rows!r}")
    if not isinstance(cfg.context_rows, int) or not 0 <= cfg.context_rows <= 8:
        raise MapsError(f"context_rows must be an integer in 0..8, got {cfg.context_rows!r}")
    d_in = d * (1 + cfg.context_rows)
    fit = {s: Moments(d, upper_layers(L, s), d_in=d_in) for s in cfg.splits}
    held = {s: Moments(d, upper_layers(L, s), d_in=d_in) for s in cfg.splits}
    unigram = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    tokens, n_docs = 0, 0
    for i, doc in enumerate(token_docs):
        n_docs += 1
        fitting = i >= cfg.heldout_docs
        for start in range(0, len(doc), cfg.max_len):
            ids = torch.tensor(doc[start:start + cfg.max_len], device=model.device)
            if ids.numel() < cfg.sink_rows + 2:
                continue
            xs, _ = exact_pass(model, ids)
            target = fit if fitting else held
            k = cfg.sink_rows                   # each chunk is a sequence from position 0
            rows = torch.arange(k, ids.numel(), device=ids.device)
            for s in cfg.splits:
                target[s].add(context_features(xs[s], rows, cfg.context_rows),
                              {l: xs[l][k:] for l in target[s].layers})
            if fitting:
                unigram += torch.bincount(ids.cpu(), minlength=unigram.numel()).double()
                tokens += ids.numel()
            del xs
        if (i + 1) % 10 == 0:
            log(f"[calibrate] {i + 1} documents, {tokens} fit tokens")
    if fit[cfg.splits[0]].n < 2 or held[cfg.splits[0]].n < 2:
        raise MapsError(f"need more than {cfg.heldout_docs} calibration documents (the first "
                        f"{cfg.heldout_docs} are held out for λ), got {n_docs}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fp = model_fingerprint(model)
    meta = {"fingerprint": fp, "calib_tokens": str(tokens), "max_len": str(cfg.max_len),
            "num_layers": str(L), "hidden_size": str(d), "sink_rows": str(cfg.sink_rows),
            "context_rows": str(cfg.context_rows)}
    summary = {"fingerprint": fp, "calib_tokens": tokens, "splits": {}}
    for s in cfg.splits:
        save_file({**fit[s].tensors("fit"), **held[s].tensors("held")},
                  str(out_dir / f"stats-S{s}.safetensors"), metadata={**meta, "split": str(s)})
        summary["splits"][s] = resolve(out_dir, s, cfg.lam, cfg.map_dtype, fit[s], held[s])
        log(f"[calibrate] split {s}: λ={summary['splits'][s]['lambda']}")
    uni = {"counts": unigram}
    if token_class is not None:
        uni["token_class"] = token_class.to(torch.int8)
    save_file(uni, str(out_dir / "unigram.safetensors"), metadata=meta)
    return summary


def _stats(out_dir: Path, split: int) -> tuple[Moments, Moments, dict]:
    path = out_dir / f"stats-S{split}.safetensors"
    if not path.exists():
        raise MapsError(f"no statistics for split {split} in {out_dir}; run calibrate first")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    t = load_file(str(path))
    L, d = int(meta["num_layers"]), int(meta["hidden_size"])
    layers = upper_layers(L, split)
    return (Moments.from_tensors(t, "fit", d, layers), Moments.from_tensors(t, "held", d, layers),
            meta)


def resolve(out_dir: str | Path, split: int, lam: float | None = None, map_dtype: str = "bf16",
            fit: Moments | None = None, held: Moments | None = None) -> dict:
    """Solve (or re-solve, from the saved sums only) the maps of one split and save them."""
    out_dir = Path(out_dir)
    fit_s, held_s, meta = _stats(out_dir, split)
    fit, held = fit or fit_s, held or held_s
    scores = {}
    if lam is None:
        lam, scores = pick_lambda(fit, held)
    maps = solve(fit, lam)
    tensors = {}
    for l, (a, b) in maps.items():
        tensors.update(encode_matrix(f"A.{l}", a, map_dtype))
        tensors[f"b.{l}"] = b.float()
    path = out_dir / f"maps-S{split}.safetensors"
    old = load_file(str(path)) if path.exists() else {}
    tensors.update({k: v for k, v in old.items() if k.startswith("delta_state.")})
    save_file(tensors, str(path), metadata={**meta, "split": str(split), "lambda": repr(lam),
                                             "map_dtype": map_dtype,
                                             "heldout_error": repr(heldout_error(maps, held))})
    return {"lambda": lam, "heldout_error": heldout_error(maps, held),
            "grid": {repr(k): v for k, v in scores.items()}, "path": str(path)}


def encode_matrix(name: str, a: torch.Tensor, map_dtype: str) -> dict[str, torch.Tensor]:
    if map_dtype == "bf16":
        return {name: a.to(torch.bfloat16)}
    scale = a.abs().amax(dim=1).clamp_min(1e-12) / 127.0                # per output row
    q = torch.round(a / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return {name: q, f"{name.replace('A.', 'A_scale.')}": scale.float()}


def token_classes(tokenizer, vocab_size: int) -> torch.Tensor:
    """[V] int8 class of each token for the `protected` selector: 1 uppercase word start,
    2 uppercase word piece, 3 lowercase word piece, 4 mixed (letters with digits or
    symbols); 0 anything else (lowercase word starts, digits, punctuation, specials)."""
    out = torch.zeros(vocab_size, dtype=torch.int8)
    for i, tok in enumerate(tokenizer.convert_ids_to_tokens(list(range(vocab_size)))):
        if not tok:
            continue
        start = tok.startswith(WORD_START)
        body = tok[1:] if start else tok
        if not body or (tok.startswith("<") and tok.endswith(">")):
            continue
        if body.isalpha():
            if body[0].isupper():
                out[i] = 1 if start else 2
            elif not start:
                out[i] = 3
        elif any(c.isalpha() for c in body) and any(not c.isalpha() for c in body):
            out[i] = 4
    return out


def calibrate_terminal(model: CausalLM, maps_dir: str | Path, split: int, token_docs,
                       tail: int = 64, log=print) -> int:
    """Terminal-state offsets ΔM_l (hybrids): the mean of (exact − filled) GDN state at the
    prefix end over `token_docs` (prompts kept apart from map fitting and evaluation).
    Stored in the split's maps file; returns how many prompts were used."""
    upper_gdn = [l for l in model.config.linear_attention_layers if l > split]
    if not upper_gdn:
        return 0
    maps = RidgeMaps(maps_dir, model, split)
    exact, filled = RidgeFill(model), RidgeFill(model, maps)
    total = {l: 0 for l in upper_gdn}
    count = 0
    for ids in token_docs:
        if len(ids) <= tail + 1:
            continue
        p = len(ids) - tail
        ex = exact.prefill(ids, FillSettings(split=model.config.num_hidden_layers, tail=0),
                           record_state_at=p)
        fi = filled.prefill(ids, FillSettings(split=split, tail=tail), record_state_at=p)
        for l in upper_gdn:
            total[l] = total[l] + (ex.prefix_recurrent[l] - fi.prefix_recurrent[l]).double()
        count += 1
    if count == 0:
        raise MapsError(f"no terminal-calibration prompt is longer than tail + 1 = {tail + 1}")
    path = maps.path
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    for l in upper_gdn:
        tensors[f"delta_state.{l}"] = (total[l] / count).float()
    save_file(tensors, str(path), metadata={**meta, "terminal_prompts": str(count),
                                            "terminal_tail": str(tail)})
    log(f"[calibrate] split {split}: terminal-state offsets from {count} prompts")
    return count
