"""An alert rule that never fires is worse than none: deploy/prometheus/ checked by Debian's promtool (`make setup` installs
it): the scrape config and the rule files it names are valid, and the rules' unit tests
(deploy/prometheus/tests/) show each alert firing on a synthetic faulty series and silent on
a healthy one."""
from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.helpers.prometheus import PROMETHEUS_DIR, binary

pytestmark = pytest.mark.slow      # runs promtool in a subprocess

ALERTS = PROMETHEUS_DIR / "rules" / "alerts.yml"
UNIT_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*.yml"))


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
