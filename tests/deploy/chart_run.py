"""The rendered chart run by `tests.deploy.kubelet`, inside the namespaces the caller made:

    unshare --net --mount --pid --fork --kill-child --mount-proc python -m tests.deploy.chart_run PLAN OUT

PLAN (JSON): `initial` and `scaled` (rendered documents), `url` (the gateway Service),
`api_key`, `model`, `workdir`, `images` (optional: the containers of those images run from
them under podman) and `upgraded` (optional: the chart with a new image tag, applied last as
KubeRay's Recreate and the gateway's rollout do: every Ray and gateway pod replaced). It applies `initial`, the gateway first and the worker pods
only once it has been up a while (its members must wait for them), and waits for every
pod's probes, sends
one chat completion through the gateway Service, then under a small load applies `scaled`
(the difference: new worker pods), runs the post-upgrade hook and reads the pools; then,
under load again, stops a worker pod that holds an MLP member as the kubelet would, and lets
KubeRay's replacement pod come. OUT (JSON) records what happened; the test asserts on it.
"""
from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from pathlib import Path

import httpx

from tests.deploy.kubelet import REPO, VENV_BIN, Cluster


class Load:
    """Short completions from `concurrency` clients until stopped; every outcome counted."""

    def __init__(self, url: str, headers: dict, model: str, concurrency: int = 2):
        self.url, self.headers, self.model = url, headers, model
        self.ok = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True)
                         for _ in range(concurrency)]

    def _client(self) -> None:
        # a connection per request: on this loaded machine a client thread can be scheduled
        # again past the server's keep-alive (5 s) and send on a connection the server is
        # closing, a disconnect before the request was read (OpenAI's client retries those)
        with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            while not self._stop.is_set():
                try:
                    r = client.post(f"{self.url}/v1/completions", headers=self.headers,
                                    json={"model": self.model, "prompt": "The capital of France is",
                                          "max_tokens": 6, "temperature": 0})
                    if r.status_code == 200 and r.json()["choices"][0]["text"] is not None:
                        self.ok += 1
                    else:
                        self.failed.append(f"{r.status_code}: {r.text[:200]}")
                except httpx.HTTPError as err:
                    self.failed.append(f"{type(err).__name__}: {err}")

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=90)

    def result(self) -> dict:
        return {"ok": self.ok, "failed": len(self.failed), "errors": self.failed[:10]}


def pools(url: str, headers: dict) -> dict:
    data = httpx.get(f"{url}/admin/pools", headers=headers, timeout=30).json()["data"]
    return {p["pool"]: p["members"] for p in data}


