"""Long held-out text present on every machine, which no calibration or distillation reads.

Two sources, in this fixed order:

- `licenses`: the licence texts Debian's `base-files` installs in /usr/share/common-licenses
  (one of each family: GFDL-1.2 and LGPL-2 are near copies of GFDL-1.3 and LGPL-2.1), and
  CPython's own LICENSE.txt from the standard library's directory;
- `python-reference`: the Python language reference topics CPython ships for `help()`
  (`pydoc_data.topics`), one document per topic.

Calibration and distillation read `evals.corpus` (stdlib docstrings) and `evals.tasks`
only; this package is imported by neither (tests/unit/test_heldout_families.py checks it).
The essays of the held-out retrieval families are these texts, reflowed into paragraphs and
cut into sentences, so a needle can sit at a sentence boundary inside a paragraph.
"""
from __future__ import annotations

import re
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from evals.corpus import Document

LICENSE_DIR = Path("/usr/share/common-licenses")
LICENSES = ("Apache-2.0", "Artistic", "CC0-1.0", "GFDL-1.3", "GPL-1", "GPL-2", "GPL-3",
            "LGPL-2.1", "LGPL-3", "MPL-1.1", "MPL-2.0")
SOURCE_NAME = "heldout-long-text (common-licenses + CPython LICENSE.txt + pydoc topics)"

MIN_WORDS = 5                   # a shorter piece is joined to the sentence after it
_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+(?=[A-Z(\"'])")


def license_documents() -> list[Document]:
    """The licence texts present on this machine, in LICENSES order, then CPython's."""
    paths = [LICENSE_DIR / name for name in LICENSES]
    paths.append(Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt")
    return [Document(f"{p.parent.name}/{p.name}", p.read_text(encoding="utf-8",
                                                              errors="replace"))
            for p in paths if p.is_file()]


def reference_documents() -> list[Document]:
    """The language reference topics, sorted by topic name."""
    from pydoc_data.topics import topics

    return [Document(f"pydoc_data.topics/{name}", topics[name].strip())
            for name in sorted(topics)]


def long_documents(min_chars: int = 2000) -> list[Document]:
    """Every held-out long document of at least `min_chars` characters, licences first."""
    return [d for d in license_documents() + reference_documents() if len(d.text) >= min_chars]


def sources() -> dict[str, int]:
    """Which texts this machine has: source -> documents (the eval states it)."""
    return {"licenses": len(license_documents()), "python-reference": len(reference_documents())}


@dataclass(frozen=True)
class Sentence:
    text: str
    paragraph_start: bool       # the first sentence of its paragraph


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs with their hard line wraps joined."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        para = " ".join(line.strip() for line in block.splitlines() if line.strip())
        if para:
            out.append(para)
    return out


@lru_cache(maxsize=1)
def essay_sentences() -> tuple[Sentence, ...]:
    """The licence texts (else the reference topics) as one stream of sentences."""
    docs = license_documents() or reference_documents()
    out = []
    for doc in docs:
        for para in paragraphs(doc.text):
            pieces: list[str] = []
            for piece in _SENTENCE_END.split(para):
                # "4." or "(a)" opens a clause rather than ending a sentence
                if pieces and len(pieces[-1].split()) < MIN_WORDS:
                    pieces[-1] += " " + piece
                else:
                    pieces.append(piece)
            out += [Sentence(p, i == 0) for i, p in enumerate(pieces)]
    if not out:
        raise FileNotFoundError(f"no held-out essay text: neither {LICENSE_DIR} nor "
                                f"pydoc_data.topics is present")
    return tuple(out)
