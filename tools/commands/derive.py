"""Derive a checkpoint from SmolLM2 (see models/zoo/README.md): `qknorm` / `hybrid`
calibrate and distil it and store its delta in models/zoo/deltas/; `apply-qknorm` /
`apply-hybrid` rebuild the checkpoint from the parent and the stored delta (what
`make setup` runs)."""
from __future__ import annotations

import argparse
import json
import sys

import torch

from services.cli.argtypes import bounded
from tools.commands import log


def _layer_list(text: str) -> list[int]:
    try:
        layers = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected layer indices like 3,7,11, got {text!r}") \
            from err
    if not layers:
        raise argparse.ArgumentTypeError("no layers given")
    return layers


def _head_list(text: str) -> list[tuple[int, int | None]]:
    """`16:0,19:*` -> [(16, 0), (19, None)]; None stands for every head of the layer."""
    message = f"expected layer:head pairs like 16:0,19:* (* for every head), got {text!r}"
    heads = []
    for part in filter(str.strip, text.split(",")):
        fields = part.strip().split(":")
        if len(fields) != 2:
            raise argparse.ArgumentTypeError(message)
        try:
            heads.append((int(fields[0]), None if fields[1] == "*" else int(fields[1])))
        except ValueError as err:
            raise argparse.ArgumentTypeError(message) from err
    if not heads:
        raise argparse.ArgumentTypeError(message)
    return heads


def build_parser() -> argparse.ArgumentParser:
    der = argparse.ArgumentParser(prog="splitstack derive", description=__doc__)
    der.add_argument("what", choices=["qknorm", "apply-qknorm", "hybrid", "apply-hybrid",
                                      "retrieval-heads", "induction-heads"],
                     help="qknorm / hybrid: calibrate + distil and store the delta; "
                          "apply-*: rebuild the checkpoint from the stored delta; "
                          "retrieval-heads: the parent's copy scores per head and the "
                          "layers a hybrid keeping them would keep; induction-heads: "
                          "induction and previous-token scores per attention layer of "
                          "--parent (any checkpoint, hybrids included), on random tokens "
                          "and on random hex characters repeated, with the top-1 copy "
                          "accuracy")
    der.add_argument("--parent", default="models/zoo/smollm2-135m")
    der.add_argument("--out", help="default: models/zoo/smollm2-{qknorm,hybrid}")
    der.add_argument("--steps", type=int, help="KL distillation steps (default: the recipe's)")
    der.add_argument("--layerwise-steps", type=int, help="hybrid: layer-wise distillation steps")
    der.add_argument("--seq-len", type=int)
    der.add_argument("--rank", type=int, help="LoRA rank")
    der.add_argument("--seed", type=int, default=0)
    der.add_argument("--needle-frac", type=float, default=0.0,
                     help="share of distillation batches that are retrieval items")
    der.add_argument("--fa-phase", type=int, choices=range(4), default=None,
                     help="hybrid: layers i with i %% 4 == phase keep attention (default 3)")
    der.add_argument("--fa-layers", type=_layer_list, default=None,
                     help="hybrid: the layers that keep attention, e.g. 3,7,11,17,18,20,21,23 "
                          "(overrides --fa-phase; `splitstack derive retrieval-heads` "
                          "suggests a set)")
    der.add_argument("--repeated-share", type=float, default=None,
                     help="hybrid: share of retrieval items whose haystack is one "
                          "calibration passage repeated (default 0)")
    der.add_argument("--needle-formats", choices=("classic", "varied"), default=None,
                     help="hybrid: the retrieval items' formats (train family): classic "
                          "(values stated twice; default) or varied (+ serial-code values, "
                          "half stated once)")
    der.add_argument("--delta", help="hybrid: where the delta goes, or (apply-hybrid) the "
                                     "one to rebuild from (default: the zoo's, "
                                     "models/zoo/deltas/smollm2-hybrid.safetensors)")
    der.add_argument("--init-delta", help="hybrid: continue from this stored delta (its "
                     "layout; only the logit stage runs)")
    der.add_argument("--needle-len", type=int, help="hybrid: tokens per retrieval item "
                     "(default: --seq-len)")
    der.add_argument("--answer-weight", type=float,
                     help="hybrid: weight of the answer-token KL on retrieval items (default 1)")
    der.add_argument("--kl-lr", type=float, help="hybrid: learning rate of the logit stage")
    der.add_argument("--gradient-checkpointing", action="store_true", default=None,
                     help="hybrid: recompute each layer and the logits in chunks in the "
                          "backward pass instead of keeping them (the logit stage on 4K-token "
                          "items then fits in a few GB, at about one more forward per step)")
    der.add_argument("--attn-weight", type=float, default=None,
                     help="hybrid: weight of attention transfer in the logit stage, the KL "
                          "from the parent's attention distributions to the child's in the "
                          "layers that keep attention (default 0: off)")
    der.add_argument("--attn-layers", type=_layer_list, default=None,
                     help="hybrid: the layers attention transfer covers (default: every "
                          "layer that keeps attention)")
    der.add_argument("--copy-frac", type=float, default=None,
                     help="hybrid: share of logit-stage batches that are copying items with "
                          "no task format: a random span written twice into calibration "
                          "text, KL on the second copy (default 0)")
    der.add_argument("--items", type=bounded(1), default=16,
                     help="retrieval-heads: train-family items to score")
    der.add_argument("--num-fa", type=bounded(1), default=8,
                     help="retrieval-heads: attention layers to suggest")
    der.add_argument("--num-retrieval", type=bounded(1), default=5,
                     help="retrieval-heads: of those, layers picked by their copying heads")
    der.add_argument("--ablate", type=_head_list, default=[],
                     help="induction-heads: zero these attention heads' outputs first, "
                          "as layer:head pairs (e.g. 16:0,19:*; * for all of a layer's)")
    der.add_argument("--threads", type=bounded(1), default=2)
    return der


