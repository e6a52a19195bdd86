"""The load generator without a model: its prompts and datasets (sized with SmolLM2's own
tokenizer), arrivals, `vllm bench serve`'s figures, goodput and censoring from known
timings, the report and its plots, the dashboard queries it sends to Prometheus, its
argument errors (a real subprocess for the unreachable server), and whole runs against
a small OpenAI-style streaming server on loopback (warm-ups, records, the server's
counters, the concurrency cap, a stalled stream cancelled at the time bound)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route
from tokenizers import Tokenizer

from loadtest.cli import run
from loadtest.client import CANCELLED, RequestResult
from loadtest.datasets import SONNET_ASK, DatasetConfig, load_conversations
from loadtest.plots import write_plots
from loadtest.prometheus import (BUILTIN, Panel, load_dashboards, panels_of, series_summaries,
                                 substitute)
from loadtest.report import write_report
from loadtest.runner import RunConfig, arrival_times, run_sweep
from loadtest.scenarios import ScenarioConfig, build_requests
from loadtest.server_metrics import increase, parse_counters
from loadtest.stats import parse_goodput, point_result, request_records

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "models" / "zoo" / "smollm2-135m" / "tokenizer.json"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def count():
    tok = Tokenizer.from_file(str(TOKENIZER))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def test_long_prompts_hold_2k_to_8k_tokens_within_the_context(count):
    cfg = ScenarioConfig("long", num_requests=6, seed=3, max_model_len=8192)
    specs = build_requests(cfg, count)
    lens = [count(s.body["prompt"]) for s in specs]
    assert all(2000 <= n and n + s.body["max_tokens"] <= 8192 for n, s in zip(lens, specs)), lens
    assert max(lens) - min(lens) > 500            # drawn over the range, not one length
    assert [s.body for s in build_requests(cfg, count)] == [s.body for s in specs]
    assert build_requests(cfg, count, point=1)[0].body != specs[0].body
    short = ScenarioConfig("long", num_requests=1, max_model_len=2048)
    with pytest.raises(ValueError, match="context length 2048"):
        build_requests(short, count)


def test_shared_prefix_shares_the_reuse_ratio_of_each_prompt(count):
    cfg = ScenarioConfig("shared-prefix", num_requests=12, seed=1, reuse_ratio=0.75,
                         prefix_prompt_tokens=512, num_prefixes=2)
    tok = Tokenizer.from_file(str(TOKENIZER))
    ids = [tok.encode(s.body["prompt"], add_special_tokens=False).ids
           for s in build_requests(cfg, count)]
    shared = []
    for i, a in enumerate(ids):
        common = max(next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                     for b in ids[:i] + ids[i + 1:])
        shared.append(common / len(a))
    assert all(0.6 <= s <= 0.8 for s in shared), shared
    assert len({tuple(x) for x in ids}) == len(ids)           # every suffix its own
    again = build_requests(cfg, count, point=1)
    assert {s.body["prompt"][:200] for s in again} <= {s.body["prompt"][:200]
                                                      for s in build_requests(cfg, count)}


def test_mix_draws_every_kind_and_extra_body_reaches_each_request(count):
    cfg = ScenarioConfig("mix", num_requests=60, seed=0, max_tokens=8,
                         prefix_prompt_tokens=64, long_tokens=(100, 200),
                         extra_body={"prefill_mode": "ridgefill"})
    specs = build_requests(cfg, count)
    assert {s.kind for s in specs} == {"chat", "long", "shared-prefix", "decode-heavy"}
    assert all(s.body["prefill_mode"] == "ridgefill" and s.body["max_tokens"] == 8
               for s in specs)
    assert {s.path for s in specs if s.kind == "chat"} == {"/v1/chat/completions"}
    assert all(s.body["ignore_eos"] for s in specs if s.kind == "decode-heavy")


def result(kind: str, start: float, ttft: float, gaps: list[float], out: int,
           prompt: int = 10, error: str = "") -> RequestResult:
    times = [start + ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestResult(kind, start, success=not error, error=error, ttft=ttft,
                         latency=times[-1] - start if not error else 0.5, itl=list(gaps),
                         prompt_len=prompt, output_tokens=out, chunk_times=times)


def test_point_figures_follow_vllm_definitions():
    rs = [result("chat", 0.0, 0.1, [0.02, 0.02, 0.02], 4, prompt=10),
          result("chat", 0.1, 0.3, [0.05], 2, prompt=20),
          result("chat", 1.0, 0.0, [], 0, error="HTTP 503: busy")]
    p = point_result(rs, duration=2.0, t0=0.0)
    assert (p["completed"], p["failed"], p["cancelled"]) == (2, 1, 0)
    assert (p["total_input_tokens"], p["total_output_tokens"]) == (30, 6)
    assert p["request_throughput"] == 1.0 and p["output_throughput"] == 3.0
    assert p["total_token_throughput"] == 18.0
    assert p["mean_ttft_ms"] == pytest.approx(200.0) and p["median_ttft_ms"] == pytest.approx(200)
    # TPOT: (E2EL - TTFT) / (tokens - 1): 60 ms / 3 and 50 ms / 1; the first two overlap
    assert p["mean_tpot_ms"] == pytest.approx(35.0)
    assert p["median_itl_ms"] == pytest.approx(20.0) and p["p99_itl_ms"] == pytest.approx(
        49.1, abs=0.1)
    assert p["mean_e2el_ms"] == pytest.approx((160 + 350) / 2)
    assert p["max_concurrent_requests"] == 2 and p["max_output_tokens_per_s"] == 6
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p95", "p99"):
            assert f"{stat}_{m}_ms" in p
    assert p["errors"] == ["", "", "HTTP 503: busy"] and len(p["itls"]) == 3


def sweep(mode: str = "concurrency") -> dict:
    points = []
    for i, c in enumerate((1, 4, 16)):
        rs = [result("chat", 0.1 * j, 0.05 * c + 0.001 * j, [0.01 * c] * 7, 8)
              for j in range(12)]
        p = point_result(rs, duration=3.0 / c, t0=0.0)
        points.append({"max_concurrency": c if mode == "concurrency" else None,
                       "request_rate": "inf" if mode == "concurrency" else float(c),
                       "burstiness": 1.0, "num_prompts": 12, "start_time": 1000.0 + 10 * i,
                       "end_time": 1005.0 + 10 * i, **p})
    return {"date": "20260101-000000", "backend": "openai", "base_url": "http://127.0.0.1:1",
            "model_id": "smollm2-135m", "max_model_len": 8192, "scenario": "chat",
            "workload": "chat", "seed": 0,
            "reuse_ratio": None, "extra_body": {}, "max_seconds": 300.0, "mode": mode,
            "points": points, "command": "splitstack loadtest --concurrency 1,4,16"}


@pytest.mark.parametrize("mode", ["concurrency", "rate"])
def test_report_writes_json_markdown_and_valid_plots(tmp_path, mode):
    files = write_report(tmp_path, sweep(mode))
    saved = json.loads((tmp_path / "result.json").read_text())
    assert [p["median_ttft_ms"] > 0 for p in saved["points"]] == [True] * 3
    md = (tmp_path / "report.md").read_text()
    for name in files["plots"]:
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 15_000, name
        assert f"]({name})" in md
    assert "| concurrency 16 |" in md if mode == "concurrency" else "| 16 req/s |" in md
    assert "splitstack loadtest --concurrency 1,4,16" in md


def test_plots_skip_failed_requests(tmp_path):
    r = sweep()
    r["points"][0]["statuses"] = ["failed"] * 12          # nothing to draw for this point
    assert write_plots(tmp_path, r)[0] == "ttft_cdf.png"
    assert (tmp_path / "ttft_cdf.png").read_bytes().startswith(PNG)


def test_dashboard_queries_get_their_variables():
    sub = lambda e, v=None: substitute(e, v or {}, "30s", 120)    # noqa: E731
    assert sub('rate(x{namespace="$namespace", service=~"$service"}[$__rate_interval])') == \
        'rate(x{namespace=~".*", service=~".*"}[30s])'
    assert sub('sum(x{service="${service}"}) / $__range', {"service": "a-1"}) == \
        'sum(x{service=~"a-1"}) / 120s'
    assert sub('x{pool!="$pool"}[$__interval]') == 'x{pool!~".*"}[30s]'
    board = {"panels": [{"type": "row", "panels": [
        {"title": "A", "fieldConfig": {"defaults": {"unit": "s"}},
         "targets": [{"expr": "a", "refId": "A"}]}]},
        {"title": "text", "type": "text"},
        {"title": "B", "targets": [{"expr": "b"}, {"expr": ""}]}]}
    assert [(p.title, p.unit, len(p.targets)) for p in panels_of(board)] == \
        [("A", "s", 1), ("B", "", 1)]


def test_dashboards_load_from_the_directory_else_the_builtin_list(tmp_path):
    assert load_dashboards(tmp_path)[0][0] == BUILTIN["title"]
    (tmp_path / "one.json").write_text(json.dumps(
        {"title": "One", "panels": [{"title": "p", "targets": [{"expr": "up"}]}]}))
    (tmp_path / "broken.json").write_text("{")
    boards = load_dashboards(tmp_path)
    assert [(t, [p.title for p in ps]) for t, ps in boards] == [("One", ["p"])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv, message", [
    (["--scenario", "nope"], "invalid choice: 'nope'"),
    (["--concurrency", "0"], "expected values > 0"),
    (["--concurrency", "1", "--rate", "2"], "not allowed with argument"),
    (["--reuse-ratio", "1.5"], "must be in [0, 1)"),
    (["--num-requests", "x"], "expected int"),
    (["--extra-body", "[1]"], "expected a JSON object"),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        run(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_splitstack_loadtest_is_wired(capsys):
    from services.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["loadtest", "--scenario", "nope"])
    assert exc.value.code == 2
    assert "splitstack loadtest: error: argument --scenario" in capsys.readouterr().err


def test_unreachable_server_is_one_line_and_exit_2(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.run([sys.executable, "-m", "loadtest", "--url", url, "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: cannot reach {url}") and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


# --- arrivals, goodput, censoring: pure logic ---

@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_have_the_rate_and_the_burstiness_cv(burstiness):
    times = arrival_times(20_001, rate=5.0, burstiness=burstiness, seed=7)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.04)
    # vLLM's gamma(shape=b, scale=1/(rate*b)): CV = 1/sqrt(b); Poisson at b = 1
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)
    assert (arrival_times(50, 5.0, burstiness, seed=7) == times[:50]).all()
    assert not (arrival_times(50, 5.0, burstiness, seed=8) == times[:50]).all()


def test_goodput_counts_completed_requests_within_every_slo():
    assert parse_goodput(["ttft:100,tpot:20", "e2el:500"]) == \
        {"ttft": 100.0, "tpot": 20.0, "e2el": 500.0}
    for bad, message in ((["ttft=100"], "KEY:MS"), (["itl:5"], "KEY:MS"),
                         (["ttft:fast"], "not a number"), (["e2el:-1"], "≥ 0")):
        with pytest.raises(ValueError, match=message):
            parse_goodput(bad)
    rs = [result("chat", 0.0, 0.1, [0.02, 0.02], 3),       # good: 100 ms, 20 ms, 140 ms
          result("chat", 0.0, 0.15, [0.01], 2),             # TTFT over
          result("chat", 0.0, 0.05, [0.03, 0.03], 3),       # TPOT over
          result("chat", 0.0, 0.05, [], 1),                 # one token: TPOT 0, good
          result("chat", 0.0, 0.0, [], 0, error="HTTP 500: boom")]
    slos = {"ttft": 120.0, "tpot": 25.0}
    p = point_result(rs, duration=2.0, t0=0.0, slos=slos)
    assert p["request_goodput"] == 1.0 and p["goodput_slos_ms"] == slos     # 2 good / 2 s
    assert p["request_throughput"] == 2.0
    assert point_result(rs, 2.0, 0.0, slos={"e2el": 120.0})["request_goodput"] == 1.0
    assert point_result(rs, 2.0, 0.0)["request_goodput"] is None
    assert [r["good"] for r in request_records(rs, 0.0, slos)] == [True, False, False, True,
                                                                   False]


def test_cancelled_requests_count_with_their_times_censored():
    done = [result("chat", 0.0, 0.1, [0.1], 2), result("chat", 0.0, 0.2, [0.1], 2)]
    silent = RequestResult("chat", start=1.0)               # no token before the cancel
    silent.censor(4.0)
    stalled = result("chat", 1.0, 0.5, [0.1], 0, prompt=7)  # 2 chunks, then nothing
    stalled.censor(5.0)
    failed = result("chat", 0.0, 0.0, [], 0, error="HTTP 503: busy")
    assert (silent.status, silent.ttft, silent.latency, silent.itl) == \
        ("cancelled", 3.0, 3.0, [])
    assert stalled.status == "cancelled" and stalled.latency == 4.0
    assert stalled.itl == pytest.approx([0.1, 3.4])         # the open gap until the cancel
    p = point_result(done + [silent, stalled, failed], duration=4.0, t0=0.0)
    assert (p["completed"], p["cancelled"], p["failed"]) == (2, 2, 1)
    # E2EL over completed and cancelled: 200, 300, 3000, 4000 ms; the failure's not counted
    assert p["mean_e2el_ms"] == pytest.approx(1875.0)
    assert p["median_ttft_ms"] == pytest.approx(350.0)      # 100, 200, 500, 3000
    assert p["p99_itl_ms"] > 3000 and p["max_concurrent_requests"] == 3
    # TPOT: 100 ms twice, and the stalled one's (4.0 - 0.5) / (2 - 1); none without tokens
    assert p["mean_tpot_ms"] == pytest.approx((100 + 100 + 3500) / 3)
    assert p["statuses"] == ["completed"] * 2 + ["cancelled"] * 2 + ["failed"]
    assert p["total_output_tokens"] == 4 and p["output_lens"][3] == 2
    assert p["errors"][2] == CANCELLED and p["e2els"][2] == 3.0


def test_server_counters_parse_and_increase():
    text = ('# TYPE splitstack_requests_total counter\n'
            'splitstack_requests_total{status="finished"} 3.0\n'
            'splitstack_requests_created{status="finished"} 1.7e9\n'
            '# TYPE splitstack_ttft_seconds histogram\n'
            'splitstack_ttft_seconds_bucket{le="0.1"} 2.0\nsplitstack_ttft_seconds_sum 0.5\n'
            'splitstack_ttft_seconds_count 3.0\n# TYPE splitstack_requests_running gauge\n'
            'splitstack_requests_running 2\n# TYPE vllm:num_preemptions counter\n'
            'vllm:num_preemptions_total{model_name="a b"} 1\n'
            '# TYPE python_gc_collections counter\npython_gc_collections_total 5\n')
    before = parse_counters(text)
    assert before == {'splitstack_requests_total{status="finished"}': 3.0,
                      "splitstack_ttft_seconds_sum": 0.5, "splitstack_ttft_seconds_count": 3.0,
                      'vllm:num_preemptions_total{model_name="a b"}': 1.0}
    after = {**before, 'splitstack_requests_total{status="finished"}': 8.0,
             'vllm:num_preemptions_total{model_name="a b"}': 0.0,     # reset: counts from 0
             'splitstack_requests_total{status="aborted"}': 2.0}     # new series
    assert increase(before, after) == {
        'splitstack_requests_total{status="aborted"}': 2.0,
        'splitstack_requests_total{status="finished"}': 5.0,
        "splitstack_ttft_seconds_count": 0.0, "splitstack_ttft_seconds_sum": 0.0,
        'vllm:num_preemptions_total{model_name="a b"}': 0.0}
    assert increase(None, after) is None


def test_prometheus_series_are_summarized_per_point():
    panel = Panel("Tokens", "tok/s", [], series=[("out", [-5.0, 0.0, 5.0, 10.0, 15.0, 25.0],
                                                  [9.0, 1.0, 3.0, 5.0, 7.0, 100.0])])
    points = [(1000.0, 1010.0, "c=1"), (1010.0, 1020.0, "c=4")]
    [s] = series_summaries([panel], points, origin=1000.0)
    assert (s["min"], s["mean"], s["max"], s["last"]) == (1.0, 4.0, 7.0, 7.0)   # pad left out
    assert s["per_point"] == [{"point": "c=1", "mean": 3.0, "max": 5.0},
                              {"point": "c=4", "mean": 6.0, "max": 7.0}]


# --- datasets ---

SAMPLE = ROOT / "tests" / "data" / "sharegpt_sample.jsonl"


def test_sharegpt_takes_the_first_human_turn_and_filters_as_vllm(count, tmp_path):
    pairs = load_conversations(SAMPLE)
    assert len(pairs) == 19                     # the unanswered record is left out
    assert ("Name three things a good library offers besides books." in
            [p for p, _ in pairs])              # after a system turn
    cfg = DatasetConfig("sharegpt", num_requests=17, seed=0, path=SAMPLE)
    specs = cfg.requests(count)
    prompts = [s.body["prompt"] for s in specs]
    assert len(set(prompts)) == 17 and "Hi" not in prompts         # too short: 1 token
    assert not any(p.startswith("Summarize this travel guide") for p in prompts)  # > 1,024
    replies = dict(pairs)
    assert all(s.body["max_tokens"] == count(replies[s.body["prompt"]]) and
               s.prompt_len == count(s.body["prompt"]) and s.path == "/v1/completions"
               for s in specs)
    assert cfg.requests(count, point=1)[0] != specs[0]              # each point its own order
    # a fixed output length skips the reply's minimum, as vLLM's does
    fixed = dataclasses.replace(cfg, sharegpt_output_len=3, endpoint="/v1/chat/completions")
    chats = fixed.requests(count)
    assert {s.body["max_tokens"] for s in chats} == {3}
    assert all(s.body["messages"][0]["role"] == "user" for s in chats)
    # fewer passing records than requests: sent again in turn, and said so
    logged = []
    again = dataclasses.replace(cfg, num_requests=40).requests(count, log=logged.append)
    assert len(again) == 40 and again[17] == again[0] and "17 conversations" in logged[0]
    # a JSON list works as well as JSONL; the context also filters
    (tmp_path / "list.json").write_text(json.dumps([json.loads(line) for line in
                                                    SAMPLE.read_text().splitlines()]))
    tight = DatasetConfig("sharegpt", num_requests=17, path=tmp_path / "list.json",
                          max_model_len=80)
    assert all(s.prompt_len + s.body["max_tokens"] <= 80 for s in tight.requests(count,
                                                                                 log=print))
    (tmp_path / "bad.jsonl").write_text('{"conversations": []}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not JSON"):
        DatasetConfig("sharegpt", num_requests=1, path=tmp_path / "bad.jsonl").requests(count)
    with pytest.raises(ValueError, match="needs --dataset-path"):
        DatasetConfig("sharegpt", num_requests=1)


def test_random_lengths_are_drawn_over_the_range(count):
    cfg = DatasetConfig("random", num_requests=20, seed=2, random_input_len=200,
                        random_output_len=40, random_range_ratio=0.5, ignore_eos=True)
    specs = cfg.requests(count)
    lens = [count(s.body["prompt"]) for s in specs]
    assert all(s.prompt_len == n and 50 <= n <= 300 for s, n in zip(specs, lens)), lens
    outs = [s.body["max_tokens"] for s in specs]
    assert all(20 <= n <= 60 for n in outs) and len(set(outs)) > 5
    assert max(lens) - min(lens) > 80 and all(s.body["ignore_eos"] for s in specs)
    assert [s.body for s in cfg.requests(count)] == [s.body for s in specs]
    with pytest.raises(ValueError, match="exceed the context length 256"):
        dataclasses.replace(cfg, max_model_len=256).requests(count)


def test_sonnet_prompts_share_their_prefix_lines_and_fit(count):
    cfg = DatasetConfig("sonnet", num_requests=8, seed=0, sonnet_input_len=300,
                        sonnet_prefix_len=120, sonnet_output_len=20)
    specs = cfg.requests(count)
    prompts = [s.body["prompt"] for s in specs]
    assert all(p.startswith(SONNET_ASK) for p in prompts)
    assert all(s.prompt_len == count(p) <= 300 for s, p in zip(specs, prompts))
    assert min(s.prompt_len for s in specs) > 200                 # filled up to the length
    shared = os.path.commonprefix(prompts)
    assert 80 <= count(shared) <= 160 and "Apache License" in shared
    assert len(set(prompts)) == 8 and {s.body["max_tokens"] for s in specs} == {20}
    with pytest.raises(ValueError, match="sonnet_prefix_len"):
        DatasetConfig("sonnet", num_requests=1, sonnet_input_len=100, sonnet_prefix_len=200)


# --- whole runs against a streaming server on loopback ---

class FakeServer:
    """An OpenAI-style server without a model: each generation request streams
    `max_tokens` one-word chunks, then its usage; a prompt with "STALL" (and more than
    the first-request check's 2 tokens) sends nothing until the client hangs up. It
    counts what it serves, in Prometheus's text too."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.in_flight = self.peak = self.finished = 0
        routes = [Route("/health", lambda r: PlainTextResponse("ok")),
                  Route("/v1/models", lambda r: JSONResponse(
                      {"data": [{"id": "fake", "max_model_len": 4096}]})),
                  Route("/tokenize", self.tokenize, methods=["POST"]),
                  Route("/metrics", self.metrics),
                  Route("/v1/completions", self.generate, methods=["POST"]),
                  Route("/v1/chat/completions", self.generate, methods=["POST"])]
        self.app = Starlette(routes=routes)

    async def tokenize(self, request):
        return JSONResponse({"count": len((await request.json())["prompt"].split())})

    async def metrics(self, request):
        return PlainTextResponse(
            "# TYPE splitstack_requests_total counter\n"
            f'splitstack_requests_total{{status="finished"}} {self.finished}\n'
            "# TYPE splitstack_requests_running gauge\n"
            f"splitstack_requests_running {self.in_flight}\n")

    async def generate(self, request):
        body = await request.json()
        self.bodies.append(body)
        text = body.get("prompt") or body["messages"][0]["content"]
        n = body["max_tokens"]

        async def events():
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            try:
                if "STALL" in text and n > 2:
                    await asyncio.sleep(3600)
                for _ in range(n):
                    await asyncio.sleep(0.01)
                    yield 'data: {"choices": [{"index": 0, "text": "word"}]}\n\n'
                usage = {"prompt_tokens": len(text.split()), "completion_tokens": n}
                yield f'data: {json.dumps({"choices": [], "usage": usage})}\n\n'
                yield "data: [DONE]\n\n"
                self.finished += 1
            finally:
                self.in_flight -= 1
        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def fake():
    server = FakeServer()
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port,
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        assert time.time() < deadline, "the fake server did not start"
        time.sleep(0.05)
    yield base, server
    srv.should_exit = True
    thread.join(timeout=10)


def test_warmups_are_sent_but_not_measured_and_records_are_written(fake, tmp_path):
    base, server = fake
    sent = len(server.bodies)
    logged = []
    run_cfg = RunConfig(url=base, concurrency=(2,), num_warmups=3, goodput={"e2el": 60_000},
                        progress=False)
    result = run_sweep(run_cfg, ScenarioConfig("chat", num_requests=5, max_tokens=4),
                       log=logged.append)
    assert len(server.bodies) - sent == 1 + 3 + 5       # the check, the warm-ups, the load
    [p] = result["points"]
    assert (p["completed"], p["num_warmups"], len(p["requests"])) == (5, 3, 5)
    assert p["request_goodput"] == p["request_throughput"] > 0
    # the counters are read after the warm-ups: the point's own 5 requests
    assert p["server_counters"] == {'splitstack_requests_total{status="finished"}': 5.0}
    assert any("p99 needs at least 100" in line for line in logged)
    files = write_report(tmp_path, result)
    records = [json.loads(line) for line in (tmp_path / files["requests"]).read_text()
               .splitlines()]
    assert len(records) == 5 and {r["point_label"] for r in records} == {"concurrency 2"}
    for r in records:
        assert r["status"] == "completed" and r["good"] is True and r["error"] == ""
        assert len(r["chunk_s"]) == 4 and r["chunk_s"][0] == r["ttft_s"] <= r["e2el_s"]
        assert r["output_len"] == 4 and r["prompt_len"] > 0 and r["send_s"] >= 0
    saved = json.loads((tmp_path / "result.json").read_text())
    assert "requests" not in saved["points"][0]
    assert saved["points"][0]["requests_file"] == "requests.jsonl"


def test_open_loop_max_concurrency_caps_requests_in_flight(fake):
    base, server = fake
    server.peak = 0
    logged = []
    run_cfg = RunConfig(url=base, rates=(1000.0,), burstiness=0.5, max_concurrency=2,
                        progress=False)
    result = run_sweep(run_cfg, ScenarioConfig("chat", num_requests=8, max_tokens=6),
                       log=logged.append)
    [p] = result["points"]
    assert p["completed"] == 8 and p["max_concurrent_requests"] <= 2 and server.peak <= 2
    assert (p["max_concurrency"], p["burstiness"]) == (2, 0.5)
    assert not any("connections per client" in line for line in logged)
    with pytest.raises(ValueError, match="caps an open loop"):
        RunConfig(concurrency=(2,), max_concurrency=2)


def test_concurrency_over_the_servers_connection_cap_is_warned(fake):
    base, _ = fake
    logged = []
    run_sweep(RunConfig(url=base, concurrency=(65,), progress=False),
              ScenarioConfig("chat", num_requests=1, max_tokens=2), log=logged.append)
    assert any("65 requests in flight" in line and "--max-connections-per-client" in line
               for line in logged)


def test_a_stalled_stream_is_cancelled_at_the_bound_and_counted(fake, tmp_path):
    base, _ = fake
    data = tmp_path / "stall.jsonl"
    data.write_text("".join(json.dumps({"conversations": [
        {"from": "human", "value": f"{word} please tell me a short story now"},
        {"from": "gpt", "value": "Once upon a time there was a story"}]}) + "\n"
        for word in ("STALL", "First", "Second")))
    code = run(["--url", base, "--dataset-name", "sharegpt", "--dataset-path", str(data),
                "--sharegpt-output-len", "5", "--concurrency", "3", "--num-requests", "3",
                "--max-seconds", "1", "--out", str(tmp_path / "out"), "--no-progress"])
    assert code == 0
    p = json.loads((tmp_path / "out" / "result.json").read_text())["points"][0]
    assert (p["completed"], p["cancelled"], p["failed"], p["not_sent"]) == (2, 1, 0, 0)
    i = p["statuses"].index("cancelled")
    assert p["errors"][i] == CANCELLED and p["ttfts"][i] == p["e2els"][i] > 0
    assert p["mean_e2el_ms"] == pytest.approx(1000 * sum(p["e2els"]) / 3)   # all three
    assert p["mean_ttft_ms"] == pytest.approx(1000 * sum(p["ttfts"]) / 3)
    [record] = [json.loads(line) for line in (tmp_path / "out" / "requests.jsonl")
                .read_text().splitlines() if "cancelled" in line]
    assert record["chunk_s"] == [] and record["ttft_s"] == record["e2el_s"]
    assert record["prompt_len"] == 8                  # the dataset's count: no usage came


@pytest.mark.parametrize("argv, message", [
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["--dataset-name", "random", "--scenario", "chat"], "the built-in dataset's"),
    (["--dataset-name", "sonnet", "--dataset-path", "nowhere.txt"], "not found: nowhere.txt"),
    (["--goodput", "ttft:soon"], "not a number"),
    (["--concurrency", "2", "--max-concurrency", "2"], "caps an open loop"),
])
def test_bad_workload_arguments_are_one_line_errors(argv, message, capsys):
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