def wait_for(predicate, timeout_s: float, period_s: float = 1.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(period_s)
    return False


def without_workers(docs: list[dict]) -> list[dict]:
    """The documents with every worker group at 0 replicas (the worker pods not yet joined)."""
    import copy

    docs = copy.deepcopy(docs)
    for doc in docs:
        if doc["kind"] == "RayCluster":
            for group in doc["spec"]["workerGroupSpecs"]:
                group["replicas"] = 0
    return docs


def scenario(cluster: Cluster, plan: dict, out: dict) -> None:
    url, model = plan["url"], plan["model"]
    headers = {"Authorization": f"Bearer {plan['api_key']}"}
    start = time.monotonic()
    # the gateway before any worker pod, as on a fresh install: its members must wait for
    # their pools' resources (not land on the gateway's node or the head), then land in
    # their own groups once the worker pods join
    started = cluster.apply(without_workers(plan["initial"]))
    gateway = next(p for p in started if p.owner.startswith("Deployment/"))
    # its log appears once its container starts (after the init containers)
    wait_for(lambda: gateway.log.exists() and "Ray runtime started" in gateway.log.read_text(),
             120)
    time.sleep(plan.get("workers_after_s", 20))
    out["served_before_workers"] = "splitstack serving" in gateway.log.read_text()
    started += cluster.apply(plan["initial"])
    out["pods"] = {p.name: p.owner for p in started}
    out["ready_s"] = {p.name: round(cluster.wait_ready(p, 300), 1) for p in started}
    out["up_s"] = round(time.monotonic() - start, 1)

    r = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=120,
                   json={"model": model, "max_tokens": 12, "temperature": 0,
                         "messages": [{"role": "user",
                                       "content": "What is the capital of France?"}]})
    out["chat"] = {"status": r.status_code, "body": r.json()}
    out["chat_without_key"] = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}]}).status_code
    out["pools_initial"] = pools(url, headers)
    out["pod_ips_initial"] = {p.name: p.ip for p in cluster.pods.values()}

    with Load(url, headers, model) as load:
        time.sleep(2)
        added = cluster.apply(plan["scaled"])
        out["scaled_pods"] = {p.name: p.owner for p in added}
        for p in added:
            cluster.wait_ready(p, 120)
        out["hooks"] = cluster.run_hooks(plan["scaled"], "post-upgrade", 240)
        start_service = time.monotonic()     # each member takes calls once routed to
        out["in_service"] = wait_for(lambda: all(
            m["state"] == "ready" and m["load"].get("stage_calls", 0) > 0
            for m in pools(url, headers)["mlp"]), 60)
        out["in_service_s"] = round(time.monotonic() - start_service, 1)
        out["pools_scaled"] = pools(url, headers)
    out["load_scale"] = load.result()
    out["pod_ips"] = {p.name: p.ip for p in cluster.pods.values()}

    mlp_ips = {m["address"].rsplit(":", 1)[0] for m in out["pools_scaled"]["mlp"]}
    victim = next(p for p in cluster.pods.values()
                  if p.owner.endswith("/mlp") and p.ip in mlp_ips)
    with Load(url, headers, model) as load:
        time.sleep(2)
        out["victim"] = victim.name
        out["stop"] = cluster.stop_pod(victim)
        out["pools_stopping"] = pools(url, headers)
        cluster.apply(plan["scaled"])          # KubeRay keeps the group at its replicas
        out["replaced"] = wait_for(lambda: [m["state"] for m in pools(url, headers)["mlp"]]
                                   == ["ready"] * 3, 120)
        time.sleep(2)
        out["pools_replaced"] = pools(url, headers)
    out["load_stop"] = load.result()
    if plan.get("upgraded"):
        out["upgrade"] = upgrade(cluster, plan["upgraded"], url, headers, model)
    out["total_s"] = round(time.monotonic() - start, 1)


def upgrade(cluster: Cluster, docs: list[dict], url: str, headers: dict, model: str) -> dict:
    """`helm upgrade` to a new image tag: the gateway's pod template and the RayCluster's
    spec changed, so the rollout replaces the gateway and KubeRay's Recreate every Ray pod
    (the old ones stopped as the kubelet does, at once), then the new ones come up."""
    old = [p for p in cluster.pods.values() if p.owner.split("/")[0] in ("Deployment", "RayCluster")]
    stoppers = [threading.Thread(target=cluster.stop_pod, args=(p,)) for p in old]
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join()
    new = cluster.apply(docs)
    ready = {p.name: round(cluster.wait_ready(p, 300), 1) for p in new}
    r = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=120,
                   json={"model": model, "max_tokens": 12, "temperature": 0,
                         "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    return {"replaced": sorted(p.name for p in old), "ready_s": ready,
            "images": {p.name: [c.spec["image"] for c in p.containers] for p in new},
            "chat": {"status": r.status_code, "body": r.json()}}


def main(plan_path: str, out_path: str) -> int:
    plan = json.loads(Path(plan_path).read_text())
    workdir = Path(plan["workdir"])
    profile = workdir / "profile.sh"
    profile.write_text(f"export PATH={VENV_BIN}:$PATH\n")
    out: dict = {"repo": str(REPO)}
    cluster = Cluster(workdir, profile, plan.get("images", []))
    try:
        scenario(cluster, plan, out)
    except Exception:
        out["error"] = traceback.format_exc()
        out["logs"] = {p.name: p.log.read_text()[-3000:] for p in cluster.pods.values()
                       if p.log and p.log.exists()}
    finally:
        out["podman_launched"] = cluster.launched
        cluster.close()
        Path(out_path).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
