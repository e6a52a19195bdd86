"""The Helm chart (k8s/splitstack/) checked without a cluster: `helm lint --strict` and
`helm template` on each value set, the values schema refusing bad value files with the error
each must give, built-in kinds through `kubernetes-validate --strict`, custom resources
strictly against their CRDs, the rendered command lines against splitstack's and Ray's own
parsers, and the chart's README and synced files against their sources."""
from __future__ import annotations

import copy
import filecmp
import re
import shlex
import subprocess
import sys
from functools import lru_cache

import jsonschema
import pytest
import yaml

from services.common.member_metrics import PORT_ENV as MEMBER_METRICS_PORT_ENV
from services.deployment.ray_cluster import POOLS, pool_resource
from tests.deploy.chart import (CHART, CRD_FILES, RELEASE, ROOT, VALUE_SETS, crd_validator,
                                documented_values, find, helm, leaf_paths, readme_table,
                                render, value_args)

BAD_VALUES = sorted((CHART / "tests" / "bad-values").glob("*.yaml"))
WORKLOADS = ("Deployment", "StatefulSet", "Job")


def expected_error(path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# error: "), f"{path.name} must start with '# error: ...'"
    return first.removeprefix("# error: ").strip()


def pod_specs(docs):
    """(name, pod spec) of every pod the release runs: workloads and the RayCluster's groups."""
    for doc in docs:
        if doc["kind"] in WORKLOADS:
            yield doc["metadata"]["name"], doc["spec"]["template"]
        elif doc["kind"] == "RayCluster":
            yield "ray-head", doc["spec"]["headGroupSpec"]["template"]
            for group in doc["spec"]["workerGroupSpecs"]:
                yield f"ray-{group['groupName']}", group["template"]


def selects(selector: dict, labels: dict) -> bool:
    """Whether a Kubernetes label selector (matchLabels and matchExpressions) takes `labels`."""
    ops = {"In": lambda key, values: labels.get(key) in values,
           "NotIn": lambda key, values: labels.get(key) not in values,
           "Exists": lambda key, _: key in labels,
           "DoesNotExist": lambda key, _: key not in labels}
    return (selector.get("matchLabels", {}).items() <= labels.items()
            and all(ops[e["operator"]](e["key"], e.get("values", []))
                    for e in selector.get("matchExpressions", [])))


def relabel(labels: dict, configs: list[dict]) -> dict:
    """A target's labels after Prometheus' `replace` and `labeldrop` relabelings (the
    actions the chart uses), applied in order: the regex anchored at both ends, `$1` its
    first group."""
    out = dict(labels)
    for config in configs:
        action = config.get("action", "replace").lower()
        if action == "labeldrop":
            out = {k: v for k, v in out.items() if not re.fullmatch(config["regex"], k)}
            continue
        assert action == "replace", config
        sources = [out.get(k, "") for k in config.get("sourceLabels", [])]
        value = config.get("separator", ";").join(sources)
        match = re.fullmatch(config.get("regex", "(.*)"), value)
        if match:
            template = re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", config.get("replacement", "$1"))
            out[config["targetLabel"]] = match.expand(template)
    return out


# ---- helm lint and the schema ---------------------------------------------------------------

@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_helm_lint_strict(value_set):
    out = helm("lint", "--strict", str(CHART), *value_args(value_set))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


def test_at_least_six_bad_value_files_are_refused_by_the_schema():
    schema_errors = [p for p in BAD_VALUES if expected_error(p).startswith("at '/")]
    assert len(schema_errors) >= 6, [p.name for p in schema_errors]


@pytest.mark.parametrize("bad", BAD_VALUES, ids=lambda p: p.stem)
def test_bad_values_are_refused_with_their_error(bad):
    """`helm template` (and so `helm install`) refuses each; `helm lint` too for a schema
    error (it reports the chart's own `fail` checks only as INFO)."""
    schema_error = expected_error(bad).startswith("at '/")
    for command in (["template", RELEASE], ["lint", "--strict"])[:2 if schema_error else 1]:
        out = helm(*command, str(CHART), *value_args("values.yaml"), "-f", str(bad))
        assert out.returncode != 0, f"helm {command[0]} accepted {bad.name}"
        assert expected_error(bad) in out.stdout + out.stderr, out.stdout + out.stderr


# ---- rendered manifests against Kubernetes' schemas ------------------------------------------

@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_builtin_kinds_pass_kubernetes_validate_strict(value_set, tmp_path):
    docs = [d for d in render(value_set) if d["kind"] not in CRD_FILES]
    manifest = tmp_path / "builtin.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    versions = ["1.30.0", "1.35.0"]
    out = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict",
                          *[a for v in versions for a in ("-k", v)], str(manifest)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WARN" not in out.stdout and "ERROR" not in out.stdout, out.stdout
    assert out.stdout.count(" passed for resource ") == len(docs) * len(versions), out.stdout


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_custom_resources_validate_strictly_against_their_crds(value_set):
    docs = render(value_set)
    kinds = {d["kind"] for d in docs if d["kind"] in CRD_FILES}
    assert {"RayCluster", "ServiceMonitor", "PodMonitor"} <= kinds
    if list((CHART / "files" / "rules").glob("*.yml")):
        assert "PrometheusRule" in kinds
    for doc in docs:
        if doc["kind"] in CRD_FILES:
            crd_validator(doc["kind"]).validate(doc)


@pytest.mark.parametrize("mistake", [
    ("maxReplicaz", lambda rc: rc["spec"]["workerGroupSpecs"][1].update(maxReplicaz=4)),
    ("replicas", lambda rc: rc["spec"]["workerGroupSpecs"][1].update(replicas="two")),
    ("readinesProbe", lambda rc: rc["spec"]["headGroupSpec"]["template"]["spec"]
     ["containers"][0].update(readinesProbe={})),
    ("upscalingMode", lambda rc: rc["spec"].update(autoscalerOptions={"upscalingMode": "Fast"})),
], ids=lambda m: m[0])
def test_the_strict_crd_check_catches_a_bad_rendered_field(mistake):
    """An unknown or mistyped field anywhere in the RayCluster, pod templates included, is an
    error, as a real API server with field validation reports it."""
    field, spoil = mistake
    raycluster = copy.deepcopy(find(render("values-cpu.yaml"), "RayCluster"))
    crd_validator("RayCluster").validate(raycluster)
    spoil(raycluster)
    with pytest.raises(jsonschema.ValidationError) as err:
        crd_validator("RayCluster").validate(raycluster)
    assert field in str(err.value) or field in list(err.value.absolute_path)


@pytest.mark.parametrize("kind,endpoints", [("ServiceMonitor", "endpoints"),
                                            ("PodMonitor", "podMetricsEndpoints")])
def test_the_strict_crd_check_catches_a_bad_monitor_field(kind, endpoints):
    monitor = copy.deepcopy(find(render("values.yaml"), kind))
    crd_validator(kind).validate(monitor)
    monitor["spec"][endpoints][0]["scrapeIntervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError, match="scrapeIntervall"):
        crd_validator(kind).validate(monitor)


# ---- the chart against the programs it runs --------------------------------------------------

@lru_cache(maxsize=1)
def ray_start_help() -> str:
    return subprocess.run([str(ROOT / ".venv" / "bin" / "ray"), "start", "--help"],
                          capture_output=True, text=True, timeout=120, check=True).stdout


def gateway_command(docs) -> tuple[list[str], list[str]]:
    """The gateway container's `ray start` and `splitstack serve` argv, with the pool sizes
    the ConfigMap gives in their environment."""
    pools = find(docs, "ConfigMap", "splitstack-pools")["data"]
    env = {f"SPLITSTACK_{p.upper()}_REPLICAS": pools[p] for p in POOLS}
    container = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["/bin/sh", "-c"]
    line = re.sub(r'"\$(\w+)"', lambda m: env[m.group(1)], container["args"][0])
    ray, serve = line.split(" && exec ")
    return shlex.split(ray), shlex.split(serve)


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_rendered_commands_parse_as_splitstack_and_ray_flags(value_set, monkeypatch):
    from services.cli import build_parser
    from services.cli.serve_args import ServeArgs

    docs = render(value_set)
    ray, serve = gateway_command(docs)
    monkeypatch.delenv("SPLITSTACK_API_KEY", raising=False)
    args = build_parser().parse_args(serve[1:])
    assert args.command == "serve"
    settings = ServeArgs.from_cli(args)      # every value and combination serve refuses
    assert settings.uses_cluster and settings.host == "0.0.0.0"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    overlay = {} if value_set == "values.yaml" else yaml.safe_load((CHART / value_set).read_text())
    pools = {**values["pools"], **overlay.get("pools", {})}
    config = settings.cluster_config()
    assert config.attention_shards == pools["attention"]["replicas"]
    assert config.prefill_replicas == pools["prefill"]["replicas"]
    assert config.transport == overlay.get("serve", {}).get("transport", "grpc")
    assert ray[:2] == ["ray", "start"]
    for flag in ray[2:]:
        assert re.search(rf"^\s+{re.escape(flag.split('=')[0])}\b", ray_start_help(), re.M), flag
    for name, spec in pod_specs(docs):
        for container in spec["spec"].get("initContainers", []):
            if container["name"] == "import-model":
                parsed = build_parser().parse_args(container["command"][1:])
                assert parsed.command == "import-gguf" and parsed.out == settings.model, name


def test_the_objectives_are_set_once_in_values():
    """`monitoring.slo` reaches the gateway as --slo-ttft-ms / --slo-itl-ms: the objectives
    its /metrics exports to the rules and dashboards, and the autoscaler's targets."""
    from services.cli import build_parser
    from services.cli.serve_args import ServeArgs

    for sets, ttft, itl in (((), 2.0, 0.2),
                            (("monitoring.slo.ttftMs=800", "monitoring.slo.itlMs=50"),
                             0.8, 0.05)):
        _, serve = gateway_command(render("values-autoscale.yaml", *sets))
        settings = ServeArgs.from_cli(build_parser().parse_args(serve[1:]))
        objectives = settings.gateway_options()["objectives"]
        assert (objectives.ttft_s, objectives.itl_s) == pytest.approx((ttft, itl))
        policy = settings.autoscaler().policy
        assert (policy.slo_ttft_s, policy.slo_itl_s) == pytest.approx((ttft, itl))


@pytest.mark.parametrize("endpoint", ["", "http://otel-collector.observability:4317"])
def test_tracing_reaches_the_gateway_as_its_otlp_flag(endpoint):
    """`monitoring.tracing.otlpEndpoint` is the gateway's --otlp-traces-endpoint (which it
    hands its members); empty: none (an unset flag falls back to the OTEL environment)."""
    from services.cli import build_parser
    from services.cli.serve_args import ServeArgs

    _, serve = gateway_command(render("values.yaml",
                                      f"monitoring.tracing.otlpEndpoint={endpoint}"))
    settings = ServeArgs.from_cli(build_parser().parse_args(serve[1:]))
    assert ("--otlp-traces-endpoint" in serve) == bool(endpoint)
    assert settings.cluster_config().otlp_traces_endpoint == (endpoint or None)


def test_the_scale_hook_runs_splitstack_scale_for_each_resizable_pool():
    from services.cli import build_parser

    docs = render("values-cpu.yaml", "pools.mlp.replicas=3")
    job = find(docs, "Job", "-scale")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-upgrade"
    line = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    specs = re.search(r"for p in ([^;]+);", line).group(1).split()
    assert specs == ["attention=1", "mlp=3"]       # no prefill replicas: not resizable
    argv = shlex.split(re.search(r"until (splitstack scale .*?); do", line).group(1)
                       .replace('"${p%=*}"', "mlp").replace('"${p#*=}"', "3")
                       .replace('"$(( end - $(date +%s) ))"', "240")
                       .replace("$ip", "10.0.0.7"))
    args = build_parser().parse_args(argv[1:])
    gateway = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert (args.pool, args.replicas, args.wait) == ("mlp", 3, True)
    assert args.url == f"http://10.0.0.7:{gateway['ports'][0]['containerPort']}"
    assert find(docs, "ConfigMap", "splitstack-pools")["data"]["mlp"] == "3"
    mlp = find(docs, "RayCluster")["spec"]["workerGroupSpecs"][1]
    assert (mlp["groupName"], mlp["replicas"]) == ("mlp", 3)
    # the gateway's pod template does not change: a scale restarts no gateway
    before = find(render("values-cpu.yaml"), "Deployment", "-gateway")["spec"]["template"]
    assert find(docs, "Deployment", "-gateway")["spec"]["template"] == before


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_each_worker_group_offers_its_pools_ray_resource(value_set):
    raycluster = find(render(value_set), "RayCluster")
    groups = {g["groupName"]: g for g in raycluster["spec"]["workerGroupSpecs"]}
    assert sorted(groups) == sorted(POOLS)
    for pool, group in groups.items():
        resources = yaml.safe_load(group["rayStartParams"]["resources"])   # '"{...}"' quoted
        assert yaml.safe_load(resources) == {pool_resource(pool): 1}
        # under autoscaling the Ray autoscaler owns `replicas` (KubeRay starts at minReplicas)
        replicas = group.get("replicas", group["minReplicas"])
        assert group["minReplicas"] <= replicas <= group["maxReplicas"]
    head = raycluster["spec"]["headGroupSpec"]["rayStartParams"]
    assert head["num-cpus"] == "0" and "resources" not in head    # no member on the head


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_probes_ports_and_drain_match_the_gateway(value_set):
    docs = render(value_set)
    _, serve = gateway_command(docs)
    pod = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    port = int(serve[serve.index("--port") + 1])
    assert container["ports"] == [{"name": "http", "containerPort": port}]
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    drain = float(serve[serve.index("--drain-timeout") + 1])
    sleep = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > sleep + drain
    service = find(docs, "Service", "-gateway")
    assert service["spec"]["ports"][0]["targetPort"] == "http"


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_pod_is_non_root_without_privilege_escalation(value_set):
    for name, template in pod_specs(render(value_set)):
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        for container in spec["containers"] + spec.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (name, container["name"])
            assert sc["readOnlyRootFilesystem"] is True, (name, container["name"])
            assert sc["capabilities"]["drop"] == ["ALL"], (name, container["name"])
            mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
            assert container["name"] == "redis" or "/tmp" in mounts, (name, container["name"])


def test_network_policies_open_only_the_gateway_and_member_metrics_ports():
    docs = render("values.yaml")
    internal = find(docs, "NetworkPolicy", "-internal")["spec"]
    outside = find(docs, "NetworkPolicy", "-gateway")["spec"]
    selector = internal["podSelector"]["matchLabels"]
    assert internal["ingress"] == [{"from": [{"podSelector": {"matchLabels": selector}}]}]
    for name, template in pod_specs(docs):      # every pod, Ray's included, is covered
        labels = template["metadata"]["labels"]
        assert selector.items() <= labels.items(), name
    assert outside["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]
    gateway = find(docs, "Deployment", "-gateway")["spec"]["template"]["metadata"]["labels"]
    assert outside["podSelector"]["matchLabels"].items() <= gateway.items()
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "NetworkPolicy"} == {
        f"{RELEASE}-splitstack-{n}" for n in ("internal", "gateway", "member-metrics")}


@pytest.mark.parametrize("sets", [(), ("networkPolicy.gatewayFrom[0].namespaceSelector"
                                       ".matchLabels.name=monitoring",)])
def test_prometheus_reaches_the_members_metrics_wherever_it_reaches_the_gateways(sets):
    """The gateway's /metrics is scraped through its HTTP port, open to
    `networkPolicy.gatewayFrom`: each worker pod's member metrics port opens to the same
    peers, and to nothing else on any other pod."""
    docs = render("values.yaml", *sets)
    gateway = find(docs, "NetworkPolicy", "-gateway")["spec"]
    members = find(docs, "NetworkPolicy", "-member-metrics")["spec"]
    assert members["policyTypes"] == ["Ingress"]
    assert members["ingress"] == [{**gateway["ingress"][0],
                                   "ports": [{"port": "member-metrics", "protocol": "TCP"}]}]
    assert ("from" in members["ingress"][0]) == bool(sets)
    opened = {name for name, t in pod_specs(docs)
              if selects(members["podSelector"], t["metadata"]["labels"])}
    assert opened == {f"ray-{pool}" for pool in POOLS}


def test_the_api_key_comes_from_a_secret():
    docs = render("values.yaml", "apiKey.value=sk-test")
    secret = find(docs, "Secret", "-api-key")
    env = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]["env"]
    (key,) = [e for e in env if e["name"] == "SPLITSTACK_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    assert "sk-test" not in yaml.safe_dump(find(docs, "Deployment", "-gateway"))


def test_the_admin_key_is_its_own_secret_for_the_gateway_and_the_scale_hook():
    docs = render("values-cpu.yaml", "apiKey.value=sk-client", "adminApiKey.value=sk-admin",
                  "pools.mlp.replicas=3")
    secret = find(docs, "Secret", "-admin-api-key")
    assert secret["metadata"]["name"] != find(docs, "Secret", "-splitstack-api-key")[
        "metadata"]["name"]
    for kind, name in (("Deployment", "-gateway"), ("Job", "-scale")):
        obj = find(docs, kind, name)
        (container,) = [c for c in obj["spec"]["template"]["spec"]["containers"]
                        if c["name"] in ("gateway", "scale")]
        (key,) = [e for e in container["env"] if e["name"] == "SPLITSTACK_ADMIN_API_KEY"]
        assert key["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"],
                                                    "key": "admin-api-key"}, kind
        assert "sk-admin" not in yaml.safe_dump(obj) and "sk-client" not in yaml.safe_dump(obj)
    # without one, nothing asks for it (the gateway's /admin/ then takes the client key)
    plain = render("values-cpu.yaml", "apiKey.value=sk-client")
    assert "SPLITSTACK_ADMIN_API_KEY" not in yaml.safe_dump_all(plain)


@pytest.mark.parametrize("source,volume", [("pvc", "persistentVolumeClaim"),
                                           ("hostPath", "hostPath"), ("image", None)])
def test_model_sources(source, volume):
    sets = {"pvc": ["model.pvcClaimName=models"], "hostPath": ["model.hostPath=/srv/models"],
            "image": []}[source]
    docs = render("values.yaml", f"model.source={source}", *sets)
    for name, template in pod_specs(docs):
        if not name.endswith(("-gateway", "ray-attention", "ray-mlp", "ray-prefill")):
            continue
        spec = template["spec"]
        assert "initContainers" not in spec, name
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert (volume in volumes["model"]) if volume else ("model" not in volumes), name


# ---- the chart's files against their sources -------------------------------------------------

@pytest.mark.parametrize("copies,sources,pattern", [
    ("files/rules", "deploy/prometheus/rules", "*.yml"),
    ("files/dashboards", "deploy/grafana", "*.json"),
])
def test_chart_copies_match_their_sources(copies, sources, pattern):
    """Helm reads only the chart's directory: `make chart-sync` copies the rules and the
    dashboards in, and a copy that differs from its source is stale."""
    copied = sorted(p.name for p in (CHART / copies).glob(pattern))
    source = sorted(p.name for p in (ROOT / sources).glob(pattern))
    assert copied == source, "run `make chart-sync`"
    for name in copied:
        assert filecmp.cmp(CHART / copies / name, ROOT / sources / name, shallow=False), name


def test_readme_values_table_matches_values_yaml():
    documented = documented_values()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    undocumented = [p for p in leaf_paths(values)
                    if not any(p == d or p.startswith(d + ".") for d in documented)]
    assert not undocumented, f"keys without a '# --' comment in values.yaml: {undocumented}"
    assert readme_table() == documented


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_worker_pods_drain_their_members_before_they_stop(value_set):
    """The preStop hook signals every member class Ray may run on a worker pod (Ray names an
    actor's process `ray::Class`), and the pod's grace period outlasts the drain."""
    from services.deployment.ray_cluster import AttentionReplica, PoolReplica, PrefillReplica

    docs = render(value_set)
    _, serve = gateway_command(docs)
    drain = float(serve[serve.index("--drain-timeout") + 1])
    for group in find(docs, "RayCluster")["spec"]["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        line = spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][2]
        pattern = re.search(r"pkill -TERM -f '([^']+)'", line).group(1)
        for member in (AttentionReplica, PoolReplica, PrefillReplica):
            assert re.match(pattern, f"ray::{member.__name__}"), member
        assert re.search(rf"while pgrep -f '{re.escape(pattern)}'", line)
        assert spec["terminationGracePeriodSeconds"] > drain


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_install_notes_name_the_gateway_service(value_set):
    out = helm("install", RELEASE, str(CHART), *value_args(value_set), "--dry-run=client")
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    service = find(render(value_set), "Service", "-gateway")["metadata"]["name"]
    assert f"port-forward svc/{service} " in notes
    assert f"rollout status deploy/{service} " in notes


# the labels the Prometheus operator puts on every target of a ServiceMonitor or PodMonitor
OPERATOR_TARGET_LABELS = {"job", "instance", "namespace", "service", "pod", "container",
                          "endpoint"}


def test_the_servicemonitor_needs_no_honor_labels():
    """No exported label collides with a target label the operator adds, so none is
    renamed `exported_*` and the scrape takes the operator's labels as they are (the members'
    series carry `member`, not `service`). docs/metrics.md lists every exported label and is
    checked against live servers (tests/e2e/test_prometheus.py)."""
    (endpoint,) = find(render("values.yaml"), "ServiceMonitor")["spec"]["endpoints"]
    assert "honorLabels" not in endpoint and endpoint["path"] == "/metrics"
    doc = (ROOT / "docs" / "metrics.md").read_text()
    labels = {label for row in re.findall(r"^\|\s*`splitstack_\w+`\s*\|[^|]*\|([^|]*)\|", doc, re.M)
              for label in re.findall(r"`(\w+)`", row)}
    assert "member" in labels and "route" in labels
    assert labels & OPERATOR_TARGET_LABELS == set()
    crd_validator("ServiceMonitor").validate(find(render("values.yaml"), "ServiceMonitor"))


def test_the_prometheus_rule_carries_the_rules_and_absolute_runbook_links():
    """The PrometheusRule holds every group of deploy/prometheus/rules/; with
    monitoring.prometheusRule.runbookUrl each alert's runbook_url is that page plus the
    alert's anchor, and without it the repository path."""
    source = {}
    for path in sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            source[group["name"]] = group
    url = "https://example.com/splitstack/docs/runbooks.md"
    for sets, prefix in (((), "docs/runbooks.md"),
                         ((f"monitoring.prometheusRule.runbookUrl={url}",), url)):
        rule = find(render("values.yaml", *sets), "PrometheusRule")
        groups = {g["name"]: g for g in rule["spec"]["groups"]}
        assert groups.keys() == source.keys()
        for name, group in groups.items():
            for got, want in zip(group["rules"], source[name]["rules"], strict=True):
                if "alert" not in want:
                    assert got == want
                    continue
                anchor = want["annotations"]["runbook_url"].partition("#")[2]
                assert got["annotations"]["runbook_url"] == f"{prefix}#{anchor}"
                assert {**got, "annotations": {}} == {**want, "annotations": {}}


# ---- the members' own /metrics: a PodMonitor on the Ray worker pods --------------------------


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_the_podmonitor_renders_with_the_operator_api_unless_disabled(value_set):
    """Like the ServiceMonitor: by default where the cluster serves the Prometheus Operator's
    API, never where it does not (the install would fail), and not when turned off."""
    def kinds(*sets, **kw):
        return [d["kind"] for d in render(value_set, *sets, **kw)]

    assert kinds().count("PodMonitor") == 1
    assert "PodMonitor" not in kinds(api_versions=())
    off = kinds("monitoring.podMonitor.enabled=false")
    assert "PodMonitor" not in off and "ServiceMonitor" in off


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_the_podmonitor_selects_exactly_the_worker_pods(value_set):
    """Every worker group's pods (where the members run), neither the head (no member) nor
    the gateway (the ServiceMonitor's) nor any other pod, nor another release's workers."""
    docs = render(value_set)
    selector = find(docs, "PodMonitor")["spec"]["selector"]
    templates = dict(pod_specs(docs))
    matched = {name for name, t in templates.items() if selects(selector, t["metadata"]["labels"])}
    assert matched == {f"ray-{pool}" for pool in POOLS}
    other = {**templates["ray-mlp"]["metadata"]["labels"], "app.kubernetes.io/instance": "other"}
    assert not selects(selector, other)


@pytest.mark.parametrize("sets,port", [((), 9400), (("monitoring.podMonitor.port=9555",), 9555),
                                       (("monitoring.podMonitor.enabled=false",), 9400)])
def test_each_worker_container_serves_member_metrics_on_the_scraped_port(sets, port):
    """The PodMonitor's port name is a containerPort of every worker container, whose number
    is the SPLITSTACK_MEMBER_METRICS_PORT its member binds (the last entry of a name wins)."""
    docs = render("values.yaml", *sets)
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    name = monitors[0]["spec"]["podMetricsEndpoints"][0]["port"] if monitors else "member-metrics"
    for group in find(docs, "RayCluster")["spec"]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        (declared,) = [p for p in container["ports"] if p["name"] == name]
        assert (declared["containerPort"], declared.get("protocol", "TCP")) == (port, "TCP")
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[MEMBER_METRICS_PORT_ENV] == str(port), group["groupName"]
    head = find(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert MEMBER_METRICS_PORT_ENV not in {e["name"] for e in head["env"]}    # no member there


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_the_members_targets_join_their_gateways_job_and_name_their_pool(value_set):
    """The operator sets a ServiceMonitor target's job to its Service's name (no jobLabel):
    the one Service the ServiceMonitor selects. Each member's target gets that job, so that
    `by (namespace, job)` sees the gateway and its members as one deployment, and its worker
    group as `pool`."""
    docs = render(value_set)
    service_monitor = find(docs, "ServiceMonitor")
    assert "jobLabel" not in service_monitor["spec"]
    (service,) = [d for d in docs if d["kind"] == "Service"
                  and selects(service_monitor["spec"]["selector"], d["metadata"]["labels"])]
    (scraped,) = service_monitor["spec"]["endpoints"]
    assert scraped["port"] in {p["name"] for p in service["spec"]["ports"]}
    (endpoint,) = find(docs, "PodMonitor")["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    for group in find(docs, "RayCluster")["spec"]["workerGroupSpecs"]:
        component = group["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        target = relabel({"job": f"{RELEASE}/{RELEASE}-splitstack-members", "namespace": RELEASE,
                          "pod": "w-1", "__meta_kubernetes_pod_name": "w-1",
                          "__meta_kubernetes_pod_label_app_kubernetes_io_component": component},
                         endpoint["relabelings"])
        assert target["job"] == service["metadata"]["name"]
        assert target["pool"] == group["groupName"]
        # the dashboards' `pod=~"$pod|"` (a gateway pod) lets a series without `pod` through
        assert "pod" not in target and target["ray_pod"] == "w-1"


@pytest.mark.parametrize("sets,interval", [
    ((), "15s"), (("monitoring.serviceMonitor.interval=1m",), "1m"),
    (("monitoring.podMonitor.interval=30s",), "30s"),
])
def test_the_podmonitor_scrapes_as_often_as_the_servicemonitor_unless_set(sets, interval):
    (endpoint,) = find(render("values.yaml", *sets), "PodMonitor")["spec"]["podMetricsEndpoints"]
    assert endpoint["interval"] == interval


def test_the_podmonitor_needs_no_honor_labels():
    """The target labels a member's series get (the operator's and `pool`) are none of the
    labels a member exports (docs/metrics.md: the rows that carry `member`)."""
    (endpoint,) = find(render("values.yaml"), "PodMonitor")["spec"]["podMetricsEndpoints"]
    assert "honorLabels" not in endpoint
    added = OPERATOR_TARGET_LABELS | {c["targetLabel"] for c in endpoint["relabelings"]
                                      if "targetLabel" in c}
    assert "pool" in added
    doc = (ROOT / "docs" / "metrics.md").read_text()
    rows = re.findall(r"^\|\s*`splitstack_\w+`\s*\|[^|]*\|([^|]*)\|", doc, re.M)
    exported = [set(re.findall(r"`(\w+)`", row)) for row in rows]
    member_labels = set().union(*[labels for labels in exported if "member" in labels])
    assert "member" in member_labels
    assert member_labels & added == set()
