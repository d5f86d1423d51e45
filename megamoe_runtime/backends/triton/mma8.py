"""FP8 tensor-core GEMMs for the MX rows (mxfp4, mxfp8) on Hopper (wgmma e4m3 x e4m3).

Why: the bf16 path decodes every E2M1 weight to bf16 and the activations to an
exact bf16 copy; on the H200 the integer pipe saturates on that decode long
before HBM does. Here both operands stay 8-bit:

* activations: the dispatch's own E4M3 bytes and UE8M0 scales
  (``staging.quantize_mxfp8`` without a dequantized copy), natural k order;
* E2M1 nibbles become E4M3 bytes with two masks and shifts per 4 bytes
  (``e2m1 * 2^-6`` exactly: the 3 magnitude bits land on the E4M3 exponent and
  top mantissa bit, the sign on bit 7), so no lookup table and no float
  conversion; the 2^6 is folded into the weight scale. E4M3 weights (mxfp8)
  are used as they are stored;
* one ``tl.dot`` per 32-wide K group (the MX block), a fresh fp32 partial that
  is scaled by ``2^(s_w) * 2^(s_x)`` (powers of two: exact) and added to the
  fp32 accumulator with one rounding, as the bf16 path's tensor cores do.

So the math is the reference's (docs/NUMERICS.md) except the order of
the fp32 sums, and inside one k32 MMA the tensor core's own summation of 32
exact products. Swap-AB: weights are the M side (L1 takes a contiguous block
of 2*BN interleaved gate/up rows, split in the epilogue), the expert's tokens
the N side. The epilogues are the bf16 path's (``l1.activation``), and the
L1 epilogue writes the intermediate as MXFP8 bytes + scales for L2.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import _jit
from .configs import W_E2M1_MX, W_E4M3_MX
from .l1 import activation
from .launch import L1Epilogue, Rows, WeightOperand
from .operands import act_rows, block_expert, block_rows, slot_rows, utccp

# E2M1 nibble pairs -> E4M3 bytes of (value * 2^-6), four packed bytes per register:
# low nibbles (even k): ((b << 2) & 0x1C) | ((b << 4) & 0x80); high nibbles (odd k):
# ((b >> 2) & 0x1C) | (b & 0x80), byte-parallel in 32-bit words (no carries cross bytes).
_E2M1_E4M3_ASM = tl.constexpr("""
{
.reg .b32 a, c;
shl.b32 a, $2, 2;
and.b32 a, a, 0x1C1C1C1C;
shl.b32 c, $2, 4;
and.b32 c, c, 0x80808080;
or.b32 $0, a, c;
shr.b32 a, $2, 2;
and.b32 a, a, 0x1C1C1C1C;
and.b32 c, $2, 0x80808080;
or.b32 $1, a, c;
}
""")


@triton.jit
def e2m1_to_e4m3(b, ASM: tl.constexpr):
    """uint8 bytes of packed E2M1 pairs [.., n] -> uint8 E4M3 bytes [.., 2n] in natural k
    order (low nibble first), each the E2M1 value times 2^-6 exactly."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_E2M1_E4M3_ASM, "=r,=r,r", [b.to(tl.uint8, bitcast=True)],
                                           dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    else:
        bi = b.to(tl.int32) & 0xFF
        lo = (((bi << 2) & 0x1C) | ((bi << 4) & 0x80)).to(tl.uint8)
        hi = (((bi >> 2) & 0x1C) | (bi & 0x80)).to(tl.uint8)
    return tl.interleave(lo, hi)


