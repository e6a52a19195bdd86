"""n-gram speculative decoding (`--speculative-config`), measured on the engine: output
tokens/s with and without drafts, side by side in one run, the acceptance rate, and
whether the greedy outputs are the same.

    .venv/bin/python -m bench.serving.speculative [--repeats 3] [--batch 1 8] [--max-tokens 128]
        [--temperature 0.7] [--deployment qfirst]

`--temperature T`: sampled requests (seeded, one seed per prompt) instead of greedy ones;
drafts are verified by rejection sampling, and a seeded answer is the plain one.
`--whole-drafts`: every draft verified whole (`"adaptive": false`), not only the tokens the
draft planner expects to pay for their rows.
`--deployment qfirst`: the engines are attention services (`qfirst_engine`, one torch
thread) over the MLP pool in a child process (one thread, the same-host link of the `grpc`
transport), as the Ray deployment runs on one host; a draft step's rows share one round
of pool calls.

Workloads (SmolLM2-135M-Instruct's chat template):
- `edit`: "rename this function" over Python standard-library functions (the reply copies
  most of the code);
- `quote`: "copy this paragraph, fixing its typos" over standard-library module
  documentation;
- `chat`: open questions, where the reply has little to copy (drafts must not slow it).

Nothing here was tuned on these prompts: the lookup settings are the flags' defaults.
Each mode has its own engine, built before any timing; the modes alternate within each
round, and figures are medians of the rounds. A round runs the workload's prompts `batch`
at a time to completion, timed from the first step to the last.
"""
from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch

from bench.common import MODEL
from kernels.sampling import SamplingParams
from models import load_model
from services.cli.argtypes import DTYPES, resolve_dtype
from services.common.tokenizer import eos_token_ids, load_tokenizer
from services.engine import EngineConfig, GenerationParams, LLMEngine
from services.engine.speculative import NgramConfig


def workloads() -> dict[str, list[str]]:
    import json.encoder
    import shlex
    import string
    import textwrap
    import fnmatch
    import colorsys
    import base64

    funcs = [textwrap.dedent, shlex.quote, fnmatch.filter, string.capwords,
             fnmatch.translate, colorsys.rgb_to_hsv, base64.b64encode,
             json.encoder.py_encode_basestring]
    edit = [f"Here is a Python function:\n\n```python\n{inspect.getsource(f)}```\n\nRewrite it "
            f"with the function renamed to `{f.__name__}_v2`. Reply with the code only."
            for f in funcs]
    docs = [textwrap, shlex, string, fnmatch, colorsys, base64, inspect, json]
    quote = []
    for mod in docs:
        text = " ".join((inspect.getdoc(mod) or "").split())[:700]
        quote.append("Copy the following paragraph, fixing any typos, and change nothing "
                     f"else:\n\n{text}")
    chat = ["What are three good habits for writing maintainable software?",
            "Explain how a refrigerator keeps food cold.",
            "Give me a short plan for learning to play the guitar.",
            "Why is the sky blue? Answer for a ten-year-old.",
            "What should I pack for a weekend hiking trip?",
            "Describe the water cycle in a few sentences.",
            "How do I make a simple tomato sauce?",
            "What is the difference between weather and climate?"]
    return {"edit": edit, "quote": quote, "chat": chat}


