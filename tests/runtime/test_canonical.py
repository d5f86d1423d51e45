"""megamoe_runtime.format.canonical: the per-row codec pair (quantize / dequantize) of checkpoint-encoded experts."""
from __future__ import annotations

import pytest
import torch

from megamoe_runtime.format import codecs
from megamoe_runtime.format.canonical import ExpertTensors, ProjectionTensors

#: max relative Frobenius error of a round trip on N(0, 1) weights
TOL = {"mxfp4": 0.2, "mxfp8": 0.05, "nvfp4": 0.15, "bf16": 0.01}


def _w(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("row", list(TOL))
def test_quantize_is_the_inverse_of_dequantize(row):
    w = _w(64, 128)
    p = ProjectionTensors.quantize(row, w)
    p.validate(row, 128, 64, "gate", "test")
    err = float((p.dequantize(row) - w).norm() / w.norm())
    assert err < TOL[row]
    assert err > 0 or row == "bf16"  # a real quantization happened (a no-op would pass the bound)


def test_quantize_uses_the_reference_quantizers_bit_for_bit():
    w = _w(32, 64, seed=1)
    p, s = codecs.quantize_mxfp4(w)
    got = ProjectionTensors.quantize("mxfp4", w)
    assert torch.equal(got.weight, p) and torch.equal(got.scale, s)
    p, s, g = codecs.quantize_nvfp4_weight(w)
    got = ProjectionTensors.quantize("nvfp4", w)
    assert torch.equal(got.weight, p) and torch.equal(got.scale.view(torch.uint8), s.view(torch.uint8))
    assert got.global_scale == g and got.input_scale is None


def test_nvfp4_expert_gate_and_up_share_one_global_scale():
    g, u, d = _w(32, 64, seed=2), _w(32, 64, seed=3) * 4, _w(64, 32, seed=4)
    et = ExpertTensors.quantize("nvfp4", g, u, d)
    assert et.gate.global_scale == et.up.global_scale != et.down.global_scale
    # negative control: quantized apart, the much larger up half gets its own global scale
    apart = ExpertTensors.quantize("nvfp4", g, u, d, shared_gate_up_global=False)
    assert apart.gate.global_scale != apart.up.global_scale
    for mx in ("mxfp4", "mxfp8", "bf16"):
        assert ExpertTensors.quantize(mx, g, u, d).gate.global_scale is None
