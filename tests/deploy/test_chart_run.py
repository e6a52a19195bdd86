"""The rendered chart run without Kubernetes: `helm template` of values-cpu.yaml, each pod
started by `tests.deploy.kubelet` as local processes in namespaces of their own (Redis, the
Ray head, each worker group's replicas, the gateway), with the command, args, env (the
Secret's values included), ports and replica counts as rendered. This catches the usual
chart defects: a command, flag, port, env var or probe path that does not match the
program. The scenario is `tests.deploy.chart_run`."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.deploy.chart import RELEASE, ROOT, find, render

API_KEY = "sk-chart-run"


def model_volume(tmp_path) -> tuple[str, ...]:
    """The zoo's checkpoint as a hostPath (no per-pod import: ~20 s each), in a copy the
    pods' user may read, as a volume the operator provides must be."""
    models = tmp_path / "models"
    shutil.copytree(ROOT / "models" / "zoo" / "smollm2-135m", models / "smollm2-135m")
    for path in [models, *models.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return ("model.source=hostPath", f"model.hostPath={models}", "model.mountPath=/mnt/models",
            "model.path=/mnt/models/smollm2-135m")


# what `make image` builds; the chart run's splitstack containers run from it when present,
# and the upgrade goes to the same image under a second tag
IMAGE_REPOSITORY, IMAGE_TAG, NEW_TAG = "localhost/splitstack", "0.1.0-cpu", "0.1.0-cpu-next"


def image_built() -> bool:
    return bool(shutil.which("podman")) and subprocess.run(
        ["podman", "image", "exists", f"{IMAGE_REPOSITORY}:{IMAGE_TAG}"]).returncode == 0


@pytest.mark.slow
def test_the_rendered_chart_serves_scales_and_loses_nothing_when_a_worker_pod_stops(tmp_path):
    """Every splitstack container from the image `make image` built (podman), Redis a host
    process, across an upgrade to a new tag; where no image is built, the repository's code
    as host processes (a machine without podman). CI builds the image first (`make
    local-image` in .ci/run) and sets SPLITSTACK_REQUIRE_IMAGE, so it never falls back."""
    runtime = "image" if image_built() else "processes"
    if runtime == "processes" and os.environ.get("SPLITSTACK_REQUIRE_IMAGE"):
        pytest.fail(f"SPLITSTACK_REQUIRE_IMAGE is set and there is no podman image "
                    f"{IMAGE_REPOSITORY}:{IMAGE_TAG} (make local-image)")
    # the key as a Secret, and a drain short enough for a test
    sets = (*model_volume(tmp_path), f"apiKey.value={API_KEY}", "serve.drainTimeoutSeconds=10",
            "ray.terminationGracePeriodSeconds=20")
    if runtime == "image":
        sets += (f"image.repository={IMAGE_REPOSITORY}", f"image.tag={IMAGE_TAG}")
    initial = render("values-cpu.yaml", *sets)
    scaled = render("values-cpu.yaml", *sets, "pools.mlp.replicas=3")
    service = find(initial, "Service", "-gateway")
    port = service["spec"]["ports"][0]["port"]
    gateway = find(initial, "Deployment", "-gateway")["spec"]["template"]["spec"]
    assert gateway["containers"][0]["ports"][0]["containerPort"] == port   # no Service NAT here
    plan = {"initial": list(initial), "scaled": list(scaled), "api_key": API_KEY,
            "url": f"http://{service['metadata']['name']}:{port}", "model": "smollm2-135m",
            "workdir": str(tmp_path)}
    if runtime == "image":
        subprocess.run(["podman", "tag", f"{IMAGE_REPOSITORY}:{IMAGE_TAG}",
                        f"{IMAGE_REPOSITORY}:{NEW_TAG}"], check=True)
        plan["images"] = [f"{IMAGE_REPOSITORY}:{t}" for t in (IMAGE_TAG, NEW_TAG)]
        plan["upgraded"] = list(render("values-cpu.yaml", *sets, "pools.mlp.replicas=3",
                                       f"image.tag={NEW_TAG}"))
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    proc = subprocess.run(
        ["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
         "--propagation", "private", sys.executable, "-m", "tests.deploy.chart_run",
         str(tmp_path / "plan.json"), str(tmp_path / "out.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert "error" not in out, out["error"] + "\n" + json.dumps(out.get("logs"), indent=1)

    if runtime == "image":      # gateway, head, 2 workers, 2 more on the scale, the hook, ...
        assert out["podman_launched"].count(f"{IMAGE_REPOSITORY}:{IMAGE_TAG}") >= 7
    # every pod of the chart ran: Redis, the Ray head, one pod per worker replica, the gateway
    owners = sorted(out["pods"].values())
    assert owners == sorted([f"Deployment/{RELEASE}-splitstack-gateway",
                             f"RayCluster/{RELEASE}-splitstack/attention",
                             f"RayCluster/{RELEASE}-splitstack/head",
                             f"RayCluster/{RELEASE}-splitstack/mlp",
                             f"StatefulSet/{RELEASE}-splitstack-redis"])
    # an OpenAI request through the gateway Service, with the key from the Secret
    assert out["chat"]["status"] == 200, out["chat"]
    assert out["chat"]["body"]["choices"][0]["message"]["content"]
    assert out["chat_without_key"] == 401
    # the gateway started first: it served only once the worker pods had joined, and each
    # member runs on a pod of its own pool's group (not the gateway's node or the head)
    assert out["served_before_workers"] is False
    assert [len(out["pools_initial"][p]) for p in ("attention", "mlp")] == [1, 1]
    for pool, members in out["pools_initial"].items():
        group_ips = {ip for name, ip in out["pod_ips_initial"].items() if f"-{pool}-" in name}
        assert {m["address"].rsplit(":", 1)[0] for m in members} <= group_ips, (
            pool, members, out["pod_ips_initial"])

    # re-rendered with 3 MLP replicas: two more worker pods, the hook's `splitstack scale`,
    # 3 members in service on 3 different pods, and no failed request under the load
    assert sorted(out["scaled_pods"].values()) == [f"RayCluster/{RELEASE}-splitstack/mlp"] * 2
    (hook,) = out["hooks"]
    assert hook["exit_codes"] == [0], hook["log"]
    mlp = out["pools_scaled"]["mlp"]
    assert [m["state"] for m in mlp] == ["ready"] * 3
    assert out["in_service"] and all(m["load"]["stage_calls"] > 0 for m in mlp), mlp
    mlp_pod_ips = {ip for name, ip in out["pod_ips"].items() if "-mlp-" in name}
    assert {m["address"].rsplit(":", 1)[0] for m in mlp} == mlp_pod_ips
    assert out["load_scale"]["failed"] == 0 and out["load_scale"]["ok"] > 0, out["load_scale"]

    # a worker pod stopped as the kubelet does (preStop drain, SIGTERM, SIGKILL after the
    # grace period): its member drained, no request lost, and the pool back at 3
    assert out["stop"]["ray-worker_prestop_rc"] == 0, out["stop"]
    assert out["load_stop"]["failed"] == 0 and out["load_stop"]["ok"] > 0, out["load_stop"]
    assert out["replaced"], out["pools_replaced"]

    if runtime == "image":
        # upgraded to a new tag: every Ray and gateway pod replaced, each new one running the
        # new image (under podman), and the deployment answers again
        upgrade = out["upgrade"]
        assert len(upgrade["replaced"]) == 6, upgrade["replaced"]   # gateway, head, 1+3 workers
        assert len(upgrade["images"]) == 6
        for name, images in upgrade["images"].items():
            assert images == [f"{IMAGE_REPOSITORY}:{NEW_TAG}"], (name, images)
        assert out["podman_launched"].count(f"{IMAGE_REPOSITORY}:{NEW_TAG}") >= 6
        assert upgrade["chat"]["status"] == 200, upgrade["chat"]
