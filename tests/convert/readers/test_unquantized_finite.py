"""A BF16 / FP16 / FP32 source converted WITHOUT --quantize (the bf16 row copies or casts the weights): a NaN or
inf weight is refused in one line naming layer, expert, projection, source tensor, index (multi-dimensional and
flat) and value, and nothing is left under OUT. Before, the bf16 row copied it into the output (the --quantize
path already refused; tests/convert/readers/test_fp8_block.py)."""
from __future__ import annotations

import pytest
import torch

from megamoe_convert.output.output_dir import temp_dir_for
from megamoe_convert.pipeline.convert import convert
from megamoe_convert.readers.common import all_finite
from megamoe_convert.testing import synth

SIZES = dict(num_layers=2, hidden=256, intermediate=128, num_experts=4, top_k=2)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_bf16_row_refuses_a_non_finite_source_weight(tmp_path, edit_source, refused_convert, fmt, value):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", fmt, **SIZES, seed=7)
    name = "model.layers.1.mlp.experts.2.up_proj.weight"

    def put(w):
        w[5, 7] = value
        w[9, 1] = value
        return w
    edit_source(src, put, name)
    err = refused_convert(src, tmp_path / "out")
    flat = 5 * SIZES["hidden"] + 7
    for part in ("layer 1 expert 2 up", name, "2 non-finite value(s)", f"first at [5, 7] = {value!r}",
                 f"(flat index {flat})", "fix the source"):
        assert part in err, f"{part!r} not in {err!r}"


def test_fp32_weight_beyond_bf16_range_is_refused(tmp_path, edit_source, refused_convert):
    """A finite FP32 weight that rounds to inf in BF16 would be served as inf: refused, saying so."""
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "fp32", **SIZES, seed=7)
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    big = float(torch.finfo(torch.float32).max)

    def put(w):
        w[3, 4] = big
        return w
    edit_source(src, put, name)
    err = refused_convert(src, tmp_path / "out")
    for part in ("layer 0 expert 1 down", name, f"first at [3, 4] = {big!r}", "beyond BF16's range"):
        assert part in err, f"{part!r} not in {err!r}"


def test_fused_experts_name_the_expert_and_flat_index(tmp_path, edit_source):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "bf16", **SIZES, seed=7, naming="fused")
    name = "model.layers.0.mlp.experts.down_proj"

    def put(w):
        w[3].view(-1)[300] = float("nan")
        return w
    edit_source(src, put, name)
    with pytest.raises(Exception, match=rf"layer 0 expert 3 down: {name}\[3\] .*first at \[2, 44\] = nan "
                                        r"\(flat index 300\)"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not temp_dir_for(tmp_path / "out").exists()


@pytest.mark.parametrize("fmt, quantize", [("bf16", None), ("bf16", "mxfp8"), ("modelopt-nvfp4", None)])
def test_shared_expert_non_finite_is_refused(tmp_path, edit_source, refused_convert, fmt, quantize):
    """BF16 shared experts are copied (bf16 row) or re-encoded (mxfp8): a NaN / inf there is refused too, from a
    plain BF16 source or from a quantized export that keeps its shared experts BF16."""
    src = synth.build_synthetic_checkpoint(tmp_path / "src", fmt, **SIZES, shared=1, shared_format="bf16", seed=7)
    name = "model.layers.1.mlp.shared_experts.gate_proj.weight"

    def put(w):
        w[0, 2] = float("inf")
        return w
    edit_source(src, put, name)
    err = refused_convert(src, tmp_path / "out", *(["--quantize", quantize] if quantize else []))
    for part in ("MoE layer 1 (model.layers.1.mlp) shared expert 0 gate weight", name,
                 "first at [0, 2] = inf (flat index 2)", "fix the source"):
        assert part in err, f"{part!r} not in {err!r}"


def test_all_finite_fast_path_and_overflowing_sum():
    """The one-sum test: NaN / inf anywhere are found; finite values whose sum overflows are still finite."""
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        w = torch.zeros(64, 64, dtype=dt)
        assert all_finite(w)
        big = torch.full((64, 64), float(torch.finfo(dt).max), dtype=dt)
        assert all_finite(big) and not bool(torch.isfinite(big.sum()))
        for v in (float("nan"), float("inf"), float("-inf")):
            x = w.clone()
            x[63, 63] = v
            assert not all_finite(x)
        x = w.clone()
        x[0, 0], x[1, 1] = float("inf"), float("-inf")
        assert not all_finite(x)
