"""Why RidgeFill's filled-region retrieval holds or fails: per held-out item, where the
needle sits in the probe's two rankings and where the question's attention goes.

For each family and length, items from `evals.heldout.families` (formats nothing upstream
calibrates on) run through:

    exact       every row through every layer (the same `_upper` code, all prefix rows
                selected), the reference
    VARIANT     RidgeFill with the probe selector and the settings given (`--variant`)

and for each item the script records:

    retrieved       the greedy completion contains the value
    lex             the needle sentence's place among the lexical net's nominated
                    sentences (0 = first; "-" = not nominated) and whether its rows fit the
                    net's share of the budget
    probe rank      the best rank of the needle's rows in the probe's attention ranking
                    (0 = most attended of the P prefix rows)
    in exact rows   share of the needle's rows the selector computed exactly
    mass            per upper attention layer, the last prompt row's attention (mean over
                    heads) on filled rows and on the needle's rows; printed as the mean over
                    layers and at the layer where exact puts the most mass on the needle

    python -m bench.ridgefill.selection --model models/zoo/smollm2-135m --maps MAPS \\
        --split 15 --lengths 2048,4096 --families passkey,niah_single_2 --n-items 4 \\
        [--variant probe] [--variant name:lexical=0.1,budget=0.1] [--threads 2]

With --net-only no model runs: for many items it counts those whose value (its rows and
the two before them, in the pass key's first or second statement) the lexical net alone
keeps exact, per family and length, under each of its orders (`shared`: the seed's; `bm25`) and shares of the prefix
(seconds for hundreds of items):

    python -m bench.ridgefill.selection --model models/zoo/smollm2-135m --net-only \\
        --lengths 1024,2048,4096,8192 --n-items 12 --seed 1

Nothing is asserted; the figures say which ranking dropped the needle.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from evals.heldout.families import FAMILIES, make_family_items
from evals.ridgefill_arms import greedy_from_prefill
from models import load_model
from models.config import FULL_ATTENTION
from services.common.tokenizer import load_tokenizer
from services.prefill import selectors
from services.prefill.lexicon import Lexicon
from services.prefill.maps import RidgeMaps
from services.prefill.ridgefill import RidgeFill
from services.prefill.settings import FillSettings


class TracedFill(RidgeFill):
    """RidgeFill that records, per upper attention layer, the last prompt row's attention
    over every key (mean over heads), and the probe's attention ranking."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.attn_rows: dict[int, torch.Tensor] = {}
        self.probe: torch.Tensor | None = None

    def _upper(self, s, x_split, xe, he, exact, filled, p, res, *, record_state_at=None,
               collect=None, memo=None):
        if collect is None:                         # the fill's own pass, not the probe's
            def collect(l, q, k, mask):
                h, kvh, d = q.shape[1], k.shape[1], q.shape[2]
                qf = q[-1].float().view(kvh, h // kvh, d)
                sc = torch.einsum("kgd,nkd->kgn", qf, k.float()) * d ** -0.5
                sc = sc.masked_fill(~mask[-1][None, None], float("-inf"))
                self.attn_rows[l] = torch.softmax(sc, -1).mean(dim=(0, 1))
        return super()._upper(s, x_split, xe, he, exact, filled, p, res,
                              record_state_at=record_state_at, collect=collect, memo=memo)


def needle_rows(tokenizer, ids: list[int], start: int, value: str) -> range:
    """Rows from the needle's first token to the end of its value's first statement."""
    for k in range(1, 160):
        if value in tokenizer.decode(ids[start:start + k]):
            return range(start, start + k)
    raise ValueError("the value does not follow the needle position")


def value_rows(tokenizer, ids: list[int], rows: range, value: str, before: int = 2) -> range:
    """The rows of `rows` that state `value` (its shortest suffix that does), and `before`
    rows ahead of them."""
    start = rows.stop - 1
    while start > rows.start and value not in tokenizer.decode(ids[start:rows.stop]):
        start -= 1
    return range(max(rows.start, start - before), rows.stop)


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, body = text.partition(":")
    opts = {}
    for kv in filter(None, body.split(",")):
        key, _, val = kv.partition("=")
        kind = type(getattr(FillSettings, key, 0.0))
        opts[key] = val if kind is str else kind(float(val))
    return name, opts


def run_item(fill: TracedFill, tokenizer, item, s: FillSettings, rows: range, answer_tokens,
             reference: dict | None = None):
    ids = item.prompt_ids
    n = len(ids)
    captured = {}
    orig = selectors.probe_scores

    def probe(*a, **k):
        captured["scores"] = out = orig(*a, **k)
        return out

    selectors.probe_scores = probe
    try:
        fill.attn_rows = {}
        res = fill.prefill(ids, s)
    finally:
        selectors.probe_scores = orig
    out = greedy_from_prefill(fill.model, res, n, answer_tokens)
    got = item.score(tokenizer.decode(out, skip_special_tokens=True))
    p = s.prefix_end(n)
    exact = torch.zeros(n, dtype=torch.bool)
    exact[res.exact_rows] = True
    needle = torch.tensor(list(rows))
    filled = ~exact[:p]
    rec = {"retrieved": got, "in_exact": float(exact[needle].float().mean()),
           "filled_rows": int(res.num_filled),
           "mass_filled": {l: float(a[:p][filled].sum()) for l, a in fill.attn_rows.items()},
           "mass_needle": {l: float(a[needle].sum()) for l, a in fill.attn_rows.items()}}
    if "scores" in captured:
        sc = captured["scores"]
        order = torch.argsort(sc, descending=True)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel())
        rec["probe_rank"] = int(rank[needle[needle < p]].min()) if (needle < p).any() else -1
    if reference is not None:       # exact attention on the rows this variant filled
        rec["exact_mass_filled"] = {l: float(a[:p][filled].sum()) for l, a in reference.items()}
    return rec, dict(fill.attn_rows)


