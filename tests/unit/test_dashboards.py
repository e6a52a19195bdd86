"""The Grafana dashboards in deploy/grafana/: the committed JSON is exactly what
deploy/grafana/generate.py writes, each dashboard is valid against the JSON Schema of
Grafana's dashboard type (generated from npm @grafana/schema by `make grafana-schema`), and
every panel has a title, a unit, a description and queries that carry the dashboard's
namespace, deployment, pod and member selectors and read only series docs/metrics.md lists. (That every
query returns data from a live deployment is tests/e2e/test_prometheus.py's part.)"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from deploy.grafana import generate

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
SCHEMA = ROOT / ".tools" / "grafana-schema" / "dashboard.schema.json"
# a series selector: a metric or recording rule name with its braces, or a bare
# {__name__=~...} selector
SELECTOR = re.compile(r"((?:[a-z_]+:)?splitstack_[a-z0-9_:]+)?(\{[^}]*\})")


def load(name: str) -> dict:
    return json.loads((GRAFANA / name).read_text())


def panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_regenerating_gives_the_committed_files():
    committed = {p.name: p.read_text() for p in sorted(GRAFANA.glob("*.json"))}
    generated = generate.render_all()
    assert sorted(committed) == sorted(generated), "deploy/grafana/*.json: one file per " \
        "dashboard of generate.py, and nothing else"
    stale = [name for name in generated if committed[name] != generated[name]]
    assert not stale, f"{stale} differ from what generate.py writes: run make dashboards"


def test_check_flag_reports_a_stale_file(tmp_path, capsys):
    assert generate.main(["--out", str(tmp_path)]) == 0
    assert generate.main(["--out", str(tmp_path), "--check"]) == 0
    edited = load("pools.json")
    edited["panels"][1]["title"] = "edited by hand"
    (tmp_path / "pools.json").write_text(json.dumps(edited, indent=2, sort_keys=True) + "\n")
    assert generate.main(["--out", str(tmp_path), "--check"]) == 1
    assert "pools.json" in capsys.readouterr().err


@pytest.fixture(scope="module")
def validator():
    assert SCHEMA.exists(), f"{SCHEMA} is missing: run make grafana-schema (part of make setup)"
    schema = json.loads(SCHEMA.read_text())
    # @grafana/schema types an annotation's query for the built-in Grafana datasource only
    # ("TODO.. this should just be a normal query target"); a Prometheus annotation keeps
    # its query in these fields of the annotation itself, which Grafana's Prometheus
    # datasource reads (and grafonnet writes). Only these are let through, typed.
    defs = schema.get("definitions") or schema["$defs"]
    defs["AnnotationQuery"]["properties"].update(
        {key: {"type": "string"} for key in ("expr", "step", "titleFormat", "tagKeys",
                                              "textFormat")}
        | {"useValueForTime": {"type": "boolean"}})
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def errors(validator, dashboard: dict) -> list[str]:
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in validator.iter_errors(dashboard))


@pytest.mark.parametrize("name", sorted(generate.DASHBOARDS))
def test_dashboard_matches_the_grafana_schema(validator, name):
    assert errors(validator, load(name)) == []


def test_the_schema_refuses_broken_dashboards(validator):
    """The validation is not vacuous: each of these breaks the schema."""
    good = load("overview.json")
    breakages = {
        "no schemaVersion": lambda d: d.pop("schemaVersion"),
        "a misspelt dashboard field": lambda d: d.update(titel=d["title"]),
        "a panel width as a string": lambda d: d["panels"][1]["gridPos"].update(w="wide"),
        "a misspelt panel field": lambda d: d["panels"][1].update(descripton="x"),
        "a variable without a name": lambda d: d["templating"]["list"][1].pop("name"),
    }
    for what, breaks in breakages.items():
        bad = copy.deepcopy(good)
        breaks(bad)
        assert errors(validator, bad), f"the schema accepts a dashboard with {what}"


@pytest.mark.parametrize("name", sorted(generate.DASHBOARDS))
def test_every_panel_has_title_unit_description_and_queries(name):
    d = load(name)
    ids = [p["id"] for p in d["panels"]]
    assert len(set(ids)) == len(ids) and 0 not in ids
    assert d["uid"].startswith("splitstack-") and "splitstack" in d["tags"]
    assert {"embedded", "ray"} & set(d["tags"]), "tags say which deployment has the data"
    for p in panels(d):
        where = f"{name}: {p.get('title')!r}"
        assert p["title"] and p["description"].endswith("."), where
        assert p["fieldConfig"]["defaults"]["unit"], where
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, where
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(set(refs)) == len(refs), where
        assert all(t["expr"] and t["legendFormat"] for t in p["targets"]), where


def recorded() -> set[str]:
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules" / "recording.yml")
                           .read_text())
    return {rule["record"] for group in rules["groups"] for rule in group["rules"]
            if "record" in rule}


@pytest.mark.parametrize("name", sorted(generate.DASHBOARDS))
def test_every_series_is_selected_by_namespace_deployment_pod_and_member(name):
    """Every series, raw or recorded, is selected by the variables; a recording rule must be
    one deploy/prometheus records."""
    for p in panels(load(name)):
        for t in p["targets"]:
            selectors = SELECTOR.findall(t["expr"])
            if not selectors:
                assert t["expr"] in recorded(), (p["title"], t["expr"])
                continue
            for metric, braces in selectors:
                assert 'namespace=~"$namespace"' in braces, (p["title"], t["expr"])
                assert 'job=~"$deployment"' in braces, (p["title"], t["expr"])
                # a series without the label (the gateway's own, a recording rule's)
                # matches whichever pod or member is picked
                assert 'pod=~"$pod|"' in braces and 'member=~"$member|"' in braces, \
                    (p["title"], t["expr"])
                assert metric or "__name__" in braces, (p["title"], t["expr"])
                assert ":" not in metric or metric in recorded(), (p["title"], metric)


def documented_series() -> set[str]:
    """The series docs/metrics.md lists (checked against live /metrics by the e2e test)."""
    doc = (ROOT / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\|\s*`(splitstack_\w+)`\s*\|", doc, re.M))


def series_read(expr: str) -> set[str]:
    """Metric names a query reads (recording rules left out): a histogram's by its name,
    alternations expanded."""
    names = set(re.findall(r"(?<![\w:])splitstack_\w+(?![\w:])", expr))
    for inner, suffix in re.findall(r"splitstack_\(([\w|]+)\)(\w*)", expr):
        names |= {f"splitstack_{alt}{suffix}" for alt in inner.split("|")}
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


@pytest.mark.parametrize("name", sorted(generate.DASHBOARDS))
def test_queries_read_only_documented_series(name):
    known = documented_series()
    assert len(known) > 30
    unknown = {(p["title"], series) for p in panels(load(name)) for t in p["targets"]
               for series in series_read(t["expr"]) if series not in known}
    assert unknown == set(), "not in docs/metrics.md"


def test_a_misspelt_series_is_caught():
    assert series_read("sum(rate(splitstack_prefil_seconds_bucket[1m]))") \
        - documented_series() == {"splitstack_prefil_seconds"}
    assert series_read('{__name__=~"splitstack_(attention|pool)_up"}') == \
        {"splitstack_attention_up", "splitstack_pool_up"}


def test_template_variables():
    for name in generate.DASHBOARDS:
        variables = {v["name"]: v for v in load(name)["templating"]["list"]}
        assert list(variables) == ["datasource", "namespace", "deployment", "pod", "member"]
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        for v in (variables[n] for n in ("namespace", "deployment", "pod", "member")):
            # "All" matches a scrape without the label (a local Prometheus has no namespace)
            assert v["includeAll"] and v["allValue"] == ".*", v["name"]
            assert v["current"]["value"] == "$__all", v["name"]
            assert v["datasource"]["uid"] == "${datasource}"
            assert v["query"].startswith("label_values(") and "splitstack_" in v["query"], \
                v["name"]


@pytest.mark.parametrize("name", ["overview.json", "pools.json"])
def test_scale_migration_and_drain_events_are_annotations(name):
    """The Ray deployment's events are marks on the time panels, not lines among them: each
    annotation queries Prometheus with the dashboard's selector, reads documented series,
    and titles its marks from their labels."""
    annotations = {a["name"]: a for a in load(name)["annotations"]["list"]}
    assert set(annotations) == {"Scale events", "Migrations", "Drains"}
    reads = {"Scale events": "splitstack_scale_events_total",
             "Migrations": "splitstack_migrations_total",
             "Drains": "splitstack_pool_replicas"}
    for title, a in annotations.items():
        assert a["enable"] and a["datasource"] == {"type": "prometheus",
                                                   "uid": "${datasource}"}
        assert reads[title] in a["expr"] and a["expr"].endswith("> 0"), a["expr"]
        assert series_read(a["expr"]) <= documented_series()
        for _, braces in SELECTOR.findall(a["expr"]):
            assert 'job=~"$deployment"' in braces and 'namespace=~"$namespace"' in braces
        used = set(re.findall(r"\{\{(\w+)\}\}", a["titleFormat"]))
        assert used and used <= set(a["tagKeys"].split(",")) | {"direction"}, a
        grouped = set(re.findall(r"sum by \(([\w, ]+)\)", a["expr"])[0].split(", "))
        assert used <= grouped, (title, used, grouped)   # labels the query keeps
