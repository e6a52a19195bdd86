"""A small kubelet for tests: the pods of a rendered chart as local processes.

There is no Kubernetes API server here, so this runs what one would: each pod of the
rendered manifests (Deployments and StatefulSets at their replica counts, the RayCluster's
head and each worker group's replicas as KubeRay builds them, post-upgrade hook Jobs) with
its own network namespace and IP on a bridge, each container in its own mount and PID
namespace (PID 1 is the container's command, as in a container), its volumes mounted at
their paths and the rest of the filesystem read-only where the container asks for it, as the
pod's user, with the command, args and environment exactly as rendered
(ConfigMap and Secret references resolved, `$(VAR)` expanded). Service names resolve to
their pod's IP through the /etc/hosts of the private mount namespace the caller made
(`unshare --net --mount --pid`). Probes are polled as declared; stopping a pod runs its
preStop hook, then SIGTERM to each container's PID 1, then SIGKILL after the grace period.

What stands in for the image: the repository's virtualenv on PATH (and in bash -l's
profile, as the image's /etc/profile.d does), the host's /bin/sh, bash and redis-server; for
the cluster's DNS, /etc/hosts (read through the C library: GRPC_DNS_RESOLVER=native). Given
`images` (ones `make image` built), a container of such an image runs as a podman container
instead: the image's filesystem, entrypoint and PATH, in the pod's network namespace, as the
pod's user with every capability dropped, read-only where asked, its volumes bind-mounted.
"""
from __future__ import annotations

import base64
import os
import re
import shlex
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
IMAGE_ENV = {"PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp",
             "TMPDIR": "/tmp", "LANG": "C.UTF-8", "RAY_USAGE_STATS_ENABLED": "0",
             "TOKENIZERS_PARALLELISM": "false",
             # the cluster's DNS is /etc/hosts here, which gRPC's own resolver (c-ares)
             # does not read: names go through the C library's
             "GRPC_DNS_RESOLVER": "native"}
BRIDGE, SUBNET = "10.244.0.1", "10.244.0"
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def run(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def quantity(text) -> float:
    """A Kubernetes quantity as a number: "250m" -> 0.25, "2Gi" -> 2147483648."""
    units = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
             "Ti": 2**40}
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(text))
    return float(m.group(1)) * units.get(m.group(2), 1)


@dataclass
class Container:
    name: str
    proc: subprocess.Popen
    spec: dict
    podman: str | None = None       # the podman container's name, when it runs in one

    @property
    def pid1(self) -> int | None:
        """The container's PID 1, seen from here (the child `unshare` forked, or podman's)."""
        if self.podman:
            out = subprocess.run(["podman", "inspect", "--format", "{{.State.Pid}}",
                                  self.podman], capture_output=True, text=True)
            pid = out.stdout.strip()
            return int(pid) if out.returncode == 0 and pid.isdigit() and pid != "0" else None
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except OSError:
            return None
        pids = children.split()
        return int(pids[0]) if pids else None


@dataclass
class Pod:
    name: str
    ip: str
    netns: str
    spec: dict
    labels: dict
    owner: str                      # e.g. "Deployment/demo-splitstack-gateway", "RayCluster/.../mlp"
    containers: list[Container] = field(default_factory=list)
    stopping: bool = False
    dir: Path | None = None
    log: Path | None = None


