"""Rewire a checkpoint's query read point to q-first and fine-tune Wq (seed 003, §6);
reports d in bits per byte against the same fine-tune of the unconverted checkpoint."""
from __future__ import annotations

import argparse
import json
import sys

import torch

from services.cli.argtypes import bounded
from tools.commands import log


def build_parser() -> argparse.ArgumentParser:
    cvt = argparse.ArgumentParser(prog="splitstack convert-qfirst", description=__doc__)
    cvt.add_argument("--model", required=True, help="Hugging Face model directory (standard)")
    cvt.add_argument("--out", required=True, help="converted checkpoint directory")
    cvt.add_argument("--data", nargs="*", help="training text files (default: the corpus's "
                                               "calibration split; held-out: its eval split)")
    cvt.add_argument("--steps", type=int, default=120, help="Wq fine-tune steps, each arm")
    cvt.add_argument("--seq-len", type=int, default=256)
    cvt.add_argument("--batch", type=int, default=1, help="windows per step")
    cvt.add_argument("--lr", type=float, default=2e-3)
    cvt.add_argument("--eval-docs", type=int, default=16,
                     help="held-out documents, one window each")
    cvt.add_argument("--seed", type=int, default=0)
    cvt.add_argument("--threads", type=bounded(1), default=2)
    return cvt


def run(argv: list[str]) -> int:
    from tools.zoo import convert_qfirst as cq

    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = cq.ConvertConfig(steps=args.steps, seq_len=args.seq_len, batch=args.batch,
                           lr=args.lr, eval_docs=args.eval_docs, seed=args.seed)
    train, heldout, source = cq.corpus_data(args.model, cfg, args.data)
    result = cq.convert_qfirst(args.model, args.out, train, heldout, cfg, log, source)
    print(json.dumps(result, indent=2))
    print(f"d = {result['d']:+.4f} bits/byte (converted + SFT {result['bpb']['converted_sft']:.4f}"
          f" vs unconverted + SFT {result['bpb']['unconverted_sft']:.4f}); "
          f"untrained {result['untrained']:+.4f}", file=sys.stderr)
    return 0
