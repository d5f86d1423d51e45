"""Every real producer export converts, and its converted kernel-layout
tensors, decoded back through the layout inverse, equal the source's
dequantized values exactly (routed experts, NVFP4 global scales, shared
experts where the conversion keeps their encoding)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import megamoe_runtime as mr
from megamoe_convert.pipeline import checks
from megamoe_convert.pipeline.convert import convert
from megamoe_convert.readers import detect_reader
from megamoe_convert.readers.source import open_source
from megamoe_runtime.format import layout

REAL = Path(__file__).resolve().parents[2] / "fixtures" / "real"
FIXTURES = sorted(p.name for p in REAL.glob("*") if (p / "config.json").is_file())


def _decoded_experts(layer: mr.DeepGemmMegaMoEExperts) -> list[tuple[torch.Tensor, ...]]:
    """fp32 (gate, up, down) of every expert, from the kernel-layout bytes only."""
    row = layer.spec.row
    experts = layout.unpack_expert_stack(row, layer.kernel_tensors())
    out = []
    for e, ex in enumerate(experts):
        if row == "nvfp4":  # global scales travel as the alphas, not in the bytes
            ex = replace(ex, gate=replace(ex.gate, global_scale=float(layer.l1_alpha[e, 0])),
                         up=replace(ex.up, global_scale=float(layer.l1_alpha[e, 1])),
                         down=replace(ex.down, global_scale=float(layer.l2_global_scale[e])))
        out.append(ex.dequantize(row))
    return out


@pytest.mark.parametrize("name", FIXTURES)
def test_real_export_round_trips_exactly(tmp_path, name, real_convert_options):
    src = REAL / name
    out = tmp_path / "out"
    opts = real_convert_options.get(name, {})
    summary = convert(src, out, **opts)
    assert summary.layers >= 1
    ckpt = mr.open_checkpoint(out)
    source = open_source(str(src))
    try:
        reader = detect_reader(source, accept_activation_change=bool(opts.get("accept_activation_change")))
        assert reader.row == ckpt.row
        infos = {info.index: info for info in reader.moe_layers()}
        assert sorted(infos) == [info.index for info in ckpt.layers]
        for info in ckpt.layers:
            layer = ckpt.build_layer(info.index, device="cpu", backend="reference")
            decoded = _decoded_experts(layer)
            assert len(decoded) == infos[info.index].num_experts
            for e, got in enumerate(decoded):
                src_et = reader.read_expert(info.index, e)
                if opts.get("on_scale_mismatch") == "requantize" and src_et.gate.global_scale != src_et.up.global_scale:
                    src_et, _ = checks.requantize_gate_up(src_et, f"{name} expert {e}")  # what convert writes
                want = src_et.dequantize(reader.row)
                for role, a, b in zip(("gate", "up", "down"), got, want):
                    assert torch.equal(a, b), f"{name} layer {info.index} expert {e} {role} differs"
            shared = json.loads((out / "megamoe.json").read_text())["layers"]
            entry = next(le for le in shared if le["index"] == info.index)["shared"]
            src_shared = reader.read_shared(info.index)
            if src_shared and layer.shared_fused and entry.get("precision") == reader.row:
                kt = layer.shared_kernel_tensors()
                (back,) = layout.unpack_shared(entry["precision"], kt, 1)
                for a, b in zip(back.dequantize(reader.row), src_shared[0].dequantize(reader.row)):
                    assert torch.equal(a, b), f"{name} layer {info.index} shared expert differs"
    finally:
        source.close()


def test_round_trip_check_catches_a_swapped_expert(tmp_path):
    """Negative control: exchanging two experts' kernel bytes is caught."""
    name = next((n for n in FIXTURES if "mxfp4" in n), None)
    assert name is not None, "the committed mxfp4 real exports are missing"
    convert(REAL / name, tmp_path / "out")
    ckpt = mr.open_checkpoint(tmp_path / "out")
    layer = ckpt.build_layer(ckpt.layers[0].index, device="cpu", backend="reference")
    with torch.no_grad():
        w = layer.l1_weight
        w[[0, 1]] = w[[1, 0]].clone()
    source = open_source(str(REAL / name))
    try:
        reader = detect_reader(source)
        got = _decoded_experts(layer)[0][0]
        want = reader.read_expert(ckpt.layers[0].index, 0).dequantize(reader.row)[0]
        assert not torch.equal(got, want)
    finally:
        source.close()
