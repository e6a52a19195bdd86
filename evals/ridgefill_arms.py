"""RidgeFill's evaluation arms (seed 000, Table 3 and Table 6).

    nofill                  upper layers write nothing for prefix rows
    identity                x̂_l = x_S (POP's fill)
    ridgefill               x̂_l = A_l x_S + b_l
    {identity,ridgefill}+{attention,question-blind,protected,probe,random}   exact rows
    ridgefill+probe-shared  the probe, its lexical net in the seed's order (not BM25)
    ridgefill+rescale       value rescale from the first 64 tail rows
    ridgefill+rescale-kv    key and value magnitude rescale from the same rows
    ridgefill+rescale-k     key magnitude rescale only (the paper's Llama correction)
    ridgefill+terminal      terminal-state correction (hybrids)
    ridgefill+splice-{k,v,kv}   exact keys / values / both swapped into filled rows
    nofill+longtail         no fill, the tail lengthened to the fill's cost
    ARM@bfloat16            any of these with the filled rows' own work in bf16

Options (from `splitstack eval`): maps_dir, split, tail (default: the eval tail), budget.
Completions prefill through `RidgeFill` and decode greedily over the resulting cache with
the exact model (`greedy_from_prefill`); the served path (engine + prefill service) gives
the same tokens (tests/unit/test_ridgefill.py).
"""
from __future__ import annotations

import torch

from evals.arms import Arm, register_arm
from kernels.attention import get_backend
from models.config import FULL_ATTENTION
from models.gdn import GDNInputs
from models.model import CausalLM
from services.prefill.capture import exact_pass
from services.prefill.fill_layers import FillLayers, parse_fill_dtype
from services.prefill.lexicon import Lexicon
from services.prefill.maps import RidgeMaps, load_unigram
from services.prefill.ridgefill import PrefillResult, RidgeFill
from services.prefill.settings import FillSettings

SPLICES = ("k", "v", "kv")


def map_cost_ratio(model: CausalLM, context_rows: int = 0, split: int | None = None) -> float:
    """Multiply-adds of one filled row in an upper layer (mean over layers `split`..L−1,
    all layers if None) over those of one exact row in a mean layer, attention excluded.

    A filled row costs the map (d·(1 + context_rows) inputs) and its layer's norm plus
    K/V projections; in a Gated DeltaNet layer, its input projection (q, k, v, β, decay)
    and its state update instead. An exact row costs every projection and the
    feed-forward (and a GDN layer's state update and output)."""
    c = model.config
    d, qd, kvd = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    ffn = 3 * d * (c.intermediate_size or c.moe_intermediate_size or d)
    fill_map = d * d * (1 + context_rows)
    fill, exact = [], []
    for l in range(c.num_hidden_layers):
        if l in c.linear_attention_layers:
            hv, state = c.linear_num_value_heads, c.linear_key_head_dim * c.linear_value_head_dim
            proj = d * (c.gdn_conv_dim + 2 * hv)
            fill.append(fill_map + proj + 2 * hv * state)
            exact.append(proj + 2 * d * c.gdn_value_dim + 4 * hv * state + ffn)
        else:
            fill.append(fill_map + 2 * d * kvd)
            exact.append(d * (2 * qd + 2 * kvd) + ffn)
    upper = fill[split or 0:]
    return (sum(upper) / len(upper)) / (sum(exact) / len(exact))


class SplicedFill(RidgeFill):
    """The splice diagnostic: RidgeFill with the exact model's keys (`splice="k"`), values
    ("v") or both ("kv") written over the filled rows' (after any rescale), in both of the
    probe's sweeps too. Shows which of the two carries the fill's error."""

    def __init__(self, *args, splice: str, **kwargs):
        if splice not in SPLICES:
            raise ValueError(f"splice must be one of {SPLICES}, got {splice!r}")
        super().__init__(*args, **kwargs)
        self.splice = splice
        self._exact_kv: dict | None = None       # {l: (k, v)} of the prompt being filled

    @torch.inference_mode()
    def prefill(self, ids, s: FillSettings, n_logits: int = 1, **kwargs) -> PrefillResult:
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.model.device)
        self.check(s, ids.shape[0])
        if s.enabled(self.L, ids.shape[0]):
            self._exact_kv = exact_pass(self.model, ids, keep_inputs=False, keep_kv=True)[1]
        try:
            return super().prefill(ids, s, n_logits, **kwargs)
        finally:
            self._exact_kv = None

    def _filled_kv(self, s, l, x_split, feats_f, a, exact, filled, tail_rows, memo):
        kf, vf = super()._filled_kv(s, l, x_split, feats_f, a, exact, filled, tail_rows, memo)
        k_exact, v_exact = self._exact_kv[l]
        if "k" in self.splice:
            kf = k_exact[filled]
        if "v" in self.splice:
            vf = v_exact[filled]
        return kf, vf


