"""What a real cluster would refuse or get wrong that the schemas alone do not catch: an image
nobody can pull, monitoring objects on a cluster without the Prometheus Operator, an object
store that leaves a pod no memory, Ray pods left on an old image, a scale hook that fails
upgrades or reaches one gateway of several, fields the Ray autoscaler owns, a gateway HPA
that cannot work, and GPU scheduling that needs labels most clusters lack."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.chart import (CHART, MONITORING_API, RELEASE, REPOSITORY, VALUE_SETS, find,
                                helm, render, value_args)
from tests.deploy.test_helm_chart import pod_specs

GIB = 1 << 30
UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
         "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def memory_bytes(quantity) -> float:
    number, unit = re.fullmatch(r"([0-9.]+(?:[eE][+-]?[0-9]+)?)([A-Za-z]*)", str(quantity)).groups()
    return float(number) * UNITS[unit]


def template(*args: str) -> subprocess.CompletedProcess:
    return helm("template", RELEASE, str(CHART), *args)


# ---- 1. the image ---------------------------------------------------------------------------

def test_an_install_without_image_repository_is_refused_with_what_to_do():
    out = template()                        # the chart's defaults alone
    assert out.returncode != 0
    assert "image.repository must be set" in out.stderr
    assert "--set image.repository=" in out.stderr
    out = template("--set", "image.repository=splitstack:0.1.0")    # a tag is image.tag
    assert out.returncode != 0 and "/image/repository" in out.stderr


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_splitstack_container_runs_the_pushed_image(value_set):
    tag = "0.1.0-cuda" if value_set == "values-gpu.yaml" else "0.1.0-cpu"
    for name, spec in pod_specs(render(value_set, "pools.mlp.replicas=2")):
        for c in spec["spec"]["containers"] + spec["spec"].get("initContainers", []):
            if c["name"] != "redis":
                assert c["image"] == f"{REPOSITORY}:{tag}", (name, c["name"])


def test_the_readme_walks_through_build_push_and_install():
    readme = (CHART / "README.md").read_text()
    for step in ("make image", "podman push", "--set image.repository=", "helm upgrade",
                 "helm uninstall"):
        assert step in readme, step


# ---- 2. monitoring objects only where the Prometheus Operator is ----------------------------

@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_monitoring_objects_render_only_where_the_cluster_serves_their_api(value_set):
    operator_kinds = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    bare = {d["kind"] for d in render(value_set, api_versions=())}
    assert not bare & operator_kinds, bare & operator_kinds      # kind, plain EKS/AKS/GKE
    assert "ServiceMonitor" in {d["kind"] for d in render(value_set)}
    assert {d["kind"] for d in render(value_set, api_versions=(MONITORING_API,))} >= {
        "ServiceMonitor"}


# ---- 3. object store against each Ray pod's memory --------------------------------------------

def ray_node_limits(docs) -> dict[str, str]:
    """Memory limit of every container that starts a Ray node (gateway, head, workers)."""
    limits = {}
    gateway = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    limits["gateway"] = gateway["resources"]["limits"]["memory"]
    for name, spec in pod_specs(docs):
        if name.startswith("ray-"):
            limits[name] = spec["spec"]["containers"][0]["resources"]["limits"]["memory"]
    return limits


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_each_ray_pod_keeps_a_gib_beside_its_object_store(value_set):
    docs = render(value_set)
    ray_line = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"][
        "containers"][0]["args"][0].split(" && ")[0]
    store = int(re.search(r"--object-store-memory=(\d+)", ray_line).group(1))
    for name, limit in ray_node_limits(docs).items():
        assert memory_bytes(limit) - store >= GIB, (value_set, name, limit, store)


@pytest.mark.parametrize("limit,ok", [("2Gi", True), ("1300Mi", True), ("1200Mi", False),
                                      ("2G", True), ("1342177280", True), ("1342177279", False), ("1100M", False)])
def test_the_chart_refuses_an_object_store_that_leaves_less_than_a_gib(limit, ok):
    out = template(*value_args("values.yaml"), "--set", "ray.objectStoreMemory=268435456",
                   "--set", f"gateway.resources.limits.memory={limit}",
                   "--set", f"gateway.resources.requests.memory={limit}")
    assert (out.returncode == 0) == ok, out.stderr
    if not ok:
        assert "gateway.resources: a memory limit of" in out.stderr
        assert "leaves less than 1 GiB beside ray.objectStoreMemory" in out.stderr


# ---- 6. upgrades roll the Ray pods -------------------------------------------------------------

def kuberay_recreate_hash(raycluster: dict) -> str:
    """KubeRay's Recreate trigger (GenerateHashWithoutReplicasAndWorkersToDelete): the spec
    without each group's replicas, min, max and workersToDelete, and without upgradeStrategy."""
    spec = json.loads(json.dumps(raycluster["spec"]))
    spec.pop("upgradeStrategy", None)
    for group in spec["workerGroupSpecs"]:
        for key in ("replicas", "minReplicas", "maxReplicas"):
            group.pop(key, None)
        group.get("scaleStrategy", {}).pop("workersToDelete", None)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def test_a_new_image_tag_recreates_the_ray_pods_and_a_scale_does_not():
    old = find(render("values-cpu.yaml"), "RayCluster")
    assert old["spec"]["upgradeStrategy"] == {"type": "Recreate"}
    new_tag = find(render("values-cpu.yaml", "image.tag=0.1.1-cpu"), "RayCluster")
    scaled = find(render("values-cpu.yaml", "pools.mlp.replicas=3"), "RayCluster")
    assert kuberay_recreate_hash(new_tag) != kuberay_recreate_hash(old)
    assert kuberay_recreate_hash(scaled) == kuberay_recreate_hash(old)