def run(argv: list[str]) -> int:
    from tools.zoo import derive, derive_hybrid

    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    out = args.out or f"models/zoo/smollm2-{args.what.removeprefix('apply-')}"
    opts = {k: v for k, v in (("steps", args.steps), ("seq_len", args.seq_len),
                              ("rank", args.rank)) if v is not None}
    if args.what == "qknorm":
        recipe = derive.derive_qknorm(args.parent, out, seed=args.seed,
                                      needle_frac=args.needle_frac, log=log, **opts)
        print(json.dumps(recipe, indent=2))
    elif args.what == "hybrid":
        if args.layerwise_steps is not None:
            opts["layerwise_steps"] = args.layerwise_steps
        if args.fa_phase is not None:
            opts["fa_phase"] = args.fa_phase
        if args.fa_layers is not None:
            opts["fa_layers"] = args.fa_layers
        if args.delta:
            opts["delta_path"] = args.delta
        for key in ("init_delta", "needle_len", "answer_weight", "kl_lr", "repeated_share",
                    "needle_formats", "gradient_checkpointing", "attn_weight", "attn_layers",
                    "copy_frac"):
            if getattr(args, key) is not None:
                opts[key] = getattr(args, key)
        recipe = derive_hybrid.derive_hybrid(args.parent, out, seed=args.seed, log=log,
                                             needle_frac=args.needle_frac, **opts)
        print(json.dumps(recipe, indent=2))
    elif args.what == "retrieval-heads":
        from models.loader import load_model
        from services.common.tokenizer import load_tokenizer
        from tools.zoo import retrieval_heads

        parent, tok = load_model(args.parent), load_tokenizer(args.parent)
        items = retrieval_heads.train_items(tok, args.items, args.seq_len or 1024, args.seed)
        scores, steps = retrieval_heads.copy_scores(parent, items)
        print(f"copy mass per head, {args.items} train-family items, {steps} copy steps")
        for l, row in enumerate(scores.tolist()):
            print(f"layer {l:2d}  max {max(row):.2f}  " + " ".join(f"{v:.2f}" for v in row))
        layers = retrieval_heads.choose_layers(scores, args.num_fa, args.num_retrieval)
        print("suggested: --fa-layers " + ",".join(map(str, layers)))
    elif args.what == "induction-heads":
        from models.loader import load_model
        from services.common.tokenizer import has_tokenizer, load_tokenizer
        from tools.zoo import retrieval_heads

        model = load_model(args.parent)
        # the hex run needs the tokenizer's single-character tokens; a checkpoint without a
        # tokenizer gets the word-piece run only
        hex_ids = retrieval_heads.single_char_ids(load_tokenizer(args.parent)) \
            if has_tokenizer(args.parent) else None
        try:
            with retrieval_heads.ablated(model, args.ablate):
                words = retrieval_heads.induction_scores(model, seed=args.seed)
                hexes = None if hex_ids is None else retrieval_heads.induction_scores(
                    model, seed=args.seed, alphabet=hex_ids)
        except ValueError as err:
            print(f"splitstack derive: error: --ablate: {err}", file=sys.stderr)
            return 2
        ablated = ", ablated " + ",".join(f"{l}:{'*' if h is None else h}"
                                          for l, h in args.ablate) \
            if args.ablate else ""
        runs = "200 random tokens repeated" + ("" if hexes is None else
                                               f", and 200 random hex characters "
                                               f"({retrieval_heads.HEX}) repeated")
        print(f"{args.parent}{ablated}: best head per attention layer, {runs}")
        print(f"top-1 copy accuracy on the second copy: tokens {words.copy:.3f}"
              + ("" if hexes is None else f", hex {hexes.copy:.3f}"))
        for l in range(words.induction.shape[0]):
            if not words.induction[l].isnan().any():
                line = (f"layer {l:2d}  induction {words.induction[l].max():.2f} "
                        f"(head {int(words.induction[l].argmax())})  previous-token "
                        f"{words.previous[l].max():.2f} "
                        f"(head {int(words.previous[l].argmax())})")
                if hexes is not None:
                    line += (f"  hex induction {hexes.induction[l].max():.2f} "
                             f"(head {int(hexes.induction[l].argmax())})")
                print(line)
    elif args.what == "apply-hybrid":
        print(f"rebuilt {derive_hybrid.apply_hybrid(args.parent, out, args.delta)}")
    else:
        print(f"rebuilt {derive.apply_qknorm(args.parent, out)}")
    return 0