@torch.inference_mode()
def greedy_from_prefill(model: CausalLM, res: PrefillResult, n_prompt: int,
                        max_tokens: int) -> list[int]:
    """Greedy decode over a (possibly filled) prefill, keys absent under no-fill excluded."""
    backend = get_backend(None, model.device)
    total = n_prompt + max_tokens
    k, v, valid = {}, {}, {}
    for l in res.k:
        k[l] = torch.zeros(total, *res.k[l].shape[1:], dtype=res.k[l].dtype)
        v[l] = torch.zeros_like(k[l])
        valid[l] = torch.zeros(total, dtype=torch.bool)
        k[l][:n_prompt], v[l][:n_prompt], valid[l][:n_prompt] = res.k[l], res.v[l], res.valid[l]
    conv = {l: res.conv[l][None].clone() for l in res.conv}
    rec = {l: res.recurrent[l][None].clone() for l in res.recurrent}
    tok = int(res.logits[-1].argmax())
    out = [tok]
    for step in range(max_tokens - 1):
        pos = n_prompt + step
        positions = torch.tensor([pos])
        x, h = model.embed(torch.tensor([tok])), None
        for l, layer in enumerate(model.model.layers):
            if layer.kind == FULL_ATTENTION:
                a = model.attn_inputs(l, x, positions, u=h)
                k[l][pos], v[l][pos], valid[l][pos] = a.k[0], a.v[0], True
                o, _ = backend.attention_lse(a.q[None], k[l][None, :pos + 1],
                                             v[l][None, :pos + 1],
                                             mask=valid[l][None, None, :pos + 1])
                h = model.attn_output(l, x, o[0], a.gate)
            else:
                inp = model.gdn_inputs(l, x)
                o, conv[l], rec[l] = model.gdn_mix(l, GDNInputs(*(t[None] for t in inp)),
                                                   conv[l], rec[l])
                h = model.gdn_output(l, x, o[0], inp.z)
            x = model.mlp(l, h)
        tok = int(model.final(x)[0].argmax())
        out.append(tok)
    return out


class FillArm(Arm):
    """A RidgeFill-family arm; subclasses only fix `base` settings. `fill_dtype` (the arm
    name's `@bfloat16`) runs the filled rows' own work in that dtype."""
    base: dict = {}
    takes_fill_dtype = True

    def __init__(self, model: CausalLM, *, maps_dir=None, split=None, tail=256, budget=0.1,
                 lexicon: Lexicon | None = None, lexical: float | None = None,
                 fill_dtype: str = "model", **options):
        super().__init__(model, **options)
        L = model.config.num_hidden_layers
        split = split or L // 2
        settings = {"split": split, "tail": tail, "budget": budget, **self.base}
        if lexical is not None:
            settings["lexical"] = lexical
        sink, context = RidgeMaps.layout_of(maps_dir, split) if maps_dir is not None else (0, 0)
        # every arm (identity and no fill too) keeps the rows the maps were calibrated
        # without exact, so paired differences compare like rows
        settings.setdefault("sink_rows", sink)
        # no fill + longer tail: the tail is widened per prompt in `_settings`, to the cost
        # of the maps at hand
        self.longtail_ratio = (map_cost_ratio(model, context, split)
                               if settings.pop("longtail", False) else None)
        splice = settings.pop("splice", "")
        self.settings = FillSettings(**settings)
        needs_maps = self.settings.fill == "ridge" or self.settings.terminal_correction
        if maps_dir is None and (needs_maps or self.settings.selector == "protected"):
            raise ValueError(f"arm {self.name!r} needs calibrated maps: pass --maps "
                             f"(splitstack calibrate writes them)")
        layers = FillLayers(model, parse_fill_dtype(fill_dtype))
        maps = RidgeMaps(maps_dir, model, split, dtype=layers.dtype) if needs_maps else None
        unigram = token_class = None
        if self.settings.selector == "protected":
            unigram, token_class = load_unigram(maps_dir, model)
        kwargs = {"lexicon": lexicon, "fill_layers": layers}
        self.fill = (SplicedFill(model, maps, unigram, token_class, splice=splice, **kwargs)
                     if splice else RidgeFill(model, maps, unigram, token_class, **kwargs))

    def _settings(self, n: int) -> FillSettings:
        s = self.settings
        if self.longtail_ratio is not None:   # S(N−T') + L·T' = S(N−T) + L·T + c(L−S)(N−T)
            extra = int(self.longtail_ratio * (n - s.tail))
            s = FillSettings(**{**s.__dict__, "tail": min(n, s.tail + extra)})
        return s

    def tail_logits(self, ids: list[int], tail_len: int) -> torch.Tensor:
        return self.fill.prefill(ids, self._settings(len(ids)), n_logits=tail_len).logits

    def complete(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outs = []
        for ids in prompts:
            res = self.fill.prefill(ids, self._settings(len(ids)))
            outs.append(greedy_from_prefill(self.model, res, len(ids), max_tokens))
        return outs


def _register(name: str, **base) -> None:
    register_arm(name)(type(f"Arm_{name}", (FillArm,), {"base": base}))


_register("nofill", fill="none")
_register("identity", fill="identity")
_register("ridgefill", fill="ridge")
for _sel in ("attention", "question-blind", "protected", "probe", "random"):
    _register(f"ridgefill+{_sel}", fill="ridge", selector=_sel)
    _register(f"identity+{_sel}", fill="identity", selector=_sel)
# the probe with the seed's order of the lexical net's sentences (the default ranks by BM25)
_register("ridgefill+probe-shared", fill="ridge", selector="probe", lexical_rank="shared")
_register("ridgefill+rescale", fill="ridge", value_rescale=64)
_register("ridgefill+rescale-kv", fill="ridge", value_rescale=64, key_rescale=True)
_register("ridgefill+rescale-k", fill="ridge", key_rescale=64)
_register("ridgefill+terminal", fill="ridge", terminal_correction=True)
for _sp in ("k", "v", "kv"):
    _register(f"ridgefill+splice-{_sp}", fill="ridge", splice=_sp)
_register("nofill+longtail", fill="none", longtail=True)
