"""Package code says why, never when: no issue numbers, no "Nth pass" of a piece of work, no dates.

The history of a change is in git and in docs/bench-log/; a comment that cites "issue 11 ninth pass" tells
the reader where to dig instead of what holds. Measurements a comment leans on are cited by the page that
records them (docs/bench-log/<area>.md). The negative controls plant each form and check that ordinary uses
of the word "pass" (a second pass over the data, the streaming pass) are not taken for history.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("megamoe_runtime", "megamoe_convert")

HISTORY = re.compile(
    r"\bissue\s+\d+"  # issue 12, issue 11 point 3
    r"|\b(?:third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(?:st|nd|rd|th))\s+pass\b"  # ninth pass
    r"|[\"'](?:first|second)\s+pass[\"']",  # the "first pass" of a piece of work, quoted as a name
    re.IGNORECASE,
)
#: a date in a comment (a string may name one as a fact: the DeepGEMM release an option needs)
DATE = re.compile(r"#.*\b20\d\d-[01]\d-[0-3]\d\b")

#: files that still carry such references, left to the branches editing them now; a listed file that no
#: longer has one fails `test_the_allowlist_is_not_stale` (take it off the list)
ALLOWED: set[str] = set()


def history_lines(text: str, where: str) -> list[str]:
    return [f"{where}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
            if HISTORY.search(line) or DATE.search(line)]


def _package_files() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def test_package_code_carries_no_history():
    found = [hit for f, text in _package_files().items() if f not in ALLOWED for hit in history_lines(text, f)]
    assert found == [], "say why, not when (cite docs/bench-log/<area>.md for a measurement)"


def test_the_allowlist_is_not_stale():
    files = _package_files()
    stale = sorted(f for f in ALLOWED if f not in files or not history_lines(files[f], f))
    assert stale == [], f"take these off ALLOWED in {Path(__file__).name}: {stale}"


@pytest.mark.parametrize("line", [
    "# measured in BENCHMARKS.md, issue 11 ninth pass",
    "# (issue 28: the few entry)",
    '#: tiles re-swept in the "Eighth pass"',
    "# the 3rd pass made it faster",
    '"First pass": one dot per K block',
    "# issue 28, 2026-12-04: 1.35x",
    "x = 1  # measured 2026-12-04: 1.35x",
])
def test_each_form_is_reported(line):
    assert len(history_lines(line, "m.py")) == 1


@pytest.mark.parametrize("line", [
    "computed anyway, so the file digest costs no second pass over the data",
    "# the streaming pass writes every shard once",
    "# a first pass collects the names, a second pass checks them",
    "raise CheckpointError(f'{name}: the issue is the scale')",
    '"statistics need DeepGEMM from 2026-04-24 or later"',
])
def test_ordinary_words_are_not_history(line):
    assert history_lines(line, "m.py") == []
