"""Exact engine vs Hugging Face `transformers` generate: prefill and decode tokens/s.

Same random-weight checkpoint (the `bench` qwen3 and qwen3_next configs of
models/model_configs.json), CPU, fp32, greedy, batch 1 and 8, median of N runs, all in one
process so both sides see the same machine state. Prints the ratios and a markdown table.

    python -m bench.serving.engine_vs_hf [--repeats 5] [--prompt-len 128] [--new-tokens 32]

Prefill time is the time to the first token of every sequence. HF decode time is
generate(new_tokens) − generate(1), i.e. the (new_tokens − 1) cached steps.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from models import load_model
from models.random_checkpoint import load_configs, save_random_checkpoint
from services.engine import EngineConfig, GenerationParams, LLMEngine


def time_hf(hf, ids: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    def gen(n):
        start = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                        min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start
    t1, tn = gen(1), gen(new_tokens)
    return t1, max(tn - t1, 1e-9)


def time_engine(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    engine = LLMEngine(model, EngineConfig(max_num_batched_tokens=max(2048, ids.numel()),
                                           max_prefill_chunk=ids.shape[1],
                                           max_num_seqs=max(8, ids.shape[0])))
    params = GenerationParams(max_tokens=new_tokens, ignore_eos=True)
    for row in ids.tolist():
        engine.add_request(row, params)
    start = time.perf_counter()
    first = None
    while engine.has_unfinished():
        engine.step()
        if first is None and all(len(s.output_ids) >= 1 for s in engine.seqs.values()):
            first = time.perf_counter()
    end = time.perf_counter()
    return first - start, end - first


def bench(family: str, batch: int, args, workdir: Path) -> dict:
    cfg = load_configs("bench")[family]
    path = workdir / family
    if not path.exists():
        save_random_checkpoint(cfg, path, seed=0, std=0.02)
    hf_cls = type(save_random_checkpoint.__globals__["build_hf_model"](cfg, 0, 0.02))
    hf = hf_cls.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path)
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, cfg["vocab_size"], (batch, args.prompt_len), generator=gen)
    time_hf(hf, ids, 2), time_engine(ours, ids, 2)                      # warm-up
    rows = {"hf": [], "ours": []}
    for _ in range(args.repeats):
        rows["hf"].append(time_hf(hf, ids, args.new_tokens))
        rows["ours"].append(time_engine(ours, ids, args.new_tokens))
    prefill_tokens, decode_tokens = batch * args.prompt_len, batch * (args.new_tokens - 1)
    result = {"family": family, "batch": batch}
    for side, times in rows.items():
        result[f"{side}_prefill"] = statistics.median(prefill_tokens / p for p, _ in times)
        result[f"{side}_decode"] = statistics.median(decode_tokens / d for _, d in times)
    result["prefill_ratio"] = result["ours_prefill"] / result["hf_prefill"]
    result["decode_ratio"] = result["ours_decode"] / result["hf_decode"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--families", default="qwen3,qwen3_next")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            for batch in map(int, args.batches.split(",")):
                r = bench(family, batch, args, Path(tmp))
                results.append(r)
                print(f"{family} batch {batch}: prefill x{r['prefill_ratio']:.2f}, "
                      f"decode x{r['decode_ratio']:.2f}", flush=True)
    print(f"\nprompt {args.prompt_len} tokens, {args.new_tokens} new tokens, fp32, "
          f"{args.threads} threads, median of {args.repeats}\n")
    print("| model | batch | prefill tok/s (HF) | prefill tok/s (splitstack) | ratio "
          "| decode tok/s (HF) | decode tok/s (splitstack) | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['family']} | {r['batch']} | {r['hf_prefill']:.0f} | {r['ours_prefill']:.0f} "
              f"| {r['prefill_ratio']:.2f}x | {r['hf_decode']:.1f} | {r['ours_decode']:.1f} "
              f"| {r['decode_ratio']:.2f}x |")


if __name__ == "__main__":
    main()