def lexical_place(lexicon: Lexicon, ids, p, rows: range, cap: int, **net) -> dict:
    noms = lexicon.nominate(ids, p, **{k: v for k, v in net.items() if k != "sentence_rows"})
    used = 0
    for i, (rare, shared, a, b) in enumerate(noms):
        if a <= rows.start < b or a < rows.stop <= b:
            return {"place": i, "of": len(noms), "rows_before": used, "cap": cap,
                    "fits": used + min(b - a, net.get("sentence_rows", 80)) <= cap,
                    "rare": rare, "shared": shared}
        used += min(b - a, net.get("sentence_rows", 80))
    return {"place": None, "of": len(noms), "rows_before": used, "cap": cap, "fits": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--maps", help="RidgeFill maps (not needed with --net-only)")
    ap.add_argument("--split", type=int, default=15)
    ap.add_argument("--tail", type=int, default=256)
    ap.add_argument("--lengths", default="2048")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--n-items", type=int, default=4)
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME[:key=value,...] FillSettings over the probe's defaults")
    ap.add_argument("--no-exact", action="store_true", help="skip the exact reference")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write every item's record here")
    ap.add_argument("--seed", type=int, default=0, help="the items' seed")
    ap.add_argument("--net-only", action="store_true",
                    help="count the needles the lexical net alone covers (no model runs)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.net_only:
        net_coverage(args)
        return
    if not args.maps:
        ap.error("--maps is required unless --net-only")

    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype=torch.float32)
    maps = RidgeMaps(args.maps, model, args.split)
    lexicon = Lexicon.from_tokenizer(tokenizer, model.config.vocab_size)
    fill = TracedFill(model, maps, lexicon=lexicon)
    base = FillSettings(split=args.split, tail=args.tail, selector="probe", budget=0.1,
                        sink_rows=maps.sink_rows)
    variants = [parse_variant(v) for v in (args.variant or ["probe"])]
    if not args.no_exact:
        variants.insert(0, ("exact", {"selector": "random", "budget": 1.0}))
    fa = [l for l in range(args.split, model.config.num_hidden_layers)
          if model.layer(l).kind == FULL_ATTENTION]
    records = []
    print(f"model {args.model}, maps {args.maps}, split {args.split}, tail {args.tail}; "
          f"upper attention layers {fa[0]}..{fa[-1]}")
    for length in map(int, args.lengths.split(",")):
        for fam in args.families.split(","):
            items = make_family_items(fam, tokenizer, length, args.n_items, args.seed)
            for j, item in enumerate(items):
                rows = needle_rows(tokenizer, item.prompt_ids, item.needle_positions[0],
                                   item.answers[0])
                p = base.prefix_end(length)
                if rows.start >= p:
                    continue                        # needle in the exact tail: not filled
                line = {"family": fam, "length": length, "item": j, "depth": item.depth,
                        "needle": [rows.start, rows.stop]}
                reference = None
                for name, opts in variants:
                    s = replace(base, **opts)
                    t0 = time.perf_counter()
                    rec, attn = run_item(fill, tokenizer, item, s, rows,
                                         FAMILIES[fam].answer_tokens, reference)
                    if name == "exact":
                        reference = attn
                    rec["seconds"] = time.perf_counter() - t0
                    if s.selector == "probe" and s.lexical > 0:
                        cap = min(s.budget_rows(p), int(round(s.lexical * p)))
                        rec["lex"] = lexical_place(lexicon, item.prompt_ids, p, rows, cap)
                    line[name] = rec
                records.append(line)
                print(summary_line(line, [v[0] for v in variants]), flush=True)
    print()
    print(table(records, [v[0] for v in variants]))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))


