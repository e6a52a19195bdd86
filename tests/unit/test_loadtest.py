"""The load generator without a server: its prompts (sized with SmolLM2's own tokenizer),
`vllm bench serve`'s figures from known timings, the report and its plots, the dashboard
queries it sends to Prometheus, and its argument errors (a real subprocess for the
unreachable server)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from loadtest.cli import run
from loadtest.client import RequestResult
from loadtest.plots import write_plots
from loadtest.prometheus import BUILTIN, load_dashboards, panels_of, substitute
from loadtest.report import write_report
from loadtest.scenarios import ScenarioConfig, build_requests
from loadtest.stats import point_result

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
    p = point_result(rs, duration=2.0, t0=0.0, cancelled=1)
    assert (p["completed"], p["failed"], p["cancelled"]) == (2, 1, 1)
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
        p = point_result(rs, duration=3.0 / c, t0=0.0, cancelled=0)
        points.append({"max_concurrency": c if mode == "concurrency" else None,
                       "request_rate": "inf" if mode == "concurrency" else float(c),
                       "burstiness": 1.0, "num_prompts": 12, "start_time": 1000.0 + 10 * i,
                       "end_time": 1005.0 + 10 * i, **p})
    return {"date": "20260101-000000", "backend": "openai", "base_url": "http://127.0.0.1:1",
            "model_id": "smollm2-135m", "max_model_len": 8192, "scenario": "chat", "seed": 0,
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
    r["points"][0]["errors"] = ["HTTP 503"] * 12          # nothing to draw for this point
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
