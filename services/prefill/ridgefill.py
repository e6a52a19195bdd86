"""Exact and RidgeFill prefill of one prompt, composed from the model's stage API.

    rows 0 .. N−1;  prefix = rows < P = N − T;  tail = rows ≥ P
    layers 0..S−1   every row, exactly (the selectors read attention here)
    layers S..L−1   exact rows E = tail ∪ selected prefix rows: the whole layer, attending
                      over the partly filled cache (causal by absolute position)
                    filled rows F = prefix − selected: only this layer's norm and K/V
                      projections (GDN: its input projections) on
                      x̂_l = A_l x_S + b_l (ridge) | x_S (identity) | nothing (none);
                      layer S reads x_S itself, so its filled KV is exact; this work
                      runs in the fill's dtype (the model's, or bf16: fill_layers.py)
                    GDN layers run their state update over E ∪ F in position order

With the fill disabled (S = L or T ≥ N) every row runs every layer through the same calls,
in the same order, as the exact engine's single-chunk prefill, so the KV, GDN states and
logits are bitwise identical (tests/unit/test_ridgefill.py). The settings are in
settings.py, the selectors of exact prefix rows in selectors.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.attention import get_backend
from models.config import FULL_ATTENTION
from models.gdn import GDNInputs, map_inputs
from models.model import CausalLM
from services.common.messages import PromptExport
from services.prefill.fill_layers import FillLayers
from services.prefill.lexicon import Lexicon
from services.prefill.maps import RidgeMaps, context_features
from services.prefill.selectors import AttentionScorer, FillMemo, memo_get, select_rows
from services.prefill.settings import FillError, FillSettings


@dataclass
class PrefillResult:
    k: dict[int, torch.Tensor]                 # FA layer -> [N, KV, D]
    v: dict[int, torch.Tensor]
    valid: dict[int, torch.Tensor]             # FA layer -> [N] bool, keys present (none fill)
    conv: dict[int, torch.Tensor] = field(default_factory=dict)       # GDN -> [conv, Kc−1]
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)  # GDN -> [HV, Dk, Dv]
    prefix_recurrent: dict[int, torch.Tensor] = field(default_factory=dict)  # at row P
    logits: torch.Tensor | None = None         # [n_logits, V] of the last rows
    exact_rows: torch.Tensor | None = None     # positions run through every layer
    num_filled: int = 0

    def export(self) -> PromptExport:
        """The prompt as every engine installs a prefilled one (`Runner.install`): KV of
        the full-attention layers and GDN states in layer order, the last row's logits."""
        for l in self.k:
            if not bool(self.valid[l].all()):
                raise FillError("a no-fill prefill leaves keys missing; it is an eval arm "
                                "and cannot be served")
        fa = sorted(self.k)
        kv = torch.stack([torch.stack([self.k[l], self.v[l]]) for l in fa])  # [F, 2, N, KV, D]
        conv = rec = None
        if self.conv:
            gdn = sorted(self.conv)
            conv = torch.stack([self.conv[l] for l in gdn])
            rec = torch.stack([self.recurrent[l] for l in gdn])
        return PromptExport(kv, conv, rec, None if self.logits is None else self.logits[-1])


