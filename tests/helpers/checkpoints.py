"""The tiny checkpoints' families, and variants of a saved checkpoint directory."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

FAMILIES = ["qwen3", "llama3", "qwen3_next", "qwen3_next_moe", "qwen3_5"]


def qfirst_copy(src: Path, dst: Path) -> Path:
    """A copy of checkpoint `src` at `dst` whose config declares the q-first wiring."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["splitstack_wiring"] = "qfirst"
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst
