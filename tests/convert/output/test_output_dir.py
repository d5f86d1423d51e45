"""output_dir.py: the converter never deletes, loses or mixes what the user has.

Each dangerous placement is tried for real through the CLI with
``--overwrite`` and the whole tree is hashed before and after (not a byte may
change); two runs on one OUT (the second refused naming the live pid); a lock
left by a ``kill -9`` recognised; a real process killed at every step of the
final swap, then the same command again completes and leaves no
``.megamoe-old``, temp folder or lock behind.
"""
import json
import os
import socket
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from megamoe_convert.cli.main import main
from megamoe_convert.pipeline.convert import convert
from megamoe_convert.output.output_dir import (
    SWAP_STEPS,
    OutputError,
    OutputLock,
    check_replaceable,
    lock_path_for,
    old_dir_for,
    temp_dir_for,
)
from megamoe_runtime.load.verify import verify_output


SMALL = dict(num_layers=2, hidden=256, intermediate=128, num_experts=4, top_k=2)
CRASH_EXIT_CODE = 99  # tests/convert/crashing_cli.py


def tree_digest(root) -> dict:
    """Every entry under `root` (not following symlinks): relative path ->
    sha256 of a file, the target of a link, or 'dir'. Equal before and after
    means not a byte changed."""
    import hashlib

    root = Path(root)
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out



def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def siblings(out: Path) -> list[str]:
    """Our names beside OUT that exist."""
    return sorted(p.name for p in (temp_dir_for(out), old_dir_for(out), lock_path_for(out))
                  if p.exists() or p.is_symlink())


# --------------------------------------------------------------------------- placement


def _user_tree(root: Path) -> Path:
    """A folder of the user's: a project with files and a sub-folder."""
    root.mkdir(parents=True)
    (root / "notes.txt").write_text("my notes")
    (root / "code").mkdir()
    (root / "code" / "main.py").write_text("print('hi')")
    return root


def test_out_equal_to_inside_or_above_the_source_is_refused(tmp_path, make_ckpt):
    src = make_ckpt("quark-mxfp4", **SMALL)
    (src.parent / "sibling.txt").write_text("keep me")
    before = tree_digest(tmp_path)
    for out, why in [(src, "is the source folder"), (src.parent, "contains the source folder"),
                     (src / "sub", "is inside the source folder")]:
        r = run_cli("convert", src, out, "--overwrite")
        assert r.exit_code == 2 and why in r.stderr and "may not overlap" in r.stderr, (out, r.output)
        assert "Traceback" not in r.output
        assert tree_digest(tmp_path) == before, out
    # through a symlink to the source: resolved first
    link = tmp_path / "link"
    link.symlink_to(src)
    before = tree_digest(tmp_path)
    r = run_cli("convert", link, tmp_path / "out", "--overwrite")  # fine: a sibling
    assert r.exit_code == 0, r.output
    os.symlink(src, tmp_path / "link2")
    r = run_cli("convert", src, tmp_path / "link2", "--overwrite")
    assert r.exit_code == 2 and "is a symlink" in r.stderr
    assert {k: v for k, v in tree_digest(tmp_path).items() if not k.startswith("out")} == \
        {**before, "link2": f"link:{src}"}


def test_foreign_folder_is_not_overwritten(tmp_path, synth_ckpt):
    src = synth_ckpt("ct-mxfp8")
    home = _user_tree(tmp_path / "home")
    before = tree_digest(tmp_path)
    r = run_cli("convert", src, home, "--overwrite")
    assert r.exit_code == 2, r.output
    assert "is not a megamoe output (no readable megamoe.json) and holds 2 entries (code, notes.txt)" in r.stderr
    assert tree_digest(tmp_path) == before and siblings(home) == []
    # a file as OUT
    r = run_cli("convert", src, home / "notes.txt", "--overwrite")
    assert r.exit_code == 2 and "is a file" in r.stderr
    assert tree_digest(tmp_path) == before
    # an empty folder may be replaced
    (tmp_path / "empty").mkdir()
    assert run_cli("convert", src, tmp_path / "empty", "--overwrite").exit_code == 0
    assert verify_output(tmp_path / "empty").ok


def test_megamoe_output_with_foreign_files_is_not_overwritten(tmp_path, synth_ckpt):
    src = synth_ckpt("ct-mxfp8")
    out = tmp_path / "out"
    convert(src, out)
    (out / "my-readme.md").write_text("added by the user")
    (out / "sub").mkdir()
    before = tree_digest(tmp_path)
    r = run_cli("convert", src, out, "--overwrite")
    assert r.exit_code == 2 and "also holds 2 entries its manifest does not list (my-readme.md, sub)" in r.stderr
    assert tree_digest(tmp_path) == before and siblings(out) == []
    # a manifest that only claims to be ours is not enough when the files it lists are not what is there
    with pytest.raises(OutputError, match="does not list"):
        check_replaceable(out)


