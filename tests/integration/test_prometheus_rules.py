"""An alert rule that never fires is worse than none: deploy/prometheus/ checked by Debian's promtool (`make setup` installs
it): the scrape config and the rule files it names are valid, and the rules' unit tests
(deploy/prometheus/tests/) show each alert firing on a synthetic faulty series and silent on
a healthy one. Healthy traffic observed through the gateway's own histograms fires no
alert, and each alert has a runbook section in docs/runbooks.md."""
from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from services.gateway.metrics import GatewayMetrics
from tests.helpers.prometheus import PROMETHEUS_DIR, ROOT, binary

pytestmark = pytest.mark.slow      # runs promtool in a subprocess

ALERTS = PROMETHEUS_DIR / "rules" / "alerts.yml"
UNIT_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*.yml"))
RUNBOOKS = ROOT / "docs" / "runbooks.md"


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"]
            for rule in group["rules"] if "alert" in rule]


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([binary("promtool"), *args], cwd=PROMETHEUS_DIR, text=True,
                          capture_output=True, timeout=120)


def test_scrape_config_and_rules_are_valid():
    done = promtool("check", "config", "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    done = promtool("check", "rules", *(str(p) for p in sorted(
        (PROMETHEUS_DIR / "rules").glob("*.yml"))))
    assert done.returncode == 0, done.stdout + done.stderr


def test_each_alert_fires_on_a_fault_and_stays_silent_when_healthy():
    done = promtool("test", "rules", *(str(p) for p in UNIT_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr
    tested = set()
    for path in UNIT_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test") or ():
                if check["exp_alerts"]:
                    assert any(a["exp_labels"].get("job") == "bad" for a in check["exp_alerts"])
                    assert all(a["exp_labels"].get("job") != "good"
                               for a in check["exp_alerts"])
                    tested.add(check["alertname"])
    alerts = {rule["alert"] for group in yaml.safe_load(ALERTS.read_text())["groups"]
              for rule in group["rules"]}
    assert tested == alerts, "every alert has a unit test where it fires"


def test_a_broken_alert_fails_its_unit_test(tmp_path):
    """The unit tests would notice an alert that never fires: the KV threshold raised to
    100% makes `promtool test rules` fail."""
    rules = ALERTS.read_text().replace("splitstack_kv_cache_usage_ratio) > 0.9",
                                       "splitstack_kv_cache_usage_ratio) > 1.0")
    assert rules != ALERTS.read_text()
    broken = tmp_path / "rules"
    broken.mkdir()
    (broken / "alerts.yml").write_text(rules)
    (broken / "recording.yml").write_text((PROMETHEUS_DIR / "rules" / "recording.yml").read_text())
    tests = tmp_path / "tests"
    tests.mkdir()
    for path in UNIT_TESTS:
        (tests / path.name).write_text(path.read_text())
    done = subprocess.run([binary("promtool"), "test", "rules",
                           *(str(tests / p.name) for p in UNIT_TESTS)],
                          cwd=tmp_path, text=True, capture_output=True, timeout=120)
    assert done.returncode != 0
    assert "SplitstackKVCacheNearlyFull" in done.stdout + done.stderr


def gateway_series(metrics: GatewayMetrics, minutes: int) -> list[dict]:
    """The gateway's /metrics as promtool input series: each sample of `metrics` (observed
    once) repeated every minute, counters and histograms growing by it each minute."""
    out = []
    for family in metrics.registry.collect():
        grows = family.type in ("counter", "histogram")
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            labels = {"namespace": "ns", "job": "good", "instance": "gw:8000", **s.labels}
            selector = s.name + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
            values = f"0+{s.value:g}x{minutes}" if grows else f"{s.value:g}x{minutes}"
            out.append({"series": selector, "values": values})
    return out


def test_healthy_first_tokens_through_the_gateways_buckets_fire_no_alert(tmp_path):
    """100 requests a minute whose first tokens take 0.4 s (80%) or 1.1 s (20%), observed by
    the gateway's own histograms with its default objectives, for three hours: no alert
    fires. With one bucket set for every histogram (1 and 2.5 around the 2 s objective) the
    p95 was estimated at 2.125 s and the TTFT alert fired."""
    metrics = GatewayMetrics()
    for ttft in [0.4] * 80 + [1.1] * 20:
        metrics.ttft.observe(ttft)
        metrics.http_requests.labels("/v1/completions", "200").inc()
        metrics.finish("stop", prompt_tokens=12, generated=21)
        for _ in range(20):
            metrics.itl.observe(0.03)
    minutes = 180
    case = {"name": "healthy traffic through the gateway's buckets", "interval": "1m",
            "input_series": gateway_series(metrics, minutes)
            + [{"series": 'up{namespace="ns", job="good", instance="gw:8000"}',
                "values": f"1x{minutes}"}],
            "alert_rule_test": [{"eval_time": t, "alertname": rule["alert"], "exp_alerts": []}
                                for t in ("10m", "1h", "3h") for rule in alert_rules()]}
    path = tmp_path / "healthy_test.yml"
    path.write_text(yaml.safe_dump({
        "rule_files": [str(PROMETHEUS_DIR / "rules" / "recording.yml"), str(ALERTS)],
        "evaluation_interval": "1m", "tests": [case]}))
    done = promtool("test", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr


def github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_alert_links_its_runbook_section():
    text = RUNBOOKS.read_text()
    sections = {github_anchor(h): body for h, body in
                re.findall(r"^## ([^\n]+)\n(.*?)(?=^## |\Z)", text, re.M | re.S)}
    for rule in alert_rules():
        url = rule["annotations"].get("runbook_url", "")
        path, _, anchor = url.partition("#")
        assert path == "docs/runbooks.md", (rule["alert"], url)
        assert anchor == github_anchor(rule["alert"]), (rule["alert"], url)
        body = sections.get(anchor)
        assert body is not None, f"docs/runbooks.md has no section {rule['alert']}"
        for part in ("**What it means.**", "**What to look at.**", "**What to do.**"):
            assert part in body, (rule["alert"], part)
    assert set(sections) == {github_anchor(r["alert"]) for r in alert_rules()}, \
        "a runbook section for an alert that does not exist"
