"""Where the fill's key/value error could still come down: three variants of the upper-layer
map against the calibrated one, scored by the relative error of the keys and values they
give filled rows, layer by layer (in memory; no serving path uses the variants).

    base     x̂_l = A_l f + b_l, then the layer's norm and K/V projections (what RidgeFill
             does; f = [x_S[t], x_S[t−1]], one context row)
    direct   a ridge map from f straight to the layer's [k, v] (before RoPE), skipping the
             norm's nonlinearity
    tail     base, corrected per document from its own last T rows' exact (x_S, x_l) pairs
             (a ridge update toward A_l, μ = 10) — what a request's exact tail could teach
             the map; an upper bound, since a real fill only has the tail's approximate x_l

With --inputs, a second table instead asks whether other per-row inputs would help the
map: a ridge map from each input set straight to the layer's [k, v] (as `direct`), λ the
best of 1e-3, 1e-2, 3e-2 for each set, at the layers given:

    base          [x_S[t], x_S[t−1]]
    +x_{S−1}      and the layer below the split's input (the split layer's own attention
                  and MLP updates apart)
    +x_{S−4}      and an input four layers lower
    +x_0          and the token's embedding
    +mean         and the causal mean of x_S over the document so far (its topic)
    +x_{S−1}[t−1] and the previous row's x_{S−1}

Each document's first 1024 tokens are cut into filled rows (all but the last T = 256) and
tail rows; the first 4 rows (sinks) are left out, as in calibration. Maps are fitted on the
corpus's calibration split, errors summed over held-out documents:
Σ‖k̂ − k‖² / Σ‖k − k̄‖² (and the same for v).

    python -m bench.ridgefill.map_probes --model models/zoo/smollm2-135m --split 15 \\
        [--fit-docs 30 --held-docs 10 --lam 1e-2 --threads 2] [--inputs 18,20,23,26,29]
"""
from __future__ import annotations

import argparse
import sys

import torch

from evals.corpus import documents
from models import load_model
from services.common.tokenizer import load_tokenizer
from services.prefill.capture import exact_pass
from services.prefill.maps import context_features

SINK, LENGTH, TAIL = 4, 1024, 256


