"""The NVFP4 scale rules, written once (docs/SCALES.md).

The converter's checks (`megamoe_convert.pipeline.checks`), the runtime's raw loader
(`megamoe_runtime.layer.loaders`) and the deepgemm backend all decide "do w1 and w3
agree", "is this scale usable" and "what is a2" here, so the three cannot
drift apart: a tolerance the loader accepts is one the converter accepted and
the backend will not refuse.
"""
from __future__ import annotations

import math
import struct
from typing import Iterable, Optional

import torch

__all__ = ["W13_RTOL", "FP32_MIN_NORMAL", "SCALE_RULE", "is_valid_scale", "is_valid_fp32_scale", "gate_up_agree",
           "gate_up_relative_difference", "gate_up_disagreeing", "global_l2_activation_scale"]

#: relative tolerance within which an expert's w1 (gate) and w3 (up)
#: weight_scale_2 count as one value (docs/SCALES.md#w1-w3-agreement)
W13_RTOL = 1e-5


#: fp32's smallest normal number, 2^-126. A per-tensor fp32 scale below it (an fp32 subnormal) is refused:
#: no producer writes one, and the kernels' fp32 products with it are denormal or flushed to 0
#: (docs/FORMATS.md#subnormal-scales)
FP32_MIN_NORMAL = 2.0 ** -126
#: what `is_valid_scale` asks, for messages
SCALE_RULE = "finite and > 0, and not an fp32 subnormal (< 2^-126; docs/FORMATS.md#subnormal-scales)"


def is_valid_scale(v: object) -> bool:
    """A float scale is usable: a real number (not a bool), finite and at least `FP32_MIN_NORMAL` (so > 0, and
    not an fp32 subnormal: docs/FORMATS.md#subnormal-scales)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= FP32_MIN_NORMAL


def is_valid_fp32_scale(v: object) -> bool:
    """A usable scale that stays usable once stored as FP32, as a2 is: a double
    such as 1e300 or 1e-300 passes `is_valid_scale` but becomes inf or 0 there."""
    if not is_valid_scale(v):
        return False
    try:  # pure Python (the load checks run it under the dry run's dispatch mode too)
        f = struct.unpack("<f", struct.pack("<f", float(v)))[0]  # round to nearest fp32
    except OverflowError:  # beyond fp32's range
        return False
    return math.isfinite(f) and f >= FP32_MIN_NORMAL


def gate_up_agree(gate: float, up: float, rtol: float = W13_RTOL) -> bool:
    """w1/w3 agreement: ``|gate - up| <= rtol * max(|gate|, |up|)``."""
    return abs(gate - up) <= rtol * max(abs(gate), abs(up))


def gate_up_relative_difference(gate: float, up: float) -> float:
    """``|gate - up| / max(|gate|, |up|)``, for messages."""
    return abs(gate - up) / max(abs(gate), abs(up))


def gate_up_disagreeing(gate: torch.Tensor, up: torch.Tensor, rtol: float = W13_RTOL) -> list[int]:
    """Indices where per-expert gate and up scale tensors break the agreement
    rule (the tensor form of :func:`gate_up_agree`, in the tensors' dtype)."""
    differ = (gate - up).abs() > rtol * torch.maximum(gate.abs(), up.abs())
    return differ.nonzero().flatten().tolist() if bool(differ.any()) else []


def global_l2_activation_scale(w2_input_scales: Iterable[float]) -> Optional[float]:
    """a2, the global L2 activation scale: the max of the w2 input scales over
    ALL experts of the layer (docs/SCALES.md#a2), as a float; None when there
    are none. Callers decide whether a missing expert is an error."""
    a2: Optional[float] = None
    for v in w2_input_scales:
        a2 = float(v) if a2 is None else max(a2, float(v))
    return a2
