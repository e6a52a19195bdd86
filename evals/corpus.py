"""Held-out natural text present on every machine: Python standard-library docstrings.

Documents are the module, class and function docstrings of each stdlib source file, joined
in source order. Files are split by a stable hash of their relative path, so calibration
(RidgeFill maps, distillation) and evaluation never read the same file:

    split("calib") = files with sha1(path) % 10 < 7,   split("eval") = the rest.
"""
from __future__ import annotations

import ast
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SOURCE_NAME = "python-stdlib-docstrings"


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _docstrings(path: Path) -> str:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 80:
                parts.append(doc.strip())
    return "\n\n".join(parts)


def _in_split(rel: str, split: str) -> bool:
    bucket = int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 10
    return bucket < 7 if split == "calib" else bucket >= 7


def documents(split: str = "eval", min_chars: int = 2000) -> list[Document]:
    """Documents of one split, in a stable order (sorted by path)."""
    if split not in ("calib", "eval"):
        raise ValueError(f"split must be 'calib' or 'eval', got {split!r}")
    root = stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        if "site-packages" in rel or "/test" in rel or rel.startswith("test"):
            continue
        if not _in_split(rel, split):
            continue
        text = _docstrings(path)
        if len(text) >= min_chars:
            out.append(Document(rel, text))
    return out


def haystack_text(docs: list[Document], start: int = 0) -> str:
    """An endless-enough filler text: documents concatenated from index `start`."""
    order = docs[start:] + docs[:start]
    return "\n\n".join(d.text for d in order)
