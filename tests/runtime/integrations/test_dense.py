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
from megamoe_runtime.integrations.dense import decode_linear_weight

#: (rows, columns) of linears in the vLLM engine tests' block-FP8 export and DeepSeek-V3 itself
SHAPES = [(256, 128), (576, 128), (192, 128), (128, 64), (128, 512), (128, 128)]


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
    for v, shown in ((float("nan"), "nan"), (float("inf"), "inf"), (0.0, "0.0"), (-1.0, "-1.0")):
        bad = s.clone()
        bad[2, 0] = v
        with pytest.raises(FormatError, match=rf"{name}: 1 of 5 block scale\(s\) are not finite and > 0 "
                                              rf"\(first {shown}"):
            decode_linear_weight(name, {"weight": w, "weight_scale_inv": bad}, 128)
    with pytest.raises(FormatError, match=rf"{name}: the weight holds 128 input features, the model's linear 256"):
        decode_linear_weight(name, {"weight": w, "weight_scale_inv": s}, 256)