@triton.jit
def _w_group(w_ptr, wsb_ptr, rows, srows, NROWS, stride_wn, k0, W_KIND: tl.constexpr, ASM: tl.constexpr):
    """E4M3 weight tile [R, 32] of K group k0/32 and its fp32 per-row scale."""
    kg = k0 // 32
    s = tl.load(wsb_ptr + ((kg // 4) * NROWS + srows) * 4 + kg % 4).to(tl.int32)
    sw = _jit.pow2_from_byte(s)
    if W_KIND == 0:
        i = tl.arange(0, 16)
        b = tl.load(w_ptr + rows[:, None] * stride_wn + k0 // 2 + i[None, :])
        w8 = e2m1_to_e4m3(b, ASM)
        sw = sw * 64.0  # the 2^-6 of the E4M3 encoding; exact
    else:
        i = tl.arange(0, 32)
        w8 = tl.load(w_ptr + rows[:, None] * stride_wn + k0 + i[None, :])
    return w8.to(tl.float8e4nv, bitcast=True), sw


@triton.jit
def _group_dot(w_ptr, wsb_ptr, rows, srows, NROWS, stride_wn, x_ptr, xsf_ptr, xrow, xsrow, mvalid, k0,
               W_KIND: tl.constexpr, ASM: tl.constexpr):
    """(W_g @ X_g^T fp32 [R, BM], weight scales [R], activation scales [BM]) of K group k0/32."""
    i = tl.arange(0, 32)
    w8, sw = _w_group(w_ptr, wsb_ptr, rows, srows, NROWS, stride_wn, k0, W_KIND, ASM)
    x8 = tl.load(x_ptr + xrow[:, None] + k0 + i[None, :], mask=mvalid[:, None], other=0)
    sx = _jit.pow2_from_byte(tl.load(xsf_ptr + xsrow + k0 // 32, mask=mvalid, other=0).to(tl.int32))
    p = tl.dot(w8, tl.trans(x8.to(tl.float8e4nv, bitcast=True)))
    return p, sw, sx


@triton.jit
def _gemm8(w_ptr, wsb_ptr, rows, srows, NROWS, stride_wn, x_ptr, xsf_ptr, xrow, xsrow, mvalid, K,
           W_KIND: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, GPI: tl.constexpr, ASM: tl.constexpr):
    """fp32 [R, BM] = sum over 32-K groups of scale_w * scale_x * (W_g @ X_g^T).

    GPI groups per step: their MMAs are issued before the first partial is scaled, so
    the tensor cores overlap instead of waiting once per group."""
    acc = tl.zeros((R, BM), tl.float32)
    for k1 in range(0, K, 32 * GPI):
        p0, w0, x0 = _group_dot(w_ptr, wsb_ptr, rows, srows, NROWS, stride_wn, x_ptr, xsf_ptr, xrow, xsrow, mvalid,
                                k1, W_KIND, ASM)
        if GPI >= 2:
            p1, w1, x1 = _group_dot(w_ptr, wsb_ptr, rows, srows, NROWS, stride_wn, x_ptr, xsf_ptr, xrow, xsrow,
                                    mvalid, k1 + 32, W_KIND, ASM)
        if GPI >= 4:
            p2, w2, x2 = _group_dot(w_ptr, wsb_ptr, rows, srows, NROWS, stride_wn, x_ptr, xsf_ptr, xrow, xsrow,
                                    mvalid, k1 + 64, W_KIND, ASM)
            p3, w3, x3 = _group_dot(w_ptr, wsb_ptr, rows, srows, NROWS, stride_wn, x_ptr, xsf_ptr, xrow, xsrow,
                                    mvalid, k1 + 96, W_KIND, ASM)
        # p * sw is exact (a power of two): each fma rounds once, as acc + p * s would
        acc = tl.fma(p0 * w0[:, None], x0[None, :], acc)
        if GPI >= 2:
            acc = tl.fma(p1 * w1[:, None], x1[None, :], acc)
        if GPI >= 4:
            acc = tl.fma(p2 * w2[:, None], x2[None, :], acc)
            acc = tl.fma(p3 * w3[:, None], x3[None, :], acc)
    return acc


@triton.jit
def _requant_mx8(a, BN: tl.constexpr, BM: tl.constexpr, HW_CVT: tl.constexpr):
    """MXFP8 of ``a`` [BN (K of L2), BM] along axis 0: (E4M3 values fp32 [BN, BM], UE8M0 bytes
    [BN/32, BM]); the same rounding as ``l1._requant`` REQ 0 (and ``codecs.quantize_mxfp8``)."""
    a3 = a.reshape(BN // 32, 32, BM)
    amax = tl.max(tl.abs(a3), axis=1)
    e = _jit.ue8m0_ceil_byte(amax, 448.0)
    q = _jit.e4m3_round(a3 * _jit.inv_pow2_from_byte(e)[:, None, :], HW_CVT)
    return q.reshape(BN, BM), e


@triton.jit
def _l1_fp8_kernel(x_ptr, xsf_ptr, w_ptr, wsb_ptr, pair_ptr, blk_ptr, nblk_ptr, tw_ptr, act_ptr, asf_ptr,
                   T, H, I, TOPK, stride_we, stride_wn, stride_wse,
                   rsf, clamp_c, act_alpha, act_beta, situ_b, situ_bl,
                   W_KIND: tl.constexpr, ACT: tl.constexpr, HAS_CLAMP: tl.constexpr, APPLY_W: tl.constexpr,
                   SHARED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GPI: tl.constexpr,
                   ASM: tl.constexpr):
    """h = x @ W13^T on 2*BN consecutive kernel rows (BN gate + BN up columns), then the
    epilogue (bf16 g/u, clamp, activation, top-k weight, MXFP8 requant) -> act bytes + scales."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    e, past = block_expert(blk_ptr, nblk_ptr, pid_m, SHARED)
    if past:
        return
    pair, mvalid, tok = block_rows(pair_ptr, pid_m, T, TOPK, SHARED, BM)
    e64 = e.to(tl.int64)
    R: tl.constexpr = 2 * BN
    rows = pid_n * R + tl.arange(0, R)
    acc = _gemm8(w_ptr + e64 * stride_we, wsb_ptr + e64 * stride_wse, rows, utccp(rows), 2 * I, stride_wn,
                 x_ptr, xsf_ptr, tok.to(tl.int64) * H, tok.to(tl.int64) * (H // 32), mvalid, H,
                 W_KIND, R, BM, GPI, ASM)
    # kernel rows 16q + r (r < 8) are gate column 8q + r, rows 16q + 8 + r the up column
    a4 = tl.permute(tl.reshape(acc, (R // 16, 2, 8, BM)), (0, 2, 3, 1))
    acc_g, acc_u = tl.split(a4)
    acc_g = tl.reshape(acc_g, (BN, BM))
    acc_u = tl.reshape(acc_u, (BN, BM))
    a = activation(acc_g, acc_u, clamp_c, act_alpha, act_beta, situ_b, situ_bl, ACT, HAS_CLAMP, True)
    if APPLY_W:
        w = tl.load(tw_ptr + pair, mask=mvalid, other=0.0) * rsf
        a = a * w[None, :]
    q, sb = _requant_mx8(a, BN, BM, True)
    orow = act_rows(pid_m, tok, SHARED, BM)
    j = pid_n * BN + tl.arange(0, BN)
    tl.store(act_ptr + orow[None, :] * I + j[:, None], q.to(tl.float8e4nv).to(tl.uint8, bitcast=True),
             mask=mvalid[None, :])
    jg = pid_n * (BN // 32) + tl.arange(0, BN // 32)
    tl.store(asf_ptr + orow[None, :] * (I // 32) + jg[:, None], sb.to(tl.uint8), mask=mvalid[None, :])


@triton.jit
def _l2_fp8_kernel(act_ptr, asf_ptr, w_ptr, wsb_ptr, pair_ptr, blk_ptr, nblk_ptr, slot_ptr,
                   T, H, I, TOPK, NSLOT, stride_we, stride_wn, stride_wse,
                   W_KIND: tl.constexpr, SHARED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   GPI: tl.constexpr, ASM: tl.constexpr):
    """y = act @ W2^T for BN output columns of one row block -> bf16 slot outputs."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    e, past = block_expert(blk_ptr, nblk_ptr, pid_m, SHARED)
    if past:
        return
    pair, mvalid, tok = block_rows(pair_ptr, pid_m, T, TOPK, SHARED, BM)
    arow, slot = slot_rows(pid_m, pair, tok, TOPK, NSLOT, SHARED, BM)
    e64 = e.to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    acc = _gemm8(w_ptr + e64 * stride_we, wsb_ptr + e64 * stride_wse, n, utccp(n), H, stride_wn,
                 act_ptr, asf_ptr, arow * I, arow * (I // 32), mvalid, I, W_KIND, BN, BM, GPI, ASM)
    y = _jit.bf16r(acc, True).to(tl.bfloat16)
    tl.store(slot_ptr + slot[None, :] * H + n[:, None], y, mask=mvalid[None, :])


@triton.jit
def _table_kernel(b_ptr, o_ptr, N: tl.constexpr, ASM: tl.constexpr):
    tl.store(o_ptr + tl.arange(0, 2 * N), e2m1_to_e4m3(tl.load(b_ptr + tl.arange(0, N)), ASM))


def e2m1_e4m3_table(device: torch.device, asm: bool) -> torch.Tensor:
    """uint8 [512]: ``e2m1_to_e4m3`` of the bytes 0..255 (low nibble, high nibble per byte),
    for the GPU self-test against ``codecs``."""
    b = torch.arange(256, dtype=torch.uint8, device=device)
    o = torch.empty(512, dtype=torch.uint8, device=device)
    _table_kernel[(1,)](b, o, N=256, ASM=asm)
    return o


# --------------------------------------------------------------------------- host side


@dataclass
class Fp8Config:
    """Tiles of the FP8 path: ``l1_bn`` intermediate columns (2x kernel rows) per L1
    program, ``l2_bn`` output rows per L2 program, ``gpi`` 32-K groups per loop step."""

    l1_bn: int = 64
    l2_bn: int = 128
    gpi: int = 2
    warps: int = 4
    stages: int = 4


def default_fp8_config(n_pairs: int, num_local: int, w_kind: int = W_E2M1_MX) -> Fp8Config:
    """Tiles by regime and weight kind; the decode choices are the best of
    ``bench/kernel.py --tune --mma fp8`` on the H200 at 8, 64 and 512 tokens (BENCHMARKS.md)."""
    mean = n_pairs / max(1, num_local)
    if mean <= 32:
        if w_kind == W_E4M3_MX:
            return Fp8Config(l1_bn=64, l2_bn=128, gpi=4, warps=4, stages=3)
        return Fp8Config(l1_bn=64, l2_bn=128, gpi=1, warps=4, stages=8)
    return Fp8Config(l1_bn=64, l2_bn=128, gpi=2, warps=8, stages=3)


def candidate_fp8_configs(n_pairs: int, num_local: int) -> list[Fp8Config]:
    """What ``bench/kernel.py --tune`` tries for the FP8 path."""
    d = default_fp8_config(n_pairs, num_local)
    out = [d]
    for bn1, bn2, gpi, w, st in ((64, 128, 4, 4, 3), (64, 128, 2, 4, 4), (64, 64, 2, 4, 4), (128, 128, 2, 8, 3),
                                 (128, 256, 4, 8, 3), (64, 128, 4, 4, 4)):
        out.append(Fp8Config(bn1, bn2, gpi, w, st))
    return out


def launch_l1(fc: Fp8Config, x: torch.Tensor, x_sf: torch.Tensor, weight: WeightOperand, rows: Rows,
              epi: L1Epilogue, act8: torch.Tensor, asf: torch.Tensor, H: int, I: int) -> None:
    """One FP8 L1 launch: E4M3 activation bytes ``x`` with UE8M0 bytes ``x_sf`` through ``weight`` and the
    epilogue's activation and top-k weight (its requant is always MXFP8 here) into ``act8`` + ``asf``."""
    bn = min(fc.l1_bn, I)
    _l1_fp8_kernel[(I // bn, rows.grid_m())](
        x_ptr=x, xsf_ptr=x_sf, act_ptr=act8, asf_ptr=asf, H=H, I=I, **rows.kernel_args(act8.device),
        **weight.fp8_kernel_args(), **epi.act.kernel_args(), **epi.weight_args(), BN=bn, GPI=fc.gpi,
        num_warps=fc.warps, num_stages=fc.stages, enable_fp_fusion=False)


def launch_l2(fc: Fp8Config, act8: torch.Tensor, asf: torch.Tensor, weight: WeightOperand, rows: Rows,
              slots: torch.Tensor, H: int, I: int) -> None:
    """One FP8 L2 launch: the MXFP8 intermediate through ``weight`` into the bf16 ``slots [T, nslot, H]``."""
    bn = min(fc.l2_bn, H)
    _l2_fp8_kernel[(H // bn, rows.grid_m())](
        act_ptr=act8, asf_ptr=asf, slot_ptr=slots, H=H, I=I, NSLOT=slots.shape[1], **rows.kernel_args(act8.device),
        **weight.fp8_kernel_args(), BN=bn, GPI=fc.gpi, num_warps=fc.warps, num_stages=fc.stages,
        enable_fp_fusion=False)