def ridge(x: torch.Tensor, y: torch.Tensor, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Centred ridge fit y ≈ A x + b with α = λ·tr(XᵀX)/d_in (the calibration's rule)."""
    mx, my = x.mean(0), y.mean(0)
    xc = x - mx
    c = xc.T @ xc
    c += lam * torch.trace(c) / c.shape[0] * torch.eye(c.shape[0], dtype=c.dtype)
    a = torch.linalg.solve(c, xc.T @ (y - my)).T
    return a, my - a @ mx


def _causal_mean(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(0) / torch.arange(1, x.shape[0] + 1, dtype=x.dtype)[:, None]


def _with_prev(x: torch.Tensor) -> torch.Tensor:
    """x [N, d] -> [x[t], x[t−1]] for every row: the c = 1 map's input (context_features)."""
    return context_features(x, torch.arange(x.shape[0]), 1)


# input sets of the --inputs table: xs (every layer's input over one document) -> [N, d·k]
INPUT_SETS = {
    "base": lambda xs, s: [_with_prev(xs[s])],
    "+x_{S−1}": lambda xs, s: [_with_prev(xs[s]), xs[s - 1]],
    "+x_{S−4}": lambda xs, s: [_with_prev(xs[s]), xs[s - 4]],
    "+x_0": lambda xs, s: [_with_prev(xs[s]), xs[0]],
    "+mean": lambda xs, s: [_with_prev(xs[s]),
                            torch.cat([xs[s][:SINK], _causal_mean(xs[s][SINK:])])],
    "+x_{S−1}[t−1]": lambda xs, s: [_with_prev(xs[s]), _with_prev(xs[s - 1])],
}


def tail_update(a, b, xt, yt, mu: float = 10.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A ridge step from (A, b) toward the tail's pairs: the residual's mean goes into b,
    its regression on the centred tail inputs (Gram form, T×T) into A."""
    r = yt - (xt @ a.T + b)
    xc, mr = xt - xt.mean(0), r.mean(0)
    g = xc @ xc.T
    d = (r - mr).T @ torch.linalg.solve(g + mu * torch.trace(g) / xt.shape[1]
                                        * torch.eye(g.shape[0], dtype=g.dtype), xc)
    return a + d, b + mr - d @ xt.mean(0)


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--split", type=int, required=True)
    ap.add_argument("--fit-docs", type=int, default=30)
    ap.add_argument("--held-docs", type=int, default=10)
    ap.add_argument("--lam", type=float, default=1e-2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--inputs", default="",
                    help="layers for the input-set table (comma-separated) instead of the map table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype=torch.float32), load_tokenizer(args.model)
    s, n_layers = args.split, model.config.num_hidden_layers
    layers = list(range(s + 1, n_layers))

    def kv(l: int, x_l: torch.Tensor) -> torch.Tensor:
        pos = torch.zeros(x_l.shape[0], dtype=torch.long)           # no rotation
        k, v = model.attn_key_value(l, model.norm_in(l, x_l.float()), pos)
        return torch.cat([k.flatten(1), v.flatten(1)], -1).double()

    def capture(doc):
        ids = torch.tensor(tok(doc.text, add_special_tokens=False)["input_ids"][:LENGTH])
        xs, _ = exact_pass(model, ids)
        rows = torch.arange(SINK, ids.numel())
        return (context_features(xs[s], rows, 1).double(),
                {l: xs[l][SINK:].double() for l in layers})

    docs = documents("calib")
    if args.inputs:
        return input_sets(model, tok, kv, docs, args, [int(v) for v in args.inputs.split(",")])
    fit = [capture(d) for d in docs[:args.fit_docs]]
    held = [capture(d) for d in docs[args.fit_docs:args.fit_docs + args.held_docs]]
    x_fit = torch.cat([f[0] for f in fit])
    print(f"{args.model}, split {s}: {x_fit.shape[0]} fit rows, {len(held)} held-out documents, "
          f"λ = {args.lam}, one context row\n")
    print("| layer | key: base | direct | tail | value: base | direct | tail |")
    print("|---|---|---|---|---|---|---|")
    for l in layers:
        y_fit = torch.cat([f[1][l] for f in fit])
        a, b = ridge(x_fit, y_fit, args.lam)
        ad, bd = ridge(x_fit, kv(l, y_fit), args.lam)
        err = {name: torch.zeros(2, dtype=torch.float64) for name in ("base", "direct", "tail")}
        var = torch.zeros(2, dtype=torch.float64)
        for x, ys in held:
            p = x.shape[0] - TAIL
            xf, true = x[:p], kv(l, ys[l][:p])
            at, bt = tail_update(a, b, x[p:], ys[l][p:])
            preds = {"base": kv(l, xf @ a.T + b), "direct": xf @ ad.T + bd,
                     "tail": kv(l, xf @ at.T + bt)}
            h = true.shape[1] // 2
            for name, pred in preds.items():
                e = (pred - true) ** 2
                err[name] += torch.stack([e[:, :h].sum(), e[:, h:].sum()])
            c = (true - true.mean(0)) ** 2
            var += torch.stack([c[:, :h].sum(), c[:, h:].sum()])
        r = {name: e / var for name, e in err.items()}
        print(f"| {l} | {r['base'][0]:.3f} | {r['direct'][0]:.3f} | {r['tail'][0]:.3f} | "
              f"{r['base'][1]:.3f} | {r['direct'][1]:.3f} | {r['tail'][1]:.3f} |", flush=True)
    return 0


def input_sets(model, tok, kv, docs, args, layers: list[int]) -> int:
    s = args.split

    def capture(doc):
        ids = torch.tensor(tok(doc.text, add_special_tokens=False)["input_ids"][:LENGTH])
        xs, _ = exact_pass(model, ids)
        feats = {n: torch.cat(fn(xs, s), -1)[SINK:].double() for n, fn in INPUT_SETS.items()}
        return feats, {l: xs[l][SINK:] for l in layers}

    fit = [capture(d) for d in docs[:args.fit_docs]]
    held = [capture(d) for d in docs[args.fit_docs:args.fit_docs + args.held_docs]]
    print(f"{args.model}, split {s}: {sum(f[1][layers[0]].shape[0] for f in fit)} fit rows, "
          f"{len(held)} held-out documents; relative error of keys / values, ridge map to [k, v]\n")
    print("| inputs | " + " | ".join(f"layer {l} k / v" for l in layers) + " |")
    print("|---|" + "---|" * len(layers))
    targets = {l: torch.cat([kv(l, f[1][l]) for f in fit]) for l in layers}
    held_t = {l: [kv(l, h[1][l]) for h in held] for l in layers}
    for name in INPUT_SETS:
        x_fit = torch.cat([f[0][name] for f in fit])
        cells = []
        for l in layers:
            h = targets[l].shape[1] // 2
            var = torch.stack([sum(((t[:, :h] - t[:, :h].mean(0)) ** 2).sum() for t in held_t[l]),
                               sum(((t[:, h:] - t[:, h:].mean(0)) ** 2).sum() for t in held_t[l])])
            best = None
            for lam in (1e-3, 1e-2, 3e-2):
                a, b = ridge(x_fit, targets[l], lam)
                err = torch.zeros(2, dtype=torch.float64)
                for (feats, _), t in zip(held, held_t[l]):
                    e = (feats[name] @ a.T + b - t) ** 2
                    err += torch.stack([e[:, :h].sum(), e[:, h:].sum()])
                r = err / var
                if best is None or r[0] < best[0]:
                    best = r
            cells.append(f"{best[0]:.3f} / {best[1]:.3f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