def run(engine: LLMEngine, prompts: list[list[int]], batch: int, max_tokens: int,
        temperature: float = 0.0):
    """-> (seconds, output tokens, outputs) of the prompts, `batch` at a time (prompt i
    sampled with seed i when `temperature` > 0)."""
    params = [GenerationParams(max_tokens=max_tokens, sampling=SamplingParams(
        temperature=temperature, seed=i if temperature else None)) for i in range(len(prompts))]
    outs, tokens, start = [], 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        for seq in engine.generate(prompts[i:i + batch], params[i:i + batch]):
            outs.append(seq.output_ids)
            tokens += len(seq.output_ids)
    return time.perf_counter() - start, tokens, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--threads", type=int, default=2, help="embedded: torch threads")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--deployment", choices=("embedded", "qfirst"), default="embedded")
    ap.add_argument("--whole-drafts", action="store_true",
                    help='"adaptive": false: verify every draft whole, whatever it costs')
    args = ap.parse_args()
    dtype = resolve_dtype("auto", False)
    model = load_model(MODEL, dtype=DTYPES[dtype])
    tok = load_tokenizer(MODEL)
    eos = eos_token_ids(MODEL)
    spec = NgramConfig(num_speculative_tokens=args.k, adaptive=not args.whole_drafts)
    config = dict(max_num_seqs=max(args.batch), kv_cache_bytes=256 << 20)
    pool = None
    if args.deployment == "qfirst":
        from bench.qfirst.probes import PoolProcess
        from services.attention.runner import qfirst_engine
        from services.deployment.transports import make_transport

        args.threads = 1
        pool = PoolProcess(str(MODEL), str(DTYPES[dtype]).removeprefix("torch."))
        transport = make_transport("grpc", [pool.address])

        def build(**more):
            return qfirst_engine(model, transport, eos_token_ids=eos,
                                 config=EngineConfig(**config, **more))
    else:
        def build(**more):
            return LLMEngine(model, EngineConfig(**config, **more), eos_token_ids=eos)
    torch.set_num_threads(args.threads)
    engines = {"plain": build(), "ngram": build(speculative=spec)}
    def encode(ask: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": ask}],
                                       add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]

    encoded = {name: [encode(p) for p in ps] for name, ps in workloads().items()}
    for e in engines.values():                                   # warm-up
        run(e, encoded["chat"][:1], 1, 8)
    mode = f"temperature {args.temperature}, seeded" if args.temperature else "greedy"
    where = ("embedded engine" if pool is None else
             "Q-First attention service + MLP pool process (same-host link), 1 thread each")
    print(f"# n-gram speculative decoding, {MODEL.name} {dtype}, {where}, {args.threads} "
          f"threads, k={spec.num_speculative_tokens}, lookup {spec.prompt_lookup_max}.."
          f"{spec.prompt_lookup_min}, {'adaptive' if spec.adaptive else 'whole'} drafts; "
          f"{args.repeats} rounds, medians; at most "
          f"{args.max_tokens} tokens, {mode}")
    print("| workload | batch | plain tok/s | ngram tok/s | speedup | acceptance | tokens "
          "per draft step | same outputs |")
    print("|---|---|---|---|---|---|---|---|")
    for name, prompts in encoded.items():
        for batch in args.batch:
            rates = {m: [] for m in engines}
            same, total, stats0 = 0, 0, None
            for r in range(args.repeats):
                s = engines["ngram"].spec_stats
                before = (s.drafts, s.draft_tokens, s.accepted_tokens)
                outs = {}
                for m in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                    sec, n, outs[m] = run(engines[m], prompts, batch, args.max_tokens,
                                          args.temperature)
                    rates[m].append(n / sec)
                same += sum(a == b for a, b in zip(outs["plain"], outs["ngram"]))
                total += len(outs["plain"])
                if stats0 is None:
                    stats0 = [after - b for after, b in zip(
                        (s.drafts, s.draft_tokens, s.accepted_tokens), before)]
            drafts, proposed, accepted = stats0
            plain, ngram = (statistics.median(rates[m]) for m in ("plain", "ngram"))
            print(f"| {name} | {batch} | {plain:.1f} | {ngram:.1f} | **{ngram / plain:.2f}x** | "
                  f"{accepted / max(1, proposed):.0%} | "
                  f"{(drafts + accepted) / max(1, drafts):.2f} | "
                  f"{same}/{total} |", flush=True)
    if pool is not None:
        pool.close()


if __name__ == "__main__":
    main()