class Cluster:
    """The pods of applied manifests. `apply` starts what the manifests add (pods the
    previous apply did not have); `run_hooks` runs hook Jobs to completion."""

    def __init__(self, workdir: Path, profile: Path, images: list[str] = ()):
        self.workdir = workdir
        self.images = set(images)
        self.hosts_lock = threading.Lock()      # pods stopped at once rewrite it from threads
        self.launched: list[str] = []       # the image of each podman container started
        self.pods: dict[str, Pod] = {}
        self.objects: dict[tuple[str, str], dict] = {}
        self.services: dict[str, dict] = {}
        self.next_ip = 2
        self.hosts = workdir / "hosts"
        self.hosts.write_text("127.0.0.1 localhost\n")
        run("ip", "link", "set", "lo", "up")
        run("ip", "link", "add", "br0", "type", "bridge")
        run("ip", "addr", "add", f"{BRIDGE}/24", "dev", "br0")
        run("ip", "link", "set", "br0", "up")
        Path("/run/netns").mkdir(parents=True, exist_ok=True)
        run("mount", "-t", "tmpfs", "tmpfs", "/run/netns")
        run("mount", "--bind", str(self.hosts), "/etc/hosts")
        # the image's /etc/profile.d (bash -l resets PATH), and a place for /mnt mounts
        run("mount", "-t", "tmpfs", "tmpfs", "/etc/profile.d")
        Path("/etc/profile.d/splitstack.sh").write_text(profile.read_text())
        run("mount", "-t", "tmpfs", "tmpfs", "/mnt")
        self.expose(Path(os.path.realpath(VENV_BIN / "python")))

    @staticmethod
    def expose(path: Path) -> None:
        """Make `path` (the interpreter) reachable for the pods' non-root user where an
        ancestor directory is closed to others (/root, under pyenv): that directory is
        replaced, here only, by one that holds just the way to `path`."""
        parts = path.parents[::-1][1:] + (path,)
        for i, directory in enumerate(parts[:-1]):
            if directory.stat().st_mode & 0o001:
                continue
            child = parts[i + 1]
            stage = Path("/mnt/.expose") / str(i)
            stage.mkdir(parents=True)
            run("mount", "--bind", str(child), str(stage))
            run("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", str(directory))
            (directory / child.name).mkdir() if stage.is_dir() else (directory / child.name).touch()
            run("mount", "--bind", str(stage), str(directory / child.name))

    # ---- manifests -----------------------------------------------------------------------
    def apply(self, docs: list[dict]) -> list[Pod]:
        for doc in docs:
            self.objects[(doc["kind"], doc["metadata"]["name"])] = doc
            if doc["kind"] == "Service":
                self.services[doc["metadata"]["name"]] = doc
        wanted = []
        for doc in docs:
            if "helm.sh/hook" in doc["metadata"].get("annotations", {}):
                continue
            name, kind = doc["metadata"]["name"], doc["kind"]
            if kind in ("Deployment", "StatefulSet"):
                for i in range(doc["spec"].get("replicas", 1)):
                    wanted.append((f"{name}-{i}", doc["spec"]["template"], f"{kind}/{name}"))
            elif kind == "RayCluster":
                wanted.append((f"{name}-head", self.kuberay(doc, None),
                               f"RayCluster/{name}/head"))
                for group in doc["spec"]["workerGroupSpecs"]:
                    for i in range(group["replicas"]):
                        wanted.append((f"{name}-{group['groupName']}-{i}",
                                       self.kuberay(doc, group),
                                       f"RayCluster/{name}/{group['groupName']}"))
        started = [self.start_pod(*w) for w in wanted if w[0] not in self.pods]
        self.write_hosts()
        for pod in started:
            threading.Thread(target=self.run_pod, args=(pod,), daemon=True).start()
        return started

    def kuberay(self, cluster: dict, group: dict | None) -> dict:
        """The pod KubeRay makes of a group: its template, with `ray start` (the group's
        rayStartParams, CPUs and memory from the container's limits) under bash -l."""
        import copy

        spec = cluster["spec"]
        template = copy.deepcopy((group or spec["headGroupSpec"])["template"])
        params = dict((group or spec["headGroupSpec"]).get("rayStartParams", {}))
        container = template["spec"]["containers"][0]
        limits = container.get("resources", {}).get("limits", {})
        params.setdefault("num-cpus", str(int(quantity(limits.get("cpu", "1")) + 0.999)))
        if "memory" in limits:
            params.setdefault("memory", str(int(quantity(limits["memory"]))))
        params.setdefault("metrics-export-port", "8080")
        params.setdefault("dashboard-agent-listen-port", "52365")
        head = f"{cluster['metadata']['name']}-head-svc"
        start = ["ray", "start", "--head" if group is None else f"--address={head}:6379"]
        start += [f"--{k}={v}" for k, v in params.items()] + ["--block"]
        container["command"] = ["/bin/bash", "-lc", "--"]
        container["args"] = ["ulimit -n 65536; " + " ".join(start)]
        container.setdefault("env", []).extend([
            {"name": "RAY_CLUSTER_NAME", "value": cluster["metadata"]["name"]},
            {"name": "RAY_IP", "value": head}, {"name": "RAY_PORT", "value": "6379"},
            {"name": "RAY_ADDRESS", "value": f"{head}:6379"},
            {"name": "RAY_NODE_TYPE_NAME", "value": group["groupName"] if group else "headgroup"}])
        if group is None:
            self.services[head] = {"spec": {"selector": {"ray.io/node-type": "head",
                                                         "ray.io/cluster": cluster["metadata"]["name"]}}}
            template["metadata"]["labels"].update({"ray.io/node-type": "head",
                                                   "ray.io/cluster": cluster["metadata"]["name"]})
        return template

    def write_hosts(self) -> None:
        """Each Service name (short and FQDN) -> the IP of a live pod its selector matches;
        a headless Service's name -> every such pod's."""
        lines = ["127.0.0.1 localhost"]
        for name, svc in self.services.items():
            selector = svc["spec"].get("selector", {})
            pods = [p for p in self.pods.values()
                    if not p.stopping and selector.items() <= p.labels.items()]
            headless = svc["spec"].get("clusterIP") == "None"
            for pod in pods if headless else pods[:1]:
                lines.append(f"{pod.ip} {name} {name}.default.svc "
                             f"{name}.default.svc.cluster.local")
        with self.hosts_lock:
            self.rewrite_in_place(self.hosts, "\n".join(lines) + "\n")

    @staticmethod
    def rewrite_in_place(path: Path, text: str) -> None:
        """New contents for a file that is bind-mounted (so it cannot be renamed over), with no
        moment at which a reader finds it empty or short: one write at offset 0, no O_TRUNC,
        and a comment pads it to at least its old length. A truncate-then-write leaves a window
        in which the C library finds no Service names and falls back to DNS, which this network
        namespace cannot reach ("Temporary failure in name resolution"); on a loaded machine
        the writing thread can be descheduled inside that window long enough for the clients
        to fail thousands of requests."""
        data = text.encode()
        fd = os.open(path, os.O_WRONLY)
        try:
            old = os.fstat(fd).st_size
            if len(data) < old:
                data += b"#" + b" " * (old - len(data) - 2) + b"\n"
            written = os.pwrite(fd, data, 0)
            if written != len(data):
                raise OSError(f"{path}: wrote {written} of {len(data)} bytes")
        finally:
            os.close(fd)

    # ---- pods ------------------------------------------------------------------------------
    def start_pod(self, name: str, template: dict, owner: str) -> Pod:
        n = self.next_ip
        self.next_ip += 1
        pod = Pod(name, f"{SUBNET}.{n}", f"pod{n}", template["spec"],
                  template["metadata"].get("labels", {}), owner)
        run("ip", "netns", "add", pod.netns)
        run("ip", "link", "add", f"veth{n}", "type", "veth", "peer", "name", "eth0", "netns",
            pod.netns)
        run("ip", "link", "set", f"veth{n}", "master", "br0", "up")
        for args in (["addr", "add", f"{pod.ip}/24", "dev", "eth0"], ["link", "set", "eth0", "up"],
                     ["link", "set", "lo", "up"], ["route", "add", "default", "via", BRIDGE]):
            run("ip", "-n", pod.netns, *args)
        pod.dir = self.workdir / f"{name}.{n}"      # a replacement pod reuses the name
        pod.dir.mkdir()
        pod.log = self.workdir / f"{name}.{n}.log"
        self.pods[name] = pod
        return pod

    def volume_dirs(self, pod: Pod) -> dict[str, Path]:
        out = {}
        for volume in pod.spec.get("volumes", []):
            if "hostPath" in volume:
                out[volume["name"]] = Path(volume["hostPath"]["path"])
            elif "emptyDir" in volume or "secret" in volume or "configMap" in volume:
                path = pod.dir / volume["name"]
                path.mkdir(exist_ok=True)
                path.chmod(0o1777)
                if "secret" in volume:
                    secret = self.objects[("Secret", volume["secret"]["secretName"])]
                    for item in volume["secret"].get("items", []):
                        (path / item["path"]).write_bytes(
                            base64.b64decode(secret["data"][item["key"]]))
                out[volume["name"]] = path
            else:
                raise ValueError(f"{pod.name}: volume {volume['name']} of an unsupported kind")
        return out

    def env(self, pod: Pod, container: dict) -> dict[str, str]:
        env = dict(IMAGE_ENV)
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = VAR.sub(lambda m: env.get(m.group(1), m.group(0)), e["value"])
                continue
            ref = e["valueFrom"]
            if "configMapKeyRef" in ref:
                r = ref["configMapKeyRef"]
                env[e["name"]] = self.objects[("ConfigMap", r["name"])]["data"][r["key"]]
            elif "secretKeyRef" in ref:
                r = ref["secretKeyRef"]
                env[e["name"]] = base64.b64decode(
                    self.objects[("Secret", r["name"])]["data"][r["key"]]).decode()
            elif ref.get("fieldRef", {}).get("fieldPath") == "status.podIP":
                env[e["name"]] = pod.ip
            else:
                raise ValueError(f"{pod.name}: env {e['name']}: unsupported valueFrom {ref}")
        return env

    def launch(self, pod: Pod, container: dict) -> Container:
        env = self.env(pod, container)
        argv = [VAR.sub(lambda m: env.get(m.group(1), m.group(0)), a)
                for a in container.get("command", []) + container.get("args", [])]
        dirs = self.volume_dirs(pod)
        if container.get("image") in self.images:
            return self.launch_podman(pod, container, env, argv, dirs)
        script = ["set -e"]
        # a mount over an ancestor of the volumes' own directories (/tmp) goes last
        mounts = sorted(container.get("volumeMounts", []),
                        key=lambda m: self.workdir.is_relative_to(m["mountPath"]))
        # a checkout under a mounted path (a clone in /tmp, and an emptyDir on /tmp) stays
        # reachable: stashed in the cluster's private /mnt first, put back after the mounts
        repo = shlex.quote(str(REPO))
        covered = any(REPO.is_relative_to(m["mountPath"]) for m in mounts)
        if covered:
            script.append(f"mkdir -p /mnt/.repo && mount --bind {repo} /mnt/.repo")
        for m in mounts:
            script.append(f"mkdir -p {shlex.quote(m['mountPath'])}")
            script.append(f"mount --bind {shlex.quote(str(dirs[m['name']]))} "
                          f"{shlex.quote(m['mountPath'])}")
            if m.get("readOnly"):
                script.append(f"mount -o remount,bind,ro {shlex.quote(m['mountPath'])}")
        if covered:
            script.append(f"mkdir -p {repo} && mount --bind /mnt/.repo {repo}")
        user = {**pod.spec.get("securityContext", {}), **container.get("securityContext", {})}
        if user.get("readOnlyRootFilesystem"):      # only the volumes stay writable
            script.append("mount -o remount,bind,ro /")
        uid, gid = user.get("runAsUser", 0), user.get("runAsGroup", user.get("runAsUser", 0))
        assert not (user.get("runAsNonRoot") and uid == 0), f"{pod.name}: runAsNonRoot as root"
        script.append(f"cd {shlex.quote(container.get('workingDir', '/tmp'))}")
        script.append(f"exec setpriv --reuid {uid} --regid {gid} --clear-groups "
                      f"{'--no-new-privs ' if not user.get('allowPrivilegeEscalation', True) else ''}"
                      "env -i " + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
                      + ' "$@"')
        cmd = ["ip", "netns", "exec", pod.netns, "unshare", "--mount", "--pid", "--fork",
               "--kill-child", "--mount-proc", "--propagation", "private",
               "/bin/sh", "-c", "\n".join(script), container["name"], *argv]
        with open(pod.log, "a") as log:         # the child keeps its own descriptor
            log.write(f"---- {container['name']}: {shlex.join(argv)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        return Container(container["name"], proc, container)

    def launch_podman(self, pod: Pod, container: dict, env: dict, argv: list[str],
                      dirs: dict[str, Path]) -> Container:
        """The container from the image, as a container runtime runs it: the image's own
        filesystem and PATH (the pod's env minus the host's PATH), its entrypoint replaced by
        the command as Kubernetes does, in the pod's network namespace."""
        user = {**pod.spec.get("securityContext", {}), **container.get("securityContext", {})}
        uid, gid = user.get("runAsUser", 0), user.get("runAsGroup", user.get("runAsUser", 0))
        image = container["image"]
        self.launched.append(image)
        name = f"kubelet-{pod.netns}-{container['name']}-{len(self.launched)}"
        cmd = ["podman", "run", "--rm", "--name", name, "--network", f"ns:/run/netns/{pod.netns}",
               "--no-hosts", "-v", f"{self.hosts}:/etc/hosts:ro", "--user", f"{uid}:{gid}",
               "--cap-drop=ALL", "--pull=never"]
        if not user.get("allowPrivilegeEscalation", True):
            cmd.append("--security-opt=no-new-privileges")
        if user.get("readOnlyRootFilesystem"):
            cmd += ["--read-only", "--read-only-tmpfs=false"]
        for m in container.get("volumeMounts", []):
            cmd += ["-v", f"{dirs[m['name']]}:{m['mountPath']}{':ro' if m.get('readOnly') else ''}"]
        for k, v in env.items():
            if k != "PATH":
                cmd += ["-e", f"{k}={v}"]
        if container.get("workingDir"):
            cmd += ["--workdir", container["workingDir"]]
        if argv:
            cmd += ["--entrypoint", argv[0], image, *argv[1:]]
        else:
            cmd.append(image)
        with open(pod.log, "a") as log:
            log.write(f"---- {container['name']} (podman {name}): {shlex.join(argv)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        return Container(container["name"], proc, container, podman=name)

    def run_pod(self, pod: Pod) -> None:
        """Init containers one after another, then the containers; a container that exits
        is started again (restartPolicy Always) unless the pod is stopping."""
        for init in pod.spec.get("initContainers", []):
            c = self.launch(pod, init)
            if c.proc.wait() != 0:
                pod.containers.append(c)
                return
        pod.containers = [self.launch(pod, c) for c in pod.spec["containers"]]
        if pod.spec.get("restartPolicy", "Always") != "Always":
            return
        while not pod.stopping:
            time.sleep(1)
            for i, c in enumerate(pod.containers):
                if c.proc.poll() is not None and not pod.stopping:
                    time.sleep(2)
                    pod.containers[i] = self.launch(pod, c.spec)

    # ---- probes --------------------------------------------------------------------------
    def probe(self, pod: Pod, container: Container, probe: dict) -> bool:
        timeout = probe.get("timeoutSeconds", 1)
        ports = {p["name"]: p["containerPort"] for p in container.spec.get("ports", [])}
        try:
            if "httpGet" in probe:
                port = probe["httpGet"]["port"]
                port = ports.get(port, port)
                r = httpx.get(f"http://{pod.ip}:{port}{probe['httpGet']['path']}",
                              timeout=timeout)
                return 200 <= r.status_code < 400
            if "tcpSocket" in probe:
                port = probe["tcpSocket"]["port"]
                with socket.create_connection((pod.ip, ports.get(port, port)), timeout=timeout):
                    return True
            if "exec" in probe:
                return self.exec(pod, container, probe["exec"]["command"], timeout + 5) == 0
        except (httpx.HTTPError, OSError, subprocess.TimeoutExpired):
            return False
        raise ValueError(f"{pod.name}: unsupported probe {probe}")

    def exec(self, pod: Pod, container: Container, command: list[str], timeout: float) -> int:
        """`kubectl exec`: the command in the container's namespaces, as its user."""
        pid = container.pid1
        if pid is None:
            return -1
        user = {**pod.spec.get("securityContext", {}), **container.spec.get("securityContext", {})}
        uid, gid = user.get("runAsUser", 0), user.get("runAsGroup", user.get("runAsUser", 0))
        env = self.env(pod, container.spec)
        cmd = ["nsenter", "-t", str(pid), "-n", "-m", "-p", "--", "setpriv", "--reuid", str(uid),
               "--regid", str(gid), "--clear-groups", "env", "-i",
               *[f"{k}={v}" for k, v in env.items()], *command]
        with open(pod.log, "a") as log:
            return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode

    def wait_ready(self, pod: Pod, deadline_s: float) -> float:
        """Poll the startup probe, then the readiness probe, each at its declared period,
        until every container is ready; returns the seconds it took."""
        start = time.monotonic()
        while len(pod.containers) < len(pod.spec["containers"]):
            self._check_deadline(pod, start, deadline_s)
            time.sleep(0.5)
        for i, spec in enumerate(pod.spec["containers"]):
            for kind in ("startupProbe", "readinessProbe"):
                probe = spec.get(kind)
                if not probe:
                    continue
                time.sleep(probe.get("initialDelaySeconds", 0))
                while not self.probe(pod, pod.containers[i], probe):   # restarts replace it
                    self._check_deadline(pod, start, deadline_s)
                    time.sleep(probe.get("periodSeconds", 10))
        return time.monotonic() - start

    def _check_deadline(self, pod: Pod, start: float, deadline_s: float) -> None:
        if time.monotonic() - start > deadline_s:
            raise TimeoutError(f"{pod.name} not ready after {deadline_s:.0f} s; its log:\n"
                               + pod.log.read_text()[-4000:])

    # ---- stopping and hooks ----------------------------------------------------------------
    def stop_pod(self, pod: Pod) -> dict:
        """As the kubelet deletes a pod: out of the Services, each container's preStop hook,
        SIGTERM to its PID 1, SIGKILL to what is left after terminationGracePeriodSeconds."""
        grace = pod.spec.get("terminationGracePeriodSeconds", 30)
        start = time.monotonic()
        pod.stopping = True
        self.write_hosts()
        out = {"grace_s": grace}
        for c in pod.containers:
            hook = c.spec.get("lifecycle", {}).get("preStop", {}).get("exec")
            if hook:
                try:
                    out[f"{c.name}_prestop_rc"] = self.exec(pod, c, hook["command"], grace)
                except subprocess.TimeoutExpired:
                    out[f"{c.name}_prestop_rc"] = "timeout"
        out["prestop_s"] = time.monotonic() - start
        for c in pod.containers:
            if c.pid1:
                run("kill", "-TERM", str(c.pid1))
        while time.monotonic() - start < grace and any(c.proc.poll() is None
                                                        for c in pod.containers):
            time.sleep(0.5)
        out["killed"] = [c.name for c in pod.containers if c.proc.poll() is None]
        for c in pod.containers:
            if c.proc.poll() is None:
                self.kill(c)
        out["stop_s"] = time.monotonic() - start
        del self.pods[pod.name]
        return out

    def run_hooks(self, docs: list[dict], hook: str, deadline_s: float) -> list[dict]:
        """Each Job annotated with `hook`, as a pod run to completion."""
        results = []
        for doc in docs:
            if doc["kind"] != "Job" or doc["metadata"].get("annotations", {}).get(
                    "helm.sh/hook") != hook:
                continue
            pod = self.start_pod(doc["metadata"]["name"], doc["spec"]["template"],
                                 f"Job/{doc['metadata']['name']}")
            self.run_pod(pod)
            start = time.monotonic()
            codes = []
            for c in pod.containers:
                try:
                    codes.append(c.proc.wait(timeout=max(1, deadline_s - (time.monotonic() - start))))
                except subprocess.TimeoutExpired:
                    self.kill(c)
                    codes.append("timeout")
            results.append({"job": doc["metadata"]["name"], "exit_codes": codes,
                            "log": pod.log.read_text()[-3000:]})
            pod.stopping = True
            del self.pods[pod.name]
        return results

    @staticmethod
    def kill(c: Container) -> None:
        """SIGKILL to the container (unshare --kill-child: to PID 1, and so the pod; podman:
        its container, which outlives a killed `podman run`)."""
        if c.podman:
            subprocess.run(["podman", "rm", "--force", "--time", "0", c.podman],
                           capture_output=True, timeout=60)
        c.proc.kill()
        c.proc.wait()

    def close(self) -> None:
        for pod in list(self.pods.values()):
            pod.stopping = True
            for c in pod.containers:
                if c.proc.poll() is None:
                    self.kill(c)
