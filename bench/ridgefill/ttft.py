"""TTFT of exact vs RidgeFill prefill, in one run: median of N, with the compute bound.

For each bench config (random weights, fp32, CPU) and prompt length N, both arms go through
the prefill service and return the first token's logits:

    exact      the fill disabled: bitwise the exact engine's one-chunk prefill
    ridgefill  split S, tail T, maps resident (and, once per length, streamed)

The compute bound is 1/r with r = S/L + (1 − S/L)·T/N (layer passes only); "share" is the
measured speedup over that bound. The speedup is the median of the N paired ratios (each
exact run over the fill run after it); the times shown are each arm's median. The process
keeps freed memory and flushes subnormal floats to zero as the serving processes do
(`--malloc-default`: glibc's defaults; `--keep-denormals`: subnormals kept).
Maps are calibrated first on a few random-token documents (their values do not matter for
time, only their shapes). Also prints the map memory.

    python -m bench.ridgefill.ttft [--families qwen3,qwen3_5] [--lengths 2048,4096,8192,16384]
                                   [--tail 512] [--reps 5] [--context-rows 0]
                                   [--selector none --budget 0.1] [--fill-dtypes model,bfloat16]
                                   [--device cuda --dtype bfloat16 --gdn-kernel triton]

With `--model DIR --maps DIR` a real checkpoint and its `splitstack calibrate` maps are timed
instead, on held-out retrieval prompts (`niah_single_2`, licence texts) of each length, the
probe's lexical net on when the selector is the probe: the settings `splitstack eval`
measures the quality of.

`--context-rows c` calibrates maps that also read the c previous rows' split states (the
map's input grows from d to d·(1+c) features; c = 0 is the paper's map). `--selector probe
--budget 0.3` times the quality mode (30% of the prefix exact, chosen by the two-sweep
probe); the bound then counts the budget's rows as exact.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from models import load_model
from models.random_checkpoint import load_configs, save_random_checkpoint
from services.common.process import flush_denormals, keep_freed_memory
from tools.calibration import CalibConfig, calibrate
from services.prefill.settings import FillSettings
from services.prefill.service import PrefillConfig, PrefillService


def timed(fn) -> float:
    """Wall time of fn(), its CUDA work included (the first token's logits are on the
    host only once the device is done)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_family(family: str, lengths: list[int], tail: int, reps: int, tmp: Path,
                 context_rows: int = 0, selector: str = "none", budget: float = 0.1,
                 device: str = "cpu", dtype: torch.dtype = torch.float32,
                 fill_dtypes: tuple[str, ...] = ("model",)) -> list[dict]:
    cfg = dict(load_configs("bench")[family])
    cfg["max_position_embeddings"] = max(lengths) * 2
    path = tmp / family
    save_random_checkpoint(cfg, path, seed=0, std=0.02)
    model = load_model(path, dtype=dtype, device=device)
    L = model.config.num_hidden_layers
    split = L // 2
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    docs = [torch.randint(0, vocab, (512,), generator=g).tolist() for _ in range(4)]
    calibrate(model, iter(docs), CalibConfig(splits=(split,), max_len=512, heldout_docs=1,
                                             context_rows=context_rows),
              path / "maps", log=lambda *_: None)
    def service(fill_dtype: str, resident: bool = True) -> PrefillService:
        return PrefillService(model, PrefillConfig(
            mode="ridgefill", maps_dir=str(path / "maps"), split=split, tail=tail,
            resident=resident, fill_dtype=fill_dtype))

    services = {fd: service(fd) for fd in fill_dtypes}
    resident = services[fill_dtypes[0]]
    streamed = service(fill_dtypes[0], resident=False)
    maps_r, maps_s = resident.maps(split), streamed.maps(split)
    layer_bytes = max(maps_r.get(l)[0].numel() * maps_r.get(l)[0].element_size()
                      for l in maps_r.layers) if maps_r.layers else 0
    rows = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        exact = FillSettings(split=L, tail=0)
        # random checkpoints have no tokenizer: the probe's lexical net is off (with a real
        # one it costs 4 ms of Python at 8K tokens, 7.5 ms at 16K)
        fill = FillSettings(split=split, tail=tail, selector=selector, budget=budget, lexical=0.0)
        for svc in services.values():                            # warm the kernels
            svc.prefill(ids[:256], exact)
            svc.prefill(ids[:1024], fill)
        t_exact, t_fill = [], {fd: [] for fd in fill_dtypes}
        for _ in range(reps):                                    # alternate the arms
            t_exact.append(timed(lambda: resident.prefill(ids, exact)))
            for fd, svc in services.items():
                t_fill[fd].append(timed(lambda: svc.prefill(ids, fill)))
        t_stream = timed(lambda: streamed.prefill(ids, fill))
        e = statistics.median(t_exact)
        bound = 1.0 / fill.compute_share(L, n)
        for fd in fill_dtypes:
            f = statistics.median(t_fill[fd])
            # the speedup is the median of the paired ratios: each exact run against the
            # fill run right after it, so that the VM's drift over a run cancels in a pair
            speedup = statistics.median(a / b for a, b in zip(t_exact, t_fill[fd]))
            rows.append({"family": family, "n": n, "S": split, "L": L, "T": tail,
                         "c": context_rows, "fill_dtype": fd,
                         "exact_s": e, "ridgefill_s": f, "speedup": speedup, "bound": bound,
                         "share": speedup / bound, "streamed_s": t_stream,
                         "maps_resident_mib": maps_r.resident_bytes / 2**20,
                         "maps_streamed_peak_mib": layer_bytes / 2**20,
                         "maps_file_mib": maps_s.file_bytes / 2**20})
            print(f"{family:>9} N={n:>6} fill {fd:>8}: exact {e:7.2f}s  ridgefill {f:7.2f}s  "
                  f"speedup {speedup:.2f}× / bound {bound:.2f}× = {100 * speedup / bound:.0f}%"
                  f"  (streamed maps, {fill_dtypes[0]}: {t_stream:.2f}s)", flush=True)
    return rows


