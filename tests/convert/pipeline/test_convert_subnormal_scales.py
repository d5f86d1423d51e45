"""Subnormal scales in the converter (docs/FORMATS.md#subnormal-scales): an fp32 per-tensor scale (NVFP4
weight_scale_2, input scales, CT's inverted global scale, --l2-activation-scale) below 2^-126 and a block-FP8 fp32
block scale below 2^-126 over a block with a nonzero element are refused in one line naming layer, expert, tensor
and value, with nothing left under OUT; an E4M3 subnormal NVFP4 block scale and a subnormal fp32 block scale over
an all-zero block still convert. Before, every one of them converted."""
from __future__ import annotations

import pytest
import torch

from megamoe_convert.pipeline.convert import convert
from megamoe_convert.testing import synth
from megamoe_runtime.format.manifest import read_manifest

SIZES = {"num_layers": 2, "hidden": 256, "intermediate": 128, "num_experts": 4, "top_k": 2}
SUB = 2.0 ** -130  # an fp32 subnormal (exact in fp32)
P = "model.layers.1.mlp.experts.2"


def _has(err: str, *parts: str) -> None:
    for p in parts:
        assert p in err, f"{p!r} not in {err!r}"


@pytest.mark.parametrize("fmt, name, role", [
    ("modelopt-nvfp4", "up_proj.weight_scale_2", "up global scale"),
    ("modelopt-nvfp4", "down_proj.input_scale", "down (w2) input scale"),
    ("modelopt-nvfp4", "gate_proj.input_scale", "gate input scale"),
])
def test_subnormal_fp32_per_tensor_scale_is_refused(tmp_path, edit_source, refused_convert, fmt, name, role):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", fmt, **SIZES, seed=4)

    def put(t):
        t[f"{P}.{name}"] = torch.full_like(t[f"{P}.{name}"], SUB)
    edit_source(src, put)
    err = refused_convert(src, tmp_path / "out")
    _has(err, "MoE layer 1", "expert 2", role, f"{P}.{name}", repr(SUB), "fp32 subnormal",
         "docs/FORMATS.md#subnormal-scales")


def test_compressed_tensors_global_divisor_whose_reciprocal_is_subnormal_is_refused(tmp_path, edit_source,
                                                                                    refused_convert):
    """CT stores the global scale as a divisor: 2^127 is a normal fp32, its reciprocal 2^-127 is not."""
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "ct-nvfp4", **SIZES, seed=4)
    name = f"{P}.down_proj.weight_global_scale"

    def put(t):
        t[name] = torch.full_like(t[name], 2.0 ** 127)
    edit_source(src, put)
    err = refused_convert(src, tmp_path / "out")
    _has(err, "MoE layer 1", "expert 2", "down global scale", name, repr(2.0 ** -127), "fp32 subnormal")


def test_l2_activation_scale_option_subnormal_is_refused(tmp_path, refused_convert):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "bf16", **SIZES, seed=4)
    err = refused_convert(src, tmp_path / "out", "--quantize", "nvfp4", "--l2-activation-scale", "1e-39")
    _has(err, "--l2-activation-scale 1e-39", "fp32 subnormal")


def test_e4m3_subnormal_nvfp4_block_scales_convert(tmp_path, edit_source):
    """E4M3 subnormals (bytes 0x01..0x07: 2^-9 .. 7*2^-9) are ordinary NVFP4 block scales: converted unchanged."""
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "modelopt-nvfp4", **SIZES, seed=4)
    name = f"{P}.up_proj.weight_scale"

    def put(t):
        b = t[name].view(torch.uint8).clone()
        b[:, :7] = torch.arange(1, 8, dtype=torch.uint8)
        t[name] = b.view(torch.float8_e4m3fn)
    edit_source(src, put)
    convert(src, tmp_path / "out")
    assert read_manifest(tmp_path / "out").row == "nvfp4"


def _fp8_scale(value, zero_block: bool):
    def put(t):
        w = t[f"{P}.gate_proj.weight"].view(torch.uint8).clone()
        if zero_block:
            w[:, 128:] = 0  # block [0, 1] (gate is [128, 256]) all zero
        t[f"{P}.gate_proj.weight"] = w.view(torch.float8_e4m3fn)
        s = t[f"{P}.gate_proj.weight_scale_inv"].clone()
        s[0, 1] = value
        t[f"{P}.gate_proj.weight_scale_inv"] = s
    return put


def test_fp8_block_subnormal_scale_over_a_live_block_is_refused(tmp_path, edit_source, refused_convert):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "fp8-block", **SIZES, seed=3)
    edit_source(src, _fp8_scale(SUB, zero_block=False))
    err = refused_convert(src, tmp_path / "out")
    _has(err, "MoE layer 1", "expert 2 gate scale", f"{P}.gate_proj.weight_scale_inv",
         f"first at [row block, col block] = [0, 1] = {SUB!r}", "fp32 subnormal", "docs/FORMATS.md#subnormal-scales")


def test_fp8_block_subnormal_scale_over_an_all_zero_block_converts(tmp_path, edit_source):
    """Like a zero scale: over an all-zero block the block is 0 whatever the scale, so it is accepted (bytes
    copied unchanged)."""
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "fp8-block", **SIZES, seed=3)
    edit_source(src, _fp8_scale(SUB, zero_block=True))
    convert(src, tmp_path / "out")
    from megamoe_runtime.load.checkpoint import open_checkpoint

    ck = open_checkpoint(tmp_path / "out")
    te = ck.manifest.entry("model.layers.1.mlp.megamoe.l1_scale")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / te.file), "pt") as f:
        got = f.get_tensor(te.name)
    assert bool((got == SUB).any())
