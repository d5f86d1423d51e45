"""`megamoe-convert warm` (megamoe_convert/cli/warm.py): its help, its refusals (exit 2, one error line, JSON
under --json) and its success output. The build itself is tested in tests/runtime/integrations/test_warm.py."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from megamoe_convert.cli.main import main
from megamoe_runtime.backends import kernel_cache as kc

ENV = {"triton": "3.6.0", "torch": "2.11.0", "cuda": "13.0", "python": "3.12", "machine": "x86_64",
       "capability": "sm_90", "gpu": "NVIDIA H100 80GB HBM3"}


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_help_has_examples():
    r = run_cli("warm", "--help")
    assert r.exit_code == 0 and "Examples:" in r.output and "megamoe-convert warm ./out" in r.output
    assert "warm" in run_cli("--help").output


def test_not_a_converted_folder(tmp_path):
    r = run_cli("warm", tmp_path, "--json")
    assert r.exit_code == 2
    out = json.loads(r.stdout)
    assert out["ok"] is False and "megamoe.json" in out["error"]


@pytest.mark.parametrize("tokens", ["0", "1,a", ""])
def test_bad_tokens(tmp_path, tokens):
    r = run_cli("warm", tmp_path, "--tokens", tokens)
    assert r.exit_code == 2 and "error:" in r.stderr


def test_bad_jobs(tmp_path):
    assert run_cli("warm", tmp_path, "--jobs", "0").exit_code == 2


def test_no_gpu(ckpts, monkeypatch, tmp_path):
    _, out = ckpts.converted("modelopt-mxfp4")
    monkeypatch.setattr(kc, "environment", lambda device=None: {**ENV, "capability": None})
    r = run_cli("warm", out, "--cache", tmp_path / "c", "--json")
    assert r.exit_code == 2 and "no CUDA device" in json.loads(r.stdout)["error"]
    assert not (tmp_path / "c").exists()


def test_success_output(ckpts, monkeypatch, tmp_path):
    from megamoe_runtime.integrations import warm

    _, out = ckpts.converted("modelopt-mxfp4")
    seen = {}

    def fake_build(folder, cache, tokens, jobs, log):
        seen.update(folder=folder, cache=cache, tokens=tokens, jobs=jobs)
        return {"ok": True, "cache": str(cache), "entries": 12, "new_entries": 12, "layers": [1], "tokens": tokens,
                "jobs": jobs, "seconds": 3.0, **{k: ENV[k] for k in ("triton", "capability", "gpu", "python")}}

    monkeypatch.setattr(warm, "build_cache", fake_build)
    r = run_cli("warm", out, "--cache", tmp_path / "c", "--tokens", "8,1", "--jobs", "3", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["entries"] == 12
    assert seen == {"folder": out, "cache": tmp_path / "c", "tokens": [1, 8], "jobs": 3}
    r = run_cli("warm", out)
    assert r.exit_code == 0 and "12 kernels" in r.stdout and seen["cache"] is None


def test_read_only_folder_one_line_naming_cache(ckpts, monkeypatch, tmp_path):
    """FOLDER where the cache cannot be created (read-only image layer, a mount): one error line naming the
    folder and --cache, exit 2, nothing written (the read-only folder is simulated: tests may run as root)."""
    import os

    _, out = ckpts.converted("modelopt-mxfp4")
    monkeypatch.setattr(kc, "environment", lambda device=None: dict(ENV))
    real_mkdir = os.mkdir

    def mkdir(path, *a, **k):
        if os.path.dirname(os.fspath(path)) == str(out):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_mkdir(path, *a, **k)

    monkeypatch.setattr(os, "mkdir", mkdir)
    before = sorted(p.name for p in out.iterdir())
    r = run_cli("warm", out)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
    assert r.stderr.startswith(f"error: {out}: cannot create the kernel cache there (Permission denied)")
    assert "--cache" in r.stderr and sorted(p.name for p in out.iterdir()) == before
