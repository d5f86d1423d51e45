"""checks.py: block-scale values, float-scale policy (w1/w3 agreement, a2),
the requantize repair and layer-spec errors."""
import math

import pytest
import torch

from megamoe_convert.pipeline import checks
from megamoe_convert.readers.base import ExpertScalars, ModelFacts, MoELayerInfo, SharedInfo
from megamoe_runtime.errors import CheckpointError, LayerSpecError, ScaleError
from megamoe_runtime.format import codecs
from megamoe_runtime.format.canonical import ExpertTensors, ProjectionTensors
from megamoe_runtime.format.formats import ActivationSpec, get_row

NV, MX4, MX8 = get_row("nvfp4"), get_row("mxfp4"), get_row("mxfp8")


def _info(E=4, H=256, I=128, shared=None, index=3):
    names = frozenset(f"model.layers.{index}.mlp.experts.{e}.{p}.{k}" for e in range(E)
                      for p in ("gate_proj", "up_proj", "down_proj") for k in ("weight", "weight_scale"))
    return MoELayerInfo(index, f"model.layers.{index}.mlp", E, H, I, shared, names)


def _nv_proj(out=128, k=256, seed=0, gscale=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(out, k, generator=g)
    packed, sf, gs = codecs.quantize_nvfp4_weight(x)
    return ProjectionTensors(packed, sf, gscale if gscale is not None else gs, 0.01)


# --------------------------------------------------------------------------- block scales

def test_ue8m0_ff_refused_with_count_and_position():
    w, sf = codecs.quantize_mxfp4(torch.randn(128, 256))
    sf = sf.clone()
    sf[5, 2] = 0xFF
    sf[7, 1] = 0xFF
    with pytest.raises(ScaleError, match=r"layer 3 expert 1 gate scale: 2 of 1024 UE8M0 .*0xFF.*\[5, 2\]"):
        checks.check_block_scales(ProjectionTensors(w, sf), MX4, "layer 3 expert 1 gate scale")


@pytest.mark.parametrize("row", [MX4, MX8])
def test_ue8m0_zero_byte_only_for_all_zero_blocks(row):
    x = torch.randn(128, 256)
    x[0, :32] = 0  # an all-zero block: ModelOpt writes scale byte 0
    w, sf = codecs.quantize_mxfp4(x) if row is MX4 else codecs.quantize_mxfp8(x)
    sf = sf.clone()
    sf[0, 0] = 0
    checks.check_block_scales(ProjectionTensors(w, sf), row, "ok")
    sf[4, 3] = 0  # nonzero block with a zero scale
    with pytest.raises(ScaleError, match=r"1 of .*zero while their block has nonzero elements.*\[4, 3\]"):
        checks.check_block_scales(ProjectionTensors(w, sf), row, "w")


def test_e4m3_nan_negative_zero():
    p = _nv_proj()
    for byte, match in ((0x7F, "NaN"), (0xFF, "NaN"), (0xB8, "negative"), (0x00, "zero while"), (0x80, "zero while")):
        s = p.scale.clone().view(torch.uint8)
        s[3, 4] = byte
        with pytest.raises(ScaleError, match=match) as ei:
            checks.check_block_scales(ProjectionTensors(p.weight, s.view(torch.float8_e4m3fn)), NV, "L0 e0 up")
        assert "[3, 4]" in str(ei.value) and f"0x{byte:02X}" in str(ei.value)
    # zero scale over an all-zero block is harmless
    w = p.weight.clone()
    w[3, 32:40] = 0  # elements 64..79 = block 4 of row 3
    s = p.scale.clone().view(torch.uint8)
    s[3, 4] = 0
    checks.check_block_scales(ProjectionTensors(w, s.view(torch.float8_e4m3fn)), NV, "ok")


def test_check_expert_names_layer_expert_and_source_tensor():
    info = _info(E=2, H=256, I=128)
    e = ExpertTensors(_nv_proj(128, 256), _nv_proj(128, 256, 1), _nv_proj(256, 128, 2))
    checks.check_expert(e, NV, info, 1)
    bad = e.down.scale.clone().view(torch.uint8)
    bad[0, 0] = 0x7F
    e.down = ProjectionTensors(e.down.weight, bad.view(torch.float8_e4m3fn), e.down.global_scale)
    with pytest.raises(ScaleError, match=r"MoE layer 3 \(model.layers.3.mlp\) expert 1 down scale "
                                         r"\(source tensor model.layers.3.mlp.experts.1.down_proj.weight_scale\)"):
        checks.check_expert(e, NV, info, 1)
    short = ExpertTensors(e.gate, e.up, ProjectionTensors(e.down.weight[:-1], e.down.scale[:-1], 1.0))
    with pytest.raises(CheckpointError, match=r"expert 1.down: weight shape \[255, 64\] != expected \[256, 64\]"):
        checks.check_expert(short, NV, info, 1)


# --------------------------------------------------------------------------- float scales

def _scalars(E=4, g=0.5, u=0.5, d=0.25, din=None, gin=0.1, uin=0.1):
    din = din or [0.01 * (e + 1) for e in range(E)]
    return [ExpertScalars(g, u, d, gin, uin, din[e]) for e in range(E)]


def test_a2_is_max_over_all_experts_and_mismatch_error():
    info = _info()
    rep = checks.check_layer_scalars(info, _scalars(), NV)
    assert rep.scalars["l2_activation_scale"] == 0.04
    assert rep.scalars["l1_activation_scale"] == 0.1
    sc = _scalars()
    sc[2] = ExpertScalars(0.5, 0.5 * (1 + 2e-5), 0.25, 0.1, 0.1, 0.03)
    with pytest.raises(ScaleError, match=r"layer 3 .*expert 2: w1 \(gate\) weight_scale_2 = 0.5 and w3 \(up\) "
                                         r"weight_scale_2 = 0.50001 .*--on-scale-mismatch requantize"):
        checks.check_layer_scalars(info, sc, NV)
    rep = checks.check_layer_scalars(info, sc, NV, on_scale_mismatch="requantize")
    assert rep.mismatches == [(2, 0.5, 0.50001)]
    sc[2] = ExpertScalars(0.5, 0.5 * (1 + 5e-6), 0.25, 0.1, 0.1, 0.03)  # within tolerance
    assert checks.check_layer_scalars(info, sc, NV).mismatches == []


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -1.0, float("inf")])
def test_bad_global_scale(bad):
    sc = _scalars()
    sc[1] = ExpertScalars(bad, 0.5, 0.25, None, None, 0.02)
    with pytest.raises(ScaleError, match=r"expert 1: gate global scale \(weight_scale_2\) = .* finite and > 0"):
        checks.check_layer_scalars(_info(), sc, NV)