class RidgeFill:
    """One model's prefill, exact or filled. `maps` (for `fill="ridge"`) must match the
    split; `unigram` / `token_class` feed the `protected` selector, `lexicon` (from the
    model's tokenizer) the `probe` selector's lexical net. `fill_layers` runs the filled rows'
    norm and projections (in the model's dtype unless it was made for a lower one; the maps
    are then loaded in that dtype too)."""

    def __init__(self, model: CausalLM, maps: RidgeMaps | None = None,
                 unigram: torch.Tensor | None = None, token_class: torch.Tensor | None = None,
                 attention_backend: str | None = None, lexicon: Lexicon | None = None,
                 fill_layers: FillLayers | None = None):
        self.model = model
        self.maps = maps
        self.fill_layers = fill_layers or FillLayers(model)
        self.unigram, self.token_class = unigram, token_class
        self.lexicon = lexicon
        self.attn = get_backend(attention_backend, model.device)
        self.L = model.config.num_hidden_layers
        self.reuse_probe_fills = True     # the probe's filled-row K/V and GDN inputs (below)

    # ---- checks ----------------------------------------------------------------------
    def check(self, s: FillSettings, n: int) -> None:
        s.validate(self.L)
        if not s.enabled(self.L, n):
            return
        if s.fill == "ridge":
            if self.maps is None:
                raise FillError("fill='ridge' needs maps (calibrate, then pass --maps)")
            if self.maps.split != s.split:
                raise FillError(f"the maps were calibrated for split {self.maps.split}, "
                                f"not {s.split}")
        if s.selector == "protected" and (self.unigram is None or self.token_class is None):
            raise FillError("the protected selector needs calibration unigram counts")
        if s.selector == "probe" and s.lexical > 0 and self.lexicon is None:
            raise FillError("the probe's lexical net needs the model's tokenizer; set "
                            "lexical to 0 to rank by attention alone")
        if s.terminal_correction and self.maps is None:
            raise FillError("terminal-state correction needs maps with delta_state offsets")

    # ---- the prefill -----------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, ids: list[int] | torch.Tensor, s: FillSettings, n_logits: int = 1, *,
                record_state_at: int | None = None) -> PrefillResult:
        """ids [N] -> PrefillResult of the last `n_logits` rows (at most T when filling).

        `record_state_at` keeps each GDN layer's state after that many rows (calibrating
        the terminal-state correction).
        """
        m = self.model
        ids = torch.as_tensor(ids, dtype=torch.long, device=m.device)
        n = ids.shape[0]
        self.check(s, n)
        if n_logits < 1:
            raise FillError("n_logits must be ≥ 1")
        enabled = s.enabled(self.L, n)
        split = s.split if enabled else self.L
        p = s.prefix_end(n) if enabled else n       # rows < p may be filled
        if record_state_at is not None and enabled and record_state_at != p:
            raise FillError("a filled prefill records GDN states at its prefix end only")
        n_logits = min(n_logits, n - p) if enabled else min(n_logits, n)
        positions = torch.arange(n, device=m.device)
        res = PrefillResult({}, {}, {})
        scorer = AttentionScorer(m.config, s, n, p) if enabled and s.selector in (
            "attention", "question-blind") else None
        # 1. lower layers, every row
        x, h = m.embed(ids), None
        for l in range(split):
            x, h = self._layer(l, x, h, positions, res, scorer, record_state_at)
        if not enabled:
            res.logits = m.final(x[-n_logits:]).float()
            res.exact_rows = positions
            return res
        # 2. pick the exact prefix rows
        memo = FillMemo() if s.selector == "probe" and self.reuse_probe_fills else None
        selected = select_rows(self, s, ids, p, scorer, x, positions, memo)
        sink = s.sink_rows
        if s.fill == "ridge" and self.maps is not None:
            sink = max(sink, self.maps.sink_rows)     # rows the maps were never fitted on
        if sink:
            selected = torch.unique(torch.cat([positions[:min(sink, p)], selected]))
        exact = torch.cat([selected, positions[p:]])
        keep = torch.ones(p, dtype=torch.bool, device=m.device)
        keep[selected] = False
        filled = positions[:p][keep]
        # 3. upper layers: exact rows run, filled rows get their KV / GDN update from x̂_l
        xe, he = x[exact], (h[exact] if h is not None else None)
        xe, _ = self._upper(s, x, xe, he, exact, filled, p, res,
                            record_state_at=record_state_at, memo=memo)
        res.logits = m.final(xe[-n_logits:]).float()
        res.exact_rows, res.num_filled = exact, int(filled.numel())
        return res

    # ---- pieces ----------------------------------------------------------------------
    def _layer(self, l, x, h, positions, res, scorer, split_at):
        """One exact layer over every row (the lower layers; the whole model if disabled)."""
        m = self.model
        if m.layer(l).kind == FULL_ATTENTION:
            a = m.attn_inputs(l, x, positions, u=h)
            res.k[l], res.v[l] = a.k, a.v
            res.valid[l] = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
            if scorer is not None:
                scorer.add(l, a.q, a.k)
            o, _ = self.attn.attention_lse(a.q[None], a.k[None], a.v[None], causal=True)
            h = m.attn_output(l, x, o[0], a.gate)
        else:
            inp = m.gdn_inputs(l, x)
            o = self._gdn_sequence(l, inp, res, split_at)
            h = m.gdn_output(l, x, o, inp.z)
        return m.mlp(l, h), h

    def _gdn_sequence(self, l, inp: GDNInputs, res, split_at, correction=None, out_rows=None):
        """Run the delta rule over rows in order from a zero state; optionally stop at row
        `split_at` to record (and correct) the state the tail inherits. `out_rows` [T] bool
        marks the rows whose output is used (the rest only advance the state)."""
        lay = self.model.layer(l).linear_attn
        conv0 = torch.zeros(1, inp.mixed.shape[-1], lay.conv1d.weight.shape[-1] - 1,
                            dtype=inp.mixed.dtype, device=inp.mixed.device)
        rec0 = torch.zeros(1, lay.hv, lay.dk, lay.dv, dtype=torch.float32,
                           device=inp.mixed.device)
        if split_at is None and correction is None:
            o, conv, rec = self.model.gdn_mix(l, map_inputs(inp, lambda t: t[None]), conv0,
                                              rec0, out_rows=out_rows)
            res.conv[l], res.recurrent[l] = conv[0], rec[0]
            return o[0]
        outs = []
        head = map_inputs(inp, lambda t: t[None, :split_at])
        tail = map_inputs(inp, lambda t: t[None, split_at:])
        if split_at > 0:
            o, conv0, rec0 = self.model.gdn_mix(
                l, head, conv0, rec0, out_rows=None if out_rows is None else out_rows[:split_at])
            outs.append(o[0])
        res.prefix_recurrent[l] = rec0[0].clone()
        if correction is not None:
            rec0 = rec0 + correction[None]
        if tail.mixed.shape[1]:
            o, conv0, rec0 = self.model.gdn_mix(
                l, tail, conv0, rec0, out_rows=None if out_rows is None else out_rows[split_at:])
            outs.append(o[0])
        res.conv[l], res.recurrent[l] = conv0[0], rec0[0]
        return torch.cat(outs)

    def _features(self, s: FillSettings, x_split: torch.Tensor, rows: torch.Tensor
                  ) -> torch.Tensor:
        """The fill's input for `rows`: their split states, beside their predecessors' when
        a ridge fill's maps read context rows (identity and no fill read x_S alone)."""
        c = self.maps.context_rows if s.fill == "ridge" and self.maps is not None else 0
        return context_features(x_split, rows, c)

    def _fill_input(self, s: FillSettings, l: int, feats: torch.Tensor) -> torch.Tensor:
        """x̂_l from the `_features` of the filled rows (their x_S come first)."""
        if l == s.split or s.fill == "identity":
            return feats[:, :self.model.config.hidden_size]
        a, b = self.maps.get(l)
        return torch.addmm(b, feats.to(a.dtype), a.T)

    def sweep(self, s: FillSettings, x_split: torch.Tensor, rows: torch.Tensor,
              filled: torch.Tensor, p: int, collect, memo: FillMemo | None = None) -> None:
        """The probe's sweep: `rows` run the upper layers exactly over the `filled` rows
        (GDN from an empty state), each attention layer's (l, q, k, mask) going to
        `collect`; the cache it builds is dropped."""
        self._upper(s, x_split, x_split[rows], None, rows, filled, p, PrefillResult({}, {}, {}),
                    collect=collect, memo=memo)

    def _upper(self, s, x_split, xe, he, exact, filled, p, res, *,
               record_state_at=None, collect=None, memo=None):
        """Layers S..L−1. Returns (x of the exact rows after the last layer, h). `memo`: a
        `FillMemo` that the probe's sweep records and the second sweep reads."""
        m = self.model
        n = x_split.shape[0]
        pos_e = exact
        feats_f = self._features(s, x_split, filled)
        tail_rows = exact[exact >= p]                 # the rescale's measuring rows
        q_pos = pos_e[:, None]
        causal = torch.arange(n, device=xe.device)[None, :] <= q_pos          # [E, N]
        for l in range(s.split, self.L):
            if m.layer(l).kind == FULL_ATTENTION:
                a = m.attn_inputs(l, xe, pos_e, u=he)
                k = torch.empty(n, *a.k.shape[1:], dtype=a.k.dtype, device=a.k.device)
                v = torch.empty_like(k)
                valid = torch.ones(n, dtype=torch.bool, device=k.device)
                k[exact], v[exact] = a.k, a.v
                if filled.numel():
                    if s.fill == "none":
                        k[filled], v[filled] = 0, 0
                        valid[filled] = False
                    else:
                        k[filled], v[filled] = self._filled_kv(s, l, x_split, feats_f, a, exact,
                                                               filled, tail_rows, memo)
                res.k[l], res.v[l], res.valid[l] = k, v, valid
                mask = causal & valid[None, :]
                if collect is not None:
                    collect(l, a.q, k, mask)
                o = self._attend(a.q, k, v, mask, pos_e)
                he = m.attn_output(l, xe, o, a.gate)
            else:
                he = self._upper_gdn(s, l, xe, feats_f, exact, filled, p, res, record_state_at,
                                     memo)
            xe = m.mlp(l, he)
        return xe, he

    def _filled_kv(self, s, l, x_split, feats_f, a, exact, filled, tail_rows, memo):
        """Attention layer l's K/V of the `filled` rows ([F, KV, D] each) from x̂_l, with the
        key / value magnitude rescale when asked, measured on the exact `tail_rows` (`a`:
        the exact rows' attention inputs). The splice diagnostic (evals/ridgefill_arms.py)
        overrides it."""
        kf, vf = memo_get(memo, l, filled, lambda: self.fill_layers.key_value(
            l, self._fill_input(s, l, feats_f), filled))
        nv, nk = s.value_rescale, s.key_rescale_rows
        if l > s.split and (nv or nk) and tail_rows.numel():
            # per-KV-head magnitude ratios exact / predicted on the first c tail rows, once
            # per distinct c: {c: (key scale, value scale)}
            scales = {c: self._norm_scales(s, l, x_split, a.k, a.v, exact, tail_rows[:c])
                      for c in {nv, nk} - {0}}
            if nv:
                vf = vf * scales[nv][1][None, :, None]
            if nk:
                kf = kf * scales[nk][0][None, :, None]
        return kf, vf

    def _attend(self, q, k, v, mask, pos, group: int = 256):
        """Exact rows (q [E, H, D], at positions `pos`, ascending) over the layer's cache
        (k, v [N, KV, D]) under the causal `mask` [E, N]. Rows go in groups of `group`, each
        over the keys up to its last row only: selected prefix rows spread over the prompt
        then cost about half the key sweep of the dense [E, N] mask."""
        outs = []
        for g0 in range(0, q.shape[0], group):
            g1 = min(q.shape[0], g0 + group)
            kmax = int(pos[g0:g1].max()) + 1
            o, _ = self.attn.attention_lse(q[None, g0:g1], k[None, :kmax], v[None, :kmax],
                                           mask=mask[None, g0:g1, :kmax])
            outs.append(o[0])
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _upper_gdn(self, s, l, xe, feats_f, exact, filled, p, res, record_state_at, memo=None):
        m = self.model
        inp_e = m.gdn_inputs(l, xe)
        use_filled = bool(filled.numel()) and s.fill != "none"
        rows = torch.cat([exact, filled]) if use_filled else exact
        order = torch.argsort(rows)
        ne = exact.numel()
        dest = torch.empty_like(order)           # sorted position of exact rows, then filled
        dest[order] = torch.arange(order.numel(), device=order.device)
        # the delta rule needs no output gate: the sequence carries none (z = None)
        if use_filled:
            inp_f = memo_get(memo, l, filled, lambda: self.fill_layers.gdn_inputs(
                l, self._fill_input(s, l, feats_f)))
            seq = GDNInputs(*(None if te is None else _interleave(te, tf, exact, filled, dest)
                              for te, tf in zip((inp_e.mixed, None, inp_e.b, inp_e.a),
                                                (inp_f.mixed, None, inp_f.b, inp_f.a))))
        else:
            seq = GDNInputs(inp_e.mixed[order], None, inp_e.b[order], inp_e.a[order])
        sorted_rows = rows[order]
        split_at = int((sorted_rows < p).sum())
        correction = None
        if s.terminal_correction and use_filled and l > s.split:
            delta = self.maps.delta_state(l)
            if delta is not None:
                g = m.layer(l).linear_attn.log_decay(seq.a[:split_at])       # [P', HV]
                # weight of row t in the state at the prefix end: Π_{u>t} decay_u
                w = torch.exp(g.flip(0).cumsum(0).flip(0) - g)
                is_filled = torch.isin(sorted_rows[:split_at], filled)
                rho = w[is_filled].sum(0) / w.sum(0).clamp_min(1e-30)        # [HV]
                correction = rho[:, None, None] * delta
        record = record_state_at is not None or correction is not None
        out_rows = None
        if use_filled:      # filled rows only advance the state: skip their outputs
            out_rows = order < exact.numel()
        o = self._gdn_sequence(l, seq, res, split_at if record else None, correction, out_rows)
        # the exact rows' outputs, in their order
        return m.gdn_output(l, xe, o[dest[:ne]], inp_e.z)

    def _norm_scales(self, s, l, x_split, k_exact_rows, v_exact_rows, exact, rows):
        """Per KV head: mean over `rows` (the first c tail rows) of ‖k_exact‖ / ‖k(x̂)‖ and
        ‖v_exact‖ / ‖v(x̂)‖ -> ([KV], [KV]). Rotary keeps norms, so rotated keys compare."""
        idx = torch.searchsorted(exact, rows)
        k_pred, v_pred = self.fill_layers.key_value(
            l, self._fill_input(s, l, self._features(s, x_split, rows)), rows)

        def ratio(true, pred):
            r = true.float().norm(dim=-1) / pred.float().norm(dim=-1).clamp_min(1e-12)
            return r.mean(0).to(true.dtype)

        return ratio(k_exact_rows[idx], k_pred), ratio(v_exact_rows[idx], v_pred)


def _interleave(te: torch.Tensor, tf: torch.Tensor, exact: torch.Tensor, filled: torch.Tensor,
                dest: torch.Tensor) -> torch.Tensor:
    """Rows of the exact (`te`) and filled (`tf`) sets in sequence order; `dest` holds the
    sorted position of each row of cat([exact, filled])."""
    if bool((exact[0] > filled[-1]).item()) and bool((exact.diff() > 0).all().item()):
        return torch.cat([tf, te])       # no prefix row selected: the filled rows, then exact
    out = te.new_empty((te.shape[0] + tf.shape[0], *te.shape[1:]))
    out[dest[:exact.numel()]] = te
    out[dest[exact.numel():]] = tf
    return out


__all__ = ["PrefillResult", "RidgeFill"]
