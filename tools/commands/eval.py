"""Quality harness: key-token and new-token loss, decoding agreement and filled-region
needle retrieval, per arm (exact, RidgeFill variants, ...) and prompt length."""
from __future__ import annotations

import argparse
import sys
import time

import torch

from services.cli.argtypes import DTYPES, bounded, int_list
from tools.commands import log


def build_parser() -> argparse.ArgumentParser:
    ev = argparse.ArgumentParser(prog="splitstack eval", description=__doc__)
    ev.add_argument("--model", required=True)
    ev.add_argument("--arms", default="exact", help="comma-separated registered arms")
    ev.add_argument("--lengths", type=int_list, default="1024,2048")
    ev.add_argument("--tasks", default="single,multikey,multivalue,word",
                    help="train-family tasks (evals.tasks; '' for none)")
    ev.add_argument("--families", default="",
                    help="held-out families (evals.heldout.families): passkey, niah_single_1, "
                         "niah_single_2, niah_single_3, paragraph, chat; 'all' for every one")
    ev.add_argument("--loss-corpus", choices=("auto", "stdlib", "long"), default="auto",
                    help="loss documents: stdlib docstrings, the long held-out texts "
                         "(licences, Python reference), or auto (long from 4096 tokens)")
    ev.add_argument("--n-items", type=int, default=10, help="items per task and length")
    ev.add_argument("--n-docs", type=int, default=6, help="loss documents per length")
    ev.add_argument("--tail-len", type=int, default=256)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--chat", action="store_true", help="wrap items in the chat template")
    ev.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ev.add_argument("--quantization", choices=("int8",),
                    help="int8: score the model with int8 in every product "
                         "(prompts too: a bound on the serving mode, which keeps prompts)")
    ev.add_argument("--served-quantization", action="store_true",
                    help="with --quantization: as `serve` quantizes, products of more than "
                         "16 rows (prompts) keep the weights")
    ev.add_argument("--threads", type=bounded(1), default=2)
    ev.add_argument("--out", help="write JSON here (and the table beside it as .md)")
    ev.add_argument("--maps", help="RidgeFill maps directory (for the fill arms)")
    ev.add_argument("--split", type=int, help="RidgeFill split S (default: half depth)")
    ev.add_argument("--budget", type=float, help="selectors' share of prefix rows (0.1)")
    ev.add_argument("--lexical", type=float,
                    help="probe arms: the lexical net's share of prefix rows (0.05)")
    return ev


def _names(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def run(argv: list[str]) -> int:
    from evals.heldout.families import FAMILIES
    from evals.run import EvalConfig, run_eval, write_outputs

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.served_quantization and not args.quantization:
        parser.error("--served-quantization needs --quantization")
    torch.set_num_threads(args.threads)
    families = tuple(FAMILIES) if args.families == "all" else _names(args.families)
    cfg = EvalConfig(lengths=args.lengths, tasks=_names(args.tasks), n_items=args.n_items,
                     n_docs=args.n_docs, tail_len=args.tail_len, seed=args.seed,
                     chat=args.chat, families=families, loss_corpus=args.loss_corpus)
    start = time.perf_counter()
    options = {k: v for k, v in (("maps_dir", args.maps), ("split", args.split),
                                 ("budget", args.budget), ("lexical", args.lexical))
               if v is not None}
    summary = run_eval(args.model, args.arms.split(","), cfg, DTYPES[args.dtype], log=log,
                       arm_options=options, quantization=args.quantization,
                       quantize_prompts=not args.served_quantization)
    print(write_outputs(summary, args.out))
    print(f"[eval finished in {time.perf_counter() - start:.0f}s]", file=sys.stderr)
    return 0
