"""L2 and combine of the triton forward: down GEMM into bf16 slots, then the slot sum.

`_l2_kernel` writes one bf16 slot per (token, top-k slot) pair (NVFP4: alphas and a2 in the
epilogue), or, split along K, fp32 partials that `_l2_split_reduce` adds in slice order before the
same epilogue (docs/KERNELS.md "Split-K L2"); `_combine_kernel` adds a token's slots in ascending
slot order in fp32, with the routed scaling factor where the row applies it in the combine.
`launch_l2`, `reduce_l2_split` and `combine` are their host sides.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _jit
from .configs import KernelConfig, k_unroll
from .launch import L2Epilogue, Rows, WeightOperand, opts
from .operands import block_expert, block_rows, fold_flag, k_loop, slot_rows, utccp
from .staging import pdl


# --------------------------------------------------------------------------- L2


@triton.jit
def _l2_kernel(act_ptr, w_ptr, wsb_ptr, fflag_ptr, pair_ptr, blk_ptr, nblk_ptr, tw_ptr, l2s_ptr, slot_ptr,
               T, H, I, TOPK, NSLOT, stride_we, stride_wn, stride_wse, a2_ptr,
               W_KIND: tl.constexpr, NV_EPI: tl.constexpr, SHARED: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HW_CVT: tl.constexpr, ASM: tl.constexpr,
               FRAG: tl.constexpr = False, FOLD: tl.constexpr = False, SWORD: tl.constexpr = False,
               WT: tl.constexpr = 0, FFLAGS: tl.constexpr = False, KSPLIT: tl.constexpr = 1,
               SAHEAD: tl.constexpr = False, KU: tl.constexpr = 1, PDL: tl.constexpr = False):
    """y = act @ W2^T for BN output columns of one row block -> bf16 slot outputs
    (FOLD, SWORD, FFLAGS, SAHEAD and KU as in ``_l1_kernel``; KU: the K slice a multiple of KU * BK).

    KSPLIT > 1 (routed launches only): program ``(n, m, s)`` sums K slice ``s`` of ``I / KSPLIT`` and
    stores its fp32 partial at ``slot_ptr[s, slot, n]`` (an fp32 ``[KSPLIT, T * NSLOT, H]`` buffer);
    ``_l2_split_reduce`` adds the slices in order and applies the epilogue. Why: with few experts and a
    long I (Mixtral, DBRX) a mid-size batch gives the L2 too few tiles to keep every SM streaming
    weights through a 112-step K loop (docs/KERNELS.md "Split-K L2"). PDL: ``_jit.pdl_wait`` (the next grid starts
    when this one's CTAs exit: ``pdl_release``)."""
    _jit.pdl_wait(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    e, past = block_expert(blk_ptr, nblk_ptr, pid_m, SHARED)
    if past:
        return
    pair, mvalid, tok = block_rows(pair_ptr, pid_m, T, TOPK, SHARED, BM)
    arow, slot = slot_rows(pid_m, pair, tok, TOPK, NSLOT, SHARED, BM)
    e64 = e.to(tl.int64)
    fflag = fold_flag(fflag_ptr, e64, FOLD, FFLAGS)
    n = pid_n * BN + tl.arange(0, BN)
    sn = utccp(n)
    we = w_ptr + e64 * stride_we
    wse = wsb_ptr + e64 * stride_wse
    SPLIT: tl.constexpr = ((W_KIND == 0) or (W_KIND == 2)) and (FRAG == 0)
    xrow = arow * I
    if KSPLIT == 1:  # the loop of one pass, as written before the split: K from 0 (its alignment known)
        k_lo = 0
        k_hi = I
    else:  # slices of whole 128-blocks (l2_split checks)
        k_lo = tl.multiple_of(pid_k * (I // KSPLIT), 128)
        k_hi = k_lo + I // KSPLIT
    acc = k_loop(act_ptr, xrow, mvalid, I, we, wse, n, sn, H, stride_wn, k_lo, k_hi, fflag, W_KIND, BN, BM,
                 BK, HW_CVT, ASM, FRAG, FOLD, SWORD, SPLIT, WT, SAHEAD, KU)
    if FOLD and W_KIND == 2:
        acc = acc * 256.0
    if KSPLIT > 1:  # the partial of this K slice; the reduce adds the slices and applies the epilogue
        part = slot_ptr + pid_k.to(tl.int64) * (T * NSLOT) * H
        tl.store(part + slot[None, :] * H + n[:, None], acc, mask=mvalid[None, :])
        return
    if NV_EPI:  # p = bf16(acc * (l2_global_scale[e] * a2)); slot = bf16(p * w)
        p = _jit.bf16r(acc * (tl.load(l2s_ptr + e64) * tl.load(a2_ptr)), HW_CVT)
        if SHARED:
            y = p.to(tl.bfloat16)
        else:
            w = tl.load(tw_ptr + pair, mask=mvalid, other=0.0)
            y = _jit.bf16r(p * w[None, :], HW_CVT).to(tl.bfloat16)
    else:
        y = _jit.bf16r(acc, HW_CVT).to(tl.bfloat16)
    tl.store(slot_ptr + slot[None, :] * H + n[:, None], y, mask=mvalid[None, :])


@triton.jit
def _l2_split_reduce(part_ptr, ids_ptr, tw_ptr, l2s_ptr, a2_ptr, slot_ptr, H, e_lo, E_l, NSLOT, NPART,
                     TOPK: tl.constexpr, KSPLIT: tl.constexpr, NV_EPI: tl.constexpr, BH: tl.constexpr,
                     HW_CVT: tl.constexpr, PDL: tl.constexpr = False):
    """slot = epilogue(sum of the KSPLIT fp32 partials, slice 0 first) for one routed (token, k) slot:
    the split L2's end, the same epilogue as ``_l2_kernel``'s. Slots of other ranks' experts and masked
    ids are left unwritten, as the unsplit L2 leaves them (the combine never reads them)."""
    _jit.pdl_start(PDL)
    pr = tl.program_id(0).to(tl.int64)  # pair = token * TOPK + k
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = h < H
    le = tl.load(ids_ptr + pr).to(tl.int32) - e_lo
    if (le < 0) | (le >= E_l):
        return
    slot = (pr // TOPK) * NSLOT + pr % TOPK
    acc = tl.load(part_ptr + slot * H + h, mask=hm, other=0.0)
    for s in tl.static_range(1, KSPLIT):
        acc = acc + tl.load(part_ptr + s * NPART * H + slot * H + h, mask=hm, other=0.0)
    if NV_EPI:
        p = _jit.bf16r(acc * (tl.load(l2s_ptr + le) * tl.load(a2_ptr)), HW_CVT)
        y = _jit.bf16r(p * tl.load(tw_ptr + pr), HW_CVT).to(tl.bfloat16)
    else:
        y = _jit.bf16r(acc, HW_CVT).to(tl.bfloat16)
    tl.store(slot_ptr + slot * H + h, y, mask=hm)


# --------------------------------------------------------------------------- combine


@triton.jit
def _combine_kernel(slot_ptr, ids_ptr, out_ptr, H, e_lo, E_l, rsf,
                    TOPK: tl.constexpr, HAS_SHARED: tl.constexpr, NV: tl.constexpr, APPLY_RSF: tl.constexpr,
                    BH: tl.constexpr, GPU: tl.constexpr, PDL: tl.constexpr = False):
    _jit.pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = h < H
    NSLOT: tl.constexpr = TOPK + HAS_SHARED
    base = slot_ptr + t * NSLOT * H
    acc = tl.zeros((BH,), tl.float32)
    for k in tl.static_range(TOPK):
        le = tl.load(ids_ptr + t * TOPK + k).to(tl.int32) - e_lo
        ok = (le >= 0) & (le < E_l)
        # where(ok, hm, False), not hm & ok: Triton 3.9's interpreter makes an integer mask of the latter
        s = tl.load(base + k * H + h, mask=tl.where(ok, hm, False), other=0.0).to(tl.float32)
        acc = acc + tl.where(ok, s, 0.0)
    if NV:
        r = _jit.bf16r(acc, GPU)
        if APPLY_RSF:
            r = _jit.bf16r(r * rsf, GPU)
        if HAS_SHARED:
            r = r + tl.load(base + TOPK * H + h, mask=hm, other=0.0).to(tl.float32)
        acc = r
    else:
        if HAS_SHARED:
            acc = acc + tl.load(base + TOPK * H + h, mask=hm, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + h, _jit.bf16r(acc, GPU).to(tl.bfloat16), mask=hm)


def l2_split(cfg, I: int) -> int:
    """The K slices of the routed L2 launches: ``cfg.l2_split`` where it cuts I into whole 128-blocks, else 1."""
    s = cfg.l2_split
    return s if s > 1 and I % (128 * s) == 0 else 1


def launch_l2(cfg: KernelConfig, act: torch.Tensor, weight: WeightOperand, rows: Rows, epi: L2Epilogue,
              slots: torch.Tensor, H: int, I: int, hw: bool, part: Optional[torch.Tensor] = None) -> None:
    """One L2 launch: ``rows`` of the intermediate ``act`` through ``weight`` and ``epi`` into the bf16
    ``slots [T, nslot, H]``. ``part`` (fp32 ``[KSPLIT, T * nslot, H]``, routed launches only): write the K
    slices' partials there instead; ``reduce_l2_split`` then ends every launch of the forward at once."""
    bn = min(cfg.l2_bn, H)
    ks = 1 if part is None else part.shape[0]
    dummy_f = torch.empty(1, dtype=torch.float32, device=act.device)
    _l2_kernel[(H // bn, rows.grid_m(), ks)](
        act_ptr=act, slot_ptr=slots if part is None else part, H=H, I=I, NSLOT=slots.shape[1],
        **rows.kernel_args(act.device), **weight.kernel_args(act), **epi.kernel_args(dummy_f),
        BN=bn, BK=128 if weight.frag or I % cfg.l2_bk else cfg.l2_bk, HW_CVT=hw, KSPLIT=ks,
        KU=k_unroll(cfg, I // ks) if weight.frag else 1,
        num_warps=cfg.l2_warps, num_stages=cfg.l2_stages, **opts(cfg.l2_maxnreg), **pdl(act.device))


def reduce_l2_split(part: torch.Tensor, ids: torch.Tensor, epi: L2Epilogue, slots: torch.Tensor, e_lo: int,
                    E_l: int, hw: bool) -> None:
    """The routed slots from the split L2's partials (``_l2_split_reduce``), after all its launches:
    ``epi`` is the routed launches' epilogue, ``ids`` the global top-k ids ``[T, K]``."""
    T, nslot, H = slots.shape
    K = ids.shape[1]
    bh = min(1024, triton.next_power_of_2(H))
    dummy_f = torch.empty(1, dtype=torch.float32, device=slots.device)
    a = epi.kernel_args(dummy_f)
    _l2_split_reduce[(T * K, triton.cdiv(H, bh))](
        part, ids, a["tw_ptr"], a["l2s_ptr"], a["a2_ptr"], slots, H, e_lo, E_l, nslot, T * nslot,
        TOPK=K, KSPLIT=part.shape[0], NV_EPI=epi.nv_epi, BH=bh, HW_CVT=hw, num_warps=4, **opts(),
        **pdl(slots.device))


def combine(spec, cfg, slots, ids, out, has_shared, rsf, hw) -> None:
    H, K, E_l = spec.hidden, spec.top_k, spec.experts_per_rank
    row = spec.row_spec
    bh = min(cfg.combine_bh, triton.next_power_of_2(H))
    _combine_kernel[(out.shape[0], triton.cdiv(H, bh))](
        slots, ids, out, H, spec.ep_rank * E_l, E_l, rsf,
        TOPK=K, HAS_SHARED=has_shared, NV=row.rsf_in_combine, APPLY_RSF=(row.rsf_in_combine and rsf != 1.0),
        BH=bh, GPU=hw, num_warps=4, **opts(), **pdl(out.device))
