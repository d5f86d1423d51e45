"""Every ``docs/PAGE.md#anchor`` the code, the tests and the docs cite exists.

The code cites the repository's own docs by section anchor; a renamed
heading or a typo in a citation would otherwise rot silently. Anchors are
derived from headings the way GitHub renders them (lower case, punctuation
dropped, spaces to hyphens).
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: ``docs/PAGE.md`` optionally followed by ``#anchor`` and further ``, #anchor``s
_CITE = re.compile(r"docs/([A-Z][A-Z_]*\.md)((?:#[a-z0-9-]+)?)((?:,\s*#[a-z0-9-]+)*)")
#: a relative link between docs pages: ``](PAGE.md#anchor)``
_LINK = re.compile(r"\]\(([A-Z][A-Z_]*\.md)(#[a-z0-9-]+)?\)")


def anchor(heading: str) -> str:
    h = heading.strip().lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out = set()
    for line in page.read_text().splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            out.add(anchor(m.group(1)))
    return out


def citations(text: str) -> list[tuple[str, str]]:
    """(page, anchor or '') for every docs citation in ``text``."""
    found = []
    for m in _CITE.finditer(text):
        page = m.group(1)
        found.append((page, m.group(2)[1:]))
        found += [(page, a) for a in re.findall(r"#([a-z0-9-]+)", m.group(3))]
    for m in _LINK.finditer(text):
        found.append((m.group(1), (m.group(2) or "#")[1:]))
    return found


def broken(files: list[Path]) -> list[str]:
    pages = {p.name: anchors(p) for p in DOCS.glob("*.md")}
    bad = []
    for f in files:
        where = f.relative_to(ROOT) if f.is_relative_to(ROOT) else f.name
        for page, a in citations(f.read_text(errors="replace")):
            if page not in pages:
                bad.append(f"{where}: docs/{page} does not exist")
            elif a and a not in pages[page]:
                bad.append(f"{where}: docs/{page}#{a}: no such section")
    return bad


def _sources() -> list[Path]:
    dirs = ["megamoe_runtime", "megamoe_convert", "tests", "bench", "examples", "tools", "docs"]
    files = [p for d in dirs for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md") and p.is_file()]
    files = [p for p in files if p != Path(__file__).resolve()]  # this file cites broken pages on purpose
    return files + [ROOT / "README.md", ROOT / "BENCHMARKS.md"]


def test_every_docs_citation_resolves():
    files = _sources()
    assert sum(len(citations(f.read_text(errors="replace"))) for f in files) > 40  # the scan sees them
    assert broken(files) == []


def test_a_wrong_citation_is_reported(tmp_path):
    """Negative control: a missing section and a missing page are both caught."""
    f = tmp_path / "x.py"
    f.write_text("see docs/LAYOUT.md#utccp, #no-such-part and docs/NOPE.md; [a](SCALES.md#a3)\n")
    assert broken([f]) == [
        "x.py: docs/LAYOUT.md#no-such-part: no such section",
        "x.py: docs/NOPE.md does not exist",
        "x.py: docs/SCALES.md#a3: no such section",
    ]


#: a page named without its folder (``LAYOUT.md``) or with one (``docs/LAYOUT.md``, ``tests/fixtures/real/README.md``)
_PAGE = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[A-Z][A-Z_0-9]*\.md)\b")
#: a path into a folder beside the repository (a session's shared folder), which a clone does not have
_OUTSIDE = re.compile(r"(?<![\w])(?:\.\./shared|/work/shared)\b")


def missing_pages(files: list[Path]) -> list[str]:
    """Every page a file names that the repository lacks, and every path it names outside the repository."""
    bad = []
    for f in files:
        where = f.relative_to(ROOT) if f.is_relative_to(ROOT) else f.name
        text = f.read_text(errors="replace")
        for page in sorted(set(_PAGE.findall(text))):
            if not any((base / page).is_file() for base in (ROOT, DOCS, f.parent)):
                bad.append(f"{where}: names {page}, which the repository lacks")
        bad += [f"{where}: points outside the repository: {m}" for m in sorted(set(_OUTSIDE.findall(text)))]
    return bad


def test_every_named_page_exists_in_the_repository():
    files = _sources() + [ROOT / "tests/fixtures/real/README.md", ROOT / "tests/fixtures/make_real_fixtures.py"]
    assert missing_pages(files) == []


def test_a_missing_page_is_reported(tmp_path):
    """Negative control: a page the repository lacks, and a path beside it, are both caught."""
    f = tmp_path / "x.py"
    f.write_text("as REFERENCE.md section 6 says; see ../shared/notes and LAYOUT.md\n")
    assert missing_pages([f]) == ["x.py: names REFERENCE.md, which the repository lacks",
                                  "x.py: points outside the repository: ../shared"]


def test_anchor_rule():
    assert anchor("w1 w3 agreement") == "w1-w3-agreement"
    assert anchor("DeepGEMM UE8M0 scale") == "deepgemm-ue8m0-scale"
    assert anchor("Kernel-side lookup") == "kernel-side-lookup"
