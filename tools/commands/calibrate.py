"""Fit RidgeFill maps: one streamed pass of the exact model over calibration text
accumulates each upper layer's ridge statistics, which are solved per split (and re-solved
for a new λ with --resolve, reading no text)."""
from __future__ import annotations

import argparse
import json
import time

import torch

from services.cli.argtypes import DTYPES, bounded, int_list
from tools.commands import log


def build_parser() -> argparse.ArgumentParser:
    cal = argparse.ArgumentParser(prog="splitstack calibrate", description=__doc__)
    cal.add_argument("--model", help="Hugging Face model directory")
    cal.add_argument("--splits", type=int_list, required=True,
                     help="comma-separated split layers, e.g. 4,6")
    cal.add_argument("--data", nargs="*", help="text files, one document each (default: the "
                                               "corpus's calibration split)")
    cal.add_argument("--max-docs", type=int, default=60, help="corpus documents to read")
    cal.add_argument("--max-len", type=int, default=2048, help="rows per forward pass")
    cal.add_argument("--sink-rows", type=int, default=4,
                     help="first rows of each sequence left out of the fit (attention sinks, "
                          "with massive activations); fills keep them exact")
    cal.add_argument("--context-rows", type=int, default=0,
                     help="previous rows' split states the map also reads (0: x_S of the row "
                          "alone, the paper's map; 1: and of the row before)")
    cal.add_argument("--heldout-docs", type=int, default=5,
                     help="first documents held out to pick λ")
    cal.add_argument("--lambda", dest="lam", type=float, default=None,
                     help="ridge λ (default: picked on the held-out documents)")
    cal.add_argument("--map-dtype", choices=["bf16", "int8"], default="bf16")
    cal.add_argument("--resolve", action="store_true",
                     help="re-solve saved statistics in --out for a new λ (no data read)")
    cal.add_argument("--terminal-docs", type=int, default=8,
                     help="hybrids: prompts (apart from the map data) for ΔM")
    cal.add_argument("--terminal-tail", type=int, default=256)
    cal.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    cal.add_argument("--threads", type=bounded(1), default=2)
    cal.add_argument("--out", required=True, help="maps directory")
    return cal


def calibration_docs(args: argparse.Namespace, tokenizer):
    """Token lists of the calibration text: --data files (one document each) or the
    corpus's calibration split. Yields lazily, so nothing but one document is held."""
    if args.data:
        from pathlib import Path
        for path in args.data:
            yield tokenizer(Path(path).read_text(encoding="utf-8", errors="replace"),
                            add_special_tokens=False)["input_ids"]
        return
    from evals.corpus import documents
    for doc in documents("calib")[:args.max_docs]:
        yield tokenizer(doc.text, add_special_tokens=False)["input_ids"]


def run(argv: list[str]) -> int:
    from services.prefill import maps as maps_mod
    from tools import calibration

    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    splits = args.splits
    if args.resolve:      # new λ from the saved sums; reads no text and no model
        for s in splits:
            info = calibration.resolve(args.out, s, args.lam, args.map_dtype)
            print(json.dumps({"split": s, **info}))
        return 0
    from models import load_model
    from services.common.tokenizer import load_tokenizer

    if not args.model:
        raise ValueError("--model is required (unless --resolve)")
    model = load_model(args.model, dtype=DTYPES[args.dtype])
    tokenizer = load_tokenizer(args.model)
    cfg = calibration.CalibConfig(splits=splits, max_len=args.max_len,
                               heldout_docs=args.heldout_docs, map_dtype=args.map_dtype,
                               lam=args.lam, sink_rows=args.sink_rows,
                               context_rows=args.context_rows)
    for s in splits:
        maps_mod.check_split(model.config.num_hidden_layers, s)
    start = time.perf_counter()
    docs = calibration_docs(args, tokenizer)
    terminal = []
    if model.config.is_hybrid and args.terminal_docs and not args.data:
        from evals.corpus import documents
        held = documents("calib")[args.max_docs:args.max_docs + args.terminal_docs]
        terminal = [tokenizer(d.text, add_special_tokens=False)["input_ids"][:args.max_len]
                    for d in held]
    summary = calibration.calibrate(model, docs, cfg, args.out, log=log,
                                 token_class=calibration.token_classes(
                                     tokenizer, model.config.vocab_size))
    for s in splits:
        if terminal:
            calibration.calibrate_terminal(model, args.out, s, terminal, args.terminal_tail,
                                        log=log)
    summary["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(summary, indent=2, default=str))
    return 0
