"""`splitstack loadtest` (or `python -m loadtest`): a bounded load against an OpenAI-compatible
server, with a report. Writes DIR/result.json (`vllm bench serve`'s field names, per sweep
point), DIR/report.md and PNG plots beside them; with --prometheus, the deployment's own
dashboard panels over the run as PNGs too.

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
from loadtest.scenarios import SCENARIOS, ScenarioConfig


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
    ap.add_argument("--scenario", choices=SCENARIOS, default="chat",
                    help="the workload (default: %(default)s); see loadtest/README.md")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=number_list(int),
                      help="closed loop: comma-separated client counts, one sweep point each "
                           "(default: 1)")
    load.add_argument("--rate", type=number_list(float),
                      help="open loop: comma-separated Poisson arrival rates in requests/s, "
                           "one sweep point each")
    ap.add_argument("--num-requests", type=positive(int), default=32,
                    help="requests per sweep point at most (default: %(default)s)")
    ap.add_argument("--max-seconds", type=positive(float), default=300.0,
                    help="seconds per sweep point at most: then sending stops and requests "
                         "in flight are cancelled (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("loadtest-out"),
                    help="output directory (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="prompts and arrivals (default: 0)")
    ap.add_argument("--max-tokens", type=positive(int),
                    help="output tokens per request (default: the scenario's)")
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

    if args.prometheus:
        check_prometheus(args.prometheus)
    run_cfg = RunConfig(url=args.url, model=args.model, api_key=args.api_key,
                        concurrency=args.concurrency or (() if args.rate else (1,)),
                        rates=args.rate or (), max_seconds=args.max_seconds,
                        request_timeout=args.request_timeout, progress=not args.no_progress)
    scenario = ScenarioConfig(name=args.scenario, num_requests=args.num_requests,
                              seed=args.seed, max_tokens=args.max_tokens,
                              reuse_ratio=args.reuse_ratio,
                              prefix_prompt_tokens=args.prefix_prompt_tokens,
                              num_prefixes=args.num_prefixes, extra_body=args.extra_body)
    result = run_sweep(run_cfg, scenario)
    result["command"] = shlex.join([*prog.split(), *args.argv])
    if args.api_key:
        result["command"] = result["command"].replace(args.api_key, "***")
    result["machine"] = machine()
    files = write_report(args.out, result, args.prometheus, dict(args.prom_var),
                         args.prom_rate_interval, args.dashboards)
    print(f"wrote {args.out / files['result']}, {args.out / files['report']} and "
          f"{len(files['plots']) + len(files['panels'])} plots", file=sys.stderr)
    return 1 if any(p["completed"] == 0 for p in result["points"]) else 0


def check_prometheus(url: str) -> None:
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/api/v1/status/buildinfo", timeout=10)
        r.raise_for_status()
    except httpx.HTTPError as exc:
        raise LoadTestError(f"cannot reach Prometheus at {url}: {type(exc).__name__}: {exc}")


def main(argv: list[str] | None = None) -> int:
    return run(sys.argv[1:] if argv is None else argv, prog="python -m loadtest")