def bench_checkpoint(model_dir: str, maps_dir: str, lengths: list[int], tail: int, reps: int,
                     selector: str, budget: float, split: int | None = None) -> list[dict]:
    """Exact vs RidgeFill TTFT of a real checkpoint on held-out prompts (text, so the probe's
    lexical net runs as served)."""
    from evals.heldout.families import make_family_items
    from services.common.tokenizer import load_tokenizer
    from services.prefill.lexicon import Lexicon

    model = load_model(model_dir)
    tokenizer = load_tokenizer(model_dir)
    L = model.config.num_hidden_layers
    split = split or L // 2
    svc = PrefillService(model, PrefillConfig(mode="ridgefill", maps_dir=maps_dir, split=split,
                                              tail=tail, selector=selector, budget=budget),
                         lexicon=Lexicon.from_tokenizer(tokenizer, model.config.vocab_size))
    fill, exact = svc.default, FillSettings(split=L, tail=0)
    name = Path(model_dir).name
    rows = []
    for n in lengths:
        ids = make_family_items("niah_single_2", tokenizer, n, 1, seed=7)[0].prompt_ids
        svc.prefill(ids[:512], exact)                            # warm the kernels
        svc.prefill(ids[:1024], fill)
        t_exact, t_fill = [], []
        for _ in range(reps):                                    # alternate the arms
            t_exact.append(timed(lambda: svc.prefill(ids, exact)))
            t_fill.append(timed(lambda: svc.prefill(ids, fill)))
        e, f = statistics.median(t_exact), statistics.median(t_fill)
        speedup = statistics.median(a / b for a, b in zip(t_exact, t_fill))
        bound = 1.0 / fill.compute_share(L, n)
        rows.append({"family": name, "n": n, "S": split, "L": L, "T": tail,
                     "c": svc.maps(split).context_rows, "fill_dtype": "model", "exact_s": e,
                     "ridgefill_s": f, "speedup": speedup, "bound": bound,
                     "share": speedup / bound, "streamed_s": float("nan")})
        print(f"{name:>9} N={n:>6}: exact {e:7.2f}s  ridgefill {f:7.2f}s  speedup "
              f"{speedup:.2f}× / bound {bound:.2f}× = {100 * speedup / bound:.0f}%", flush=True)
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--families", default="qwen3,qwen3_5")
    ap.add_argument("--model", help="a real checkpoint instead of the random bench configs")
    ap.add_argument("--maps", help="with --model: its maps from splitstack calibrate")
    ap.add_argument("--split", type=int, help="with --model: the maps' split (half depth)")
    ap.add_argument("--lengths", default="2048,4096,8192,16384")
    ap.add_argument("--tail", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context-rows", type=int, default=0,
                    help="previous rows the maps also read (0: the paper's map)")
    ap.add_argument("--selector", default="none", help="exact-row selector of the fill arm")
    ap.add_argument("--budget", type=float, default=0.1, help="the selector's share of the prefix")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    ap.add_argument("--fill-dtypes", default="model",
                    help="filled rows' map and projections: model and/or bfloat16, each its own "
                         "fill arm, alternated with exact in the same reps")
    ap.add_argument("--malloc-default", action="store_true",
                    help="leave glibc malloc as it is (the serving processes keep freed memory, "
                         "services/common/process.py)")
    ap.add_argument("--keep-denormals", action="store_true",
                    help="compute with subnormal floats (the serving processes flush them to "
                         "zero, services/common/process.py)")
    ap.add_argument("--gdn-kernel", choices=("torch", "triton"), default=None,
                    help="chunked delta-rule kernel on CUDA (sets SPLITSTACK_GDN_KERNEL)")
    return ap