@pytest.mark.parametrize("edit", ["appended", "same size"])
def test_a_listed_file_the_user_edited_is_not_overwritten(tmp_path, synth_ckpt, edit):
    """A config.json the user edited inside an earlier megamoe output is theirs now: --overwrite refuses
    naming it and changes no byte (it used to replace it silently); put back as written, the overwrite
    goes ahead."""
    src = synth_ckpt("ct-mxfp8")
    out = tmp_path / "out"
    convert(src, out)
    cfg = out / "config.json"
    written = cfg.read_bytes()
    assert written.endswith(b"\n")
    cfg.write_bytes(written.replace(b"}", b', "my_note": 1}', 1) if edit == "appended" else
                    written[:-1] + b" ")  # same size: only the digest tells
    assert cfg.read_bytes() != written and (edit == "appended") == (len(cfg.read_bytes()) != len(written))
    before = tree_digest(tmp_path)
    r = run_cli("convert", src, out, "--overwrite")
    assert r.exit_code == 2, r.output
    assert "1 file(s) it lists changed since megamoe-convert wrote them (config.json" in r.stderr
    assert tree_digest(tmp_path) == before and siblings(out) == []
    cfg.write_bytes(written)
    assert run_cli("convert", src, out, "--overwrite").exit_code == 0 and verify_output(out).ok


def _warmed(out: Path, monkeypatch) -> Path:
    """``megamoe-convert warm OUT`` as it runs on a GPU machine: the real build (its worker runs the reference
    backend on this CPU, which compiles nothing), then what triton would have written into the entries folder:
    an entry of plain files and a ``tmp.pid_*`` folder of a compile killed mid-write."""
    from megamoe_runtime.backends import kernel_cache as kc
    from megamoe_runtime.integrations import warm

    env = {"triton": "3.6.0", "torch": "2.11.0", "cuda": "13.0", "python": "3.12", "machine": "x86_64",
           "capability": "sm_90", "gpu": "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(kc, "environment", lambda device=None: dict(env))
    warm.build_cache(out, tokens=[1], jobs=1, backend="reference", device="cpu")
    entry = out / kc.FOLDER_SUBDIR / kc.ENTRIES_DIR / "K3Y"
    (entry / "tmp.pid_41_0c5e").mkdir(parents=True)
    for name in ("kern.cubin", "kern.json", "__grp__kern.json", "tmp.pid_41_0c5e/kern.ptx"):
        (entry / name).write_bytes(b"compiled")
    assert kc.not_own_reason(out / kc.FOLDER_SUBDIR) is None
    return out / kc.FOLDER_SUBDIR


def test_overwrite_replaces_an_output_holding_the_kernel_cache_warm_built(tmp_path, synth_ckpt, monkeypatch):
    """The kernel cache ``megamoe-convert warm OUT`` builds in OUT is megamoe's own output, compiled for OUT's old
    shards: --overwrite takes it with them (was refused: 'holds 1 entry its manifest does not list
    (kernel-cache)'), saying so and how to build it again."""
    src = synth_ckpt("ct-mxfp8")
    out = tmp_path / "out"
    convert(src, out)
    _warmed(out, monkeypatch)
    r = run_cli("convert", src, out, "--overwrite", "--no-progress")
    assert r.exit_code == 0, r.output
    assert f"{out / 'kernel-cache'} holds the kernels megamoe-convert warm compiled" in r.stderr
    assert f"run `megamoe-convert warm {out}` again" in r.stderr
    assert not (out / "kernel-cache").exists() and verify_output(out).ok and siblings(out) == []


def test_killed_mid_swap_with_a_kernel_cache_then_rerun_leaves_no_old_folder(tmp_path, synth_ckpt, crashing_run,
                                                                               monkeypatch):
    """Killed with the old output (and its kernel cache) moved to .OUT.megamoe-old: the next run recognises that
    folder as its own and removes it (a kernel cache it could not prove its own would keep it, with a warning)."""
    src = synth_ckpt("ct-mxfp8")
    out = tmp_path / "out"
    convert(src, out)
    _warmed(out, monkeypatch)
    p = crashing_run("old-moved", 1, "convert", src, out, "--overwrite", "--no-progress")
    assert p.returncode == CRASH_EXIT_CODE, p.stderr
    assert (old_dir_for(out) / "kernel-cache").is_dir()
    r = run_cli("convert", src, out, "--overwrite", "--no-progress")
    assert r.exit_code == 0, r.output
    assert "left alone" not in r.stderr and siblings(out) == [] and verify_output(out).ok


def _plant_note(cache: Path) -> None:
    (cache / "notes.txt").write_text("mine")


def _plant_in_entries(cache: Path) -> None:
    (cache / "triton" / "README").write_text("mine")


def _plant_link_in_entry(cache: Path) -> None:
    (cache / "triton" / "K3Y" / "kern.so").symlink_to(cache.parent.parent / "elsewhere.so")


def _plant_dir_in_entry(cache: Path) -> None:
    (cache / "triton" / "K3Y" / "sub").mkdir()


def _drop_manifest(cache: Path) -> None:
    (cache / "megamoe-kernel-cache.json").unlink()


def _foreign_manifest(cache: Path) -> None:
    (cache / "megamoe-kernel-cache.json").write_text('{"format": 99}')


def _link_instead(cache: Path) -> None:
    import shutil

    real = cache.parent.parent / "my-kernels"
    shutil.move(cache, real)
    cache.symlink_to(real)


@pytest.mark.parametrize("plant, why", [
    (_plant_note, "also holds what neither megamoe-convert warm nor triton writes there: notes.txt"),
    (_plant_in_entries, "triton/README"),
    (_plant_link_in_entry, "triton/K3Y/kern.so"),
    (_plant_dir_in_entry, "triton/K3Y/sub"),
    (_drop_manifest, "not a megamoe kernel cache (no megamoe-kernel-cache.json"),
    (_foreign_manifest, "kernel cache format 99"),
    (_link_instead, "a symlink (to "),
])
def test_a_kernel_cache_not_provably_warms_own_is_refused_naming_it(tmp_path, synth_ckpt, monkeypatch, plant, why):
    """Anything in OUT/kernel-cache that megamoe-convert warm and triton do not write (or one without warm's
    valid manifest, or a link to a folder elsewhere) makes the whole folder the user's: --overwrite refuses,
    naming the path and why, and no byte anywhere changes."""
    src = synth_ckpt("ct-mxfp8")
    out = tmp_path / "out"
    convert(src, out)
    plant(_warmed(out, monkeypatch))
    before = tree_digest(tmp_path)
    r = run_cli("convert", src, out, "--overwrite", "--no-progress")
    assert r.exit_code == 2, r.output
    assert "its manifest does not list (kernel-cache)" in r.stderr, r.stderr
    assert f"({out / 'kernel-cache'} is not a kernel cache megamoe-convert warm made: " in r.stderr, r.stderr
    assert why in r.stderr, r.stderr
    assert tree_digest(tmp_path) == before and siblings(out) == []


def test_out_is_the_working_directory_or_above_it(tmp_path, synth_ckpt, monkeypatch):
    src = synth_ckpt("ct-mxfp8")
    work = _user_tree(tmp_path / "proj")
    monkeypatch.chdir(work / "code")
    before = tree_digest(tmp_path)
    for out in (".", "..", str(work), "./"):
        r = run_cli("convert", src, out, "--overwrite")
        assert r.exit_code == 2 and "is the working directory" in r.stderr, (out, r.output)
        assert "Device or resource busy" not in r.output and "Traceback" not in r.output
        assert tree_digest(tmp_path) == before, out
    assert not any(p.name.startswith(".") for p in tmp_path.rglob("*"))  # no hidden copy left anywhere


def test_hub_cache_counts_as_source(tmp_path, synth_ckpt, monkeypatch):
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    (cache / "models--org--name").mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    before = tree_digest(tmp_path)
    for out in (cache, cache / "models--org--name" / "out", tmp_path):
        with pytest.raises(OutputError, match="may not overlap"):
            convert("org/name", out, overwrite=True)
    assert tree_digest(tmp_path) == before


def test_missing_parents_are_created(tmp_path, synth_ckpt):
    out = tmp_path / "a" / "b" / "out"
    r = run_cli("convert", synth_ckpt("ct-mxfp8"), out, "--json")
    assert r.exit_code == 0, r.output
    assert verify_output(out).ok and siblings(out) == []


# --------------------------------------------------------------------------- lock


def test_second_run_refused_naming_the_live_process(tmp_path, synth_ckpt, crashing_run):
    src = synth_ckpt("quark-mxfp4", **SMALL)
    out = tmp_path / "out"
    first = crashing_run("tensor", "2:6", "convert", src, out, "--no-progress", wait=False)
    try:
        deadline = time.time() + 120
        while b"pausing" not in (_peek_stderr(first)) and time.time() < deadline:
            time.sleep(0.1)
        holder = json.loads(lock_path_for(out).read_text())
        assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()
        for extra in ([], ["--resume"], ["--overwrite"]):
            r = run_cli("convert", src, out, *extra)
            assert r.exit_code == 2, r.output
            assert f"another megamoe-convert run is writing {out} right now (pid {first.pid} on " in r.stderr
            assert "interrupted" not in r.stderr
        assert not out.exists()  # the second run touched nothing
        _, err = first.communicate(timeout=300)
        assert first.returncode == 0, err
    finally:
        if first.poll() is None:
            first.kill()
    assert verify_output(out).ok and siblings(out) == []


_STDERR_SEEN: dict[int, bytes] = {}


def _peek_stderr(p) -> bytes:
    """What the process has written to stderr so far (non-blocking)."""
    import fcntl

    fd = p.stderr.fileno()
    fl = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, fl | os.O_NONBLOCK)
    try:
        chunk = os.read(fd, 1 << 16)
    except BlockingIOError:
        chunk = b""
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, fl)
    _STDERR_SEEN[p.pid] = _STDERR_SEEN.get(p.pid, b"") + chunk
    return _STDERR_SEEN[p.pid]


