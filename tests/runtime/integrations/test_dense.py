"""`integrations.dense.decode_linear_weight` on block-FP8 non-expert linears (DeepSeek-V3 ``weight_scale_inv``,
compressed-tensors ``weight_scale``): the float weight equals an independent decode -- torch's own float8_e4m3fn
to float conversion times each element's block scale, looked up one element at a time -- for grids 128 tiles
and for the partial edge blocks real exports have (DeepSeek-V3's 576-row kv_a_proj_with_mqa: 5 row blocks),
squeezed grids included. Negative controls: a doubled block scale or a shifted grid gives another weight;
a grid of the wrong size and non-finite or non-positive scales are refused naming the linear.
"""
from __future__ import annotations

import pytest
import torch

from megamoe_runtime.errors import FormatError
from megamoe_runtime.format import codecs, scales
from megamoe_runtime.integrations.dense import decode_linear_weight

#: (rows, columns) of linears in the vLLM engine tests' block-FP8 export and DeepSeek-V3 itself
SHAPES = [(256, 128), (576, 128), (192, 128), (128, 64), (128, 512), (128, 128)]
#: an fp32 subnormal (docs/FORMATS.md#subnormal-scales)
SUB = 2.0 ** -130


def _has(msg: str, *parts: str) -> None:
    assert "\n" not in msg, msg
    for p in parts:
        assert p in msg, f"{p!r} not in {msg!r}"


def _fp8_linear(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    w = b.masked_fill((b & 0x7F) == 0x7F, 0x38).view(torch.float8_e4m3fn)  # no NaN bytes
    s = torch.rand((-(-n // 128), -(-k // 128)), generator=g) * 0.01 + 1e-4
    return w, s


def _independent(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    vals = w.to(torch.float32)
    out = torch.empty_like(vals)
    for i in range(vals.shape[0]):
        for jb in range(s.shape[1]):
            out[i, jb * 128:(jb + 1) * 128] = vals[i, jb * 128:(jb + 1) * 128] * s[i // 128, jb]
    return out


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("suffix", ["weight_scale_inv", "weight_scale"])
def test_block_fp8_linear_equals_an_independent_decode(n, k, suffix):
    w, s = _fp8_linear(n, k, seed=n + k)
    ref = _independent(w, s)
    got = decode_linear_weight("model.layers.0.self_attn.q_proj", {"weight": w, suffix: s}, k)
    assert got.dtype == torch.float32 and torch.equal(got, ref)
    if s.numel() == 1:  # a producer that squeezed a one-block grid to a scalar
        assert torch.equal(decode_linear_weight("x", {"weight": w, suffix: s.reshape(())}, k), ref)
    # negative controls: one block scale doubled (the last, partial where the edge is), the grid's blocks
    # shifted by one along a dimension that has more than one
    bad = s.clone()
    bad[-1, -1] *= 2
    assert not torch.equal(decode_linear_weight("x", {"weight": w, suffix: bad}, k), ref)
    for dim in (0, 1):
        if s.shape[dim] > 1:
            rolled = torch.roll(s, 1, dim)
            assert not torch.equal(decode_linear_weight("x", {"weight": w, suffix: rolled}, k), ref)


def test_bad_block_fp8_scales_are_refused_naming_the_linear():
    w, s = _fp8_linear(576, 128, seed=1)
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa"
    with pytest.raises(FormatError, match=rf"{name}: block FP8 weight needs 5x1 fp32 block scales"):
        decode_linear_weight(name, {"weight": w, "weight_scale_inv": s[:4]}, 128)
    for v in (SUB, float("nan"), float("inf"), 0.0, -1.0):
        bad = s.clone()
        bad[2, 0] = v
        with pytest.raises(FormatError) as ei:
            decode_linear_weight(name, {"weight": w, "weight_scale_inv": bad}, 128)
        _has(str(ei.value), f"{name}: 1 of 5 block scale(s) in {name}.weight_scale_inv are not {scales.SCALE_RULE}",
             f"first at [row block, col block] = [2, 0] = {v!r}")
    ok = s.clone()
    ok[2, 0] = scales.FP32_MIN_NORMAL  # fp32's smallest normal: decoded
    assert torch.equal(decode_linear_weight(name, {"weight": w, "weight_scale_inv": ok}, 128), _independent(w, ok))
    with pytest.raises(FormatError, match=rf"{name}: the weight holds 128 input features, the model's linear 256"):
        decode_linear_weight(name, {"weight": w, "weight_scale_inv": s}, 256)


@pytest.mark.parametrize("what, value, shown", [
    ("weight_scale_2", SUB, f"= {SUB!r}"),
    ("weight_scale_2", 0.0, "= 0.0"),
    ("weight_global_scale", 2.0 ** 127, f"= {2.0 ** 127!r} (its reciprocal, the multiplier: {2.0 ** -127!r})"),
    ("weight_global_scale", SUB, f"= {SUB!r} (its reciprocal, the multiplier: inf)"),
])
def test_nvfp4_global_scale_fp32_subnormal_is_refused(what, value, shown):
    """An NVFP4 linear's per-tensor global scale follows the experts' rule (`scales.is_valid_scale`): a
    multiplier (ModelOpt / Quark ``weight_scale_2``) below 2^-126 is refused, and so is a divisor
    (compressed-tensors ``weight_global_scale``) whose fp32 reciprocal is; fp32's smallest normal decodes."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 64, generator=g)
    packed, sf = codecs.quantize_nvfp4(x, torch.tensor(1.0))
    name = "model.layers.0.self_attn.o_proj"
    with pytest.raises(FormatError) as ei:
        decode_linear_weight(name, {"weight": packed, "weight_scale": sf, what: torch.tensor(value)}, 64)
    _has(str(ei.value), f"{name}.{what} {shown}: must be {scales.SCALE_RULE}")
    edge = scales.FP32_MIN_NORMAL if what == "weight_scale_2" else 2.0 ** 126
    got = decode_linear_weight(name, {"weight": packed, "weight_scale": sf, what: torch.tensor(edge)}, 64)
    assert bool(torch.isfinite(got).all()) and bool((got != 0).any())
