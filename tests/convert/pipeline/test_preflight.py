"""preflight.py: the layer decisions convert and inspect share, raising for one and collecting for the other."""
import pytest

from megamoe_convert.pipeline import checks
from megamoe_convert.testing import synth
from megamoe_convert.pipeline.preflight import layer_decisions
from megamoe_convert.readers import detect_reader
from megamoe_convert.readers.source import open_source
from megamoe_runtime.errors import FormatError, LayerSpecError
from megamoe_runtime.format.formats import get_row

SMALL = dict(num_layers=1, hidden=256, intermediate=128, num_experts=4, top_k=2)


def test_layer_decisions_raise_for_convert_and_collect_for_inspect(tmp_path):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "quark-mxfp4", **SMALL, shared=1)
    with open_source(src) as s:
        reader = detect_reader(s)
        row, facts, info = get_row(reader.row), reader.model_facts(), reader.moe_layers()[0]
        shared, rec, spec = layer_decisions(info, row, facts, 2, "auto")
        assert shared.precision == "mxfp8" and rec["precision"] == "mxfp8" and spec.experts_per_rank == 2
        with pytest.raises(FormatError, match="--shared-precision bf16"):
            layer_decisions(info, row, facts, 1, "bf16")
        problems = []
        shared, rec, spec = layer_decisions(info, row, facts, 1, "bf16", problems)
        assert len(problems) == 1 and "--shared-precision bf16" in problems[0]
        assert (shared, rec) == checks.shared_spec_for(info, row) and spec is not None  # the row's own decision
        with pytest.raises(LayerSpecError):
            layer_decisions(info, row, facts, 3, "auto")  # 4 experts over 3 ranks
        problems = []
        assert layer_decisions(info, row, facts, 3, "auto", problems)[2] is None and len(problems) == 1