def test_lock_in_process_and_stale_lock(tmp_path, synth_ckpt):
    src = synth_ckpt("ct-mxfp8")
    out = tmp_path / "out"
    with OutputLock(out):
        with pytest.raises(OutputError, match=rf"right now \(pid {os.getpid()} on"):
            convert(src, out)
    assert not lock_path_for(out).exists()  # released and removed
    # a lock file left by a dead process (kill -9 leaves it; the kernel dropped its flock)
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    lock_path_for(out).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": "earlier"}))
    logs = []
    convert(src, out, log=logs.append)
    assert any(f"left by an earlier run (pid {pid} on {socket.gethostname()}, started earlier) that is no longer "
               "running" in m for m in logs), logs
    assert verify_output(out).ok and siblings(out) == []


# --------------------------------------------------------------------------- warm under the same lock


WARM_ENV = {"triton": "3.6.0", "torch": "2.11.0", "cuda": "13.0", "python": "3.12", "machine": "x86_64",
            "capability": "sm_90", "gpu": "NVIDIA H100 80GB HBM3"}


def _warm_cli_with(monkeypatch, during):
    """`megamoe-convert warm` through the CLI with its compile workers replaced by `during(folder, cache)`,
    which runs while the build holds whatever lock it takes (the real workers need a GPU): returns during's
    result. The rest of the build is real (`build_cache`: its checks, its lock, the hidden folder it builds in,
    the manifest and the rename), on a process that looks like an sm_90 machine with triton."""
    from megamoe_runtime.backends import kernel_cache as kc
    from megamoe_runtime.integrations import warm

    seen = {}

    def fake_workers(folder, parts, entries, backend="triton", device="cuda", pass_fds=()):
        seen["during"] = during(folder, Path(entries).parent)

    monkeypatch.setattr(kc, "environment", lambda device=None: dict(WARM_ENV))
    monkeypatch.setattr(warm, "run_workers", fake_workers)
    return seen


