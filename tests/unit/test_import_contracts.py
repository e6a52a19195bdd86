"""The import contracts of `.importlinter` hold for this tree, and an import that breaks a
layer is caught (checked on a copy of the packages with one bad import added)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kernels", "models", "services", "evals", "tools", "bench", "loadtest")
LINT = Path(sys.executable).with_name("lint-imports")


def lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, capture_output=True, text=True)


def test_contracts_hold():
    out = lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


@pytest.mark.parametrize("module,bad,contract", [
    ("kernels/merge.py", "import services.engine", "kernels import nothing of ours"),
    ("models/model.py", "import evals.metrics", "models import only kernels"),
    ("services/engine/engine.py", "import services.attention.runner",
     "The engine imports no gateway, attention, prefill or deployment code"),
    ("services/common/codec.py", "import services.mlp_pool.pool",
     "services.common imports no service"),
    ("services/mlp_pool/pool.py", "import services.prefix_cache.store",
     "The MLP pool imports neither attention nor the prefix cache"),
    ("services/prefix_cache/store.py", "import services.engine.engine",
     "Service packages point down, without cycles"),
    ("services/engine/decode_graph.py", "import services.engine.runner",
     "Sibling modules import each other in one direction only (no cycles)"),
    ("services/common/transport.py", "import services.common.grpc_transport",
     "Sibling modules import each other in one direction only (no cycles)"),
    ("evals/arms.py", "import evals.catalog",
     "Sibling modules import each other in one direction only (no cycles)"),
    ("services/gateway/gateway.py", "import services.engine.scheduler",
     "The gateway imports no engine internals"),
    ("services/gateway/app.py", "from services.engine.backend import EngineBackend",
     "The gateway imports no engine internals"),
])
def test_a_bad_import_breaks_its_contract(tmp_path, module, bad, contract):
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.safetensors", "*.gguf"))
    shutil.copy(ROOT / ".importlinter", tmp_path)
    with open(tmp_path / module, "a") as f:
        f.write(f"\n{bad}  # noqa\n")
    out = lint(tmp_path)
    assert out.returncode != 0
    assert f"{contract} BROKEN" in out.stdout, out.stdout