# ---- 7. the scale hook -------------------------------------------------------------------------

def test_the_scale_hook_runs_only_when_a_pool_size_changes():
    """The pools ConfigMap and the hook carry a hash of the sizes; the hook renders only where
    the live ConfigMap's differs (Helm's `lookup` finds nothing without a cluster)."""
    def sizes(*sets):
        docs = render("values-cpu.yaml", *sets)
        return find(docs, "ConfigMap", "splitstack-pools")["metadata"]["annotations"][
            "splitstack.io/pool-sizes"], docs
    base, docs = sizes()
    assert find(docs, "Job", "-scale")["metadata"]["annotations"][
        "splitstack.io/pool-sizes"] == base
    assert sizes("image.tag=0.1.1-cpu")[0] == base
    assert sizes("apiKey.value=sk-new")[0] == base
    assert sizes("pools.mlp.replicas=3")[0] != base
    hook = (CHART / "templates" / "scale-hook.yaml").read_text()
    assert re.search(r'lookup "v1" "ConfigMap" .*-pools', hook)
    assert re.search(r"splitstack.io/pool-sizes.*\$live", hook)


def test_the_scale_hook_fits_helms_timeout_and_retries_in_one_deadline():
    job = find(render("values-cpu.yaml"), "Job", "-scale")
    script = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    budget = int(re.search(r"end=\$\(\( \$\(date \+%s\) \+ (\d+) \)\)", script).group(1))
    assert budget < 300                    # Helm's default --timeout waits on the hook
    assert budget < job["spec"]["activeDeadlineSeconds"] < 300
    assert job["spec"]["backoffLimit"] == 0
    assert job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]


