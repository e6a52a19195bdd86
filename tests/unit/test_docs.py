"""The documentation's own rules, checked as plain files: the README's size, links that
resolve, results pages that name their command and commit, a manifest that matches
`bench/results/`, no work-log narrative or paths outside the repository; and across every
tracked text file: no issue numbers, no run codenames in user docs, no path or commit that
is not in this repository (the checks themselves: `tests/helpers/doc_checks.py`)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import doc_checks

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
    present = {str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*")
               if p.is_file() and p != MANIFEST}
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


# ---- every tracked text file --------------------------------------------------------------
def tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()


# the checks' own bad examples
SELF = {"tests/unit/test_docs.py", "tests/helpers/doc_checks.py"}


def texts() -> dict[str, str]:
    """Tracked text files, without the recorded outputs of `bench/results/` (what a run
    printed at its commit) and the checks' own examples."""
    out = {}
    for name in tracked():
        path = ROOT / name
        if (name.startswith("bench/results/") and path != MANIFEST) or name in SELF \
                or not path.is_file():
            continue
        try:
            out[name] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
    return out


def user_pages() -> list[str]:
    """What a user reads: every README and docs/ page but the research history."""
    return [n for n in texts() if n.endswith(".md") and not n.startswith("bench/results/")
            and not n.startswith("docs/research/")
            and (n.startswith("docs/") or Path(n).name == "README.md")]


# generated at build time (`make proto` maps proto/ to this path)
GENERATED = {"services/common/pb/splitstack.proto"}
# copies of deploy/ (`make chart-sync`), whose relative paths are checked at the source
COPIES = "k8s/splitstack/files/"


def test_no_issue_numbers():
    """Why a line exists, not which issue asked for it (a TODO names its issue)."""
    hits = {n: doc_checks.issue_refs(t) for n, t in texts().items()}
    hits = {n: h for n, h in hits.items() if h}
    assert not hits, hits


def test_no_codenames_in_user_docs():
    """Run names and stage letters belong to docs/research/; a user page says what a
    checkpoint is."""
    all_texts = texts()
    hits = {n: doc_checks.codenames(all_texts[n]) for n in user_pages()}
    hits = {n: h for n, h in hits.items() if h}
    assert not hits, hits


def test_named_paths_exist():
    files = set(tracked())
    names = {Path(n).name for n in files}

    def exists_from(source: str):
        bases = [ROOT, *(ROOT / source).parents]
        return lambda path: path in files or path in GENERATED or any(
            (base / path).exists() for base in bases if ROOT in (base, *base.parents))

    missing = {n: doc_checks.missing_paths(t, exists_from(n), names)
               for n, t in texts().items() if not n.startswith(COPIES)}
    missing = {(n, p) for n, ps in missing.items() for p in ps}
    assert not missing, sorted(missing)


def test_commit_hashes_are_in_the_history():
    found: dict[str, list[str]] = {}
    for name, text in texts().items():
        for h in doc_checks.commit_hashes(text):
            found.setdefault(h, []).append(name)
    assert len(found) > 20, "the docs name commits; the check finds none"
    unknown = doc_checks.unknown_commits(found)
    assert not unknown, {h: found[h] for h in unknown}


# ---- the checks on small inputs ------------------------------------------------------------
def test_issue_check_catches_and_spares():
    assert doc_checks.issue_refs('"""Issue 29, finding 4: counts."""') == ["Issue 29"]
    assert doc_checks.issue_refs("see issues 3 and issue #12") == ["issues 3", "issue #12"]
    assert doc_checks.issue_refs("# TODO(issue 6): insert them as FILLED rows") == []
    assert doc_checks.issue_refs("an issue with 3 causes") == []


def test_codename_check_catches_and_spares():
    bad = "Stage F copies; Gj3c and G3v beat H2v; see finding 4; stages B to F"
    assert doc_checks.codenames(bad) == ["Stage F", "Gj3c", "G3v", "H2v", "finding 4",
                                         "stages B"]
    clean = "`heldout_smollm2_hybrid_rh_Gj3c_2k_b.md`, .tmp/hyb/G3v, a stage of the recipe, 8 GB"
    assert doc_checks.codenames(clean) == []


def test_path_check_catches_and_spares():
    here = {"bench/serving/soak.py", "docs/results/peers.md"}
    names = {"README.md", "MANIFEST.md"}
    text = ("run `bench/soak.py` as DESIGN.md says, then bench/serving/soak.py;\n"
            "see README.md and docs/results/peers.md\n")
    never = lambda commit, path: False  # noqa: E731
    assert doc_checks.missing_paths(text, here.__contains__, names, never) == \
        ["bench/soak.py", "DESIGN.md"]
    old = "- Command: `python bench/soak.py` at commit `2cff19d`\n"
    assert doc_checks.missing_paths(old, here.__contains__, names, never) == ["bench/soak.py"]
    assert doc_checks.missing_paths(old, here.__contains__, names,
                                    lambda c, p: (c, p) == ("2cff19d", "bench/soak.py")) == []
    shown = "read it with `git show 2cff19d:bench/results/old.md`\n"
    assert doc_checks.missing_paths(shown, here.__contains__, names, never) == []


def test_commit_check_catches_and_spares():
    text = "commit `2cff19d`, commits 1e4caac and `abcdef0`; a count of `1234567`; `deadbeefx`"
    assert doc_checks.commit_hashes(text) == {"2cff19d", "1e4caac", "abcdef0"}
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert doc_checks.unknown_commits([head[:7], head, "abcdef0"]) == ["abcdef0"]
