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


@pytest.mark.parametrize("how", ["missing", "truncated"])
def test_a_broken_shard_is_named_without_its_consequences(ckpts, tmp_path, how):
    """A missing or truncated expert shard: the refusal names the file and what is wrong with it, not also
    every parameter byte that file would have written (before: '... l1_weight: 524288 byte(s) never written'
    for each role of each layer after the cause)."""
    import json
    import shutil

    from megamoe_runtime.errors import CheckpointError
    from megamoe_runtime.integrations.folder import check_folder_for_model

    _, out = ckpts.converted("fp8-block")
    folder = tmp_path / "out"
    shutil.copytree(out, folder)
    shard = sorted(folder.glob("megamoe-experts-*.safetensors"))[0]
    if how == "missing":
        shard.unlink()
    else:
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size - 64)
    config = json.loads((folder / "config.json").read_text())
    with pytest.raises(CheckpointError) as e:
        check_folder_for_model(folder, config)
    msg = str(e.value)
    assert f"the expert shards cannot be loaded: {shard}" in msg and ("missing" if how == "missing" else "truncated") in msg
    assert "never written" not in msg, msg
