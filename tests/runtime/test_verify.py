"""verify.py: a converted folder checked against its manifest by the runtime alone."""
import subprocess
import sys

import pytest

from megamoe_runtime.errors import OutputError
from megamoe_runtime.load.verify import verify_output


def test_verify_a_converted_folder(ckpts):
    _, out = ckpts.converted("modelopt-nvfp4")
    rep = verify_output(out)
    assert rep.ok and rep.files_checked > 1 and rep.tensors_checked > 0 and rep.row == "nvfp4"


def test_verify_refuses_a_missing_folder_with_the_converters_error_class(tmp_path):
    from megamoe_convert.output.output_dir import OutputError as ConvertOutputError

    assert ConvertOutputError is OutputError  # one class: `except OutputError` catches both
    with pytest.raises(OutputError, match="is not a folder"):
        verify_output(tmp_path / "absent")


def test_verify_needs_no_converter():
    """A serve-only install verifies a folder: importing verify imports nothing of megamoe_convert."""
    code = ("import sys, megamoe_runtime.load.verify; "
            "print(sorted(m for m in sys.modules if m.startswith('megamoe_convert')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _add_header_entries(path, count: int) -> None:
    """Rewrite a safetensors file with `count` extra empty tensors in its header (valid: they tile the end
    of the data section with zero bytes)."""
    import json
    import struct

    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    end = max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
    for i in range(count):
        header[f"stray.{i}"] = {"dtype": "U8", "shape": [0], "data_offsets": [end, end]}
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])


def test_verify_lists_a_bounded_number_of_problems(ckpts, tmp_path, monkeypatch):
    """A shard whose header holds many entries the manifest does not list: the report lists the first
    MAX_LISTED_PROBLEMS and counts the rest, in the JSON and on the terminal (a million stray entries
    printed a million lines); a header beyond the tensor limit is one problem, refused before parsing."""
    import json

    from click.testing import CliRunner

    from megamoe_convert.cli.main import main
    from megamoe_runtime.files import limits
    from megamoe_runtime.load.verify import MAX_LISTED_PROBLEMS

    _, out = ckpts.fresh_converted("quark-mxfp4", tmp_path / "out")
    shard = sorted(out.glob("megamoe-experts-*.safetensors"))[0]
    _add_header_entries(shard, 3 * MAX_LISTED_PROBLEMS)
    rep = verify_output(out)
    assert not rep.ok and len(rep.problems) == MAX_LISTED_PROBLEMS
    assert rep.problem_count > 3 * MAX_LISTED_PROBLEMS and rep.unlisted == rep.problem_count - MAX_LISTED_PROBLEMS
    r = CliRunner().invoke(main, ["verify", str(out), "--no-progress"])
    assert r.exit_code == 1
    lines = r.stdout.splitlines()
    assert len(lines) <= MAX_LISTED_PROBLEMS + 2 and lines[-1] == (
        f"  ... and {rep.unlisted} more (the first {MAX_LISTED_PROBLEMS} are listed)")
    d = json.loads(CliRunner().invoke(main, ["verify", str(out), "--json"]).stdout)
    assert len(d["problems"]) == MAX_LISTED_PROBLEMS and d["problems_unlisted"] == rep.unlisted
    monkeypatch.setitem(limits.LIMITS, "header_tensors", 2 * MAX_LISTED_PROBLEMS)
    rep = verify_output(out)
    assert [p for p in rep.problems if "tensors listed in its safetensors header" in p] == [rep.problems[-1]]
    assert rep.problem_count < 10


def test_verify_names_a_fifo_shard_for_what_it_is(ckpts, tmp_path):
    """A shard replaced by a FIFO: verify says it is a FIFO (it said "missing" though the name exists) and
    never opens it (a read would block: this test would hang)."""
    import os

    _, out = ckpts.fresh_converted("quark-mxfp4", tmp_path / "out")
    shard = sorted(out.glob("megamoe-experts-*.safetensors"))[0]
    shard.unlink()
    os.mkfifo(shard)
    rep = verify_output(out)
    assert f"{shard}: is a FIFO (named pipe), not a regular file" in "\n".join(rep.problems), rep.problems
