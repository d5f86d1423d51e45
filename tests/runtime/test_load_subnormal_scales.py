"""Subnormal fp32 scales at load (docs/FORMATS.md#subnormal-scales): the runtime refuses what the converter
refuses. A converted NVFP4 folder whose per-expert global scale became an fp32 subnormal after conversion is
refused by the load checks at level "headers" before the first byte is written (naming file, tensor, expert and
value), and at level "none" by the end of the load (the layer is then unusable, never served); the raw
(vLLM-style) loader refuses a subnormal weight_scale_2 or input scale as it arrives. Before, all three served the
expert with a denormal alpha."""
from __future__ import annotations

import struct

import pytest
import torch

import megamoe_runtime as mr
from megamoe_runtime.errors import LayerUnusableError, LoadCheckError, ScaleError
from megamoe_runtime.files.safetensors_header import parse_safetensors_header
from megamoe_runtime.format import scales
from megamoe_runtime.layer.experts import DeepGemmMegaMoEExperts

SUB = 2.0 ** -130


def _poke_f32(folder, name: str, index: int, value: float) -> None:
    m = mr.open_checkpoint(folder).manifest
    te = m.entry(name)
    h = parse_safetensors_header(folder / te.file)
    with open(folder / te.file, "r+b") as f:
        f.seek(h.data_start + h.tensors[te.name].begin + 4 * index)
        f.write(struct.pack("<f", value))


def test_rule_in_numbers():
    assert scales.FP32_MIN_NORMAL == float(torch.finfo(torch.float32).tiny)
    assert scales.is_valid_scale(scales.FP32_MIN_NORMAL) and scales.is_valid_fp32_scale(scales.FP32_MIN_NORMAL)
    for v in (SUB, 1e-39, float(torch.finfo(torch.float32).smallest_normal) / 2, 0.0, -1.0, float("nan")):
        assert not scales.is_valid_scale(v) and not scales.is_valid_fp32_scale(v), v
    assert scales.is_valid_scale(1e300) and not scales.is_valid_fp32_scale(1e300)  # beyond fp32: inf there


def test_subnormal_global_scale_is_refused_before_writing_under_headers(ckpts, tmp_path, layer_bytes):
    _, out_a = ckpts.converted("modelopt-nvfp4", seed=0)
    _, out_b = ckpts.fresh_converted("modelopt-nvfp4", tmp_path / "b", seed=5)
    layer = mr.open_checkpoint(out_a).build_layer(1, backend="reference")
    before = layer_bytes(layer)
    _poke_f32(out_b, "model.layers.1.mlp.megamoe.l1_alpha", 2 * 2 + 1, SUB)  # expert 2, up half
    with pytest.raises(LoadCheckError) as ei:
        mr.open_checkpoint(out_b).load_layer(layer)
    msg = str(ei.value)
    for part in ("megamoe-experts-rank000-of-001-00001.safetensors", "model.layers.1.mlp.megamoe.l1_alpha",
                 "an fp32 subnormal", "for experts [2]", f"first: expert 2, index 1 = {SUB!r}",
                 "docs/FORMATS.md#subnormal-scales"):
        assert part in msg, f"{part!r} not in {msg!r}"
    after = layer_bytes(layer)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_subnormal_global_scale_under_verify_none_leaves_the_layer_unusable(ckpts, tmp_path):
    _, out = ckpts.fresh_converted("modelopt-nvfp4", tmp_path / "b", seed=5)
    _poke_f32(out, "model.layers.0.mlp.megamoe.l2_global_scale", 3, SUB)
    ck = mr.open_checkpoint(out, verify="none")
    with pytest.raises(LayerUnusableError, match=r"l2_global_scale is unset or invalid for experts \[3\].*"
                                                 r"not an fp32 subnormal"):
        ck.build_layer(0, backend="reference")


@pytest.mark.parametrize("suffix, shard", [("weight_scale_2", "w1"), ("input_scale", "w2")])
def test_raw_loader_refuses_a_subnormal_scale(ckpts, suffix, shard):
    _, out = ckpts.converted("modelopt-nvfp4")
    ck = mr.open_checkpoint(out)
    li = ck.layer_entry(0)
    layer = DeepGemmMegaMoEExperts(ck.layer_spec(0), backend="reference", prefix=li.prefix, layer_index=0)
    layer.begin_load("raw")
    role = {"w1": "gate_proj", "w2": "down_proj"}[shard]
    name = f"{li.prefix}.experts.1.{role}.{suffix}"
    with pytest.raises(ScaleError, match=rf"{name} \(expert 1, {shard}\).* = {SUB!r}; .*fp32 subnormal"):
        layer.weight_loader(None, torch.tensor(SUB), name, shard, 1)
