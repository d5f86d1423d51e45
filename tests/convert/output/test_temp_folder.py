"""temp_folder.py: the temp-folder protocol and the progress journal."""
import json
import os

import pytest

from megamoe_convert.output.output_dir import JOURNAL_NAME, TMP_MARKER, OutputError, temp_dir_for
from megamoe_convert.output.temp_folder import Journal, finalize_output, prepare_temp_dir


def _fake_output(d, files=("a.safetensors",)):
    """A folder whose manifest says it is a megamoe output listing `files`."""
    d.mkdir()
    for f in files:
        (d / f).write_text("x")
    (d / "megamoe.json").write_text(json.dumps({"format": "megamoe", "files": {f: {} for f in files}}))
    return d


def test_temp_dir_protocol(tmp_path):
    out = tmp_path / "out"
    tmp, resuming = prepare_temp_dir(out, overwrite=False, resume=False)
    assert tmp == temp_dir_for(out) == tmp_path / ".out.megamoe-tmp" and not resuming
    assert (tmp / TMP_MARKER).is_file()  # what makes it provably ours
    with pytest.raises(OutputError, match=r"interrupted \(no process holds its lock, so it is not running\); "
                                          r"pass --resume .* or pass --overwrite"):
        prepare_temp_dir(out, overwrite=False, resume=False)
    with pytest.raises(OutputError, match="no progress journal"):
        prepare_temp_dir(out, overwrite=False, resume=True)
    j = Journal(tmp)
    j.start("fp")
    assert prepare_temp_dir(out, overwrite=False, resume=True) == (tmp, True)
    (tmp / "a.safetensors").write_text("new")
    (tmp / "megamoe.json").write_text(json.dumps({"format": "megamoe", "files": {"a.safetensors": {}}}))
    # a complete temp folder: of this run, resumed without --resume; of another run, refused
    j.mark_complete()
    assert prepare_temp_dir(out, overwrite=False, resume=False, fingerprint="fp") == (tmp, True)
    with pytest.raises(OutputError, match="holds a finished conversion .* of different inputs or options"):
        prepare_temp_dir(out, overwrite=False, resume=False, fingerprint="other")
    _fake_output(out, ["old.safetensors"])
    with pytest.raises(OutputError, match="already exists; pass --overwrite"):
        prepare_temp_dir(out, overwrite=False, resume=True)
    assert prepare_temp_dir(out, overwrite=True, resume=False, fingerprint="fp") == (tmp, True)
    finalize_output(tmp, out)
    assert sorted(p.name for p in out.iterdir()) == ["a.safetensors", "megamoe.json"]  # journal + marker gone
    assert not tmp.exists() and [p.name for p in tmp_path.iterdir()] == ["out"]  # old copy removed
    tmp2, _ = prepare_temp_dir(out, overwrite=True, resume=False)
    assert tmp2.is_dir() and out.is_dir()  # OUT is replaced only by finalize_output


def test_journal_ignores_torn_line(tmp_path):
    j = Journal(tmp_path)
    j.start("abc")
    j.record_file("f1", 10, "00" * 32, {"t": {"x": 1}})
    j.record_layer(3, {"repairs": [], "shared": {}})
    with open(tmp_path / JOURNAL_NAME, "a") as f:
        f.write('{"kind": "file", "name": "f2", "si')  # killed mid-write
    fp, files, layers = j.load()
    assert fp == "abc" and list(files) == ["f1"] and files["f1"]["size"] == 10 and layers[3]["repairs"] == []


# --------------------------------------------------------------------------- resume: what it keeps (issue 31 item 2)


SMALL = dict(num_layers=2, hidden=256, intermediate=128, num_experts=4, top_k=2)
ARGS = dict(max_shard_size="60KB")


@pytest.fixture
def interrupted(tmp_path, stopped_convert):
    """make(name) -> (src, out, ref): a source, its reference conversion, and a run to `out` stopped after
    9 tensors (some files finished and journaled)."""
    from megamoe_convert.testing import synth
    from megamoe_convert.pipeline.convert import convert

    src = synth.build_synthetic_checkpoint(tmp_path / "src", "quark-mxfp4", **SMALL, seed=6)
    ref = tmp_path / "ref"
    convert(src, ref, **ARGS)

    def make(name: str):
        out = tmp_path / name
        stopped_convert(src, out, 9, **ARGS)
        return src, out, ref
    return make


