"""Decode a quantized non-expert linear (attention, dense MLP) of a converted folder into a float weight.

The converter copies non-expert tensors byte for byte: a ModelOpt, Quark or compressed-tensors export keeps
its attention and dense-MLP projections in the producer's format. The engine integrations run those layers
as float matmuls (transformers has no kernel for most of these formats), so they decode each such weight once,
at load, into the model's dtype: weight-only emulation of the source's quantization. The activation
quantization the producer calibrated for those layers (``input_scale``) is not applied; docs/ENGINES.md
states the consequence. Formats (docs/FORMATS.md, docs/CHECKPOINTS.md#source-formats):

* NVFP4, multiplier global (ModelOpt, Quark): ``e2m1 * (e4m3(weight_scale) * weight_scale_2)`` per 16; a
  32-element block scale (ModelOpt W4A8_NVFP4_FP8) covers two 16-blocks.
* NVFP4, divisor global (compressed-tensors): ``e2m1 * (e4m3(weight_scale) / weight_global_scale)``.
* MXFP4 / MXFP8: ``value * 2^(weight_scale - 127)`` per 32.
* Block FP8 (DeepSeek-V3, FineGrainedFP8, compressed-tensors FP8_BLOCK): ``e4m3 * scale`` per 128x128 block,
  the scale being ``weight_scale_inv`` / ``weight_scale`` (a multiplier either way).
"""
from __future__ import annotations

from typing import Mapping

import torch

from ..errors import FormatError
from ..format import codecs, scales
from ..format.source_formats import SUFFIXES

__all__ = ["decode_linear_weight"]

#: the suffixes of the stored weight itself, by family (``weight_packed``: compressed-tensors)
_WEIGHT_SUFFIXES = ("weight", "weight_packed")


def decode_linear_weight(name: str, tensors: Mapping[str, torch.Tensor], in_features: int) -> torch.Tensor:
    """The float32 ``[out, in_features]`` weight of linear ``name`` from its stored tensors (suffix -> tensor).

    FormatError naming the linear and its tensors when the combination is none of the formats above."""
    unknown = sorted(set(tensors) - set(SUFFIXES) - {"bias"})
    if unknown:
        raise FormatError(f"{name}: stored tensors {unknown} are not a weight format megamoe can decode for a "
                          f"non-expert linear (has {sorted(tensors)})")
    w = next((tensors[s] for s in _WEIGHT_SUFFIXES if s in tensors), None)
    scale = tensors.get("weight_scale", tensors.get("weight_scale_inv"))
    if w is None or scale is None:
        raise FormatError(f"{name}: a quantized weight needs its weight and weight_scale; has {sorted(tensors)}")
    desc = ", ".join(f"{k} {str(v.dtype).replace('torch.', '')} {list(v.shape)}" for k, v in sorted(tensors.items()))
    packed = w.dtype in (torch.uint8, torch.int8)
    elems = 2 * w.shape[-1] if packed else w.shape[-1]
    if elems != in_features:
        raise FormatError(f"{name}: the weight holds {elems} input features, the model's linear "
                          f"{in_features} ({desc})")
    if w.dtype == torch.float8_e4m3fn and scale.dtype in (torch.float32, torch.bfloat16):
        # block FP8: one multiplier per 128x128 block (a squeezed grid gets its size-1 dims back)
        grid = (-(-w.shape[0] // codecs.FP8_BLOCK), -(-elems // codecs.FP8_BLOCK))
        if scale.numel() != grid[0] * grid[1]:
            raise FormatError(f"{name}: block FP8 weight needs {grid[0]}x{grid[1]} fp32 block scales ({desc})")
        s = scale.float().reshape(grid)
        bad = ~(torch.isfinite(s) & (s >= scales.FP32_MIN_NORMAL))  # `scales.is_valid_scale`, per element
        if bool(bad.any()):
            first = [int(i) for i in bad.nonzero()[0]]
            sfx = "weight_scale" if "weight_scale" in tensors else "weight_scale_inv"
            raise FormatError(f"{name}: {int(bad.sum())} of {s.numel()} block scale(s) in {name}.{sfx} are not "
                              f"{scales.SCALE_RULE}; first at [row block, col block] = {first} = "
                              f"{float(s[tuple(first)])!r} ({desc}); the checkpoint's producer wrote a broken "
                              "scale for this linear")
        return codecs.dequantize_fp8_block(w, s)
    sf_per_row = scale.shape[-1]
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu) and sf_per_row * codecs.MX_GROUP == elems:
        return codecs.dequantize_mx(w, scale, "e2m1" if packed else "e4m3")
    if scale.dtype == torch.float8_e4m3fn and packed:
        if sf_per_row * 2 * codecs.NVFP4_GROUP == elems:  # per-32 block scales: two equal per-16 scales
            scale = scale.repeat_interleave(2, dim=-1)
        if scale.shape[-1] * codecs.NVFP4_GROUP != elems:
            raise FormatError(f"{name}: E4M3 block scales of {sf_per_row} per row do not tile {elems} "
                              f"features in blocks of 16 or 32 ({desc})")
        vals = codecs.e2m1_decode_packed(w)
        if "weight_scale_2" in tensors:
            block = codecs.e4m3_decode(scale) * _scalar(tensors["weight_scale_2"], name, "weight_scale_2")
        elif "weight_global_scale" in tensors:
            block = codecs.e4m3_decode(scale) / _scalar(tensors["weight_global_scale"], name, "weight_global_scale",
                                                         divisor=True)
        else:
            raise FormatError(f"{name}: NVFP4 weight without weight_scale_2 or weight_global_scale ({desc})")
        out = vals.unflatten(-1, (block.shape[-1], codecs.NVFP4_GROUP)) * block.unsqueeze(-1)
        return out.reshape(vals.shape)
    raise FormatError(f"{name}: {desc} is neither MXFP4/MXFP8 (UE8M0 per 32) nor NVFP4 (E4M3 per 16) weight "
                      "storage; megamoe cannot decode it for a non-expert linear")


def _scalar(t: torch.Tensor, name: str, what: str, divisor: bool = False) -> torch.Tensor:
    """The per-tensor fp32 global scale `what`, usable (`scales.is_valid_scale`; for a `divisor`, such as
    compressed-tensors' ``weight_global_scale``, its fp32 reciprocal too, which is the multiplier)."""
    if t.numel() != 1:
        raise FormatError(f"{name}.{what}: one value expected (per-tensor), got shape {list(t.shape)}")
    v = t.reshape(()).to(torch.float32)
    inv = float(torch.reciprocal(v)) if divisor else None
    if not scales.is_valid_scale(float(v)) or (divisor and not scales.is_valid_scale(inv)):
        recip = f" (its reciprocal, the multiplier: {inv!r})" if divisor else ""
        raise FormatError(f"{name}.{what} = {float(v)!r}{recip}: must be {scales.SCALE_RULE}")
    return v
