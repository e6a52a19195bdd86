"""The repository-wide text checks of `tests/unit/test_docs.py`, as functions of a string, so
each can be shown to fail on a small bad input. Each returns the offending pieces, empty
when the text is clean."""
from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# "Issue 29", "issues 3 and 5", "issue #4"; a TODO names its issue (CONVENTIONS habit 7)
ISSUE = re.compile(r"(?<!TODO\()\b[Ii]ssues? #?\d+")
# derivation run names: stage letters, the retrieval-head runs (G, G2, G3v, Ga, Gi, Gj3c...),
# the 12-layer runs, and review findings by number
CODENAME = re.compile(r"\b[Ss]tages? [A-H]\b(?!-)|\bG(?:j3c|j2v|jc30|j|2v|3v|2a|a|i|nr|p3|2|3)\b"
                      r"|\bH[23]v\b|\b[Ff]indings? \d+")
TOP_DIRS = ("bench", "deploy", "docs", "evals", "k8s", "kernels", "loadtest", "models", "proto",
            "services", "tests", "tools")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\.(?:py|md|sh|json|txt|toml|ya?ml|proto|cfg))\b"
                  % "|".join(TOP_DIRS))
DOC_NAME = re.compile(r"(?<![\w./-])([A-Z][A-Z_]{2,}\.md)\b")      # DESIGN.md, ENVIRONMENT.md
# a hash in backticks, or after "commit(s)" (up to two more hashes: "commits `a`, `b` and c")
HASH_TICKED = re.compile(r"`([0-9a-f]{7,40})`")
HASH_AFTER = re.compile(r"\bcommits?:?\s+(?:at\s+)?`?([0-9a-f]{7,40})\b", re.I)
AT_COMMIT = re.compile(r"\bgit show ([0-9a-f]{7,40}):([\w./-]+)")
PLACEHOLDER = re.compile(r"/(?:NAME|FILE|SCRIPT|PAGE|DIR|OUT)\.\w+$")     # bench/SCRIPT.py


def issue_refs(text: str) -> list[str]:
    return ISSUE.findall(text)


def codenames(text: str) -> list[str]:
    """Run names a user cannot look up, outside file names (`..._rh_Gj3c_2k.md` is a file)."""
    return [m.group(0) for m in CODENAME.finditer(text)
            if text[max(m.start() - 1, 0)] not in "_/." and text[m.end():m.end() + 1] != "_"]


def commit_hashes(text: str) -> set[str]:
    """Strings that read as commit hashes: hex in backticks (with a letter, so that `1234567`
    stays a number), and hex after the word commit."""
    found = {h for h in HASH_TICKED.findall(text) if re.search(r"[a-f]", h)}
    found |= {h for h in HASH_AFTER.findall(text) if re.search(r"[a-f]", h)}
    return found


def unknown_commits(hashes: Iterable[str], cwd: Path = ROOT) -> list[str]:
    """The hashes that name no commit of this repository (one `git cat-file` for all)."""
    hashes = sorted(set(hashes))
    if not hashes:
        return []
    out = subprocess.run(["git", "cat-file", "--batch-check"], cwd=cwd, capture_output=True,
                         text=True, check=True,
                         input="".join(f"{h}^{{commit}}\n" for h in hashes)).stdout
    return [h for h, line in zip(hashes, out.splitlines()) if line.endswith("missing")
            or " commit " not in line]


def existed_at(commit: str, path: str, cwd: Path = ROOT) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{commit}:{path}"], cwd=cwd,
                          capture_output=True).returncode == 0


def missing_paths(text: str, exists: Callable[[str], bool], names: set[str],
                  at_commit: Callable[[str, str], bool] = existed_at) -> list[str]:
    """Repository paths (`bench/foo.py`) and capitalised doc names (`DESIGN.md`) the text
    names that are not here. A path on a line that names a commit is read at that commit
    (a recorded command), and `git show HASH:path` names a path at HASH."""
    missing = []
    for line in text.splitlines():
        shown = {path for _, path in AT_COMMIT.findall(line)}
        for path in PATH.findall(line):
            if path in shown or PLACEHOLDER.search(path) or exists(path):
                continue
            if any(at_commit(h, path) for h in re.findall(r"\b(?=\w*[a-f])[0-9a-f]{7,40}\b", line)):
                continue
            missing.append(path)
        missing += [n for n in DOC_NAME.findall(line) if n not in names]
    return missing
