"""`integrations.folder.verify_level`: the load check level both engine integrations open a folder with."""
from __future__ import annotations

import pytest

from megamoe_runtime.integrations.folder import VERIFY_ENV, verify_level


def test_config_then_environment_then_default(monkeypatch):
    monkeypatch.delenv(VERIFY_ENV, raising=False)
    assert verify_level(None) == "headers"
    assert verify_level({"verify": "checksums"}) == "checksums"
    monkeypatch.setenv(VERIFY_ENV, "none")
    assert verify_level({}) == "none"
    assert verify_level({"verify": "checksums"}) == "checksums"  # the config's own wins


def test_unknown_level_is_refused(monkeypatch):
    monkeypatch.setenv(VERIFY_ENV, "paranoid")
    with pytest.raises(ValueError, match=r"'paranoid' is unknown; valid: none, headers, checksums"):
        verify_level({})
