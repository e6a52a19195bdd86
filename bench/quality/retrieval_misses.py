"""What a model answers on the retrieval items it gets wrong: each item's completion beside
the asked value and every needle's value (exact arm, greedy), and a count of misses that
copy a distractor's value.

    python -m bench.quality.retrieval_misses --model models/zoo/smollm2-135m [--task multikey]
                                     [--length 2048] [--n-items 12] [--threads 2]
"""
from __future__ import annotations

import argparse
import re
import sys

import torch

from evals import catalog
from evals.corpus import documents
from evals.run import haystack_text
from evals.tasks import make_items
from models import load_model
from services.common.tokenizer import load_tokenizer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="models/zoo/smollm2-135m")
    ap.add_argument("--task", default="multikey")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--n-items", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model)
    arm = catalog.make_arm("exact", load_model(args.model))
    filler = tok(haystack_text(documents("eval")), add_special_tokens=False)["input_ids"]
    items = make_items(args.task, tok, filler, args.length, args.n_items, args.seed)
    outs = arm.complete([it.prompt_ids for it in items], 14)
    right = distractor = 0
    for it, out in zip(items, outs):
        text = tok.decode(it.prompt_ids)
        values = re.findall(r"is:? (\S+?)\. Remember", text)        # every needle's value
        answer = tok.decode(out, skip_special_tokens=True)
        ok = it.score(answer) == 1.0
        other = [v for v in values if v not in it.answers and v in answer]
        right += ok
        distractor += bool(other) and not ok
        print(f"depth {it.depth:.2f}  {'ok  ' if ok else 'MISS'}  asked {it.answers}  "
              f"needles {values}  answer {answer.strip()!r}")
    n = len(items)
    print(f"\n{args.task}@{args.length}: {right}/{n} right; {distractor} of the {n - right} "
          f"misses answer another needle's value")
    return 0


if __name__ == "__main__":
    sys.exit(main())
