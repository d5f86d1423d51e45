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
    from megamoe_convert.output_dir import OutputError as ConvertOutputError

    assert ConvertOutputError is OutputError  # one class: `except OutputError` catches both
    with pytest.raises(OutputError, match="is not a folder"):
        verify_output(tmp_path / "absent")


def test_verify_needs_no_converter():
    """A serve-only install verifies a folder: importing verify imports nothing of megamoe_convert."""
    code = ("import sys, megamoe_runtime.load.verify; "
            "print(sorted(m for m in sys.modules if m.startswith('megamoe_convert')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