def test_missing_input_scales():
    sc = _scalars(din=[0.01, None, 0.5, None])
    sc[1] = ExpertScalars(0.5, 0.5, 0.25, 0.1, 0.1, None)
    sc[3] = ExpertScalars(0.5, 0.5, 0.25, 0.1, 0.1, None)
    with pytest.raises(ScaleError, match=r"2 of 4 experts have no w2 \(down\) input scale \(experts \[1, 3\]\)"):
        checks.check_layer_scalars(_info(), sc, NV)
    rep = checks.check_layer_scalars(_info(), sc, NV, allow_missing_input_scales=True)
    assert rep.scalars["l2_activation_scale"] == 0.5 and rep.missing_input == [1, 3]
    none = [ExpertScalars(0.5, 0.5, 0.25) for _ in range(4)]
    with pytest.raises(ScaleError, match="no expert has a w2 \\(down\\) input scale"):
        checks.check_layer_scalars(_info(), none, NV, allow_missing_input_scales=True)
    bad = _scalars(din=[0.01, float("nan"), 0.02, 0.03])
    with pytest.raises(ScaleError, match="expert 1: down \\(w2\\) input scale = nan"):
        checks.check_layer_scalars(_info(), bad, NV)


def test_mx_rows_take_no_float_scales():
    info = _info()
    assert checks.check_layer_scalars(info, [ExpertScalars()] * 4, MX4).scalars == {}
    with pytest.raises(ScaleError, match="row mxfp4 has no float scales"):
        checks.check_layer_scalars(info, [ExpertScalars(gate_global=1.0)] * 4, MX4)


