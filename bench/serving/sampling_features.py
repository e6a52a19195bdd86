"""What the OpenAI sampling features cost the embedded engine, as ratios in one run.

Each arm runs the same request on the same engine (SmolLM2-135M from models/zoo by default,
fp32, CPU), arms alternated, median of N paired ratios against the plain request:

    prefill    a P-token prompt, one token out; + prompt log-probs (echo with logprobs=5)
    decode     G tokens after a short prompt; + logprobs=20 (top 20 per token), + penalties
               (repetition, frequency, presence and a logit bias), + min_tokens = G

    python -m bench.serving.sampling_features [--model models/zoo/smollm2-135m] [--prompt 1024]
                                      [--generate 64] [--reps 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.common import MODEL
from kernels.sampling import SamplingParams
from models import load_model
from services.engine import GenerationParams, LLMEngine


def timed(engine: LLMEngine, prompt: list[int], params: GenerationParams) -> float:
    start = time.perf_counter()
    seq = engine.generate([prompt], params)[0]
    elapsed = time.perf_counter() - start
    assert len(seq.output_ids) == params.max_tokens, "every arm must generate the same count"
    return elapsed


def compare(engine, prompt, base: GenerationParams, arms: dict, reps: int) -> list[str]:
    timed(engine, prompt, base)                              # warm up
    times = {"plain": [], **{name: [] for name in arms}}
    for _ in range(reps):
        times["plain"].append(timed(engine, prompt, base))
        for name, params in arms.items():
            times[name].append(timed(engine, prompt, params))
    lines = [f"  plain {statistics.median(times['plain']):.3f} s"]
    for name in arms:
        ratio = statistics.median(t / p for t, p in zip(times[name], times["plain"]))
        lines.append(f"  {name:<34} {statistics.median(times[name]):.3f} s  "
                     f"x{ratio:.3f} of plain (median of {reps} paired ratios)")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens of the prefill arm")
    ap.add_argument("--generate", type=int, default=64, help="tokens of the decode arm")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    engine = LLMEngine(model)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    long_prompt = torch.randint(100, vocab, (args.prompt,), generator=gen).tolist()
    short_prompt = long_prompt[:32]
    print(f"model {args.model}, {torch.get_num_threads()} threads")
    print(f"prefill, {args.prompt}-token prompt, 1 token out:")
    one = GenerationParams(max_tokens=1, ignore_eos=True)
    print("\n".join(compare(engine, long_prompt, one, {
        "+ prompt log-probs (echo, k = 5)": GenerationParams(max_tokens=1, ignore_eos=True,
                                                             prompt_logprobs=5)}, args.reps)))
    g = args.generate
    print(f"decode, {g} tokens after a 32-token prompt (greedy):")
    penalties = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5,
                               presence_penalty=0.5, logit_bias=((13, -5.0), (28, 2.0)))
    print("\n".join(compare(engine, short_prompt, GenerationParams(max_tokens=g, ignore_eos=True), {
        "+ logprobs (top 20 per token)": GenerationParams(max_tokens=g, ignore_eos=True,
                                                          logprobs=20),
        "+ penalties and logit bias": GenerationParams(max_tokens=g, ignore_eos=True,
                                                       sampling=penalties),
        "+ min_tokens = all": GenerationParams(max_tokens=g, min_tokens=g),
    }, args.reps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