def run_hook(tmp_path, gateways: list[str], failures: int, sets=()) -> tuple[int, list[str], str]:
    """The rendered hook script with stand-ins for `getent` (the headless Service's
    addresses), `splitstack` (fails its first `failures` calls), `date` (100 s per call)
    and `sleep`."""
    docs = render("values-cpu.yaml", "pools.mlp.replicas=3", *sets)
    script = find(docs, "Job", "-scale")["spec"]["template"]["spec"]["containers"][0]["args"][0]
    headless = find(docs, "Service", "-gateway-pods")
    assert headless["spec"]["clusterIP"] == "None"
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    calls, clock = tmp_path / "calls", tmp_path / "clock"
    stubs = {
        "getent": f'[ "$2" = {headless["metadata"]["name"]} ] || exit 2\n'
                  + "".join(f'echo "{ip} STREAM $2"\n' for ip in gateways),
        "splitstack": f'echo "$*" >> {calls}\nn=$(wc -l < {calls})\n[ "$n" -gt {failures} ]',
        "date": f'echo $(( $(cat {clock} 2>/dev/null || echo 1000) + 100 )) > {clock}.n; '
                f'mv {clock}.n {clock}; cat {clock}',
        "sleep": "true",
    }
    for name, body in stubs.items():
        (bin_ / name).write_text("#!/bin/sh\n" + body + "\n")
        (bin_ / name).chmod(0o755)
    out = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"})
    lines = calls.read_text().splitlines() if calls.exists() else []
    return out.returncode, lines, out.stdout + out.stderr


def test_the_scale_hook_resizes_every_ready_gateway(tmp_path):
    code, calls, log = run_hook(tmp_path, ["10.0.0.5", "10.0.0.9"], failures=0)
    assert code == 0, log
    urls = sorted({re.search(r"--url (\S+)", c).group(1) for c in calls})
    assert urls == ["http://10.0.0.5:8000", "http://10.0.0.9:8000"]
    assert sorted(c.split(" --")[0] for c in calls) == sorted(
        ["scale attention 1", "scale mlp 3"] * 2)


def test_the_scale_hook_retries_a_gateway_that_is_not_answering_yet(tmp_path):
    code, calls, log = run_hook(tmp_path, ["10.0.0.5"], failures=1)
    assert code == 0, log
    assert [c.split(" --")[0] for c in calls] == ["scale attention 1"] * 2 + ["scale mlp 3"]


def test_the_scale_hook_gives_up_at_its_deadline(tmp_path):
    code, calls, log = run_hook(tmp_path, ["10.0.0.5"], failures=10**6)
    assert code == 1 and "not at 1 within 240 s" in log, log
    assert 1 <= len(calls) <= 3


def test_with_no_ready_gateway_the_scale_hook_has_nothing_to_do(tmp_path):
    code, calls, log = run_hook(tmp_path, [], failures=0)
    assert code == 0 and calls == [], log


def test_a_new_api_key_rolls_the_gateways_and_a_scale_does_not():
    def annotations(*sets):
        docs = render("values-cpu.yaml", *sets)
        return find(docs, "Deployment", "-gateway")["spec"]["template"]["metadata"].get(
            "annotations", {})
    first, second = annotations("apiKey.value=sk-one"), annotations("apiKey.value=sk-two")
    assert first["checksum/api-key"] != second["checksum/api-key"]
    assert annotations("apiKey.value=sk-one", "pools.mlp.replicas=3") == first
    assert "sk-one" not in json.dumps(first)


# ---- 8. fields the Ray autoscaler owns ---------------------------------------------------------

def test_under_autoscaling_the_chart_leaves_the_groups_replicas_to_the_autoscaler():
    """Helm 4 applies server-side: a `replicas` the chart renders conflicts with (or undoes)
    the autoscaler's edit on the next upgrade."""
    for group in find(render("values-autoscale.yaml"), "RayCluster")["spec"]["workerGroupSpecs"]:
        assert "replicas" not in group, group["groupName"]
        assert group["minReplicas"] >= 1
    for group in find(render("values-cpu.yaml"), "RayCluster")["spec"]["workerGroupSpecs"]:
        assert "replicas" in group
    assert "replicas" not in find(render("values-autoscale.yaml"), "Deployment", "-gateway")["spec"]


