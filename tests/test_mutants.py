"""tools/mutants.py stays runnable: a mutant whose text no longer occurs in the
package (the code moved on) would report "stale" instead of proving a test
catches the broken rule, so every pattern must still occur, and the test
files that guard it must exist."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mutants():
    spec = importlib.util.spec_from_file_location("_megamoe_mutants", ROOT / "tools" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MUTANTS


@pytest.mark.parametrize("mutant", _mutants(), ids=lambda m: m[0])
def test_mutant_still_applies(mutant):
    name, rel, old, new, tests = mutant
    text = (ROOT / rel).read_text()
    assert old in text, f"{name}: its text no longer occurs in {rel} (the script mutates the first occurrence)"
    assert old != new, f"{name}: the mutant changes nothing"
    missing = [t for t in tests if not (ROOT / t).exists()]
    assert not missing, f"{name}: guard test file(s) missing: {missing}"