NET_ORDERS = (("shared", 0.05), ("bm25", 0.05), ("bm25", 0.10))


def net_coverage(args) -> None:
    """Needles the lexical net alone keeps exact (rank, share of the prefix), per family
    and length, with the tail as in the fill."""
    from models.config import ModelConfig

    tokenizer = load_tokenizer(args.model)
    lexicon = Lexicon.from_tokenizer(tokenizer, ModelConfig.from_pretrained(args.model).vocab_size)
    names = [f"{rank} {share:.0%}" for rank, share in NET_ORDERS]
    lines = ["| family | length | needles in the prefix | " + " | ".join(names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    totals, count = [0] * len(NET_ORDERS), 0
    for length in map(int, args.lengths.split(",")):
        for fam in args.families.split(","):
            hits, n = [0] * len(NET_ORDERS), 0
            for item in make_family_items(fam, tokenizer, length, args.n_items, args.seed):
                ids, pos = item.prompt_ids, item.needle_positions[0]
                p = len(ids) - args.tail
                rows = needle_rows(tokenizer, ids, pos, item.answers[0])
                if rows.stop > p:
                    continue                   # the value sits in the exact tail
                n += 1
                # the value's rows and the two before them ("is:"), in either statement of
                # the pass key
                spans = [value_rows(tokenizer, ids, rows, item.answers[0])]
                if fam.startswith("passkey"):
                    again = needle_rows(tokenizer, ids, rows.stop, item.answers[0])
                    spans.append(value_rows(tokenizer, ids, again, item.answers[0]))
                for i, (rank, share) in enumerate(NET_ORDERS):
                    kept = set(lexicon.net(ids, p, int(round(share * p)), rank=rank))
                    hits[i] += any(set(span) <= kept for span in spans if span.stop <= p)
            count += n
            totals = [a + b for a, b in zip(totals, hits)]
            lines.append(f"| {fam} | {length} | {n} | " + " | ".join(
                f"{h}/{n}" for h in hits) + " |")
    lines.append(f"| all | | {count} | " + " | ".join(
        f"**{t}/{count}** ({t / max(1, count):.0%})" for t in totals) + " |")
    print(f"items: seed {args.seed}, {args.n_items} per family and length; tail {args.tail}")
    print("\n".join(lines))


def summary_line(line: dict, names: list[str]) -> str:
    parts = [f"{line['family']:>13} {line['length']:>5} d={line['depth']:.2f}"]
    ref = line.get("exact")
    peak = max(ref["mass_needle"], key=ref["mass_needle"].get) if ref else None
    for name in names:
        r = line[name]
        lex = r.get("lex")
        lex_s = ("" if lex is None else f" lex={lex['place']}/{lex['of']}"
                 f"{'+' if lex['fits'] else '-'}")
        pr = f" rank={r['probe_rank']}" if "probe_rank" in r else ""
        mf = statistics.mean(r["mass_filled"].values())
        ef = (f"/{statistics.mean(r['exact_mass_filled'].values()):.2f}"
              if "exact_mass_filled" in r else "")
        mn = r["mass_needle"][peak] if peak is not None else max(r["mass_needle"].values())
        parts.append(f"{name}: {'OK ' if r['retrieved'] else 'miss'}{lex_s}{pr} "
                     f"ex={r['in_exact']:.2f} filled={mf:.2f}{ef} needle@{peak}={mn:.3f}")
    return " | ".join(parts)


def table(records: list[dict], names: list[str]) -> str:
    """Retrieval per (family, length) and arm, with the needle's mean rank and exact share."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in records:
        groups.setdefault((r["family"], r["length"]), []).append(r)
    head = "| family | length | items | " + " | ".join(names) + " |"
    lines = [head, "|---|---|---|" + "---|" * len(names)]
    for (fam, length), recs in groups.items():
        cells = []
        for name in names:
            ok = sum(r[name]["retrieved"] for r in recs)
            ex = statistics.mean(r[name]["in_exact"] for r in recs)
            cells.append(f"{ok}/{len(recs)} (needle exact {ex:.0%})")
        lines.append(f"| {fam} | {length} | {len(recs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
