"""Run a snippet in a fresh Python interpreter from the repository root (for process-wide
settings and measurements that a long-lived test process would already have disturbed)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_fresh(code: str, *args: str, timeout: int = 300, **env: str) -> str:
    """The stdout of `python -c code args...` (with `env` added); raises on failure."""
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, check=True,
                         capture_output=True, text=True, env={**os.environ, **env},
                         timeout=timeout)
    return out.stdout
