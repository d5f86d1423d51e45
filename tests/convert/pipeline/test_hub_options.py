"""Hub options (issue 31 item 7): --cache-dir, --token, --local-files-only as huggingface_hub names them,
passed through to snapshot_download; a hub failure is one line, whatever the library's text."""
from __future__ import annotations

import fnmatch
import json
import shutil

import pytest
from click.testing import CliRunner

from megamoe_convert.cli.main import main


@pytest.fixture
def fake_hub(monkeypatch, tmp_path, synth_ckpt):
    """snapshot_download replaced: records its keyword arguments and serves a synthetic checkpoint."""
    import huggingface_hub

    src = synth_ckpt("modelopt-mxfp8")
    snap = tmp_path / "cache" / "snapshots" / "abc123"
    calls = []

    def fake(repo_id, **kw):
        calls.append(kw)
        snap.mkdir(parents=True, exist_ok=True)
        for p in src.iterdir():
            if any(fnmatch.fnmatchcase(p.name, pat) for pat in kw["allow_patterns"]):
                shutil.copyfile(p, snap / p.name)
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return calls


def test_cli_passes_cache_dir_token_and_local_files_only(fake_hub, tmp_path):
    cache = tmp_path / "hfcache"
    r = CliRunner().invoke(main, ["inspect", "org/model", "--cache-dir", str(cache), "--token", "hf_secret",
                                  "--local-files-only", "--json"])
    assert r.exit_code == 0, r.output
    assert fake_hub and all(c["token"] == "hf_secret" and str(c["cache_dir"]) == str(cache)
                            and c["local_files_only"] is True for c in fake_hub)
    assert "hf_secret" not in r.output  # a token is never echoed
    fake_hub.clear()
    r = CliRunner().invoke(main, ["convert", "org/model", str(tmp_path / "out"), "--token", "hf_secret",
                                  "--no-progress"])
    assert r.exit_code == 0, r.output
    assert fake_hub and all(c["token"] == "hf_secret" and c["local_files_only"] is False for c in fake_hub)
    assert "hf_secret" not in r.output and "hf_secret" not in (tmp_path / "out" / "megamoe.json").read_text()


def test_help_names_the_hub_options():
    for cmd in ("convert", "inspect"):
        text = CliRunner().invoke(main, [cmd, "--help"]).output
        for opt in ("--cache-dir", "--token", "--local-files-only", "--revision"):
            assert opt in text, (cmd, opt)


def test_resume_command_never_prints_the_token():
    from megamoe_convert.cli.main import _resume_command, convert

    import click
    ctx = click.Context(convert, info_name="convert")
    ctx.params = {p.name: p.default for p in convert.params}
    ctx.params.update(src="org/m", out="o", token="hf_secret")
    cmd = _resume_command(ctx)
    assert "hf_secret" not in cmd and "--token '$HF_TOKEN'" in cmd


def test_offline_failure_is_one_line(monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub import errors

    def fail(repo_id, **kw):
        raise errors.LocalEntryNotFoundError(
            "An error happened while trying to locate the files on the Hub and we cannot find the appropriate"
            " snapshot folder for the specified revision on the local disk.\nPlease check your internet "
            "connection and try again.\n\nRequest ID: 123\nhttps://huggingface.co/...")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    r = CliRunner().invoke(main, ["inspect", "org/model", "--cache-dir", str(tmp_path / "c"), "--json"])
    assert r.exit_code == 2
    err = json.loads(r.stdout)["error"]
    assert "\n" not in err, err
    assert "LocalEntryNotFoundError: An error happened while trying to locate the files" in err
    assert "Request ID" not in err and f"hf download org/model --cache-dir {tmp_path / 'c'}" in err
    assert r.stderr.count("\n") == 1  # 'error: ...' and nothing else
