"""The Helm chart in k8s/splitstack/ as the tests see it: `helm` (installed by `make tools`),
rendering a value set into documents, CRD schemas made strict, and the values table."""
from __future__ import annotations

import re
import subprocess
from functools import lru_cache
from pathlib import Path

import yaml

LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "k8s" / "splitstack"
HELM = ROOT / ".tools" / "bin" / "helm"
CRDS = ROOT / "k8s" / "crds"
VALUE_SETS = ("values.yaml", "values-cpu.yaml", "values-gpu.yaml", "values-autoscale.yaml")
RELEASE = "demo"
# where an operator pushed the image (`image.repository` has no default: nothing public holds it)
REPOSITORY = "registry.example.com/splitstack"
# the Prometheus Operator's API: without it the chart renders no ServiceMonitor, PodMonitor or
# PrometheusRule
MONITORING_API = "monitoring.coreos.com/v1"
# custom resource kind -> its CRD file in k8s/crds/
CRD_FILES = {
    "RayCluster": "ray.io_rayclusters.yaml",
    "ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
    "PodMonitor": "monitoring.coreos.com_podmonitors.yaml",
    "PrometheusRule": "monitoring.coreos.com_prometheusrules.yaml",
}


def helm(*args: str) -> subprocess.CompletedProcess:
    if not HELM.exists():
        raise FileNotFoundError(f"{HELM} is missing: `make tools` installs it")
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=60)


def value_args(value_set: str) -> list[str]:
    """`-f` for a value set (values.yaml itself is the chart's defaults), and the image's
    repository, which every install names."""
    files = [] if value_set == "values.yaml" else ["-f", str(CHART / value_set)]
    return [*files, "--set", f"image.repository={REPOSITORY}"]


@lru_cache(maxsize=None)
def render(value_set: str, *sets: str,
           api_versions: tuple[str, ...] = (MONITORING_API,)) -> tuple[dict, ...]:
    """`helm template` of the chart with a value set and `--set` overrides, as documents, for
    a cluster that serves `api_versions` besides the built-in ones (by default one with the
    Prometheus Operator)."""
    extra = [a for s in sets for a in ("--set", s)]
    extra += [a for v in api_versions for a in ("--api-versions", v)]
    out = helm("template", RELEASE, str(CHART), *value_args(value_set), *extra)
    if out.returncode:
        raise AssertionError(f"helm template {value_set} {sets}: {out.stderr}")
    return tuple(d for d in yaml.load_all(out.stdout, Loader=LOADER) if d)


def find(docs, kind: str, name_suffix: str = "") -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    return doc


@lru_cache(maxsize=None)
def crd_schema(kind: str) -> dict:
    """The served version's openAPIV3Schema of `kind`'s CRD, as strict JSON Schema."""
    crd = yaml.load((CRDS / CRD_FILES[kind]).read_text(), Loader=LOADER)
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    return strict_schema(version["schema"]["openAPIV3Schema"])


@lru_cache(maxsize=None)
def crd_validator(kind: str):
    """A validator of `kind` against its strict CRD schema (checked once, reused)."""
    import jsonschema

    schema = crd_schema(kind)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls.check_schema(schema)
    return cls(schema)


def strict_schema(node):
    """OpenAPI v3 (Kubernetes' dialect) -> JSON Schema that refuses unknown fields, as an API
    server with field validation does: `nullable` adds null, int-or-string takes either, and
    an object that lists properties (and keeps no unknown fields) allows no others."""
    if isinstance(node, list):
        return [strict_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict_schema(v) for k, v in node.items()
           if not k.startswith("x-kubernetes-") and k != "nullable"}
    if "(?i)" in str(out.get("pattern", "")):     # Go's regexp takes the flag anywhere
        out["pattern"] = "(?i)" + out["pattern"].replace("(?i)", "")
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    keeps_unknown = node.get("x-kubernetes-preserve-unknown-fields")
    if node.get("x-kubernetes-embedded-resource"):
        out.setdefault("properties", {}).update(
            {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
             "metadata": {"type": "object"}})
    if "properties" in out and not keeps_unknown and "additionalProperties" not in out:
        out["additionalProperties"] = False
    if keeps_unknown:
        out.pop("additionalProperties", None)
    return out


# ---- the values table ---------------------------------------------------------------------

KEY_LINE = re.compile(r"^(\s*)([A-Za-z0-9_.-]+):(.*)$")


def documented_values() -> dict[str, str]:
    """Key path -> its default as JSON-ish text, for every key of values.yaml with a `# --`
    comment (helm-docs' convention)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    documented: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    pending = False
    for line in (CHART / "values.yaml").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            pending = True
            continue
        if stripped.startswith("#") or not stripped:
            continue
        m = KEY_LINE.match(line)
        if not m:
            continue
        indent, key = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        if pending:
            path = ".".join(k for _, k in stack)
            documented[path] = default_text(lookup(values, path))
            pending = False
    return documented


def lookup(values: dict, path: str):
    for key in path.split("."):
        values = values[key]
    return values


def default_text(value) -> str:
    import json

    return json.dumps(value, separators=(", ", ": "))


def leaf_paths(values, prefix: str = "") -> list[str]:
    if isinstance(values, dict) and values:
        return [p for k, v in values.items() for p in leaf_paths(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")]


def readme_table() -> dict[str, str]:
    """Key -> default of the chart README's values table (`| key | default | description |`)."""
    rows = {}
    for line in (CHART / "README.md").read_text().splitlines():
        m = re.match(r"^\| `([^`]+)` \| `(.*?)` \|", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows
