"""Host-side launch arguments shared by the L1, L2, combine and FP8 launches.

The typed groups every GEMM launch takes (docs/KERNELS.md "Launch types"): `Rows` (which tokens a
launch computes: a routing plan's row blocks, or every token once for the shared expert),
`WeightOperand` (one GEMM's weights and scales as the kernels read them, with the decode choices),
`Activation` (the activation's scalars), `L1Epilogue` / `L2Epilogue` (what the epilogues apply).
Each maps onto its kernel parameters by name (``kernel_args``), so a launch passes groups, never a
run of positional flags. Tile choices stay in ``configs`` (`KernelConfig`): a launch reads its
tiles from there and its operands from these.

Below them the helpers: compile options (`opts`), the byte view of the MN-major scales' physical
base (`scale_bytes`) and the rules `WeightOperand.of` applies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton

from .configs import W_E2M1_MX, W_E2M1_NV, W_E4M3_MX
from .staging import RoutingPlan, hw_cvt_default


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


def _bytes_if_fp8(w: torch.Tensor) -> torch.Tensor:
    return w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w


def _weight_strides(w: torch.Tensor) -> tuple[int, int]:
    if w.dim() == 3:
        return w.stride(0), w.stride(1)
    return 0, w.stride(0)


def _scale_stride(sf: Optional[torch.Tensor]) -> int:
    if sf is None or sf.dim() == 2:
        return 0
    return sf.shape[-1] * sf.shape[-2] * 4  # bytes per expert of the physical base


def _scale_words(sword: bool, frag: bool, w_kind: int) -> bool:
    """Scale words for the E2M1 frag kernels only: with E4M3 weights the word tensor's layout made
    Triton route the decoded operand through shared memory (PRMT/STS in the SASS, +30%
    instructions per step), so the mxfp8 row keeps its byte loads."""
    return bool(sword and frag and w_kind in (W_E2M1_MX, W_E2M1_NV))


def _scale_ahead(ahead: bool, frag: bool, w_kind: int) -> bool:
    """Scale bytes one K step ahead for the E4M3 (mxfp8) frag kernels only: the E2M1 tiles' scale loads
    are cp.async-pipelined already (4 bytes per thread at 128 rows), and carrying them sent the mxfp4
    one-dot L1's decoded operand through shared memory (sm_90 SASS: 427 -> 783 instructions per step,
    288 bytes of spills)."""
    return bool(ahead and frag and w_kind == W_E4M3_MX)


# --------------------------------------------------------------------------- launch types


@dataclass(frozen=True)
class Rows:
    """The tokens one launch computes. ``plan`` set: the routing plan's row blocks of ``block_m``
    (token, expert) pairs, one program row per block up to ``plan.max_blocks``. ``plan`` None: every
    token once, in blocks of ``block_m`` tokens (the shared expert, weight 1, slot ``top_k``)."""

    tokens: int
    top_k: int
    block_m: int
    plan: Optional[RoutingPlan] = None

    @property
    def shared(self) -> bool:
        return self.plan is None

    def grid_m(self) -> int:
        return triton.cdiv(self.tokens, self.block_m) if self.plan is None else self.plan.max_blocks

    def kernel_args(self, device: torch.device) -> dict:
        """``pair_ptr``, ``blk_ptr``, ``nblk_ptr`` (a dummy int32 for the shared launch, which reads none),
        ``T``, ``TOPK``, ``SHARED``, ``BM``."""
        if self.plan is None:
            d = torch.empty(1, dtype=torch.int32, device=device)
            tables = dict(pair_ptr=d, blk_ptr=d, nblk_ptr=d)
        else:
            p = self.plan
            tables = dict(pair_ptr=p.sorted_pairs, blk_ptr=p.block_expert, nblk_ptr=p.num_blocks)
        return tables | dict(T=self.tokens, TOPK=self.top_k, SHARED=self.plan is None, BM=self.block_m)


@dataclass(frozen=True)
class WeightOperand:
    """One GEMM's weights as the kernels read them: the bytes (E4M3 as uint8), the physical base of
    the MN-major scales as bytes, their per-expert strides, the weight kind (``configs.W_*``) and the
    decode choices (``frag`` K order, ``fold`` decode, ``sword`` scale words, ``sahead`` scale bytes one
    K step ahead, ``asm`` inline-asm decode, ``w_tile`` tiled arrangement, ``fold_flags`` per-expert
    flags). Build it with ``of``: it applies the rules that make a choice take effect (fold needs frag and
    asm; scale words only for E2M1 frag; scales ahead only for E4M3 frag)."""

    weight: torch.Tensor
    scales: torch.Tensor
    stride_e: int
    stride_n: int
    scale_stride_e: int
    kind: int
    asm: bool = False
    frag: bool = False
    fold: bool = False
    sword: bool = False
    w_tile: int = 0
    fold_flags: Optional[torch.Tensor] = None
    sahead: bool = False

    @classmethod
    def of(cls, w: torch.Tensor, ws: Optional[torch.Tensor], kind: int, *, asm: bool = False, frag: bool = False,
           fold: bool = False, sword: bool = False, w_tile: int = 0,
           fold_flags: Optional[torch.Tensor] = None, sahead: bool = False) -> "WeightOperand":
        swe, swn = _weight_strides(w)
        return cls(_bytes_if_fp8(w), scale_bytes(ws, w.device), swe, swn, _scale_stride(ws), kind, bool(asm),
                   bool(frag), bool(fold and frag and asm), _scale_words(sword, frag, kind), int(w_tile), fold_flags,
                   _scale_ahead(sahead, frag, kind))

    def kernel_args(self, dummy: torch.Tensor) -> dict:
        """The weight parameters of ``l1._l1_kernel`` / ``l2._l2_kernel`` (``dummy``: any tensor, for the
        flags pointer when there are no flags; the kernels never read it then)."""
        return dict(w_ptr=self.weight, wsb_ptr=self.scales,
                    fflag_ptr=dummy if self.fold_flags is None else self.fold_flags,
                    stride_we=self.stride_e, stride_wn=self.stride_n, stride_wse=self.scale_stride_e,
                    W_KIND=self.kind, ASM=self.asm, FRAG=self.frag, FOLD=self.fold, SWORD=self.sword,
                    WT=self.w_tile, FFLAGS=self.fold_flags is not None, SAHEAD=self.sahead)

    def fp8_kernel_args(self) -> dict:
        """The weight parameters of the FP8 path's kernels (``mma8``: no decode choices)."""
        return dict(w_ptr=self.weight, wsb_ptr=self.scales, stride_we=self.stride_e, stride_wn=self.stride_n,
                    stride_wse=self.scale_stride_e, W_KIND=self.kind, ASM=self.asm)


