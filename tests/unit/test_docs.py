"""The user documentation's own rules, checked as plain files: the README's size, links that
resolve, results pages that name their command and commit, a manifest that matches
`bench/results/`, and no work-log narrative or paths outside the repository."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = ROOT / "bench" / "results"
MANIFEST = RESULTS / "MANIFEST.md"

README_MAX_BYTES = 12 * 1024
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")
NARRATIVE = re.compile(r"\bstop \d+\b|this session|\.\./shared|/work/|(?<![\w.])/tmp/")


def user_docs() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose(path: Path) -> str:
    """The page without its fenced code blocks (a link there is an example, not a link)."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, and a
    -1, -2 ... suffix on repeats."""
    seen: dict[str, int] = {}
    out = set()
    for title in HEADING.findall(prose(path)):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_readme_is_at_most_12_kib():
    size = README.stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES})"


@pytest.mark.parametrize("page", user_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):        # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor})")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def results_pages() -> list[Path]:
    return sorted((DOCS / "results").glob("*.md"))


def test_there_are_results_pages():
    assert results_pages()


@pytest.mark.parametrize("page", results_pages(), ids=lambda p: p.name)
def test_results_page_names_command_and_commit(page: Path):
    text = page.read_text(encoding="utf-8")
    assert re.search(r"\bcommand\b", text, re.I), f"{page.name} names no command"
    commit_lines = [line for line in text.splitlines()
                    if "commit" in line.lower() and COMMIT.search(line)]
    assert commit_lines, f"{page.name} has no line naming a commit hash"


def manifest_entries() -> list[str]:
    return re.findall(r"^- `([^`]+)`", MANIFEST.read_text(encoding="utf-8"), re.M)


def test_manifest_lists_every_result_file():
    listed = set(manifest_entries())
    present = {p.name for p in RESULTS.iterdir() if p.is_file() and p != MANIFEST}
    assert not present - listed, f"not in MANIFEST.md: {sorted(present - listed)}"
    assert not listed - present, f"in MANIFEST.md but missing: {sorted(listed - present)}"
    entries = manifest_entries()
    assert len(entries) == len(listed), "MANIFEST.md lists a file twice"


@pytest.mark.parametrize("page", user_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_work_log_or_outside_paths(page: Path):
    hits = [f"{i}: {line.strip()}"
            for i, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
            if NARRATIVE.search(line)]
    assert not hits, f"{page.relative_to(ROOT)}:\n" + "\n".join(hits)
