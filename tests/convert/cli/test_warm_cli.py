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


def test_a_warm_killed_while_its_workers_compile_leaves_a_folder_the_next_warm_removes(ckpts, monkeypatch, tmp_path):
    """`warm` killed with SIGKILL while its worker processes compile: its hidden OUT/.kernel-cache.partial-*
    folder stays (the workers, orphaned, go on writing there), and `convert --overwrite` refuses OUT for it.
    The next `warm` leaves it while those workers still run (they hold its marker's lock, inherited from the
    killed build), and removes it once they are gone; then `convert --overwrite` replaces OUT. Before, nothing
    ever removed it. Real processes: the killed warm, and workers that inherit exactly what the real ones
    would (only their command is a stand-in that compiles "forever")."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from megamoe_runtime.integrations import warm

    src, converted = ckpts.converted("modelopt-mxfp4")
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    pids = tmp_path / "worker-pids"
    pids.mkdir()
    stand_in = ("import os, sys, time; open(os.path.join(sys.argv[1], str(os.getpid())), 'w').close(); "
                "time.sleep(600)")
    code = (f"import subprocess, sys\n"
            f"from megamoe_runtime.backends import kernel_cache as kc\n"
            f"kc.environment = lambda device=None: {ENV!r}\n"
            f"real = subprocess.Popen\n"
            f"subprocess.Popen = lambda cmd, **kw: real([sys.executable, '-c', {stand_in!r}, {str(pids)!r}], **kw)\n"
            f"from megamoe_convert.cli.main import main\n"
            f"main(['warm', {str(out)!r}, '--tokens', '1,2', '--jobs', '2'], prog_name='megamoe-convert')\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    workers: list[int] = []
    try:
        deadline = time.time() + 120
        while len(os.listdir(pids)) < 2 and p.poll() is None:
            assert time.time() < deadline, "the workers never started"
            time.sleep(0.05)
        assert p.poll() is None, p.stderr.read().decode()
        workers = [int(n) for n in os.listdir(pids)]
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=60)
        [partial] = out.glob(f".kernel-cache.partial-{p.pid}-*")
        assert (partial / warm.PARTIAL_MARKER).is_file() and not (out / "kernel-cache").exists()
        r = run_cli("convert", src, out, "--overwrite", "--no-progress")
        assert r.exit_code == 2 and partial.name in r.stderr, r.output

        monkeypatch.setattr(kc, "environment", lambda device=None: dict(ENV))
        monkeypatch.setattr(warm, "run_workers", lambda *a, **k: None)  # this warm's own workers: nothing to do
        r = run_cli("warm", out)  # the orphaned workers still run
        assert r.exit_code == 0, r.output
        assert f"warm: note: {partial} is left as it is: a running process holds it" in r.stderr
        assert (partial / warm.PARTIAL_MARKER).is_file()

        for w in workers:
            os.kill(w, signal.SIGKILL)
        deadline = time.time() + 60
        while any(_running(w) for w in workers):
            assert time.time() < deadline, "the workers did not stop"
            time.sleep(0.05)
        r = run_cli("warm", out)
        assert r.exit_code == 0, r.output
        assert f"warm: removed {partial}, the unfinished folder of a build killed before it finished (pid {p.pid}" \
               in r.stderr
        assert not partial.exists() and not list(out.glob(".kernel-cache.partial-*"))
        r = run_cli("convert", src, out, "--overwrite", "--no-progress")
        assert r.exit_code == 0, r.output
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for w in workers:
            if _running(w) and str(pids) in Path(f"/proc/{w}/cmdline").read_text(errors="replace"):  # ours still
                os.kill(w, signal.SIGKILL)


def _running(pid: int) -> bool:
    """The process runs (a zombie, dead but not yet reaped by whoever adopted it, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