def _tree(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


class _Display:
    """A progress display with the phase protocol (`plan.report_stage`)."""

    def __init__(self):
        self.stages = []

    def __call__(self, done, total):
        pass

    def stage(self, text):
        self.stages.append(text)


def _counting(monkeypatch, owner, name):
    calls = []
    real = getattr(owner, name)

    def wrapped(*a, **k):
        calls.append(a)
        return real(*a, **k)
    monkeypatch.setattr(owner, name, wrapped)
    return calls


def test_resume_keeps_untouched_files_without_reading_them_again(interrupted, monkeypatch):
    """The 12.5 s blank screen: a resume re-hashed every kept file (read back from disk: the shards are
    written with O_DIRECT) and then re-derived and hashed all their tensors from the source, more work
    than a fresh run. Kept files the journal saw closed, unchanged on this boot, of a source whose status
    is unchanged, are now kept without reading a byte of them or of their source; the output is the same."""
    import megamoe_convert.output.temp_folder as tf
    from megamoe_convert.pipeline.convert import convert
    from megamoe_convert.pipeline.stream import Run
    from megamoe_runtime.files import digests

    monkeypatch.setattr(tf, "RACY_NS", 0)  # the fixture's source was written a moment ago
    src, out, ref = interrupted("out")
    rehashed = _counting(monkeypatch, digests, "file_digest")
    checked = _counting(monkeypatch, Run, "check_bytes")
    logs, display = [], _Display()
    s = convert(src, out, resume=True, log=logs.append, progress=display, **ARGS)
    assert s.resumed_files > 0 and _tree(out) == _tree(ref)
    assert rehashed == [] and checked == []
    assert any("keeping" in m and "as the interrupted run left them" in m for m in logs), logs
    assert any(t.startswith("resume: checking what") for t in display.stages), display.stages


def test_resume_rechecks_what_it_cannot_trust(interrupted, monkeypatch):
    """Negative controls of the fast path: after a restart (another boot id) the kept files are re-hashed,
    each shown in the progress phase; a source file whose status changed (utime: same mtime, new ctime)
    or that was written just before the interrupted run read it has its tensors re-derived and compared,
    the log saying why."""
    import megamoe_convert.output.temp_folder as tf
    from megamoe_convert.pipeline.convert import convert
    from megamoe_convert.pipeline.stream import Run
    from megamoe_runtime.files import digests

    # a restart between the runs
    monkeypatch.setattr(tf, "RACY_NS", 0)
    src, out, ref = interrupted("out1")
    monkeypatch.setattr(tf, "boot_id", lambda: "another-boot")
    rehashed = _counting(monkeypatch, digests, "file_digest")
    logs, display = [], _Display()
    s = convert(src, out, resume=True, log=logs.append, progress=display, **ARGS)
    assert s.resumed_files > 0 and len(rehashed) == s.resumed_files and _tree(out) == _tree(ref)
    assert any("re-hashing" in m and "the machine restarted since" in m for m in logs), logs
    assert any(t.startswith(f"resume: re-hashing kept file 1/{s.resumed_files} ") for t in display.stages)
    monkeypatch.undo()

    # the source's status changed (an edit with the mtime put back changes ctime)
    monkeypatch.setattr(tf, "RACY_NS", 0)
    src, out, ref = interrupted("out2")
    shard = sorted(src.glob("*.safetensors"))[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    checked = _counting(monkeypatch, Run, "check_bytes")
    logs = []
    s = convert(src, out, resume=True, log=logs.append, **ARGS)
    assert s.resumed_files > 0 and checked and _tree(out) == _tree(ref)
    assert any(f"{shard.name} had its status changed (ctime)" in m for m in logs), logs
    monkeypatch.undo()

    # a source written just before the interrupted run read it (the default rule; the fixture's is)
    src, out, ref = interrupted("out3")
    checked = _counting(monkeypatch, Run, "check_bytes")
    logs = []
    s = convert(src, out, resume=True, log=logs.append, **ARGS)
    assert s.resumed_files > 0 and checked and _tree(out) == _tree(ref)
    assert any("before the interrupted run read it (less than 2 s" in m for m in logs), logs


def test_resume_with_other_options_names_them_and_the_first_command(interrupted, monkeypatch):
    """Before: "different inputs or options (run fingerprint 3f2a..., this run 9c1b...)". Now each differing
    option is named with both values, and the command the interrupted run was started with (kept in the temp
    folder's marker) is shown."""
    import sys

    from megamoe_convert.pipeline.convert import convert

    monkeypatch.setattr(sys, "argv", ["/usr/bin/megamoe-convert", "convert", "SRC", "OUT", "--max-shard-size",
                                      "60KB"])
    src, out, _ = interrupted("out")
    monkeypatch.undo()
    tmp = temp_dir_for(out)
    assert json.loads((tmp / TMP_MARKER).read_text())["command"]["argv"] == [
        "megamoe-convert", "convert", "SRC", "OUT", "--max-shard-size", "60KB"]
    with pytest.raises(OutputError) as e:
        convert(src, out, resume=True, max_shard_size="1MB", ep_size=2, checksum="sha256")
    msg = str(e.value)
    for needle in ("--max-shard-size: 60.00 KB then, 1.00 MB now", "--ep-size: 1 then, 2 now",
                   '--checksum: "blake3" then, "sha256" now', "the planned files",
                   "It was started as: megamoe-convert convert SRC OUT --max-shard-size 60KB",
                   f"(kept in {tmp / TMP_MARKER})", "pass --overwrite to discard it"):
        assert needle in msg, (needle, msg)
    assert "fingerprint" not in msg
    assert tmp.is_dir() and not out.exists()  # refused: the interrupted run's folder is kept as it was


def test_the_kept_command_never_holds_a_token(monkeypatch):
    """The marker keeps the command line; a hub token given on it (``--token``) is kept as ``$HF_TOKEN``."""
    import sys

    from megamoe_convert.output.output_dir import this_command

    monkeypatch.setattr(sys, "argv", ["/x/megamoe-convert", "convert", "org/m", "out", "--token", "hf_secret",
                                      "--token=hf_other", "--ep-size", "2"])
    argv = this_command()["argv"]
    assert argv == ["megamoe-convert", "convert", "org/m", "out", "--token", "$HF_TOKEN", "--token=$HF_TOKEN",
                    "--ep-size", "2"]
    assert "hf_" not in json.dumps(this_command())


def test_overwrite_discard_removes_only_what_the_tool_wrote(tmp_path):
    """--overwrite discards a stale temp folder entry by entry: a file the tool did not write (a user's,
    dropped in there) refuses the discard, naming it, and nothing in the folder is removed."""
    out = tmp_path / "out"
    tmp, _ = prepare_temp_dir(out, overwrite=False, resume=False)
    j = Journal(tmp)
    j.start("fp")
    (tmp / "model-00001-of-00001.safetensors").write_text("shard")
    j.record_file("model-00001-of-00001.safetensors", 5, "0" * 64, {})
    (tmp / "megamoe-experts-rank000-of-001-00001.safetensors").write_text("half-written, not journaled")
    (tmp / "config.json.part").write_text("{")
    (tmp / "notes.txt").write_text("mine")
    (tmp / "subdir").mkdir()
    before = sorted(p.name for p in tmp.iterdir())
    with pytest.raises(OutputError, match=r"also holds 2 entries it did not write \(notes.txt, subdir\).*"
                                          r"left in place"):
        prepare_temp_dir(out, overwrite=True, resume=False, fingerprint="other",
                         planned={"megamoe-experts-rank000-of-001-00001.safetensors", "config.json"})
    assert sorted(p.name for p in tmp.iterdir()) == before and (tmp / "notes.txt").read_text() == "mine"
    (tmp / "notes.txt").unlink()
    (tmp / "subdir").rmdir()
    # without the plan the unjournaled shard is not provably ours either
    with pytest.raises(OutputError, match=r"megamoe-experts-rank000-of-001-00001.safetensors"):
        prepare_temp_dir(out, overwrite=True, resume=False, fingerprint="other")
    assert sorted(p.name for p in tmp.iterdir()) == sorted(set(before) - {"notes.txt", "subdir"})
    tmp2, resuming = prepare_temp_dir(out, overwrite=True, resume=False, fingerprint="other",
                                      planned={"megamoe-experts-rank000-of-001-00001.safetensors", "config.json"})
    assert tmp2 == tmp and not resuming and sorted(p.name for p in tmp.iterdir()) == [TMP_MARKER]


def test_resume_summary_rates_only_the_bytes_it_processed(interrupted, monkeypatch):
    """A resume's throughput was all input bytes over the resume's time (``1.96 GB/s`` for a run that
    rewrote little): it is now over the bytes this run processed, and the summary says how many the
    earlier run's kept files account for."""
    import megamoe_convert.output.temp_folder as tf
    from megamoe_convert.cli.main import _print_summary
    from megamoe_convert.pipeline.convert import convert
    from megamoe_convert.output.shard_writer import format_bytes

    monkeypatch.setattr(tf, "RACY_NS", 0)
    src, out, _ = interrupted("out")
    s = convert(src, out, resume=True, **ARGS)
    assert s.resumed_files > 0 and 0 < s.bytes_kept < s.bytes_in
    assert s.bytes_processed == s.bytes_in - s.bytes_kept
    s.seconds = 2.0
    assert s.gb_per_s == pytest.approx(s.bytes_processed / 2.0 / 1e9)
    assert s.to_dict()["bytes_kept"] == s.bytes_kept
    lines = []
    monkeypatch.setattr("click.echo", lambda m="", **k: lines.append(m))
    _print_summary(s)
    assert any(f"{format_bytes(s.bytes_kept)} kept from the earlier run" in m
               and f"over the {format_bytes(s.bytes_processed)} processed by this run" in m for m in lines), lines
    fresh = convert(src, out.parent / "fresh", **ARGS)
    assert fresh.bytes_kept == 0 and fresh.bytes_processed == fresh.bytes_in


@pytest.mark.parametrize("err", ["ENOSPC", "EIO"])
def test_a_failed_write_names_the_file_and_the_resume(tmp_path, synth_ckpt, monkeypatch, err):
    """A full disk (ENOSPC) or an I/O error at a shard write: exit 2 with one error naming the shard file,
    saying the temp folder remains and giving the --resume command (it used to print only
    ``OSError: [Errno 28] No space left on device``); the printed command then completes the output."""
    import errno
    import shlex

    from click.testing import CliRunner

    from megamoe_convert.cli.main import main
    from megamoe_runtime.load.verify import verify_output

    src = synth_ckpt("quark-mxfp4", num_layers=2, hidden=256, intermediate=128, num_experts=4, top_k=2)
    out = tmp_path / "out"
    real, calls = os.pwrite, [0]

    def failing(fd, data, pos):
        calls[0] += 1
        if calls[0] > 6:  # past the first file's header and first tensors
            raise OSError(getattr(errno, err), os.strerror(getattr(errno, err)))
        return real(fd, data, pos)

    monkeypatch.setattr(os, "pwrite", failing)
    r = CliRunner().invoke(main, ["convert", str(src), str(out), "--max-shard-size", "60KB", "--no-progress"])
    monkeypatch.setattr(os, "pwrite", real)
    tmp = temp_dir_for(out)
    assert r.exit_code == 2, r.output
    line = next(x for x in r.stderr.splitlines() if x.startswith("error:"))
    assert os.strerror(getattr(errno, err)) in line and f"'{tmp}/" in line and ".safetensors'" in line
    assert f"{tmp} remains" in line and ("once space is free" in line) == (err == "ENOSPC")
    assert not out.exists() and tmp.is_dir()
    cmd = r.stderr.split("continue with:\n  ", 1)[1].splitlines()[0]
    assert cmd.endswith("--resume")
    assert CliRunner().invoke(main, shlex.split(cmd)[1:]).exit_code == 0
    assert verify_output(out).ok and not tmp.exists()


def _damage(how: str, p):
    """Change a finished shard the way a user (or a cleanup job) could while the run goes on."""
    if how == "deleted":
        p.unlink()
    elif how == "moved":
        p.rename(p.with_name("elsewhere.bin"))
    elif how == "truncated":
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size // 2)
    elif how == "replaced":  # same bytes count, another file
        data = bytearray(p.read_bytes())
        data[-1] ^= 0xFF
        p.unlink()
        p.write_bytes(bytes(data))
    elif how == "rewritten":  # same file, same size, mtime put back: only ctime tells
        st = p.stat()
        with open(p, "r+b") as f:
            f.seek(st.st_size - 1)
            b = f.read(1)
            f.seek(st.st_size - 1)
            f.write(bytes([b[0] ^ 0xFF]))
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("how", ["deleted", "moved", "truncated", "replaced", "rewritten"])
def test_a_shard_changed_in_the_temp_folder_is_never_swapped_in(tmp_path, synth_ckpt, how):
    """A finished shard deleted, moved, truncated or rewritten inside ``.OUT.megamoe-tmp`` while the run goes
    on (here: after the final fsync, right before the journal says complete): the run refuses naming the
    file and what happened, nothing is moved into OUT (it used to swap in and exit 0, and verify then
    failed), and ``--resume`` rewrites the shard into a verified output."""
    from megamoe_convert.pipeline.convert import convert
    from megamoe_runtime.load.verify import verify_output

    src = synth_ckpt("quark-mxfp4", num_layers=2, hidden=256, intermediate=128, num_experts=4, top_k=2)
    out = tmp_path / "out"
    tmp = temp_dir_for(out)
    victim = []

    def on_step(name):
        if name == "synced":
            p = sorted(tmp.glob("megamoe-experts-*.safetensors"))[0]
            victim.append(p)
            _damage(how, p)

    with pytest.raises(OutputError) as e:
        convert(str(src), out, max_shard_size=60_000, on_step=on_step)
    what = {"deleted": ["is gone"], "moved": ["is gone"], "truncated": ["is"], "rewritten": ["was modified"],
            "replaced": ["was replaced", "was modified"]}[how]  # a freed inode number may be reused at once
    assert any(f"{victim[0]} {w} " in str(e.value) for w in what) and "nothing was moved into" in str(e.value)
    assert how != "truncated" or "bytes, " in str(e.value)
    assert not out.exists() and tmp.is_dir()
    (tmp / "elsewhere.bin").unlink(missing_ok=True)  # the user's move; the resume would refuse a stranger
    convert(str(src), out, max_shard_size=60_000, resume=True)
    assert verify_output(out).ok and not tmp.exists()