def test_running_warm_refuses_convert_overwrite_touching_nothing(tmp_path, synth_ckpt, monkeypatch):
    """A `warm` building OUT/kernel-cache holds OUT's lock: `convert SRC OUT --overwrite` meanwhile is refused
    with the converter's one-line refusal naming OUT and the warm (exit 2), and not a byte changes. Before,
    warm took no lock and the overwrite swapped OUT under it."""
    src = synth_ckpt("ct-mxfp8")
    out = tmp_path / "out"
    convert(src, out)

    def during(folder, cache):
        before = tree_digest(tmp_path)
        r = run_cli("convert", src, out, "--overwrite", "--no-progress")
        return r, before, tree_digest(tmp_path)

    seen = _warm_cli_with(monkeypatch, during)
    r = run_cli("warm", out)
    assert r.exit_code == 0, r.output
    inner, before, after = seen["during"]
    assert inner.exit_code == 2, inner.output
    assert inner.stderr.count("\n") == 1 and inner.stderr.startswith(
        f"error: another megamoe-convert run is writing {out} right now (pid {os.getpid()} on "), inner.stderr
    assert "running `megamoe-convert warm`" in inner.stderr
    assert after == before
    assert siblings(out) == [] and verify_output(out).ok  # warm released (and removed) its lock
    assert (out / "kernel-cache" / "megamoe-kernel-cache.json").is_file()


def test_build_cache_from_python_and_warm_exclude_each_other(tmp_path, synth_ckpt, monkeypatch):
    """`build_cache` called from Python takes the same writer lock as `megamoe-convert warm` and `convert`, in
    two real processes: while a Python build of OUT runs, `warm OUT` and `convert SRC OUT --overwrite` are
    refused naming it (exit 2, one line, not a byte changed); while a `warm OUT` runs, a Python `build_cache`
    of OUT raises OutputError naming it. Before, build_cache took no lock from Python."""
    import subprocess
    import sys

    src = synth_ckpt("ct-mxfp8")
    out = tmp_path / "out"
    convert(src, out)
    root = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    hold = ("import sys, time\n"
            "from megamoe_runtime.backends import kernel_cache as kc\n"
            "from megamoe_runtime.integrations import warm\n"
            f"kc.environment = lambda device=None: {WARM_ENV!r}\n"
            "def hang(*a, **k):\n"
            "    print('building', file=sys.stderr, flush=True); time.sleep(300)\n"
            "warm.run_workers = hang\n")
    entries = {
        "python": hold + f"warm.build_cache({str(out)!r})\n",
        "cli": hold + ("from megamoe_convert.cli.main import main\n"
                       f"main(['warm', {str(out)!r}], prog_name='megamoe-convert')\n"),
    }
    from megamoe_runtime.backends import kernel_cache as kc

    monkeypatch.setattr(kc, "environment", lambda device=None: dict(WARM_ENV))  # the in-process `warm`
    for first, second in (("python", "cli"), ("cli", "python")):
        p = subprocess.Popen([sys.executable, "-c", entries[first]], stderr=subprocess.PIPE, env=env)
        try:
            _wait_for(lambda: b"building" in _peek_stderr(p) or p.poll() is not None)
            assert p.poll() is None, _peek_stderr(p)
            before = tree_digest(tmp_path)
            held = f"another megamoe-convert run is writing {out} right now (pid {p.pid} on "
            if second == "cli":
                r = run_cli("warm", out)
                assert r.exit_code == 2 and r.stderr.count("\n") == 1 and held in r.stderr, r.output
                assert "running `megamoe-convert warm`" in r.stderr
            else:
                q = subprocess.run([sys.executable, "-c", hold.replace("warm.run_workers = hang\n", "") + (
                    "from megamoe_runtime.errors import OutputError\n"
                    f"try:\n    warm.build_cache({str(out)!r})\n"
                    "except OutputError as e:\n    print(e)\n")], capture_output=True, text=True, env=env,
                    timeout=300)
                assert held in q.stdout and "running `megamoe-convert warm`" in q.stdout, (q.stdout, q.stderr)
            r = run_cli("convert", src, out, "--overwrite", "--no-progress")
            assert r.exit_code == 2 and r.stderr.count("\n") == 1 and held in r.stderr, r.output
            assert tree_digest(tmp_path) == before
        finally:
            p.kill()
            p.wait(timeout=60)


