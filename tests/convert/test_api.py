"""The converter's public API (`megamoe_convert/__init__.py`): convert, inspect, the available formats."""
from __future__ import annotations

import subprocess
import sys

import pytest

import megamoe_convert as mc
from megamoe_convert.pipeline.convert import convert
from megamoe_convert.pipeline.inspection import InspectReport, inspect_checkpoint
from megamoe_convert.pipeline.summary import ConvertSummary
from megamoe_convert.readers import DETECTION_ORDER, available_formats
from megamoe_convert.testing import synth

PUBLIC = {"convert", "inspect", "available_formats", "ConvertSummary", "InspectReport"}
SMALL = dict(num_layers=2, hidden=256, intermediate=128, num_experts=4, top_k=2)


def test_all_is_the_api_and_each_name_is_the_defining_object():
    assert set(mc.__all__) == PUBLIC
    assert (mc.convert, mc.inspect, mc.available_formats, mc.ConvertSummary, mc.InspectReport) == \
        (convert, inspect_checkpoint, available_formats, ConvertSummary, InspectReport)
    assert mc.available_formats() == list(DETECTION_ORDER) and "modelopt-nvfp4" in mc.available_formats()


@pytest.mark.parametrize("name", ["inspect_checkpoint", "detect_reader", "main", "build_synthetic_checkpoint",
                                  "nope"])
def test_only_the_public_names_resolve(name):
    """No aliases: any other name is imported from the module that defines it."""
    with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
        getattr(mc, name)


def test_inspect_then_convert_through_the_api(tmp_path):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "modelopt-nvfp4", **SMALL)
    rep = mc.inspect(src, ep_size=2)
    assert isinstance(rep, mc.InspectReport) and rep.ok and rep.row == "nvfp4"
    summary = mc.convert(src, tmp_path / "out", ep_size=2)
    assert isinstance(summary, mc.ConvertSummary) and (tmp_path / "out" / "megamoe.json").is_file()
    # negative control: a split the experts do not allow is a problem through the API too
    assert not mc.inspect(src, ep_size=3).ok


def test_import_stays_cheap():
    """Importing the package (and listing its API) loads none of its floors, so no torch."""
    code = ("import sys, megamoe_convert as mc; dir(mc); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('megamoe_convert.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
