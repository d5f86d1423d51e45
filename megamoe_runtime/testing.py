"""Numeric comparison helpers shared by tests and benchmarks.

Kept in the runtime package (not under tests/) so benches and downstream users
can report errors with the same metrics the test suite asserts on.
"""
from __future__ import annotations

import torch

__all__ = ["calc_diff", "rel_l2"]


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity error: ``1 - 2*sum(x*y) / sum(x^2 + y^2)`` in float64.

    Same definition as DeepGEMM ``deep_gemm/testing/numeric.py`` so our
    thresholds (e.g. DG's NVFP4 1e-3) mean what they mean there; 0.0 when both
    tensors are all zero. It equals ``|x-y|^2 / (|x|^2 + |y|^2)``: 0 iff x == y,
    and scale-sensitive (``calc_diff(x, 2x) = 0.2``).
    """
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    if float(denominator) == 0.0:
        return 0.0
    return float(1.0 - 2.0 * (x * y).sum() / denominator)


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ``|x - ref| / |ref|`` in float64 (DGv's NVFP4 metric).

    0.0 when both are all zero; ``inf`` when only ``ref`` is all zero.
    """
    x, ref = x.double(), ref.double()
    num = float((x - ref).norm())
    den = float(ref.norm())
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den