def main() -> int:
    args = build_parser().parse_args()
    if args.gdn_kernel:
        os.environ["SPLITSTACK_GDN_KERNEL"] = args.gdn_kernel
    flushed = not args.keep_denormals and flush_denormals()    # before any parallel op
    torch.set_num_threads(args.threads)
    kept = not args.malloc_default and keep_freed_memory()
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    if args.model:
        if not args.maps:
            raise SystemExit("--model needs --maps")
        rows = bench_checkpoint(args.model, args.maps, lengths, args.tail, args.reps,
                                args.selector, args.budget, args.split)
    with tempfile.TemporaryDirectory() as tmp:
        for family in ([] if args.model else args.families.split(",")):
            rows += bench_family(family, lengths, args.tail, args.reps, Path(tmp),
                                 args.context_rows, args.selector, args.budget, args.device,
                                 getattr(torch, args.dtype), tuple(args.fill_dtypes.split(",")))
    print(f"\nmalloc: {'freed memory kept (as served)' if kept else 'glibc defaults'}; "
          f"subnormals: {'flushed to zero (as served)' if flushed else 'kept'}; "
          "speedup = median of the paired exact/fill ratios")
    if args.selector != "none":
        print(f"\nfill arm: selector {args.selector}, budget {args.budget}")
    if args.device != "cpu":
        print(f"\ndevice {torch.cuda.get_device_name() if args.device == 'cuda' else args.device}"
              f", {args.dtype}, delta-rule kernel "
              f"{os.environ.get('SPLITSTACK_GDN_KERNEL', 'torch')}")
    print("\n| config | N | S/L | T | context rows | fill dtype | exact (s) | RidgeFill (s) | "
          "speedup | bound 1/r | share of bound | streamed maps (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['n']} | {r['S']}/{r['L']} | {r['T']} | {r['c']} | "
              f"{r['fill_dtype']} | {r['exact_s']:.2f} | "
              f"{r['ridgefill_s']:.2f} | {r['speedup']:.2f}× | {r['bound']:.2f}× | "
              f"{100 * r['share']:.0f}% | "
              f"{'–' if r['streamed_s'] != r['streamed_s'] else format(r['streamed_s'], '.2f')} |")
    seen = set()
    for r in rows:
        if r["family"] not in seen:
            seen.add(r["family"])
            if "maps_resident_mib" not in r:
                continue
            print(f"maps {r['family']}: resident {r['maps_resident_mib']:.1f} MiB in memory, "
                  f"streamed peak {r['maps_streamed_peak_mib']:.1f} MiB (one layer), "
                  f"{r['maps_file_mib']:.1f} MiB on disk (bf16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
