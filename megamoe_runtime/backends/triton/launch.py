"""Host-side launch arguments shared by the L1, L2, combine and FP8 launches.

Compile options (`opts`), byte views of the weights and of the MN-major scales' physical base
(`bytes_if_fp8`, `scale_bytes`, `weight_strides`, `scale_stride`), the activation's scalar
arguments (`act_params`) and the scale-word choice (`sword`).
"""
from __future__ import annotations

from typing import Optional

import torch

from .configs import W_E2M1_MX, W_E2M1_NV
from .staging import hw_cvt_default


def opts(maxnreg: Optional[int] = None) -> dict:
    """Compile options: no fp contraction on the GPU; a register cap where a config sets one."""
    if not hw_cvt_default():
        return {}
    return {"enable_fp_fusion": False} | ({"maxnreg": int(maxnreg)} if maxnreg else {})


def scale_bytes(sf: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """uint8 view of the contiguous physical base ``[.., P, N]`` of an MN-major kernel view."""
    if sf is None:
        return torch.empty(4, dtype=torch.uint8, device=device)
    phys = sf.transpose(-1, -2)
    if not phys.is_contiguous():
        from megamoe_runtime.errors import LayoutError

        raise LayoutError(f"scale view {tuple(sf.shape)} strides {sf.stride()} is not MN-major over a "
                          f"contiguous physical base; the triton backend reads the kernel layout only")
    return phys.view(torch.uint8)


def act_params(spec) -> tuple:
    act = spec.activation
    if act.clamp is not None:
        c = float(torch.tensor(float(act.clamp), dtype=torch.bfloat16).float())
    else:
        c = 0.0
    return (0 if act.kind == "swiglu" else 1, act.clamp is not None, c, float(act.alpha), float(act.beta),
            float(act.situ_beta or 1.0), float(act.situ_linear_beta or 1.0))


def _f32_host(v) -> float:
    """A float32 value as a Python float (exactly representable, so Triton passes it unchanged)."""
    return float(torch.as_tensor(v, dtype=torch.float32).reshape(()).cpu())


def bytes_if_fp8(w: torch.Tensor) -> torch.Tensor:
    return w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w


def weight_strides(w: torch.Tensor) -> tuple[int, int]:
    if w.dim() == 3:
        return w.stride(0), w.stride(1)
    return 0, w.stride(0)


def scale_stride(sf: Optional[torch.Tensor]) -> int:
    if sf is None or sf.dim() == 2:
        return 0
    return sf.shape[-1] * sf.shape[-2] * 4  # bytes per expert of the physical base


def scale_words(sword: bool, frag: bool, w_kind: int) -> bool:
    """Scale words for the E2M1 frag kernels only: with E4M3 weights the word tensor's layout made
    Triton route the decoded operand through shared memory (PRMT/STS in the SASS, +30%
    instructions per step), so the mxfp8 row keeps its byte loads."""
    return bool(sword and frag and w_kind in (W_E2M1_MX, W_E2M1_NV))