def test_running_convert_refuses_warm(tmp_path, synth_ckpt, monkeypatch):
    """The converter's lock on OUT (what a running `convert` holds) refuses `warm OUT`: exit 2, the same
    refusal, the build never started, OUT unchanged."""
    src = synth_ckpt("ct-mxfp8")
    out = tmp_path / "out"
    convert(src, out)
    seen = _warm_cli_with(monkeypatch, lambda folder, cache: "built")
    before = tree_digest(out)
    with OutputLock(out):
        r = run_cli("warm", out, "--json")
    assert r.exit_code == 2, r.output
    err = json.loads(r.stdout)["error"]
    assert err.startswith(f"another megamoe-convert run is writing {out} right now (pid {os.getpid()} on "), err
    assert "during" not in seen and tree_digest(out) == before and siblings(out) == []


def test_two_warms_on_one_folder_or_one_cache(tmp_path, synth_ckpt, monkeypatch):
    """A second `warm` of a folder a running `warm` holds is refused naming it; so is a second build into one
    --cache outside the folder (the cache's own lock beside it); a build into another --cache only reads the
    folder and is not refused."""
    src = synth_ckpt("ct-mxfp8")
    out = tmp_path / "out"
    convert(src, out)
    ext, other = tmp_path / "kernels", tmp_path / "kernels2"
    inner: list = []
    depth = [0]

    def during(folder, cache):  # the outer build runs the second warm; a second build that gets in does nothing
        depth[0] += 1
        try:
            return run_cli("warm", out, *inner) if depth[0] == 1 else None
        finally:
            depth[0] -= 1

    seen = _warm_cli_with(monkeypatch, during)
    results = []
    for outer, second in (([], []), (["--cache", ext], ["--cache", ext]), ([], ["--cache", other])):
        inner[:] = second
        assert run_cli("warm", out, *outer).exit_code == 0
        results.append(seen["during"])
    second, second_ext, third = results
    for r, held in ((second, out), (second_ext, ext)):
        assert r.exit_code == 2, r.output
        assert f"another megamoe-convert run is writing {held} right now (pid {os.getpid()} on " in r.stderr
        assert "running `megamoe-convert warm`" in r.stderr
    assert third.exit_code == 0, third.output
    assert siblings(out) == [] and siblings(ext) == []


def test_warm_in_a_folder_whose_parent_is_read_only(tmp_path, synth_ckpt, monkeypatch):
    """No lock file can be made beside OUT (its parent read-only, OUT writable: a mounted model folder; no
    conversion can write OUT there either): `warm` still builds, holding a lock on OUT's own directory, and a
    second `warm` meanwhile is refused, naming OUT. Simulated (tests may run as root): creating the lock file
    fails with EACCES."""
    import errno

    src = synth_ckpt("ct-mxfp8")
    out = tmp_path / "out"
    convert(src, out)
    real_open = os.open

    def open_(path, flags, *a, **k):
        if os.fspath(path).endswith(".megamoe-lock"):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", open_)
    depth = [0]

    def during(folder, cache):
        depth[0] += 1
        try:
            return run_cli("warm", out) if depth[0] == 1 else None
        finally:
            depth[0] -= 1

    seen = _warm_cli_with(monkeypatch, during)
    r = run_cli("warm", out)
    assert r.exit_code == 0, r.output
    second = seen["during"]
    assert second.exit_code == 2 and second.stderr.count("\n") == 1, second.output
    assert second.stderr.startswith(f"error: another megamoe-convert warm is writing {out} right now"), second.stderr
    assert siblings(out) == []


def test_warm_killed_leaves_a_stale_lock_taken_over_like_the_converters(tmp_path, synth_ckpt, monkeypatch):
    """`warm` killed with SIGKILL while it holds OUT's lock: the kernel drops the flock and the lock file stays,
    naming the dead warm; the next `warm` and the next `convert --overwrite` take it over with the converter's
    stale-lock note, as after a killed convert (the next `warm` also removes the hidden folder the killed one
    was building in: tests/runtime/integrations/test_warm.py has the cases)."""
    import signal
    import subprocess
    import sys

    src = synth_ckpt("ct-mxfp8")
    out = tmp_path / "out"
    convert(src, out)
    code = ("import sys, time\n"
            "from megamoe_runtime.backends import kernel_cache as kc\n"
            "from megamoe_runtime.integrations import warm\n"
            f"kc.environment = lambda device=None: {WARM_ENV!r}\n"
            "def hang(*a, **k):\n"
            "    print('building', file=sys.stderr, flush=True); time.sleep(300)\n"
            "warm.run_workers = hang\n"
            "from megamoe_convert.cli.main import main\n"
            f"main(['warm', {str(out)!r}], prog_name='megamoe-convert')\n")
    root = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, env=env)
    try:
        _wait_for(lambda: b"building" in _peek_stderr(p) or p.poll() is not None)
        assert p.poll() is None, _peek_stderr(p)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    held = json.loads(lock_path_for(out).read_text())
    assert held["pid"] == p.pid and held["command"] == "warm"
    [partial] = out.glob(f".kernel-cache.partial-{p.pid}-*")  # the killed build's hidden folder
    before = {k: v for k, v in tree_digest(out).items() if not k.startswith(partial.name)}
    note = (f"note: {lock_path_for(out)} was left by an earlier run (pid {p.pid} on {socket.gethostname()}, "
            f"started {held['started']}, running `megamoe-convert warm`) that is no longer running; taking it over")
    from megamoe_runtime.integrations import warm

    def fail(*a, **k):
        raise warm.kc.KernelCacheError("warm worker failed: planted")

    monkeypatch.setattr(warm.kc, "environment", lambda device=None: dict(WARM_ENV))
    monkeypatch.setattr(warm, "run_workers", fail)
    r = run_cli("warm", out)
    assert r.exit_code == 2 and note in r.stderr and "error: warm worker failed: planted" in r.stderr, r.output
    assert f"warm: removed {partial}, the unfinished folder of a build killed before it finished" in r.stderr
    assert tree_digest(out) == before and siblings(out) == []  # taken over, then released and removed
    lock_path_for(out).write_text(json.dumps(held))  # the dead warm's lock again, for the converter
    r = run_cli("convert", src, out, "--overwrite", "--no-progress")
    assert r.exit_code == 0, r.output
    assert note in r.stderr and verify_output(out).ok and siblings(out) == []