# ---- 9. the gateway HPA ------------------------------------------------------------------------

def test_a_gateway_hpa_without_ray_autoscaling_is_refused():
    out = template(*value_args("values-cpu.yaml"), "--set", "gateway.hpa.enabled=true")
    assert out.returncode != 0
    assert "gateway.hpa.enabled needs autoscaling.enabled" in out.stderr


def test_the_gateway_hpa_scales_on_queue_depth_not_cpu():
    hpa = find(render("values-autoscale.yaml"), "HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "splitstack_requests_waiting"
    assert metric["pods"]["target"]["type"] == "AverageValue"
    assert "splitstack_requests_waiting" in (Path(__file__).parents[2] / "services" / "gateway"
                                             / "metrics.py").read_text()


def test_the_gateway_hpa_can_read_the_queue_as_an_external_metric(tmp_path):
    """Where the adapter (or KEDA's metrics server) serves external metrics only: the
    release's queue, selected by its namespace and job, averaged by the HPA over the pods."""
    docs = render("values-autoscale.yaml", "gateway.hpa.metricSource=external")
    (metric,) = find(docs, "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == "splitstack_requests_waiting"
    labels = metric["external"]["metric"]["selector"]["matchLabels"]
    assert labels["job"] == find(docs, "Service", "-gateway")["metadata"]["name"]
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "4"}
    manifest = tmp_path / "hpa.yaml"
    manifest.write_text(yaml.safe_dump(find(docs, "HorizontalPodAutoscaler")))
    out = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", "1.30.0",
                          str(manifest)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and " passed for resource " in out.stdout, out.stdout + out.stderr
    out = template(*value_args("values-autoscale.yaml"), "--set", "gateway.hpa.metricSource=cpu")
    assert out.returncode != 0 and "metricSource" in out.stderr


# ---- 10. probes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_liveness_follows_the_process_and_readiness_the_ability_to_serve(value_set):
    container = find(render(value_set), "Deployment", "-gateway")["spec"]["template"]["spec"][
        "containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"


# ---- 11. GPU scheduling --------------------------------------------------------------------------

def test_gpu_pods_schedule_on_their_gpu_requests_alone():
    """GPU Feature Discovery labels (nvidia.com/gpu.present) exist only with the GPU Operator:
    the `nvidia.com/gpu` request is what every cluster with the device plugin honours."""
    docs = render("values-gpu.yaml")
    for group in find(docs, "RayCluster")["spec"]["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        assert not spec.get("nodeSelector"), group["groupName"]
        assert "runtimeClassName" not in spec
        limits = spec["containers"][0]["resources"]["limits"]
        assert str(limits["nvidia.com/gpu"]) == "1", group["groupName"]


def test_a_runtime_class_reaches_the_pools_pods():
    docs = render("values-gpu.yaml", "pools.attention.runtimeClassName=nvidia")
    groups = {g["groupName"]: g["template"]["spec"]
              for g in find(docs, "RayCluster")["spec"]["workerGroupSpecs"]}
    assert groups["attention"]["runtimeClassName"] == "nvidia"
    assert "runtimeClassName" not in groups["mlp"]


# ---- 12, 14. Redis: bounded, and its password never in args -------------------------------------

def all_args(docs) -> str:
    return json.dumps([c.get("command", []) + c.get("args", [])
                       for _, spec in pod_specs(docs)
                       for c in spec["spec"]["containers"] + spec["spec"].get("initContainers", [])])


def test_the_in_chart_redis_is_bounded_and_evicts():
    docs = render("values-cpu.yaml")
    redis = find(docs, "StatefulSet", "-redis")["spec"]["template"]["spec"]["containers"][0]
    line = " ".join(redis["command"] + redis["args"])
    limit = memory_bytes(redis["resources"]["limits"]["memory"])
    maxmemory = int(re.search(r"'--maxmemory' '(\d+)'", line).group(1))
    assert 0 < maxmemory <= 0.8 * limit
    assert "'--maxmemory-policy' 'allkeys-lru'" in line


def test_the_redis_password_reaches_redis_and_the_gateway_through_the_environment(tmp_path):
    docs = render("values-cpu.yaml")
    secret = find(docs, "Secret", "-redis")
    password = __import__("base64").b64decode(secret["data"]["redis-password"]).decode()
    assert len(password) >= 24 and password not in all_args(docs)
    redis = find(docs, "StatefulSet", "-redis")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in redis["env"]}
    assert env["REDIS_PASSWORD"]["name"] == env["REDISCLI_AUTH"]["name"] == secret["metadata"]["name"]
    # the container's line, run: Redis starts with a config file holding the password
    stub = tmp_path / "redis-server"
    stub.write_text('#!/bin/sh\necho "$@"; cat "$1"\n')
    stub.chmod(0o755)
    line = redis["args"][0].replace("/run/redis", str(tmp_path))
    out = subprocess.run(["/bin/sh", "-c", line], capture_output=True, text=True, timeout=10,
                         env={"PATH": f"{tmp_path}:/usr/bin:/bin", "REDIS_PASSWORD": "s3cret"})
    assert out.returncode == 0, out.stderr
    assert "requirepass s3cret" in out.stdout and "allkeys-lru" in out.stdout
    gateway = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    (pw,) = [e for e in gateway["env"] if e["name"] == "SPLITSTACK_REDIS_PASSWORD"]
    assert pw["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    assert '"redis://:${SPLITSTACK_REDIS_PASSWORD}@' + RELEASE in gateway["args"][0]


def test_an_external_redis_password_comes_from_its_secret_not_the_args():
    docs = render("values.yaml", "redis.enabled=false", "redis.url=redis://cache.example:6379/2",
                  "redis.auth.existingSecret=cache-auth", "redis.auth.secretKey=password")
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-redis")]
    gateway = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    (pw,) = [e for e in gateway["env"] if e["name"] == "SPLITSTACK_REDIS_PASSWORD"]
    assert pw["valueFrom"]["secretKeyRef"] == {"name": "cache-auth", "key": "password"}
    assert '"redis://:${SPLITSTACK_REDIS_PASSWORD}@cache.example:6379/2"' in gateway["args"][0]


# ---- 13, 15. resources everywhere, PDBs, and the values a platform needs ------------------------

@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_container_init_and_hook_included_sets_resources(value_set):
    for name, spec in pod_specs(render(value_set)):
        for c in spec["spec"]["containers"] + spec["spec"].get("initContainers", []):
            limits = c.get("resources", {}).get("limits", {})
            assert "memory" in limits and "cpu" in limits, (value_set, name, c["name"])


def test_each_worker_group_has_a_disruption_budget_matching_its_pods():
    docs = render("values-autoscale.yaml")
    budgets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodDisruptionBudget"}
    for group in find(docs, "RayCluster")["spec"]["workerGroupSpecs"]:
        pdb = budgets[f"{RELEASE}-splitstack-{group['groupName']}"]["spec"]
        assert pdb["maxUnavailable"] == 1
        labels = group["template"]["metadata"]["labels"]
        assert pdb["selector"]["matchLabels"].items() <= labels.items()
        others = [g for g in find(docs, "RayCluster")["spec"]["workerGroupSpecs"] if g is not group]
        for other in others:                    # one group's budget covers no other group
            assert not pdb["selector"]["matchLabels"].items() <= other["template"]["metadata"][
                "labels"].items()


def test_extra_env_annotations_service_account_priority_and_spread_reach_the_pods():
    docs = render("values-cpu.yaml", "extraEnv[0].name=NCCL_SOCKET_IFNAME",
                  "extraEnv[0].value=eth0", "podAnnotations.team=ml", "serviceAccountName=splitstack",
                  "priorityClassName=inference", "pools.mlp.topologySpreadConstraints[0].maxSkew=1",
                  "pools.mlp.topologySpreadConstraints[0].topologyKey=kubernetes.io/hostname",
                  "pools.mlp.topologySpreadConstraints[0].whenUnsatisfiable=ScheduleAnyway")
    for name, template in pod_specs(docs):
        spec = template["spec"]
        if name.endswith("-redis"):
            continue
        for c in spec["containers"] + spec.get("initContainers", []):
            assert {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"} in c["env"], (name, c["name"])
        if name.endswith("-scale"):
            continue
        assert template["metadata"]["annotations"]["team"] == "ml", name
        assert spec["priorityClassName"] == "inference", name
        assert spec.get("serviceAccountName") == (None if name == "ray-head" else "splitstack"), name
        assert ("topologySpreadConstraints" in spec) == (name == "ray-mlp"), name


# ---- the Hugging Face download ----------------------------------------------------------------

def test_the_huggingface_init_container_downloads_the_model_through_a_mirror(tmp_path):
    """The rendered init container's command and environment, run against a loopback Hub
    (`HF_ENDPOINT`), with the token from its Secret: the checkpoint lands in model.path."""
    from tests.helpers.hub_mirror import serve

    repo_dir = tmp_path / "repo"
    repo_dir.mkdir()
    zoo = Path(__file__).parents[2] / "models" / "zoo" / "smollm2-135m"
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        (repo_dir / name).write_bytes((zoo / name).read_bytes())
    server, requests = serve(repo_dir, "org/tiny", token="hf_secret")
    try:
        endpoint = f"http://127.0.0.1:{server.server_port}"
        docs = render("values-cpu.yaml", "model.source=huggingface", "model.huggingface.repo=org/tiny",
                      "model.huggingface.tokenSecret=hf-token", f"model.huggingface.endpoint={endpoint}")
        specs = dict(pod_specs(docs))
        for name in (f"{RELEASE}-splitstack-gateway", "ray-attention", "ray-mlp"):
            (init,) = specs[name]["spec"]["initContainers"]
            assert init["name"] == "download-model", name
            volumes = {v["name"]: v for v in specs[name]["spec"]["volumes"]}
            assert "emptyDir" in volumes["model"], name
        assert "hf_secret" not in json.dumps(docs)
        env = {}
        for e in init["env"]:
            if "value" in e:
                env[e["name"]] = e["value"]
            else:
                assert e["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
                env[e["name"]] = "hf_secret"
        env["HF_HOME"] = str(tmp_path / "hf-home")
        command = list(init["command"])
        out_dir = tmp_path / "model"
        assert command[command.index("--local-dir") + 1] == "/models/smollm2-135m"
        command[command.index("--local-dir") + 1] = str(out_dir)
        command[0] = str(Path(__file__).parents[2] / ".venv" / "bin" / "hf")
        run = subprocess.run(command, capture_output=True, text=True, timeout=120,
                             env={"PATH": os.environ["PATH"], **env})
        assert run.returncode == 0, run.stdout + run.stderr
    finally:
        server.shutdown()
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        assert (out_dir / name).read_bytes() == (repo_dir / name).read_bytes()
    downloads = [r for r in requests if "/resolve/" in r[1]]
    assert downloads and all(auth == "Bearer hf_secret" for _, _, auth in downloads)


def test_a_huggingface_cache_pvc_keeps_the_download():
    docs = render("values-cpu.yaml", "model.source=huggingface", "model.huggingface.repo=org/tiny",
                  "model.huggingface.cachePvcClaimName=models-rwx")
    for name, spec in pod_specs(docs):
        volumes = {v["name"]: v for v in spec["spec"].get("volumes", [])}
        if "model" in volumes:
            assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models-rwx"}, name