# --------------------------------------------------------------------------- repair

def test_requantize_gate_up_rescales_smaller_half():
    gate = _nv_proj(128, 256, 0)
    up = _nv_proj(128, 256, 1)
    up = ProjectionTensors(up.weight, up.scale, up.global_scale * 3.0, up.input_scale)  # up is larger
    down = _nv_proj(256, 128, 2)
    e = ExpertTensors(gate, up, down)
    fixed, rep = checks.requantize_gate_up(e, "L0 e1")
    s2 = up.global_scale
    assert fixed.gate.global_scale == fixed.up.global_scale == s2
    assert rep["requantized"] == "gate" and rep["weight_scale_2"] == s2
    assert torch.equal(fixed.gate.weight, gate.weight)  # nibbles unchanged
    assert torch.equal(fixed.up.scale.view(torch.uint8), up.scale.view(torch.uint8))
    want = codecs.e4m3_encode(codecs.e4m3_decode(gate.scale).double() * (gate.global_scale / s2))
    assert torch.equal(fixed.gate.scale.view(torch.uint8), want.view(torch.uint8))
    old = codecs.dequantize_nvfp4(gate.weight, gate.scale, gate.global_scale)
    new = codecs.dequantize_nvfp4(fixed.gate.weight, fixed.gate.scale, s2)
    assert math.isclose(rep["max_abs_change"], float((new - old).abs().max()), rel_tol=1e-6)
    assert 0 < rep["max_rel_change"] < 0.1  # one extra E4M3 rounding: <= 2^-4 relative
    assert rep["underflow_blocks"] == 0 and rep["zeroed_blocks"] == 0


def test_requantize_reports_underflow():
    gate = _nv_proj(128, 256, 0)
    up = _nv_proj(128, 256, 1)
    up = ProjectionTensors(up.weight, up.scale, gate.global_scale * 1e6)
    _, rep = checks.requantize_gate_up(ExpertTensors(gate, up, _nv_proj(256, 128, 2)), "x")
    assert rep["underflow_blocks"] > 0 and rep["zeroed_blocks"] > 0
    assert rep["max_rel_change"] == 1.0  # erased values


# --------------------------------------------------------------------------- specs

FACTS = ModelFacts(ActivationSpec(), top_k=2, routed_scaling_factor=2.5, num_experts=4)


def test_layer_spec_names_layer_and_rule():
    spec = checks.layer_spec(_info(), FACTS, NV, 2, None)
    assert spec.experts_per_rank == 2 and spec.routed_scaling_factor == 2.5
    with pytest.raises(LayerSpecError, match=r"MoE layer 3 \(model.layers.3.mlp\): hidden=192 is not a multiple "
                                             r"of 128 .*nearest valid: 128 or 256"):
        checks.layer_spec(_info(H=192), FACTS, NV, 1, None)
    with pytest.raises(LayerSpecError, match="MoE layer 3 .*not divisible by ep_size=3"):
        checks.layer_spec(_info(), FACTS, NV, 3, None)


def test_shared_spec_for():
    assert checks.shared_spec_for(_info(), NV)[1]["present"] is False
    sh = SharedInfo(num_shared=2, intermediate=128, encoding="nvfp4")
    spec, rec = checks.shared_spec_for(_info(shared=sh), NV)
    assert spec.precision == "mxfp8" and rec["fused_capable"] and rec["precision"] == "mxfp8"
    spec, rec = checks.shared_spec_for(_info(shared=SharedInfo(1, 128, "bf16")), NV)
    assert spec.precision == "bf16"
    spec, rec = checks.shared_spec_for(_info(shared=SharedInfo(1, 128, "bf16", unsupported_reason="gated")), NV)
    assert spec is None and rec["reason"] == "gated" and not rec["fused_capable"]
    spec, rec = checks.shared_spec_for(_info(shared=SharedInfo(1, 100, "mxfp8")), MX4)
    assert spec is None and "multiple of" in rec["reason"]