def test_lock_path_holding_something_not_ours_is_left_alone(tmp_path, synth_ckpt):
    """A symlink planted at ``.OUT.megamoe-lock`` (e.g. in a shared /tmp, pointing at the victim's file) or a
    user's own file of that name: refused (exit 2) and not a byte of it changed. Before, the lock open followed
    the link and truncated its target, then overwrote it with the lock's JSON; a user file was replaced and
    deleted."""
    src = synth_ckpt("ct-mxfp8")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for i, plant in enumerate(("symlink", "file", "dangling")):
        out = tmp_path / f"out{i}"
        lock = lock_path_for(out)
        if plant == "symlink":
            lock.symlink_to(victim)
        elif plant == "file":
            lock.write_text("my notes\n")
        else:
            lock.symlink_to(tmp_path / "nowhere")
        before = tree_digest(tmp_path)
        r = run_cli("convert", src, out)
        assert r.exit_code == 2, (plant, r.output)
        assert str(lock) in r.stderr and "not a megamoe-convert lock" in r.stderr, r.stderr
        assert tree_digest(tmp_path) == before and not out.exists() and not temp_dir_for(out).exists(), plant
    assert victim.read_text() == "precious\n"


def test_old_name_holding_something_not_ours_is_left_alone(tmp_path, synth_ckpt):
    """A user folder (or a dangling link) at ``.OUT.megamoe-old``: a first run to OUT leaves it alone (it was
    deleted by the swap's last step, which removed whatever held that name); ``--overwrite`` of an existing
    OUT is refused before converting (was a NotADirectoryError after the conversion), naming it."""
    src = synth_ckpt("ct-mxfp8")
    out = tmp_path / "out"
    old = old_dir_for(out)
    old.mkdir()
    (old / "mine.txt").write_text("precious\n")
    before = tree_digest(old)
    r = run_cli("convert", src, out)
    assert r.exit_code == 0, r.output
    assert verify_output(out).ok and tree_digest(old) == before
    r = run_cli("convert", src, out, "--overwrite")
    assert r.exit_code == 2 and str(old) in r.stderr and "not a megamoe output" in r.stderr, r.output
    assert tree_digest(old) == before and not temp_dir_for(out).exists() and verify_output(out).ok
    (old / "mine.txt").unlink()
    old.rmdir()
    old.symlink_to(tmp_path / "nowhere")
    out_before = tree_digest(out)
    r = run_cli("convert", src, out, "--overwrite")
    assert r.exit_code == 2 and str(old) in r.stderr, r.output
    assert "Error:" not in r.stderr and old.is_symlink() and tree_digest(out) == out_before
    assert not temp_dir_for(out).exists()


# --------------------------------------------------------------------------- killed at every swap step


@pytest.mark.parametrize("step", SWAP_STEPS)
def test_killed_at_each_swap_step_then_plain_rerun_completes(tmp_path, synth_ckpt, ckpts, crashing_run, step):
    """--overwrite of an existing output, the process killed (os._exit) right
    after `step`: every byte is under a known name (the old or the new output
    verifies), and the same command again completes, leaving no
    .megamoe-old, temp folder or lock."""
    src_old = synth_ckpt("quark-mxfp4", **SMALL, seed=1)
    src = synth_ckpt("quark-mxfp4", **SMALL, seed=2)
    _, ref = ckpts.converted("quark-mxfp4", **SMALL, seed=2)
    out = tmp_path / "out"
    convert(src_old, out)
    old_tree = tree_digest(out)
    p = crashing_run(step, 1, "convert", src, out, "--overwrite", "--no-progress")
    assert p.returncode == CRASH_EXIT_CODE, p.stderr
    # nothing lost: each output is whole under a known name at every step
    old_home = {"synced": out, "complete": out, "old-moved": old_dir_for(out), "new-moved": old_dir_for(out),
                "cleaned": old_dir_for(out), "old-removed": None}[step]
    new_home = {"synced": temp_dir_for(out), "complete": temp_dir_for(out), "old-moved": temp_dir_for(out)}.get(
        step, out)
    if old_home is not None:
        assert tree_digest(old_home) == old_tree, step
    else:
        assert not old_dir_for(out).exists()
    got = {k: v for k, v in tree_digest(new_home).items() if k not in ("megamoe-journal.jsonl", "megamoe-tmp.json")}
    assert got == tree_digest(ref), step
    r = run_cli("convert", src, out, "--overwrite")
    assert r.exit_code == 0, (step, r.output)
    assert tree_digest(out) == tree_digest(ref), step
    assert siblings(out) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["out"], step


