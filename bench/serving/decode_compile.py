"""What the engine's decode modes cost per step, in one run: SmolLM2 in bf16, the engine's
eager step against `--compile` (decode steps as `torch.compile`d graphs,
`services/engine/compiled_decode.py`), `--quantization int8` (int8 decode products) and
both, interleaved, median of N; and the step's weight products alone in bf16 and int8 (the
floor each mode streams at).

    .venv/bin/python -m bench.serving.decode_compile [--batch 1 8] [--repeats 5] [--steps 32]
    .venv/bin/python -m bench.serving.decode_compile --batch --product-rows 1,2,4,6,8,16

`--product-rows`: the step's products alone at each row count, bf16 against int8 forced at
every row count, on the native VNNI kernel (`kernels/linear/cpu_int8.c`, where the CPU has
VNNI; "apart": each weight's copy in its own tensor instead of one buffer on huge pages,
`kernels.linear.cpu_int8.consolidate`) and on torch's weight-only product: where
`--quantization int8` should stop reading the int8 copy
(`models.layers.INT8_NATIVE_MAX_ROWS`, `INT8_MAX_ROWS`).

Each mode has its own engine, built (and its graphs compiled) before any timing. A step is
the engine's whole `step()`: scheduling, metadata, the model, sampling.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from models import load_model
from models import layers
from models import model as model_module
from models.layers import project
from services.engine import EngineConfig, GenerationParams, LLMEngine

PROMPT = 200
MODES = {"engine": (None, False), "--compile": (None, True), "int8": ("int8", False),
         "int8 --compile": ("int8", True)}


def step_ms(engine: LLMEngine, batch: int, steps: int, seed: int) -> float:
    """Mean ms of `steps` decode steps of `batch` sequences with 200-token prompts."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    for _ in range(batch):
        engine.add_request(torch.randint(0, vocab, (PROMPT,), generator=gen).tolist(),
                           GenerationParams(max_tokens=steps + 1, ignore_eos=True))
    engine.step()                                        # the prompts
    start, n = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        n += 1
    return (time.perf_counter() - start) / n * 1e3


def products_ms(model, batch: int, repeats: int) -> float:
    cfg = model.config
    xs = [torch.randn(batch, n, dtype=model.dtype) for n in (cfg.hidden_size,
                                                            cfg.intermediate_size)]

    def run():
        for layer in model.model.layers:
            project(xs[0], layer.self_attn.qkv.weight)
            project(xs[0], layer.self_attn.o_proj.weight)
            project(xs[0], layer.mlp.gate_up.weight)
            project(xs[1], layer.mlp.down_proj.weight)
        project(xs[0], model.lm_head_weight())

    times = []
    with torch.inference_mode():
        run()
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(10):
                run()
            times.append((time.perf_counter() - start) / 10 * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/zoo/smollm2-135m")
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--product-rows", type=lambda s: [int(r) for r in s.split(",")],
                    default=[])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    plain = load_model(args.model, torch.bfloat16)
    quant = load_model(args.model, torch.bfloat16).quantize("int8")
    if args.product_rows:
        native_int8, consolidate = layers._native_int8, model_module.consolidate_int8
        forced = load_model(args.model, torch.bfloat16).quantize("int8", prompts=True)
        model_module.consolidate_int8 = lambda weights: None   # each copy its own tensor
        forced_apart = load_model(args.model, torch.bfloat16).quantize("int8", prompts=True)
        model_module.consolidate_int8 = consolidate
        layers._native_int8 = lambda: False          # the copies built here are torch's
        forced_torch = load_model(args.model, torch.bfloat16).quantize("int8", prompts=True)
        layers._native_int8 = native_int8
        native = native_int8()
        print(f"model {args.model}, bf16, {args.threads} threads: one step's products, "
              f"median of {args.repeats}, ms")
        for rows in args.product_rows:
            line = f"rows {rows}: bf16 {products_ms(plain, rows, args.repeats):.2f}, "
            if native:
                line += (f"int8 native {products_ms(forced, rows, args.repeats):.2f}, "
                         f"int8 native apart {products_ms(forced_apart, rows, args.repeats):.2f}, ")
            line += f"int8 torch {products_ms(forced_torch, rows, args.repeats):.2f}"
            print(line, flush=True)
    if not args.batch:
        return
    print(f"model {args.model}, bf16, {args.threads} threads, prompts of {PROMPT} tokens, "
          f"{args.steps} decode steps per run, median of {args.repeats} interleaved runs")
    for batch in args.batch:
        engines = {}
        for name, (quantization, compiled) in MODES.items():
            start = time.perf_counter()
            engines[name] = LLMEngine(quant if quantization else plain, EngineConfig(
                max_num_seqs=batch, max_num_batched_tokens=4096, max_prefill_chunk=512,
                compile_decode=compiled))
            if compiled:
                print(f"  batch {batch}: {name} engine built (graphs compiled) in "
                      f"{time.perf_counter() - start:.0f} s", flush=True)
        runs = {name: [] for name in MODES}
        for r in range(args.repeats):
            order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
            for name in order:
                runs[name].append(step_ms(engines[name], batch, args.steps, seed=r))
        row = {name: statistics.median(v) for name, v in runs.items()}
        row["products bf16"] = products_ms(plain, batch, args.repeats)
        row["products int8"] = products_ms(quant, batch, args.repeats)
        base = row["engine"]
        print(f"batch {batch}: " + ", ".join(
            f"{k} {v:.1f} ms ({base / v:.2f}x)" + (f" [{min(runs[k]):.1f}-{max(runs[k]):.1f}]"
                                                   if k in runs else "")
            for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