@dataclass(frozen=True)
class Activation:
    """The activation's scalar arguments: kind (0 SwiGLU, 1 SiTU), the clamp (as the bf16 value the
    reference clamps with), SwiGLU's alpha / beta and SiTU's betas."""

    kind: int
    has_clamp: bool
    clamp: float
    alpha: float
    beta: float
    situ_beta: float
    situ_linear_beta: float

    @classmethod
    def of(cls, spec) -> "Activation":
        act = spec.activation
        c = float(torch.tensor(float(act.clamp), dtype=torch.bfloat16).float()) if act.clamp is not None else 0.0
        return cls(0 if act.kind == "swiglu" else 1, act.clamp is not None, c, float(act.alpha), float(act.beta),
                   float(act.situ_beta or 1.0), float(act.situ_linear_beta or 1.0))

    def kernel_args(self) -> dict:
        return dict(clamp_c=self.clamp, act_alpha=self.alpha, act_beta=self.beta, situ_b=self.situ_beta,
                    situ_bl=self.situ_linear_beta, ACT=self.kind, HAS_CLAMP=self.has_clamp)


@dataclass(frozen=True)
class L1Epilogue:
    """What the L1 epilogue applies after the gate/up GEMM: the NVFP4 alphas (``token_scales`` x
    ``alphas``, ``nv_in``), the activation, the top-k weight times ``rsf`` (``apply_w``), the requant of
    the intermediate (``req``: ``configs.REQ_*``, with the NVFP4 global ``a2``) and the K order the L2
    reads it in (``out_order``: 0 natural, 1 even/odd split, 2 E2M1 frag, 3 E4M3 frag)."""

    act: Activation
    topk_weights: torch.Tensor
    rsf: float
    apply_w: bool
    req: int
    out_order: int
    nv_in: bool = False
    token_scales: Optional[torch.Tensor] = None
    alphas: Optional[torch.Tensor] = None
    a2: Optional[torch.Tensor] = None

    @staticmethod
    def order_for(next_e2m1: bool, frag: bool) -> int:
        """The intermediate's K order: what the L2's weights (E2M1 or not) read in the frag / split orders."""
        return (2 if frag else 1) if next_e2m1 else (3 if frag else 0)

    def kernel_args(self, dummy: torch.Tensor) -> dict:
        """``dummy``: an fp32 tensor for the pointers this epilogue does not read."""
        def ptr(t):
            return dummy if t is None else t

        return self.act.kernel_args() | self.weight_args() | dict(
            xts_ptr=ptr(self.token_scales), alpha_ptr=ptr(self.alphas), a2_ptr=ptr(self.a2), NV_IN=self.nv_in,
            REQ=self.req, SPLIT_OUT=self.out_order)

    def weight_args(self) -> dict:
        """The top-k weight part (``tw_ptr``, ``rsf``, ``APPLY_W``), which the FP8 path's L1 takes too."""
        return dict(tw_ptr=self.topk_weights, rsf=self.rsf, APPLY_W=self.apply_w)


@dataclass(frozen=True)
class L2Epilogue:
    """What the L2 epilogue applies: for NVFP4 (``nv_epi``) the per-expert global scale times ``a2``
    and, on routed slots, the top-k weight; else the bf16 rounding alone."""

    topk_weights: torch.Tensor
    nv_epi: bool = False
    l2_scales: Optional[torch.Tensor] = None
    a2: Optional[torch.Tensor] = None

    def kernel_args(self, dummy: torch.Tensor) -> dict:
        return dict(tw_ptr=self.topk_weights, l2s_ptr=dummy if self.l2_scales is None else self.l2_scales,
                    a2_ptr=dummy if self.a2 is None else self.a2, NV_EPI=self.nv_epi)