@pytest.mark.parametrize("step", ["complete", "new-moved"])
def test_killed_before_or_after_the_rename_of_a_first_run(tmp_path, synth_ckpt, ckpts, crashing_run, step):
    """No OUT before: killed with the temp folder complete (before its rename)
    or just after it; the plain command again (no --overwrite, no --resume)
    completes without converting again."""
    src = synth_ckpt("quark-mxfp4", **SMALL, seed=2)
    _, ref = ckpts.converted("quark-mxfp4", **SMALL, seed=2)
    out = tmp_path / "out"
    p = crashing_run(step, 1, "convert", src, out, "--no-progress")
    assert p.returncode == CRASH_EXIT_CODE, p.stderr
    r = run_cli("convert", src, out, "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["resumed_files"] == s["files"] - 1 or "nothing left to do" in r.stderr, r.output
    assert tree_digest(out) == tree_digest(ref)
    assert siblings(out) == []


@pytest.mark.parametrize("step", ["complete", "new-moved"])
def test_rerun_after_a_kill_at_the_rename_notices_an_edited_source(tmp_path, synth_ckpt, crashing_run, step):
    """Killed with the temp folder complete (or just renamed), then the source is edited: the plain rerun
    recovers the interrupted run's output as before, but may not call it "this conversion, nothing left to
    do" (exit 0): it is the conversion of the old source. Refused naming the changed file; OUT is kept whole
    (the old source's complete conversion) and --overwrite then converts the current source."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(synth_ckpt("quark-mxfp4", **SMALL, seed=3), src)
    out = tmp_path / "out"
    p = crashing_run(step, 1, "convert", src, out, "--no-progress")
    assert p.returncode == CRASH_EXIT_CODE, p.stderr
    shard = sorted(src.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x40  # a weight byte near the end: outside the sampled content hash
    shard.write_bytes(bytes(data))
    r = run_cli("convert", src, out)
    assert r.exit_code == 2, r.output
    assert "source changed" in r.stderr and shard.name in r.stderr, r.stderr
    assert verify_output(out).ok and siblings(out) == []
    r = run_cli("convert", src, tmp_path / "ref")
    assert r.exit_code == 0, r.output
    assert tree_digest(out) != tree_digest(tmp_path / "ref")  # the control: OUT is the old source's output
    r = run_cli("convert", src, out, "--overwrite")
    assert r.exit_code == 0, r.output
    assert tree_digest(out) == tree_digest(tmp_path / "ref")


# --------------------------------------------------------------------------- a lock removed or replaced (issue 30)


def _wait_for(cond, timeout=120.0):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def _no_raw_os_error(text: str) -> None:
    assert "Traceback" not in text and "Errno" not in text and "FileNotFoundError" not in text, text


@pytest.mark.parametrize("delay", [0.0, 0.4, 1.5])
def test_removed_lock_file_lets_no_second_run_in(tmp_path, synth_ckpt, ckpts, crashing_run, delay):
    """The issue's hostile user: run A converts to OUT; as soon as ``.OUT.megamoe-tmp`` exists the lock file
    is deleted; `delay` s later run B starts with --overwrite. Before, B discarded A's live temp folder (a
    bare ``Directory not empty`` / ``FileNotFoundError``) and OUT held files of both runs. Now B is refused
    naming A's folder and pid (A's temp folder is claimed by a lock on its own directory), A finishes,
    re-creating its lock, and OUT is one complete output, equal to the reference."""
    src = synth_ckpt("quark-mxfp4", **SMALL)
    _, ref = ckpts.converted("quark-mxfp4", **SMALL)
    out = tmp_path / "out"
    a = crashing_run("tensor", "3:2.5", "convert", src, out, "--no-progress", wait=False)
    try:
        _wait_for(lambda: temp_dir_for(out).is_dir())
        lock_path_for(out).unlink()
        time.sleep(delay)
        r = run_cli("convert", src, out, "--overwrite")
        _no_raw_os_error(r.output)
        assert r.exit_code == 2, r.output
        assert f"another megamoe-convert run is writing {temp_dir_for(out)} right now" in r.stderr, r.stderr
        assert f"pid {a.pid}" in r.stderr and "removed or replaced" in r.stderr, r.stderr
        _, err = a.communicate(timeout=300)
    finally:
        if a.poll() is None:
            a.kill()
    assert a.returncode == 0, err
    _no_raw_os_error(err)
    assert tree_digest(out) == tree_digest(ref) and verify_output(out).ok
    assert siblings(out) == []


def test_removed_lock_during_the_swap_of_an_overwrite(tmp_path, synth_ckpt, ckpts, crashing_run):
    """The same, with the lock file deleted while A is mid-swap (the previous OUT already moved to
    ``.megamoe-old``): B waits for A's swap (OUT's parent directory lock), A re-creates its lock and
    finishes; B is then refused naming A, or (A already gone) does what it was asked: a conversion
    replacing A's complete output. OUT is never half there and ends one complete output."""
    src_old = synth_ckpt("quark-mxfp4", **SMALL, seed=1)
    src = synth_ckpt("quark-mxfp4", **SMALL, seed=2)
    _, ref = ckpts.converted("quark-mxfp4", **SMALL, seed=2)
    out = tmp_path / "out"
    convert(src_old, out)
    a = crashing_run("old-moved", "1:1.5", "convert", src, out, "--overwrite", "--no-progress", wait=False)
    try:
        _wait_for(lambda: b"pausing" in _peek_stderr(a))
        lock_path_for(out).unlink()
        r = run_cli("convert", src, out, "--overwrite")
        _no_raw_os_error(r.output)
        assert r.exit_code == 0 or f"right now (pid {a.pid} on" in r.stderr, r.output
        _, err = a.communicate(timeout=300)
    finally:
        if a.poll() is None:
            a.kill()
    assert a.returncode == 0, err
    assert tree_digest(out) == tree_digest(ref) and verify_output(out).ok and siblings(out) == []


