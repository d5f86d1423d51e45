"""L1 of the triton forward: gate/up GEMM and its epilogue, one launch per row-block plan.

`_l1_kernel` computes both halves of the interleaved gate/up rows of a tile, then the epilogue
the reference defines (bf16 g/u, clamp, `activation`, top-k weight, MXFP8 / NVFP4 / bf16 requant
of the intermediate); `launch_l1` marshals its arguments. `activation` is shared with the FP8
path (`mma8`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _jit
from .configs import REQ_NV4, KernelConfig, k_unroll, resolve_l1_gu
from .launch import L1Epilogue, Rows, WeightOperand, opts
from .operands import (
    FOLD_SCAN_CONSTEXPR, NV_REDO_SCALE, act_rows, block_expert, block_rows, fold_flag, fold_redo, k_loop, mm_block,
    utccp, x_tiles,
)
from .staging import pdl


@triton.jit
def activation(g, u, clamp_c, act_alpha, act_beta, situ_b, situ_bl,
                ACT: tl.constexpr, HAS_CLAMP: tl.constexpr, GPU: tl.constexpr):
    """act(bf16(g), bf16(u)) in fp32 exactly as ``reference.activation_fp32`` (+ ``apply_clamp``)."""
    g = _jit.bf16r(g, GPU)
    u = _jit.bf16r(u, GPU)
    if HAS_CLAMP:
        g = tl.minimum(g, clamp_c)
        u = tl.maximum(tl.minimum(u, clamp_c), -clamp_c)
    one = tl.full(g.shape, 1.0, tl.float32)
    if ACT == 0:
        den = one + _jit.expf(-(act_alpha * g), GPU)
        return tl.math.div_rn(g, den) * (u + act_beta)
    else:
        sig = tl.math.div_rn(one, one + _jit.expf(-g, GPU))
        bv = one * situ_b
        blv = one * situ_bl
        t1 = _jit.tanhf(tl.math.div_rn(g, bv), GPU)
        t2 = _jit.tanhf(tl.math.div_rn(u, blv), GPU)
        return (((sig * situ_b) * t1) * situ_bl) * t2


#: Largest 1 / a2 for which the NVFP4 requantization divides the block amax by 6 with `_jit.div_markstein`
#: (two residual steps) instead of an IEEE division. The residual form is RN(amax / 6) wherever its residuals
#: stay exact: for every amax >= 2^-100 (checked exhaustively over the fp32 significands on the GPU,
#: `staging.division_mismatches(2, six=True)`, and power-of-two scaling carries that down to there). Below
#: 2^-100 the quotient times 1 / a2 <= 2^80 is under 2^-22, far under the E4M3 floor of the scale (2^-9),
#: so whichever quotient the form gives, the scale is the floor, as with the IEEE quotient. A layer with a
#: smaller a2 (none is known) takes the division.
DIV6_FAST_INV_A2 = tl.constexpr(2.0 ** 80)


@triton.jit
def _requant(a, inv_a2, REQ: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, HW_CVT: tl.constexpr):
    """Quantize-dequantize ``a`` [BN (K of L2), BM] along axis 0; the result is exact in bf16."""
    if REQ == 0:  # MXFP8 per 32: e = ceil_ue8m0(max(amax,1e-4)/448); q = e4m3(a * 2^-e)
        a3 = a.reshape(BN // 32, 32, BM)
        amax = tl.max(tl.abs(a3), axis=1)
        e = _jit.ue8m0_ceil_byte(amax, 448.0)
        q = _jit.e4m3_round(a3 * _jit.inv_pow2_from_byte(e)[:, None, :], HW_CVT)
        return (q * _jit.pow2_from_byte(e)[:, None, :]).reshape(BN, BM).to(tl.bfloat16)
    elif REQ == 1:  # NVFP4 per 16 with global a2: sf = e4m3(max(amax/6*inv, 2^-9)); q = e2m1(a*inv/sf)
        a3 = a.reshape(BN // 16, 16, BM)
        amax = tl.max(tl.abs(a3), axis=1)
        if inv_a2 <= DIV6_FAST_INV_A2:  # RN(amax / 6) by residuals: exact, see DIV6_FAST_INV_A2
            q6 = _jit.div_markstein(amax, 6.0, _jit.RCP6, 2)
            q6 = tl.where(amax == float("inf"), amax, q6)  # (the residual form gives NaN there)
        else:
            q6 = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
        sf = q6 * inv_a2
        sf = _jit.e4m3_round(tl.maximum(sf, _jit.E4M3_MIN_SUB), HW_CVT)
        d = sf[:, None, :]  # each element's block scale
        # E2M1 code of RN(y / d) by compares against the midpoints times d (exact: _jit.e2m1_magnitude)
        y = a3 * inv_a2
        c = _jit.e2m1_magnitude(tl.abs(y), d) | ((y.to(tl.int32, bitcast=True) >> 28) & 8)
        return (_jit.e2m1_value(c) * d).reshape(BN, BM).to(tl.bfloat16)
    else:
        return _jit.bf16r(a, HW_CVT).to(tl.bfloat16)


@triton.jit
def _l1_two_dots(x_ptr, xrow, mvalid, we, wse, rg, ru, sg, su, NROWS, stride_wn, H, W_KIND: tl.constexpr,
                 BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, HW_CVT: tl.constexpr, ASM: tl.constexpr,
                 FRAG: tl.constexpr, FOLD: tl.constexpr, SWORD: tl.constexpr, SPLIT: tl.constexpr,
                 WT: tl.constexpr = 0, fflag=FOLD_SCAN_CONSTEXPR):
    """The L1 main loop as a gate dot and an up dot of BN rows each (every K order; ``fflag`` the
    expert's fold flag, ``fold_redo``)."""
    acc_g = tl.zeros((BN, BM), tl.float32)
    acc_u = tl.zeros((BN, BM), tl.float32)
    for k0 in range(0, H, BK):
        xa, xb = x_tiles(x_ptr, xrow, mvalid, k0, H // 2, SPLIT, BM, BK)
        acc_g = mm_block(acc_g, we, wse, rg, sg, NROWS, stride_wn, k0, xa, xb, W_KIND, BN, BK, HW_CVT, ASM,
                          FRAG, FOLD, SWORD, WT)
        acc_u = mm_block(acc_u, we, wse, ru, su, NROWS, stride_wn, k0, xa, xb, W_KIND, BN, BK, HW_CVT, ASM,
                          FRAG, FOLD, SWORD, WT)
    if FOLD:
        if fold_redo(fflag, wse, sg, NROWS, H, W_KIND, BN) or fold_redo(fflag, wse, su, NROWS, H, W_KIND, BN):
            acc_g = tl.zeros((BN, BM), tl.float32)  # a scale above the limit: redo with the plain decode
            acc_u = tl.zeros((BN, BM), tl.float32)
            for k0 in tl.range(0, H, BK, num_stages=1):  # rare: unpipelined (no registers taken from the main loop)
                xa, xb = x_tiles(x_ptr, xrow, mvalid, k0, H // 2, SPLIT, BM, BK)
                acc_g = mm_block(acc_g, we, wse, rg, sg, NROWS, stride_wn, k0, xa, xb, W_KIND, BN, BK, HW_CVT,
                                  ASM, FRAG, False, SWORD, WT)
                acc_u = mm_block(acc_u, we, wse, ru, su, NROWS, stride_wn, k0, xa, xb, W_KIND, BN, BK, HW_CVT,
                                  ASM, FRAG, False, SWORD, WT)
            if W_KIND == 2:  # the caller restores the fold's 2^8 (exact: see NV_REDO_SCALE)
                acc_g = acc_g * NV_REDO_SCALE
                acc_u = acc_u * NV_REDO_SCALE
    return acc_g, acc_u


# --------------------------------------------------------------------------- L1


@triton.jit
def _l1_kernel(x_ptr, xts_ptr, w_ptr, wsb_ptr, alpha_ptr, fflag_ptr,
               pair_ptr, blk_ptr, nblk_ptr, tw_ptr, act_ptr,
               T, H, I, TOPK, stride_we, stride_wn, stride_wse,
               rsf, clamp_c, act_alpha, act_beta, situ_b, situ_bl, a2_ptr,
               W_KIND: tl.constexpr, NV_IN: tl.constexpr, ACT: tl.constexpr, HAS_CLAMP: tl.constexpr,
               REQ: tl.constexpr, APPLY_W: tl.constexpr, SHARED: tl.constexpr, SPLIT_OUT: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HW_CVT: tl.constexpr, ASM: tl.constexpr,
               FRAG: tl.constexpr = False, FOLD: tl.constexpr = False, SWORD: tl.constexpr = False,
               GU: tl.constexpr = False, WT: tl.constexpr = 0, FFLAGS: tl.constexpr = False,
               SAHEAD: tl.constexpr = False, KU: tl.constexpr = 1, STORE32: tl.constexpr = False,
               PDL: tl.constexpr = False):
    """h = x @ W13^T for BN intermediate columns (gate and up) of one row block, then the
    epilogue (alphas, bf16 g/u, clamp, activation, top-k weight, requant) into ``act``.

    GU (frag only): the 2*BN contiguous kernel rows of the tile (gate and up interleaved in
    groups of 8) are one ``[2BN, 128]`` operand and one dot, instead of a gate dot and an up
    dot of BN rows each. In the wgmma accumulator a thread owns rows r and r + 8 of every
    16-row slab, so gate row 16m + i and its up row 16m + 8 + i land in the same thread and
    the split after the loop renames registers. Why: with 8 warps a 64-row dot is split along
    the tokens and both warpgroups decode the same weights; a 128-row dot is split along the
    rows, so 128-pair tiles can take 8 warps (half the accumulator registers per thread, no
    spills) without decoding anything twice. Same products, same per-element sums: bitwise
    the same output.

    FOLD (frag + asm): the decode's bias multiply rides on the scale operand (``_w_frag``). MX
    weights: exact while every UE8M0 byte of the tile is <= 128 (E4M3: 134); ``_fold_bad`` checks that
    after the loop and, if one was larger, the tile is computed again with the plain decode
    (never taken by real weights, so it costs only the check). NVFP4: the
    accumulators are value * 2^-8 exactly and get the 2^8 back here. FFLAGS: ``fflag_ptr`` holds the
    per-expert fold flags the layer computed at load (``fold_flags``), read instead of the scan. SAHEAD
    (GU, E4M3 weights): each K step's scale bytes are loaded one step ahead (``mx_scales``). KU (GU): K
    blocks per loop trip (``KernelConfig.k_unroll``; H a multiple of KU * BK). STORE32 (routed rows): the
    intermediate is stored through one 64-bit base per row block and 32-bit offsets (``store32``). PDL:
    ``_jit.pdl_wait`` (the next grid starts when this one's CTAs exit: ``pdl_release``)."""
    _jit.pdl_wait(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    e, past = block_expert(blk_ptr, nblk_ptr, pid_m, SHARED)
    if past:
        return
    pair, mvalid, tok = block_rows(pair_ptr, pid_m, T, TOPK, SHARED, BM)
    e64 = e.to(tl.int64)
    fflag = fold_flag(fflag_ptr, e64, FOLD, FFLAGS)
    xrow = tok.to(tl.int64) * H
    j = pid_n * BN + tl.arange(0, BN)
    rg = 16 * (j // 8) + j % 8
    ru = rg + 8
    sg = utccp(rg)
    su = utccp(ru)
    we = w_ptr + e64 * stride_we
    wse = wsb_ptr + e64 * stride_wse
    NROWS = 2 * I
    SPLIT: tl.constexpr = ((W_KIND == 0) or (W_KIND == 2)) and (FRAG == 0)
    if GU:  # one dot over the 2BN contiguous kernel rows (gate/up interleaved by 8), the L2's K loop
        r2 = pid_n * (2 * BN) + tl.arange(0, 2 * BN)
        s2 = utccp(r2)
        acc = k_loop(x_ptr, xrow, mvalid, H, we, wse, r2, s2, NROWS, stride_wn, 0, H, fflag, W_KIND, 2 * BN,
                     BM, BK, HW_CVT, ASM, FRAG, FOLD, SWORD, SPLIT, WT, SAHEAD, KU)
        a4 = tl.permute(acc.reshape(BN // 8, 2, 8, BM), (0, 2, 3, 1))  # (slab, i, token, gate/up)
        acc_g, acc_u = tl.split(a4)
        acc_g = acc_g.reshape(BN, BM)
        acc_u = acc_u.reshape(BN, BM)
    else:
        acc_g, acc_u = _l1_two_dots(x_ptr, xrow, mvalid, we, wse, rg, ru, sg, su, NROWS, stride_wn, H, W_KIND, BN,
                                    BM, BK, HW_CVT, ASM, FRAG, FOLD, SWORD, SPLIT, WT, fflag)
    if FOLD and W_KIND == 2:
        acc_g = acc_g * 256.0
        acc_u = acc_u * 256.0
    if NV_IN:  # NVFP4: acc * (token_scale * l1_alpha[e, half]), scalar product first
        ts = tl.load(xts_ptr + tok, mask=mvalid, other=0.0)
        acc_g = acc_g * (ts * tl.load(alpha_ptr + e64 * 2))[None, :]
        acc_u = acc_u * (ts * tl.load(alpha_ptr + e64 * 2 + 1))[None, :]
    a = activation(acc_g, acc_u, clamp_c, act_alpha, act_beta, situ_b, situ_bl, ACT, HAS_CLAMP, HW_CVT)
    if APPLY_W:
        w = tl.load(tw_ptr + pair, mask=mvalid, other=0.0) * rsf
        a = a * w[None, :]
    if REQ == 1:  # inv = 1 / a2 in fp32, as codecs.quantize_nvfp4
        a2v = tl.load(a2_ptr + tl.arange(0, 1))
        inv_a2 = tl.sum(tl.math.div_rn(tl.full((1,), 1.0, tl.float32), a2v), axis=0)
    else:
        inv_a2 = 1.0
    q = _requant(a, inv_a2, REQ, BN, BM, HW_CVT)
    orow = act_rows(pid_m, tok, SHARED, BM)
    if SPLIT_OUT == 2:  # frag K order: the next GEMM's e2m1 weights read 16-byte runs (_w_frag)
        col = _jit.frag_pos(j)
    elif SPLIT_OUT == 3:  # E4M3 frag K order (_w_frag8)
        col = _jit.frag8_pos(j)
    elif SPLIT_OUT:  # [even j | odd j]: the next GEMM's e2m1 weights take even/odd k separately
        col = j // 2 + (j % 2) * (I // 2)
    else:
        col = j
    if STORE32:  # a routed block's BM consecutive rows: one 64-bit base, 32-bit offsets (BM * I < 2^31: store32)
        dst = (act_ptr + (pid_m * BM).to(tl.int64) * I) + (tl.arange(0, BM)[None, :] * I + col[:, None])
    else:
        dst = act_ptr + orow[None, :] * I + col[:, None]
    tl.store(dst, q, mask=mvalid[None, :])


def store32(block_m: int, I: int, req: int) -> bool:
    """Whether the L1 stores a routed block's intermediate through 32-bit offsets from one 64-bit base per
    block (otherwise a 64-bit address per element): at 128-row tiles and for the NVFP4 intermediate, where
    it was measured 0-4% faster for the whole layer; not at mxfp8's 32-row tiles, where its two more
    registers cost a CTA per SM (10% slower at one point). The same bytes are stored either way. The offsets
    need ``block_m * I < 2^31``; past that the 64-bit form is kept (docs/KERNELS.md "The intermediate's
    store"). The shared expert's rows are not consecutive: its launch never takes it."""
    return (block_m == 128 or req == REQ_NV4) and block_m * I < 2 ** 31


def launch_l1(cfg: KernelConfig, x: torch.Tensor, weight: WeightOperand, rows: Rows, epi: L1Epilogue,
              act: torch.Tensor, H: int, I: int, hw: bool) -> None:
    """One L1 launch: ``rows`` of ``x`` (the staged activations, in the K order ``weight`` reads) through
    ``weight``'s gate/up rows and ``epi`` into ``act`` ``[rows, I]``; tiles from ``cfg``."""
    bn = min(cfg.l1_bn, I)
    dummy_f = torch.empty(1, dtype=torch.float32, device=act.device)
    rargs = rows.kernel_args(act.device)
    gu = bool(weight.frag and resolve_l1_gu(cfg) and not rows.shared)
    ku = k_unroll(cfg, H) if gu else 1
    wargs = weight.kernel_args(x)
    wargs["SAHEAD"] = wargs["SAHEAD"] and gu  # the two-dot L1 loads its scales in the step
    _l1_kernel[(I // bn, rows.grid_m())](
        x_ptr=x, act_ptr=act, H=H, I=I, **rargs, **wargs,
        **epi.kernel_args(dummy_f), BN=bn, BK=128 if weight.frag or H % cfg.l1_bk else cfg.l1_bk, HW_CVT=hw,
        GU=gu, KU=ku, STORE32=not rows.shared and store32(rargs["BM"], I, epi.req),
        num_warps=cfg.l1_warps, num_stages=cfg.l1_stages, **opts(cfg.l1_maxnreg), **pdl(act.device))
