"""`splitstack loadtest` (or `python -m loadtest`): a bounded load against an OpenAI-compatible
server, with a report. Writes DIR/result.json (`vllm bench serve`'s field names, per sweep
point), DIR/requests.jsonl (every request), DIR/report.md and PNG plots beside them; with
--prometheus, the deployment's own dashboard panels over the run as PNGs too.

Exit status: 0 when the run finished, 1 when some point completed no request, 2 for bad
arguments or a server that cannot be reached or refuses the first request."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from loadtest.client import LoadTestError
from loadtest.datasets import DATASETS, ENDPOINTS, DatasetConfig
from loadtest.scenarios import SCENARIOS, ScenarioConfig
from loadtest.stats import parse_goodput


def number_list(kind):
    def parse(text: str) -> tuple:
        try:
            values = tuple(kind(t) for t in text.split(",") if t.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, "
                                             f"got {text!r}")
        if not values or any(not v > 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected values > 0, got {text!r}")
        return values
    return parse


def positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}")
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def at_least_zero(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected int, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be ≥ 0, got {text}")
    return value


def share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def key_value(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def build_parser(prog: str = "splitstack loadtest") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000",
                    help="the server (default: %(default)s)")
    ap.add_argument("--model", help="model name (default: the server's first in /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("SPLITSTACK_API_KEY"),
                    help="sent as a Bearer token (default: $SPLITSTACK_API_KEY)")
    ap.add_argument("--dataset-name", choices=DATASETS, default="builtin",
                    help="the prompts: the built-in scenarios (--scenario) or vLLM's random, "
                         "sharegpt or sonnet datasets (default: %(default)s)")
    ap.add_argument("--scenario", choices=SCENARIOS,
                    help="the built-in dataset's workload (default: chat); see "
                         "loadtest/README.md")
    ap.add_argument("--dataset-path", type=Path,
                    help="sharegpt: a JSON or JSONL file of conversations; sonnet: a text "
                         "(default: the Apache License 2.0 in loadtest/data)")
    ap.add_argument("--endpoint", choices=ENDPOINTS, default=ENDPOINTS[0],
                    help="the route of the random, sharegpt and sonnet datasets' requests "
                         "(default: %(default)s)")
    ap.add_argument("--random-input-len", type=positive(int), default=1024,
                    help="random: prompt tokens (default: %(default)s)")
    ap.add_argument("--random-output-len", type=positive(int), default=128,
                    help="random: output tokens (default: %(default)s)")
    ap.add_argument("--random-range-ratio", type=share, default=0.0,
                    help="random: lengths drawn from [L*(1-r), L*(1+r)] (default: 0)")
    ap.add_argument("--sharegpt-output-len", type=positive(int),
                    help="sharegpt: every output length (default: each reply's length)")
    ap.add_argument("--sonnet-input-len", type=positive(int), default=550,
                    help="sonnet: prompt tokens at most (default: %(default)s)")
    ap.add_argument("--sonnet-output-len", type=positive(int), default=150,
                    help="sonnet: output tokens (default: %(default)s)")
    ap.add_argument("--sonnet-prefix-len", type=positive(int), default=200,
                    help="sonnet: tokens of lines every prompt shares (default: %(default)s)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="random, sharegpt, sonnet: generate every output length's tokens")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=number_list(int),
                      help="closed loop: comma-separated client counts, one sweep point each "
                           "(default: 1)")
    load.add_argument("--rate", type=number_list(float),
                      help="open loop: comma-separated arrival rates in requests/s, one sweep "
                           "point each")
    ap.add_argument("--burstiness", type=positive(float), default=1.0,
                    help="open loop: gamma arrivals' shape; 1 is Poisson, lower is burstier "
                         "(default: %(default)s)")
    ap.add_argument("--max-concurrency", type=positive(int),
                    help="open loop: requests in flight at most")
    ap.add_argument("--num-requests", type=positive(int), default=200,
                    help="requests per sweep point at most; p99 needs at least 100 "
                         "(default: %(default)s)")
    ap.add_argument("--num-warmups", type=at_least_zero, default=0,
                    help="unmeasured requests before each sweep point (default: 0)")
    ap.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=[],
                    help="SLOs of a good request, e.g. ttft:500,tpot:50,e2el:5000: reports "
                         "request_goodput")
    ap.add_argument("--max-seconds", type=positive(float), default=300.0,
                    help="seconds per sweep point at most: then sending stops and requests "
                         "in flight are cancelled (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("loadtest-out"),
                    help="output directory (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="prompts and arrivals (default: 0)")
    ap.add_argument("--max-tokens", type=positive(int),
                    help="built-in dataset: output tokens per request (default: the "
                         "scenario's)")
    ap.add_argument("--reuse-ratio", type=share, default=0.75,
                    help="shared-prefix: the shared share of each prompt (default: %(default)s)")
    ap.add_argument("--prefix-prompt-tokens", type=positive(int), default=1024,
                    help="shared-prefix: prompt length in tokens (default: %(default)s)")
    ap.add_argument("--num-prefixes", type=positive(int), default=4,
                    help="shared-prefix: distinct shared prefixes (default: %(default)s)")
    ap.add_argument("--extra-body", type=json_object, default={},
                    help="JSON merged into every request body, e.g. "
                         "'{\"prefill_mode\": \"ridgefill\"}'")
    ap.add_argument("--request-timeout", type=positive(float), default=600.0,
                    help="seconds one request may take (default: %(default)s)")
    ap.add_argument("--prometheus", metavar="URL",
                    help="add the deployment's dashboard panels over the run from this "
                         "Prometheus to the report")
    ap.add_argument("--prom-var", type=key_value, action="append", default=[],
                    metavar="NAME=VALUE",
                    help="a dashboard variable's value (default for each: .*); repeatable")
    ap.add_argument("--prom-rate-interval", default="1m",
                    help="what $__rate_interval stands for (default: %(default)s)")
    ap.add_argument("--dashboards", type=Path,
                    help="directory of Grafana dashboard JSON (default: deploy/grafana)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def run(argv: list[str], prog: str = "splitstack loadtest") -> int:
    args = build_parser(prog).parse_args(argv)
    args.argv = list(argv)
    try:
        return _run(args, prog)
    except (LoadTestError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, prog: str) -> int:
    from loadtest.report import machine, write_report
    from loadtest.runner import RunConfig, run_sweep

    load = workload(args)
    if args.prometheus:
        check_prometheus(args.prometheus)
    run_cfg = RunConfig(url=args.url, model=args.model, api_key=args.api_key,
                        concurrency=args.concurrency or (() if args.rate else (1,)),
                        rates=args.rate or (), burstiness=args.burstiness,
                        max_concurrency=args.max_concurrency, max_seconds=args.max_seconds,
                        num_warmups=args.num_warmups, goodput=parse_goodput(args.goodput),
                        request_timeout=args.request_timeout, progress=not args.no_progress)
    result = run_sweep(run_cfg, load)
    result["command"] = shlex.join([*prog.split(), *args.argv])
    if args.api_key:
        result["command"] = result["command"].replace(args.api_key, "***")
    result["machine"] = machine()
    files = write_report(args.out, result, args.prometheus, dict(args.prom_var),
                         args.prom_rate_interval, args.dashboards)
    print(f"wrote {args.out / files['result']}, {args.out / files['requests']}, "
          f"{args.out / files['report']} and {len(files['plots']) + len(files['panels'])} "
          "plots", file=sys.stderr)
    return 1 if any(p["completed"] == 0 for p in result["points"]) else 0


def workload(args: argparse.Namespace) -> ScenarioConfig | DatasetConfig:
    if args.dataset_name == "builtin":
        return ScenarioConfig(name=args.scenario or "chat", num_requests=args.num_requests,
                              seed=args.seed, max_tokens=args.max_tokens,
                              reuse_ratio=args.reuse_ratio,
                              prefix_prompt_tokens=args.prefix_prompt_tokens,
                              num_prefixes=args.num_prefixes, extra_body=args.extra_body)
    if args.scenario or args.max_tokens:
        raise ValueError(f"--scenario and --max-tokens are the built-in dataset's; "
                         f"--dataset-name {args.dataset_name} has its own prompts and "
                         f"--{args.dataset_name}-output-len")
    return DatasetConfig(
        name=args.dataset_name, num_requests=args.num_requests, seed=args.seed,
        path=args.dataset_path, endpoint=args.endpoint,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        sharegpt_output_len=args.sharegpt_output_len, sonnet_input_len=args.sonnet_input_len,
        sonnet_output_len=args.sonnet_output_len,
        sonnet_prefix_len=args.sonnet_prefix_len, ignore_eos=args.ignore_eos,
        extra_body=args.extra_body)


def check_prometheus(url: str) -> None:
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/api/v1/status/buildinfo", timeout=10)
        r.raise_for_status()
    except httpx.HTTPError as exc:
        raise LoadTestError(f"cannot reach Prometheus at {url}: {type(exc).__name__}: {exc}")


def main(argv: list[str] | None = None) -> int:
    return run(sys.argv[1:] if argv is None else argv, prog="python -m loadtest")
