"""`splitstack loadtest` and the Locust file against a live embedded SmolLM2 server on
loopback (the e2e `server` fixture): bounded runs write result.json with `vllm bench
serve`'s fields and sane values, report.md and valid PNG plots; Poisson arrivals; the
time bound cancels what is in flight, counts it with censored times, and the server frees
it; the README's ShareGPT example (gamma arrivals, a concurrency cap, warm-ups, goodput,
per-request records and the server's counters); with a real Prometheus
scraping the server, the report draws every dashboard's panels over the run (a misspelt
metric shows as a panel without data, a broken query as an error); a short headless
Locust run records streamed requests and their TTFT."""
from __future__ import annotations

import contextlib
import csv
import json
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from loadtest.cli import run
from loadtest.prometheus import prometheus_panels
from tests.helpers.gateway import wait_idle

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
VLLM_FIELDS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
               "request_throughput", "output_throughput", "total_token_throughput",
               "max_concurrency", "request_rate", "input_lens", "output_lens", "ttfts", "itls",
               "errors", *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99")
                           for m in ("ttft", "tpot", "itl", "e2el")))


def check_outputs(out: Path, n: int) -> dict:
    result = json.loads((out / "result.json").read_text())
    for p in result["points"]:
        assert not [f for f in VLLM_FIELDS if f not in p]
        assert (p["completed"], p["failed"], p["cancelled"]) == (n, 0, 0), p["errors"]
        assert all(0 < t <= e for t, e in zip(p["ttfts"], p["e2els"]))
        assert p["mean_ttft_ms"] <= p["mean_e2el_ms"] and p["total_output_tokens"] > 0
        assert all(i > 0 for i in p["input_lens"]) and sum(p["output_lens"]) == \
            p["total_output_tokens"]
        assert p["request_throughput"] > 0 and p["output_throughput"] > 0
        assert p["end_time"] > p["start_time"]
    md = (out / "report.md").read_text()
    for name in ("ttft_cdf.png", "itl_cdf.png", "throughput.png", "latency.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 15_000, name
        assert f"]({name})" in md
    return result


def test_concurrency_sweep_writes_result_report_and_plots(server, tmp_path):
    base, _ = server
    out = tmp_path / "sweep"
    code = run(["--url", base, "--scenario", "chat", "--concurrency", "1,4",
                "--num-requests", "6", "--max-tokens", "6", "--max-seconds", "120",
                "--out", str(out), "--no-progress"])
    assert code == 0
    result = check_outputs(out, 6)
    assert [p["max_concurrency"] for p in result["points"]] == [1, 4]
    assert result["points"][1]["max_concurrent_requests"] > 1
    assert result["model_id"] == "smollm2-135m" and result["scenario"] == "chat"
    assert all(n <= 6 for n in result["points"][0]["output_lens"])


def test_poisson_arrivals_with_shared_prefixes(server, tmp_path):
    base, _ = server
    out = tmp_path / "poisson"
    code = run(["--url", base, "--scenario", "shared-prefix", "--rate", "4",
                "--num-requests", "5", "--max-tokens", "4", "--prefix-prompt-tokens", "96",
                "--max-seconds", "120", "--out", str(out), "--no-progress"])
    assert code == 0
    result = check_outputs(out, 5)
    point = result["points"][0]
    assert point["request_rate"] == 4.0 and point["max_concurrency"] is None
    assert all(80 <= n <= 130 for n in point["input_lens"]), point["input_lens"]
    assert "| 4 req/s |" in (out / "report.md").read_text()


def test_time_bound_cancels_requests_in_flight(server, tmp_path):
    base, gateway = server
    out = tmp_path / "bounded"
    code = run(["--url", base, "--scenario", "decode-heavy", "--concurrency", "2",
                "--num-requests", "6", "--max-tokens", "4000", "--max-seconds", "2",
                "--out", str(out), "--no-progress"])
    point = json.loads((out / "result.json").read_text())["points"][0]
    assert code == 1 and point["completed"] == 0 and point["failed"] == 0
    assert point["cancelled"] == 2          # the two in flight; the other four never sent
    assert point["not_sent"] == 4 and point["statuses"] == ["cancelled"] * 2
    # counted, censored at the cancel: sent at the start, cut off at the 2 s bound
    assert all(1.0 < e <= 3.0 for e in point["e2els"]) and point["p99_e2el_ms"] > 1000
    wait_idle(gateway)                      # the server saw the hang-ups and aborted them


def readme_example(marker: str) -> list[str]:
    """The arguments of loadtest/README.md's example command that contains `marker`."""
    text = (ROOT / "loadtest" / "README.md").read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if marker in ln)
    argv = shlex.split(line)
    assert argv[:2] == [".venv/bin/splitstack", "loadtest"], argv
    return argv[2:]


