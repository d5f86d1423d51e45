"""temp_folder.py: the temp-folder protocol and the progress journal."""
import json

import pytest

from megamoe_convert.output_dir import JOURNAL_NAME, TMP_MARKER, OutputError, temp_dir_for
from megamoe_convert.temp_folder import Journal, finalize_output, prepare_temp_dir


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