def test_lock_replaced_by_another_process_stops_the_run_touching_nothing(tmp_path, synth_ckpt, ckpts,
                                                                          crashing_run, monkeypatch):
    """While A runs, its lock file is replaced by another live process's lock (here: this test's, flocked):
    A stops with a clear error naming the lock, OUT and that process, before its first rename; its temp
    folder stays as it was, and once the other process lets go ``--resume`` finishes it to the reference."""
    import fcntl

    src = synth_ckpt("quark-mxfp4", **SMALL)
    _, ref = ckpts.converted("quark-mxfp4", **SMALL)
    out = tmp_path / "out"
    a = crashing_run("tensor", "3:2", "convert", src, out, "--no-progress", wait=False)
    other = tmp_path / "other-lock"
    try:
        _wait_for(lambda: b"pausing" in _peek_stderr(a))
        other.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": "now"}))
        fd = os.open(other, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.replace(other, lock_path_for(out))
        _, err = a.communicate(timeout=300)
    finally:
        if a.poll() is None:
            a.kill()
    try:
        assert a.returncode == 2, err
        _no_raw_os_error(err)
        assert f"the lock {lock_path_for(out)} of {out} was removed or replaced while this run" in err, err
        assert f"pid {os.getpid()} on {socket.gethostname()}" in err and "touches nothing" in err, err
        assert not out.exists() and temp_dir_for(out).is_dir()
        assert json.loads(lock_path_for(out).read_text())["pid"] == os.getpid()  # not removed by A
    finally:
        os.close(fd)
    lock_path_for(out).unlink()
    r = run_cli("convert", src, out, "--resume")
    assert r.exit_code == 0, r.output
    assert tree_digest(out) == tree_digest(ref) and siblings(out) == []


def test_temp_folder_replaced_under_a_live_run(tmp_path, synth_ckpt, crashing_run):
    """A's temp folder is moved away and a user's folder put at its name while A runs: A stops (it is no
    longer its folder) and touches neither: the user's folder and A's moved folder are byte for byte kept."""
    src = synth_ckpt("quark-mxfp4", **SMALL)
    out = tmp_path / "out"
    a = crashing_run("tensor", "3:2", "convert", src, out, "--no-progress", wait=False)
    try:
        _wait_for(lambda: b"pausing" in _peek_stderr(a))
        tmp = temp_dir_for(out)
        os.rename(tmp, tmp_path / "moved")
        _user_tree(tmp)
        before = tree_digest(tmp)
        _, err = a.communicate(timeout=300)
    finally:
        if a.poll() is None:
            a.kill()
    assert a.returncode == 2, err
    _no_raw_os_error(err)
    assert f"{tmp} is no longer this run's temp folder" in err and "touches nothing" in err, err
    assert tree_digest(tmp) == before and not out.exists()
    assert (tmp_path / "moved" / "megamoe-journal.jsonl").is_file()


def test_temp_claim_in_process(tmp_path):
    """The claim on a temp folder: a second claim, a discard, a resume and the early target check are
    refused naming the holder's run; the marker keeps the creating command when a resume takes over."""
    from megamoe_convert.output.output_dir import TempClaim, discard_temp, read_temp_marker
    from megamoe_convert.output.temp_folder import Journal, check_output_target, prepare_temp_dir

    out = tmp_path / "out"
    lock = OutputLock(out).acquire()
    try:
        tmp, resuming = prepare_temp_dir(out, overwrite=False, resume=False, guard=lock)
        assert not resuming and lock.claim is not None
        Journal(tmp).start("fp")
        m = read_temp_marker(tmp)
        assert m["run_id"] == lock.run_id and m["command"]["argv"]
        lock.fd, fd = None, lock.fd  # another "run" whose lock file was removed: only the claim is left
        for attempt in (lambda: TempClaim.adopt(tmp, out), lambda: discard_temp(tmp),
                        lambda: check_output_target(out, overwrite=True, resume=False),
                        lambda: prepare_temp_dir(out, overwrite=False, resume=True)):
            with pytest.raises(OutputError, match=rf"writing {tmp} right now \(run {lock.run_id}, pid {os.getpid()} on "):
                attempt()
        lock.fd = fd
    finally:
        lock.release()
    assert not lock_path_for(out).exists()
    second = OutputLock(out).acquire()
    try:
        assert prepare_temp_dir(out, overwrite=False, resume=True, guard=second) == (tmp, True)
        m2 = read_temp_marker(tmp)
        assert m2["run_id"] == second.run_id and m2["command"] == m["command"]
        assert m2["resumes"][0]["run_id"] == m["run_id"]
    finally:
        second.release()