def test_readme_sharegpt_example(server, tmp_path):
    base, gateway = server
    out = tmp_path / "sharegpt"
    argv = readme_example("--dataset-name sharegpt")
    assert "--goodput" in argv and "--num-warmups" in argv and "--burstiness" in argv
    # the example, smaller: later flags override earlier ones
    code = run([*argv, "--url", base, "--num-requests", "6", "--num-warmups", "2",
                "--sharegpt-output-len", "8", "--max-seconds", "120", "--out", str(out),
                "--no-progress"])
    assert code == 0
    result = check_outputs(out, 6)
    point = result["points"][0]
    assert result["dataset_name"] == "sharegpt" and point["num_warmups"] == 2
    assert point["max_concurrency"] == 8 and point["burstiness"] == 0.5
    assert point["request_goodput"] is not None and point["goodput_slos_ms"] == \
        {"ttft": 500.0, "tpot": 100.0}
    # the server's own count of the point: its 6 requests' prompts, not the warm-ups'
    counters = point["server_counters"]
    assert counters["splitstack_prompt_tokens_total"] == point["total_input_tokens"]
    records = [json.loads(ln) for ln in (out / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 6 and all(r["status"] == "completed" for r in records)
    assert all(r["chunk_s"][0] == r["ttft_s"] <= r["chunk_s"][-1] <= r["e2el_s"]
               for r in records)
    assert [r["prompt_len"] for r in records] == point["input_lens"]
    wait_idle(gateway)


def test_locust_headless_run(server, tmp_path):
    base, gateway = server
    locust = Path(sys.executable).parent / "locust"
    proc = subprocess.run(
        [str(locust), "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless",
         "-u", "3", "-r", "3", "-t", "8s", "--host", base, "--scenario", "chat",
         "--max-tokens", "4", "--csv", str(tmp_path / "run"), "--only-summary"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(tmp_path / "run_stats.csv") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    post, ttft = rows[("POST", "chat")], rows[("TTFT", "chat")]
    assert int(post["Request Count"]) > 0 and int(post["Failure Count"]) == 0
    assert int(ttft["Request Count"]) == int(post["Request Count"])
    assert 0 < float(ttft["Median Response Time"]) <= float(post["Median Response Time"])
    wait_idle(gateway)                  # the streams Locust left at its time limit ended


@contextlib.contextmanager
def prometheus(target: str, workdir: Path):
    """Debian's Prometheus (`make setup` installs it) on a free loopback port, scraping
    `target` (host:port) every second."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: `make setup` installs it"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = workdir / "prometheus.yml"
    job = f"{{job_name: splitstack, static_configs: [{{targets: ['{target}']}}]}}"
    config.write_text(f"global: {{scrape_interval: 1s}}\nscrape_configs:\n  - {job}\n")
    proc = subprocess.Popen([binary, f"--config.file={config}",
                             f"--storage.tsdb.path={workdir / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:          # ready, and the server scraped once
            try:
                up = httpx.get(url + "/api/v1/query", params={"query": "up"}, timeout=2).json()
                if any(r["value"][1] == "1" for r in up["data"]["result"]):
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            assert proc.poll() is None and time.time() < deadline, "Prometheus did not start"
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_report_draws_the_dashboards_from_prometheus(server, tmp_path):
    base, _ = server
    out = tmp_path / "prom"
    with prometheus(base.removeprefix("http://"), tmp_path) as url:
        code = run(["--url", base, "--scenario", "chat", "--concurrency", "2",
                    "--num-requests", "6", "--max-tokens", "8", "--max-seconds", "120",
                    "--prometheus", url, "--prom-rate-interval", "5s", "--out", str(out),
                    "--no-progress"])
        assert code == 0
        result = json.loads((out / "result.json").read_text())
        boards = {d["dashboard"]: d for d in result["prometheus"]["dashboards"]}
        titles = {json.loads(p.read_text())["title"]
                  for p in (ROOT / "deploy" / "grafana").glob("*.json")}
        assert titles and set(boards) == titles
        md = (out / "report.md").read_text()
        for d in boards.values():
            data = (out / d["file"]).read_bytes()
            assert data.startswith(PNG) and len(data) > 30_000 and f"]({d['file']})" in md
            assert not d["errors"], d["errors"]
        overview = next(d for t, d in boards.items() if "Overview" in t)
        assert len(overview["empty"]) < overview["panels"] / 2, overview["empty"]
        # the same range, a dashboard of our own: one good query, one misspelt, one broken
        (tmp_path / "boards").mkdir()
        (tmp_path / "boards" / "t.json").write_text(json.dumps({"title": "T", "panels": [
            {"title": title, "targets": [{"expr": expr}]} for title, expr in (
                ("good", "sum(rate(splitstack_generation_tokens_total[$__rate_interval]))"),
                ("misspelt", "sum(rate(splitstack_generation_tokenz_total[$__rate_interval]))"),
                ("broken", "sum(rate(splitstack_generation_tokens_total["))]}))
        point = result["points"][0]
        [d] = prometheus_panels(tmp_path, url, [(point["start_time"], point["end_time"], "c=2")],
                                {}, "5s", tmp_path / "boards")
    assert d["empty"] == ["misspelt"]
    assert len(d["errors"]) == 1 and "splitstack_generation_tokens_total[" in d["errors"][0]
