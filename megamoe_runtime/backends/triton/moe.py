"""Triton MegaMoE forward on the DeepGEMM kernel-layout bytes (Hopper and newer).

The kernels read the converted tensors exactly as the SM100 mega kernels do
(docs/LAYOUT.md), with no re-layout at load or per call:

* L1 weights ``[E_l, 2I, Dw]`` with gate/up rows interleaved in groups of 8:
  a program owning intermediate columns ``j`` reads gate rows
  ``16*(j//8) + j%8`` and up rows ``+8``, so one tile yields matching g/u;
* packed int32 MN-major UTCCP-permuted scales: for weight row ``n'`` and
  K-group ``kg`` the scale byte is byte ``kg % 4`` of int32
  ``phys[e, kg // 4, utccp(n')]`` (the physical ``[E_l, P, N]`` behind the
  ``[E_l, N, P]`` kernel view), read as a byte address;
* E2M1 nibbles / E4M3 bytes decoded in registers. Because a dot is a sum over k,
  the kernels never re-interleave weights: the activations (which our own staging
  and L1 epilogue write) are stored in the K order the weights' registers need.
  Default "frag" order (docs/KERNELS.md): each thread of the wgmma A operand owns
  16 (E2M1) or 32 (E4M3) contiguous weight bytes of a row per 128-wide K block,
  one MX group with one scale, decoded by shifts and masks straight into the
  operand registers. The older "split" order (low nibbles = even k, high = odd k,
  two dots; E4M3 natural order) stays selectable (``KernelConfig.k_order``).

Numerics are the reference backend's (``backends/reference.py``): each
operand is decoded exactly to bf16 (E2M1/E4M3 times its UE8M0 or E4M3 block
scale is always representable), the tensor cores accumulate in fp32, and the
epilogues reproduce every rounding point (bf16 g/u, clamp, activation with
``expf``/``tanhf``/true division, top-k weight, MXFP8 or NVFP4 requant,
bf16 slots, ascending-slot fp32 combine). Only the fp32 accumulation order
differs from torch's matmul.

Decode sizes are weight-bandwidth bound; the GEMMs are written "swap-AB"
(weights are the M side of the MMA, the few tokens of an expert the N side,
padded to 16), so every routed expert's bytes are streamed once per
row block of tokens.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch
import triton
import triton.language as tl

from . import _jit, decode_asm
from .staging import hw_cvt_default, quantize_mxfp8, quantize_nvfp4_per_token, route, split_tails

# weight kinds
W_E2M1_MX = 0
W_E4M3_MX = 1
W_E2M1_NV = 2
W_BF16 = 3
# requant kinds of the L1 epilogue
REQ_MX8 = 0
REQ_NV4 = 1
REQ_BF16 = 2


# --------------------------------------------------------------------------- device helpers


@triton.jit
def _utccp(r):
    return (r // 128) * 128 + (r % 32) * 4 + (r // 32) % 4


@triton.jit
def _x_tiles(x_ptr, xrow, mvalid, k0, HALF, SPLIT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Activation tile(s) for K-block k0 from an exactly dequantized bf16 copy.

    SPLIT: rows stored as [even k | odd k] (``HALF`` = K/2), returns (even, odd)
    ``[BM, BK/2]``; else the natural ``[BM, BK]`` twice. Plain contiguous loads,
    so they pipeline (cp.async) straight into shared memory.
    """
    if SPLIT:
        i = tl.arange(0, BK // 2)
        off = xrow[:, None] + k0 // 2 + i[None, :]
        ve = tl.load(x_ptr + off, mask=mvalid[:, None], other=0.0)
        vo = tl.load(x_ptr + off + HALF, mask=mvalid[:, None], other=0.0)
        return ve, vo
    else:
        i = tl.arange(0, BK)
        v = tl.load(x_ptr + xrow[:, None] + k0 + i[None, :], mask=mvalid[:, None], other=0.0)
        return v, v


@triton.jit
def _w_tiles(w_ptr, wsb_ptr, rows, srows, NROWS, stride_wn, k0,
             W_KIND: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HW_CVT: tl.constexpr, ASM: tl.constexpr):
    """Weight tile(s) of ``rows`` (kernel rows) for K-block k0, decoded to bf16.

    e2m1 kinds return (low nibbles = even k, high nibbles = odd k) ``[BN, BK/2]``;
    the others (full ``[BN, BK]``, same). ``w_ptr``/``wsb_ptr`` point at this
    expert's weight and physical scale bytes; ``srows`` = utccp(rows).
    """
    if W_KIND == 0:  # E2M1 + UE8M0 per 32
        G: tl.constexpr = BK // 32
        g = tl.arange(0, G)
        kg = k0 // 32 + g
        s = tl.load(wsb_ptr + ((kg // 4)[None, :] * NROWS + srows[:, None]) * 4 + (kg % 4)[None, :]).to(tl.int32)
        sc = _jit.pow2_from_byte(s).to(tl.bfloat16)  # 2^(s-127) exactly; byte 0 -> 0.0
        i = tl.arange(0, 16)
        off = rows[:, None, None] * stride_wn + k0 // 2 + g[None, :, None] * 16 + i[None, None, :]
        b = tl.load(w_ptr + off)
        scb = tl.broadcast_to(sc[:, :, None], (BN, G, 16))
        lo, hi = _jit.e2m1_pair_bf16(b, scb, ASM)
        return lo.reshape(BN, BK // 2), hi.reshape(BN, BK // 2)
    elif W_KIND == 1:  # E4M3 + UE8M0 per 32
        G: tl.constexpr = BK // 32
        g = tl.arange(0, G)
        kg = k0 // 32 + g
        s = tl.load(wsb_ptr + ((kg // 4)[None, :] * NROWS + srows[:, None]) * 4 + (kg % 4)[None, :]).to(tl.int32)
        sc = _jit.pow2_from_byte(s)[:, :, None]
        i = tl.arange(0, 32)
        off = rows[:, None, None] * stride_wn + k0 + g[None, :, None] * 32 + i[None, None, :]
        b = tl.load(w_ptr + off)
        v = (_jit.e4m3_byte_to_f32(b, HW_CVT) * sc).reshape(BN, BK).to(tl.bfloat16)
        return v, v
    elif W_KIND == 2:  # E2M1 + E4M3 per 16 (NVFP4, global scale via the alphas)
        G16: tl.constexpr = BK // 16
        g = tl.arange(0, G16)
        kg = k0 // 16 + g
        sfb = tl.load(wsb_ptr + ((kg // 4)[None, :] * NROWS + srows[:, None]) * 4 + (kg % 4)[None, :])
        sc = _jit.e4m3_byte_to_f32(sfb, HW_CVT).to(tl.bfloat16)  # exact
        i = tl.arange(0, 8)
        off = rows[:, None, None] * stride_wn + k0 // 2 + g[None, :, None] * 8 + i[None, None, :]
        b = tl.load(w_ptr + off)
        scb = tl.broadcast_to(sc[:, :, None], (BN, G16, 8))
        lo, hi = _jit.e2m1_pair_bf16(b, scb, ASM)
        return lo.reshape(BN, BK // 2), hi.reshape(BN, BK // 2)
    else:  # BF16
        i = tl.arange(0, BK)
        v = tl.load(w_ptr + rows[:, None] * stride_wn + k0 + i[None, :])
        return v, v


@triton.jit
def _scale_bytes_mx(wsb_ptr, rows, srows, NROWS, k0, SWORD: tl.constexpr):
    """int32 UE8M0 bytes ``[BN, 4]`` of the four MX groups of K-block k0 (128 wide).

    The four bytes of a row are one int32 of the packed scales (``kg // 4`` is the same for
    the block). SWORD reads that word (a 4-byte load, which Triton pipelines with cp.async
    like the weight bytes) and shifts the bytes out; else one byte load per group (2-byte
    vectors, not pipelined: its latency is paid in every K step)."""
    q = tl.arange(0, 4)
    if SWORD:
        w32 = wsb_ptr.to(tl.pointer_type(tl.int32))
        sw = tl.load(w32 + (k0 // 128) * NROWS + srows)
        return (sw[:, None] >> (8 * q[None, :])) & 0xFF
    else:
        kg = k0 // 32 + q
        return tl.load(wsb_ptr + ((kg // 4)[None, :] * NROWS + srows[:, None]) * 4 + (kg % 4)[None, :]).to(tl.int32)


@triton.jit
def _w_run(rows, k0, stride, RB: tl.constexpr, WT: tl.constexpr):
    """Offset (in the unit of ``stride``) of the ``RB`` units of each kernel row in K-block k0
    (128 wide). WT 0: the converted layout, rows of ``stride`` units. WT > 0: the tiled Hopper
    arrangement (docs/KERNELS.md, "Tiled weights"): each group of WT rows stores its K blocks
    one after another, every block WT * RB contiguous units, so a tile reads whole runs of memory
    instead of RB units per row strided by the row length."""
    if WT == 0:
        return rows * stride + (k0 // 128) * RB
    else:
        return (rows // WT) * (WT * stride) + (k0 // 128) * (WT * RB) + (rows % WT) * RB


@triton.jit
def _fold_scale_bits(s, BIAS: tl.constexpr):
    """bf16 bits (int32, low half) of ``2^(s - 127) * 2^BIAS`` for UE8M0 bytes s in [1, 127 - BIAS + 128]
    (byte 0 -> 0.0 as ``pow2_from_byte``); larger bytes give garbage, which the kernels detect."""
    return tl.where(s == 0, 0, (s + BIAS) << 7)


#: NVFP4 tiles redone with the plain decode (a scale byte ``_nv_fold_scale_bits`` cannot take)
#: hold the plain accumulators; times 2^-8 they are what the fold would have held, so the fold's
#: closing ``* 256`` applies unchanged. Exact: every nonzero product of an E2M1 * E4M3 weight and
#: an activation is a multiple of 2^-20, so no accumulator comes near fp32's subnormals.
_NV_REDO_SCALE = tl.constexpr(0.00390625)
_NV_FOLD_MUL = tl.constexpr(decode_asm.NV_FOLD_SCALE_MUL)
_NV_FOLD_ADD = tl.constexpr(decode_asm.NV_FOLD_SCALE_ADD)


@triton.jit
def _nv_fold_scale_bits(b):
    """bf16x2 bits (int32, the same value in both halves) of ``E4M3(b) * 2^118`` for scale bytes b.

    A normal E4M3 byte ``b = e << 3 | m`` (e >= 1) shifted left by 4 is the bf16 pattern with
    exponent field e and mantissa m, i.e. the scale times 2^-120; adding 238 to the exponent
    field gives the scale times 2^118. ``b * 0x100010 + 0x77007700`` (``decode_asm``) does both
    for both halves in one integer multiply-add (no carry crosses a half: ``0x7F0 + 0x7700 < 0x10000``).
    Exact only for normal, positive, finite bytes 0x08..0x7E: subnormal and zero bytes (whose
    value is not linear in the bits), NaN and sign bits give garbage, which ``_fold_bad``
    detects after the loop so the tile is computed again with the plain decode (docs/KERNELS.md,
    "The NVFP4 scale operand from the byte")."""
    return b.to(tl.int32) * _NV_FOLD_MUL + _NV_FOLD_ADD


@triton.jit
def _w_frag(w_ptr, wsb_ptr, rows, srows, NROWS, stride_wn, k0,
            W_KIND: tl.constexpr, BN: tl.constexpr, HW_CVT: tl.constexpr, ASM: tl.constexpr,
            FOLD: tl.constexpr = False, SWORD: tl.constexpr = False, WT: tl.constexpr = 0):
    """E2M1 weight tile ``[BN, 128]`` of K-block k0 (128 wide), decoded to bf16 in the frag K order.

    The bytes are read as ``[BN, 4, 16]``: row n, MX group q, 16 contiguous bytes (32 weights).
    In the wgmma A-operand layout one thread owns exactly such a run of 16 bytes for two rows
    (docs/KERNELS.md, "The frag K order"), so the byte tile reaches the registers as 16-byte
    vectors, every run has one UE8M0 scale (two E4M3 scales for NVFP4), and the reshapes
    below only rename registers: no layout conversion through shared memory.

    FOLD (inline asm only): the decode's 2^126 bias multiply is folded into the scale operand.
    UE8M0: exact for bytes <= 128, which the caller checks (``_fold_bad``). NVFP4: the
    operand is E4M3 scale * 2^118 (always a finite bf16: the scale is < 2^9), so the decoded
    weight is value * scale * 2^-8, and the caller multiplies the fp32 accumulator by 2^8
    (exact: every product and partial sum is the plain path's times 2^-8, far from fp32's
    subnormals and overflow)."""
    q = tl.arange(0, 4)
    if W_KIND == 0:  # UE8M0 per 32: group q of the block
        s = _scale_bytes_mx(wsb_ptr, rows, srows, NROWS, k0, SWORD)
        sc = _jit.pow2_from_byte(s).to(tl.bfloat16)  # [BN, 4]; 2^(s-127) exactly, byte 0 -> 0.0
    else:  # NVFP4: E4M3 per 16, two per run of 16 bytes
        if SWORD:  # the 8 bytes of the block are 2 int32 words per row
            w32 = wsb_ptr.to(tl.pointer_type(tl.int32))
            h2 = tl.arange(0, 2)
            sw = tl.load(w32 + (k0 // 64 + h2)[None, :] * NROWS + srows[:, None])
            sfb = ((sw[:, :, None] >> (8 * q[None, None, :])) & 0xFF).reshape(BN, 8)
        else:
            g = tl.arange(0, 8)
            kg = k0 // 16 + g
            sfb = tl.load(wsb_ptr + ((kg // 4)[None, :] * NROWS + srows[:, None]) * 4 + (kg % 4)[None, :])
        if not (FOLD and ASM):
            sc = _jit.e4m3_byte_to_f32(sfb, HW_CVT).to(tl.bfloat16).reshape(BN, 4, 2)  # exact
    if ASM:  # one int32 word = 8 nibbles per element, so the asm is elementwise whatever the layout
        iw = tl.arange(0, 4)
        w32 = w_ptr.to(tl.pointer_type(tl.int32))
        wd = tl.load(w32 + _w_run(rows, k0, stride_wn // 4, 16, WT)[:, None, None] + q[None, :, None] * 4
                     + iw[None, None, :])
        if FOLD and W_KIND == 0:  # bf16 bits of 2^(s-1) = scale * 2^126 straight from the byte
            sb = _fold_scale_bits(s, 126)
        elif W_KIND == 0:  # bf16 bits of 2^(s-127) straight from the byte (0 -> 0.0): no F2F in the loop
            sb = s << 7
        elif FOLD:  # E4M3 scale * 2^118 in both bf16 halves by one multiply-add (_nv_fold_scale_bits)
            sb = _nv_fold_scale_bits(sfb).reshape(BN, 4, 2)
        else:
            sb = sc.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        if not (FOLD and W_KIND == 2):
            sb = sb | (sb << 16)  # the scale in both halves of a bf16x2
        if W_KIND == 0:
            s2 = tl.broadcast_to(sb[:, :, None], (BN, 4, 4))
        else:  # words 0, 1 of a run take scale 2q, words 2, 3 scale 2q + 1
            s2 = tl.broadcast_to(sb[:, :, :, None], (BN, 4, 2, 2)).reshape(BN, 4, 4)
        n0, n4, n1, n5, n2, n6, n3, n7 = _jit.e2m1_frag_words(wd, s2, FOLD)
        # nibble j + 4h of word w -> k = 16(2w + j//2) + 8(j%2) + 2q + h, j = 2o + j'
        b0 = tl.join(tl.join(n0, n4), tl.join(n1, n5))  # (n, q, w, h, j') for o = 0
        b1 = tl.join(tl.join(n2, n6), tl.join(n3, n7))  # o = 1
        v = tl.join(b0, b1)  # (n, q, w, h, j', o)
        v = tl.permute(v, (0, 2, 5, 4, 1, 3))  # (n, w, o, j', q, h)
    else:  # arithmetic decode of the bytes: natural nibble i = 2 * byte + (high nibble) = 4h + 2o + j'
        i = tl.arange(0, 16)
        off = _w_run(rows, k0, stride_wn, 64, WT)[:, None, None] + q[None, :, None] * 16 + i[None, None, :]
        b = tl.load(w_ptr + off)
        if W_KIND == 0:
            scb = tl.broadcast_to(sc[:, :, None], (BN, 4, 16))
        else:
            scb = tl.broadcast_to(sc[:, :, :, None], (BN, 4, 2, 8)).reshape(BN, 4, 16)
        lo, hi = _jit.e2m1_pair_bf16(b, scb, False)
        v = tl.join(lo, hi).reshape(BN, 4, 4, 2, 2, 2)  # (n, q, w, h, o, j')
        v = tl.permute(v, (0, 2, 4, 5, 1, 3))  # (n, w, o, j', q, h)
    return v.reshape(BN, 128)


@triton.jit
def _w_frag8(w_ptr, wsb_ptr, rows, srows, NROWS, stride_wn, k0, BN: tl.constexpr, HW_CVT: tl.constexpr,
             ASM: tl.constexpr, FOLD: tl.constexpr = False, SWORD: tl.constexpr = False, WT: tl.constexpr = 0):
    """E4M3 weight tile ``[BN, 128]`` of K-block k0, decoded to bf16 in the E4M3 frag K order
    (``_jit.frag8_pos``): per row and thread, 32 contiguous bytes with one UE8M0 scale. FOLD (asm
    only): the 2^120 bias rides on the scale operand, exact for UE8M0 bytes <= 134, which the
    caller checks (``_fold_bad``)."""
    q = tl.arange(0, 4)
    s = _scale_bytes_mx(wsb_ptr, rows, srows, NROWS, k0, SWORD)
    sc = _jit.pow2_from_byte(s).to(tl.bfloat16)  # [BN, 4]
    if ASM:
        if FOLD:  # bf16 bits of 2^(s-7) = scale * 2^120
            sb = _fold_scale_bits(s, 120)
        else:
            sb = sc.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        iw = tl.arange(0, 8)
        w32 = w_ptr.to(tl.pointer_type(tl.int32))
        wd = tl.load(w32 + _w_run(rows, k0, stride_wn // 4, 32, WT)[:, None, None] + q[None, :, None] * 8
                     + iw[None, None, :])
        s2 = tl.broadcast_to((sb | (sb << 16))[:, :, None], (BN, 4, 8))
        b0, b2, b1, b3 = _jit.e4m3_frag_words(wd, s2, FOLD)
        v = tl.join(tl.join(b0, b2), tl.join(b1, b3))  # (n, q, w, h, p): byte 2h + p
    else:
        i = tl.arange(0, 32)
        b = tl.load(w_ptr + _w_run(rows, k0, stride_wn, 128, WT)[:, None, None] + q[None, :, None] * 32
                    + i[None, None, :])
        v = (_jit.e4m3_byte_to_f32(b, HW_CVT) * sc.to(tl.float32)[:, :, None]).to(tl.bfloat16)
        v = v.reshape(BN, 4, 8, 2, 2)  # (n, q, w, h, p)
    v = tl.permute(v, (0, 2, 4, 1, 3))  # (n, w, p, q, h): k = 16w + 8p + 2q + h
    return v.reshape(BN, 128)


@triton.jit
def _mm_block(acc, w_ptr, wsb_ptr, rows, srows, NROWS, stride_wn, k0, xa, xb,
              W_KIND: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HW_CVT: tl.constexpr, ASM: tl.constexpr,
              FRAG: tl.constexpr = False, FOLD: tl.constexpr = False, SWORD: tl.constexpr = False,
              WT: tl.constexpr = 0):
    """acc + W[rows, k0:k0+BK] @ x^T (WT: ``_w_run``; frag only)."""
    if FRAG:  # activations stored in the frag K order of the weight kind, BK == 128
        if W_KIND == 1:
            wf = _w_frag8(w_ptr, wsb_ptr, rows, srows, NROWS, stride_wn, k0, BN, HW_CVT, ASM, FOLD, SWORD, WT)
        else:
            wf = _w_frag(w_ptr, wsb_ptr, rows, srows, NROWS, stride_wn, k0, W_KIND, BN, HW_CVT, ASM, FOLD,
                         SWORD, WT)
        if HW_CVT:
            acc = tl.dot(wf, tl.trans(xa), acc)
        else:
            acc = tl.dot(wf.to(tl.float32), tl.trans(xa.to(tl.float32)), acc, input_precision="ieee")
    else:
        wa, wb = _w_tiles(w_ptr, wsb_ptr, rows, srows, NROWS, stride_wn, k0, W_KIND, BN, BK, HW_CVT, ASM)
        if HW_CVT:
            acc = tl.dot(wa, tl.trans(xa), acc)
            if W_KIND == 0 or W_KIND == 2:
                acc = tl.dot(wb, tl.trans(xb), acc)
        else:  # the interpreter's bf16 dot is broken; the operands are exact in fp32 too
            acc = tl.dot(wa.to(tl.float32), tl.trans(xa.to(tl.float32)), acc, input_precision="ieee")
            if W_KIND == 0 or W_KIND == 2:
                acc = tl.dot(wb.to(tl.float32), tl.trans(xb.to(tl.float32)), acc, input_precision="ieee")
    return acc


@triton.jit
def _fold_bad(wsb_ptr, srows, NROWS, K, W_KIND: tl.constexpr, BN: tl.constexpr):
    """Whether any scale byte of rows ``srows`` (physical scale rows, K columns) is outside what
    the FOLD decode computes exactly: UE8M0 bytes above its limit (E2M1: 128, scale * 2^126
    must be a finite bf16; E4M3: 134), or for NVFP4 any E4M3 byte that is not normal, positive
    and finite (0x08..0x7E, ``_nv_fold_scale_bits``).

    A separate pass over the tile's packed scale words after the main loop (1/16 of the E2M1
    bytes the loop read, still in L2) rather than a running max inside the loop: a loop-carried
    tensor made Triton reload the scales unpipelined in a second layout. The tests are per byte
    with no carries between bytes (each sum stays below 0x100): UE8M0 ``(b & 0x7F) + (255 -
    LIMIT)`` carries into bit 7 exactly when ``b & 0x7F > LIMIT - 128``, so ``b & that & 0x80``
    flags ``b > LIMIT``; E4M3 with ``lo = b & 0x7F``: ``lo + 0x78`` lacks bit 7 exactly when
    ``lo < 8`` and ``lo + 1`` has it exactly when ``lo == 0x7F``."""
    if W_KIND == 1:
        ADD: tl.constexpr = 0x79797979  # 255 - 134 per byte
    else:
        ADD: tl.constexpr = 0x7F7F7F7F  # 255 - 128 per byte
    w32 = wsb_ptr.to(tl.pointer_type(tl.int32))
    if W_KIND == 2:
        NW = K // 64  # 16 weights per E4M3 byte, 4 bytes per word
    else:
        NW = K // 128
    bad = tl.zeros((BN, 8), tl.int32)
    for kb in range(0, NW, 8):
        c = kb + tl.arange(0, 8)
        sw = tl.load(w32 + c[None, :] * NROWS + srows[:, None], mask=(c < NW)[None, :], other=0x08080808)
        if W_KIND == 2:
            lo = sw & 0x7F7F7F7F
            bad = bad | ((sw | ~(lo + 0x78787878) | (lo + 0x01010101)) & (-2139062144))  # 0x80808080
        else:
            bad = bad | (sw & ((sw & 0x7F7F7F7F) + ADD) & (-2139062144))  # 0x80808080
    return tl.max(tl.max((bad != 0).to(tl.int32), axis=1), axis=0) != 0


#: values of the per-expert fold flags (``fold_flags``): the expert's scale bytes were checked after
#: the last load and the fold decode takes them all / some need the plain decode / not known (a load
#: is in progress, or no flags: the tile scans its own scale words, ``_fold_bad``)
FOLD_OK = 0
FOLD_REDO = 1
FOLD_SCAN = 2
_FOLD_SCAN = tl.constexpr(FOLD_SCAN)


@triton.jit
def _fold_flag(fflag_ptr, e64, FOLD: tl.constexpr, FFLAGS: tl.constexpr):
    """The expert's fold flag, loaded at the start of the tile so its latency hides behind the main
    loop (FOLD_SCAN where the kernel has no flags)."""
    if FOLD and FFLAGS:
        return tl.load(fflag_ptr + e64)
    else:
        return _FOLD_SCAN


@triton.jit
def _fold_redo(fflag, wsb_ptr, srows, NROWS, K, W_KIND: tl.constexpr, BN: tl.constexpr):
    """Whether the tile must be computed again with the plain decode: by the expert's flag, which
    the layer computes once per load from the same bytes (``fold_flags``), or by scanning the tile's
    scale words where the flag says FOLD_SCAN. Why: the scan reads 1/16 (MX: 1/32) of the bytes the
    loop read, unpipelined, after the loop; at decode sizes it was 8% of the nvfp4 L1's stall
    samples (BENCHMARKS.md, issue 11 seventh pass)."""
    if fflag == _FOLD_SCAN:
        return _fold_bad(wsb_ptr, srows, NROWS, K, W_KIND, BN)
    else:
        return fflag != 0


@triton.jit
def _activation(g, u, clamp_c, act_alpha, act_beta, situ_b, situ_bl,
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
        sf = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)) * inv_a2
        sf = _jit.e4m3_round(tl.maximum(sf, _jit.E4M3_MIN_SUB), HW_CVT)
        sfb = tl.full(a3.shape, 1.0, tl.float32) * sf[:, None, :]
        c = _jit.e2m1_code(tl.math.div_rn(a3 * inv_a2, sfb))
        return (_jit.e2m1_value(c) * sfb).reshape(BN, BM).to(tl.bfloat16)
    else:
        return _jit.bf16r(a, HW_CVT).to(tl.bfloat16)


@triton.jit
def _l1_two_dots(x_ptr, xrow, mvalid, we, wse, rg, ru, sg, su, NROWS, stride_wn, H, W_KIND: tl.constexpr,
                 BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, HW_CVT: tl.constexpr, ASM: tl.constexpr,
                 FRAG: tl.constexpr, FOLD: tl.constexpr, SWORD: tl.constexpr, SPLIT: tl.constexpr,
                 WT: tl.constexpr = 0, fflag=_FOLD_SCAN):
    """The L1 main loop as a gate dot and an up dot of BN rows each (every K order; ``fflag`` the
    expert's fold flag, ``_fold_redo``)."""
    acc_g = tl.zeros((BN, BM), tl.float32)
    acc_u = tl.zeros((BN, BM), tl.float32)
    for k0 in range(0, H, BK):
        xa, xb = _x_tiles(x_ptr, xrow, mvalid, k0, H // 2, SPLIT, BM, BK)
        acc_g = _mm_block(acc_g, we, wse, rg, sg, NROWS, stride_wn, k0, xa, xb, W_KIND, BN, BK, HW_CVT, ASM,
                          FRAG, FOLD, SWORD, WT)
        acc_u = _mm_block(acc_u, we, wse, ru, su, NROWS, stride_wn, k0, xa, xb, W_KIND, BN, BK, HW_CVT, ASM,
                          FRAG, FOLD, SWORD, WT)
    if FOLD:
        if _fold_redo(fflag, wse, sg, NROWS, H, W_KIND, BN) or _fold_redo(fflag, wse, su, NROWS, H, W_KIND, BN):
            acc_g = tl.zeros((BN, BM), tl.float32)  # a scale above the limit: redo with the plain decode
            acc_u = tl.zeros((BN, BM), tl.float32)
            for k0 in tl.range(0, H, BK, num_stages=1):  # rare: unpipelined (no registers taken from the main loop)
                xa, xb = _x_tiles(x_ptr, xrow, mvalid, k0, H // 2, SPLIT, BM, BK)
                acc_g = _mm_block(acc_g, we, wse, rg, sg, NROWS, stride_wn, k0, xa, xb, W_KIND, BN, BK, HW_CVT,
                                  ASM, FRAG, False, SWORD, WT)
                acc_u = _mm_block(acc_u, we, wse, ru, su, NROWS, stride_wn, k0, xa, xb, W_KIND, BN, BK, HW_CVT,
                                  ASM, FRAG, False, SWORD, WT)
            if W_KIND == 2:  # the caller restores the fold's 2^8 (exact: see _NV_REDO_SCALE)
                acc_g = acc_g * _NV_REDO_SCALE
                acc_u = acc_u * _NV_REDO_SCALE
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
               GU: tl.constexpr = False, WT: tl.constexpr = 0, FFLAGS: tl.constexpr = False):
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
    per-expert fold flags the layer computed at load (``fold_flags``), read instead of the scan."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    m = tl.arange(0, BM)
    if SHARED:
        e = pid_m * 0
        tok = pid_m * BM + m
        mvalid = tok < T
        tok = tl.where(mvalid, tok, 0)
        pair = tok
    else:
        # block count and expert id go out together (blk holds max_blocks entries, this grid's size) instead
        # of one round trip after the other; ``e < 0`` never holds for a routed block, it keeps the compiler
        # from sinking the expert's load below the exit
        nb = tl.load(nblk_ptr)
        e = tl.load(blk_ptr + pid_m)
        if (pid_m >= nb) | (e < 0):
            return
        pair = tl.load(pair_ptr + pid_m * BM + m)
        mvalid = pair >= 0
        pair = tl.where(mvalid, pair, 0)
        tok = pair // TOPK
    e64 = e.to(tl.int64)
    fflag = _fold_flag(fflag_ptr, e64, FOLD, FFLAGS)
    xrow = tok.to(tl.int64) * H
    j = pid_n * BN + tl.arange(0, BN)
    rg = 16 * (j // 8) + j % 8
    ru = rg + 8
    sg = _utccp(rg)
    su = _utccp(ru)
    we = w_ptr + e64 * stride_we
    wse = wsb_ptr + e64 * stride_wse
    NROWS = 2 * I
    SPLIT: tl.constexpr = ((W_KIND == 0) or (W_KIND == 2)) and (FRAG == 0)
    if GU:  # one dot over the 2BN contiguous kernel rows (gate/up interleaved by 8)
        r2 = pid_n * (2 * BN) + tl.arange(0, 2 * BN)
        s2 = _utccp(r2)
        acc = tl.zeros((2 * BN, BM), tl.float32)
        for k0 in range(0, H, BK):
            xa, xb = _x_tiles(x_ptr, xrow, mvalid, k0, H // 2, SPLIT, BM, BK)
            acc = _mm_block(acc, we, wse, r2, s2, NROWS, stride_wn, k0, xa, xb, W_KIND, 2 * BN, BK, HW_CVT, ASM,
                            FRAG, FOLD, SWORD, WT)
        if FOLD:
            if _fold_redo(fflag, wse, s2, NROWS, H, W_KIND, 2 * BN):  # a scale the fold cannot take: plain again
                acc = tl.zeros((2 * BN, BM), tl.float32)
                for k0 in tl.range(0, H, BK, num_stages=1):  # rare: unpipelined (no registers taken from the main loop)
                    xa, xb = _x_tiles(x_ptr, xrow, mvalid, k0, H // 2, SPLIT, BM, BK)
                    acc = _mm_block(acc, we, wse, r2, s2, NROWS, stride_wn, k0, xa, xb, W_KIND, 2 * BN, BK, HW_CVT,
                                    ASM, FRAG, False, SWORD, WT)
                if W_KIND == 2:  # the fold's 2^8 is restored below (exact: see _NV_REDO_SCALE)
                    acc = acc * _NV_REDO_SCALE
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
    a = _activation(acc_g, acc_u, clamp_c, act_alpha, act_beta, situ_b, situ_bl, ACT, HAS_CLAMP, HW_CVT)
    if APPLY_W:
        w = tl.load(tw_ptr + pair, mask=mvalid, other=0.0) * rsf
        a = a * w[None, :]
    if REQ == 1:  # inv = 1 / a2 in fp32, as codecs.quantize_nvfp4
        a2v = tl.load(a2_ptr + tl.arange(0, 1))
        inv_a2 = tl.sum(tl.math.div_rn(tl.full((1,), 1.0, tl.float32), a2v), axis=0)
    else:
        inv_a2 = 1.0
    q = _requant(a, inv_a2, REQ, BN, BM, HW_CVT)
    if SHARED:
        orow = tok.to(tl.int64)
    else:
        orow = (pid_m * BM + m).to(tl.int64)
    if SPLIT_OUT == 2:  # frag K order: the next GEMM's e2m1 weights read 16-byte runs (_w_frag)
        col = _jit.frag_pos(j)
    elif SPLIT_OUT == 3:  # E4M3 frag K order (_w_frag8)
        col = _jit.frag8_pos(j)
    elif SPLIT_OUT:  # [even j | odd j]: the next GEMM's e2m1 weights take even/odd k separately
        col = j // 2 + (j % 2) * (I // 2)
    else:
        col = j
    tl.store(act_ptr + orow[None, :] * I + col[:, None], q, mask=mvalid[None, :])


# --------------------------------------------------------------------------- L2


@triton.jit
def _l2_kernel(act_ptr, w_ptr, wsb_ptr, fflag_ptr, pair_ptr, blk_ptr, nblk_ptr, tw_ptr, l2s_ptr, slot_ptr,
               T, H, I, TOPK, NSLOT, stride_we, stride_wn, stride_wse, a2_ptr,
               W_KIND: tl.constexpr, NV_EPI: tl.constexpr, SHARED: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HW_CVT: tl.constexpr, ASM: tl.constexpr,
               FRAG: tl.constexpr = False, FOLD: tl.constexpr = False, SWORD: tl.constexpr = False,
               WT: tl.constexpr = 0, FFLAGS: tl.constexpr = False):
    """y = act @ W2^T for BN output columns of one row block -> bf16 slot outputs
    (FOLD, SWORD and FFLAGS as in ``_l1_kernel``)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    m = tl.arange(0, BM)
    if SHARED:
        e = pid_m * 0
        tok = pid_m * BM + m
        mvalid = tok < T
        tok = tl.where(mvalid, tok, 0)
        arow = tok.to(tl.int64)
        slot = tok.to(tl.int64) * NSLOT + TOPK
        pair = tok
    else:
        # block count and expert id go out together (blk holds max_blocks entries, this grid's size) instead
        # of one round trip after the other; ``e < 0`` never holds for a routed block, it keeps the compiler
        # from sinking the expert's load below the exit
        nb = tl.load(nblk_ptr)
        e = tl.load(blk_ptr + pid_m)
        if (pid_m >= nb) | (e < 0):
            return
        pair = tl.load(pair_ptr + pid_m * BM + m)
        mvalid = pair >= 0
        pair = tl.where(mvalid, pair, 0)
        arow = (pid_m * BM + m).to(tl.int64)
        slot = (pair // TOPK).to(tl.int64) * NSLOT + pair % TOPK
    e64 = e.to(tl.int64)
    fflag = _fold_flag(fflag_ptr, e64, FOLD, FFLAGS)
    n = pid_n * BN + tl.arange(0, BN)
    sn = _utccp(n)
    we = w_ptr + e64 * stride_we
    wse = wsb_ptr + e64 * stride_wse
    SPLIT: tl.constexpr = ((W_KIND == 0) or (W_KIND == 2)) and (FRAG == 0)
    acc = tl.zeros((BN, BM), tl.float32)
    xrow = arow * I
    for k0 in range(0, I, BK):
        xa, xb = _x_tiles(act_ptr, xrow, mvalid, k0, I // 2, SPLIT, BM, BK)
        acc = _mm_block(acc, we, wse, n, sn, H, stride_wn, k0, xa, xb, W_KIND, BN, BK, HW_CVT, ASM, FRAG, FOLD, SWORD,
                        WT)
    if FOLD:
        if _fold_redo(fflag, wse, sn, H, I, W_KIND, BN):  # a scale the fold cannot take: redo with the plain decode
            acc = tl.zeros((BN, BM), tl.float32)
            for k0 in tl.range(0, I, BK, num_stages=1):  # rare: unpipelined, so it costs the main loop no registers
                xa, xb = _x_tiles(act_ptr, xrow, mvalid, k0, I // 2, SPLIT, BM, BK)
                acc = _mm_block(acc, we, wse, n, sn, H, stride_wn, k0, xa, xb, W_KIND, BN, BK, HW_CVT, ASM,
                                FRAG, False, SWORD, WT)
            if W_KIND == 2:  # the fold's 2^8 is restored below (exact: see _NV_REDO_SCALE)
                acc = acc * _NV_REDO_SCALE
    if FOLD and W_KIND == 2:
        acc = acc * 256.0
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


# --------------------------------------------------------------------------- combine


@triton.jit
def _combine_kernel(slot_ptr, ids_ptr, out_ptr, H, e_lo, E_l, rsf,
                    TOPK: tl.constexpr, HAS_SHARED: tl.constexpr, NV: tl.constexpr, APPLY_RSF: tl.constexpr,
                    BH: tl.constexpr, GPU: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = h < H
    NSLOT: tl.constexpr = TOPK + HAS_SHARED
    base = slot_ptr + t * NSLOT * H
    acc = tl.zeros((BH,), tl.float32)
    for k in tl.static_range(TOPK):
        le = tl.load(ids_ptr + t * TOPK + k).to(tl.int32) - e_lo
        ok = (le >= 0) & (le < E_l)
        s = tl.load(base + k * H + h, mask=hm & ok, other=0.0).to(tl.float32)
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


# --------------------------------------------------------------------------- host side


@dataclass
class KernelConfig:
    """Tile choices. ``block_m`` None picks by the mean pairs per expert."""

    block_m: Optional[int] = None
    l1_bn: int = 64
    l1_bk: int = 128
    l1_warps: int = 4
    l1_stages: int = 3
    l2_bn: int = 64
    l2_bk: int = 128
    l2_warps: int = 4
    l2_stages: int = 3
    combine_bh: int = 1024
    #: GEMM path of the MX rows: "fp8" (E4M3 wgmma, ``mma8``), "bf16" (decode to bf16) or
    #: None = env ``MEGAMOE_TRITON_MMA`` (default "auto" = bf16, the exact path). Other rows: bf16.
    mma: Optional[str] = None
    #: tiles of the fp8 path (None: ``mma8.default_fp8_config``)
    fp8: Any = None
    #: K order of the E2M1 and E4M3 rows' bf16 GEMMs: "frag" (16/32-byte weight runs per
    #: thread, the operand built in registers by shifts and masks, docs/KERNELS.md "The frag
    #: K order"), "split" (E2M1: even/odd nibble halves; E4M3: natural order; the issue-5
    #: paths) or None = env ``MEGAMOE_TRITON_KORDER`` (default ``DEFAULT_K_ORDER``).
    #: frag needs H and I multiples of 128 (else the old order is used).
    k_order: Optional[str] = None
    #: weight decode of the frag paths: "fold" (the decode's bias multiply folded into the scale
    #: operand: one bf16x2 multiply per operand register instead of two, bitwise the same
    #: output; docs/KERNELS.md "The frag K order"), "plain", or None = env
    #: ``MEGAMOE_TRITON_DECODE``, else by row (``resolve_decode``); ``default_config`` sets it
    #: per regime and row from ``FRAG_TILES``. Needs the inline-asm decode.
    decode: Optional[str] = None
    #: the L2 kernel's decode where it differs from ``decode`` (the two kernels are separate
    #: launches, so each can take the one measured faster for it); None: ``decode``
    l2_decode: Optional[str] = None
    #: how the frag paths read the weight scales: "words" (one int32 per row and 128-wide K
    #: block, a 4-byte load that is software-pipelined), "bytes" (per-group byte loads), or
    #: None = env ``MEGAMOE_TRITON_SCALES`` (default ``DEFAULT_SCALE_LOAD``).
    scale_load: Optional[str] = None
    #: frag L1 as one dot over the tile's 2*BN gate/up kernel rows (``_l1_kernel`` GU) instead
    #: of a gate dot and an up dot; None = env ``MEGAMOE_TRITON_L1GU`` ("1"/"0"), else off
    #: (``default_config`` sets it where it was measured faster, with its tiles).
    l1_gu: Optional[bool] = None
    #: register cap per thread of the L1 / L2 kernel (ptxas ``.maxnreg``; None: the compiler's
    #: choice). Occupancy is set by registers: 8-warp tiles at 132 registers fit one CTA per
    #: SM, at 128 two.
    l1_maxnreg: Optional[int] = None
    l2_maxnreg: Optional[int] = None
    #: frag path: an expert whose last row block holds 1..``tail_max`` pairs has that block
    #: computed by a second L1/L2 launch of small row blocks (``staging.split_tails``;
    #: docs/KERNELS.md "Tail blocks"); 0: off. ``default_config`` sets it at prefill.
    tail_max: int = 0
    #: the tiles of those launches (their ``block_m`` is the tail row block); None: the frag
    #: tiles of the regime below (``tail_config``)
    tail: Optional["KernelConfig"] = None

    def pick_block_m(self, n_pairs: int, num_local: int) -> int:
        if self.block_m is not None:
            return self.block_m
        mean = n_pairs / max(1, num_local)
        for bm in (16, 32, 64):
            if mean <= bm:
                return bm
        return 128


def resolve_l1_gu(cfg: Optional["KernelConfig"] = None) -> bool:
    """Whether the frag L1 runs as one gate/up dot: ``KernelConfig.l1_gu`` (``default_config``
    sets it per regime and row), else env ``MEGAMOE_TRITON_L1GU`` ("1"/"0"), else off."""
    import os

    if cfg is not None and cfg.l1_gu is not None:
        return bool(cfg.l1_gu)
    v = os.environ.get("MEGAMOE_TRITON_L1GU")
    return False if v is None else v not in ("0", "false", "no", "")


#: at most this many (token, expert) pairs is the "few" regime: a token or two, so at most this
#: many experts and too few L1 tiles to give every SM its CTAs with the decode tiles
FEW_PAIRS = 16


def frag_regime(mean_pairs: float, n_pairs: Optional[int] = None) -> str:
    """Regime of the frag tiles by mean (token, expert) pairs per local expert: "decode"
    (<= 8: weight streaming, row blocks mostly padding; "few" when there are at most
    ``FEW_PAIRS`` pairs in all), "mid" (<= 32), "prefill64" (<= 64: an expert's mean fits one
    64-pair row block), "prefill" (128-pair blocks)."""
    if mean_pairs <= 32:
        if mean_pairs > 8:
            return "mid"
        return "few" if n_pairs is not None and n_pairs <= FEW_PAIRS else "decode"
    return "prefill64" if mean_pairs <= 64 else "prefill"


class FragTiles(NamedTuple):
    """One ``FRAG_TILES`` entry: the L1 and L2 tiles of the frag path for a regime and weight kind."""

    #: pairs per row block (None: 64 up to 64 pairs per expert, else 128)
    block_m: Optional[int]
    #: the L1 as one gate/up dot (``KernelConfig.l1_gu``)
    l1_gu: bool
    l1_bn: int
    l1_warps: int
    l1_stages: int
    l2_bn: int
    l2_warps: int
    l2_stages: int
    #: weight decode of the L1 and of the L2 ("plain" / "fold"; each kernel takes its faster one)
    decode: str
    l2_decode: str
    #: L1 register cap (None: the compiler's; 128 lets four 4-warp L1 CTAs share an SM)
    l1_maxnreg: Optional[int]
    #: ``KernelConfig.tail_max`` (0: no tail launches)
    tail_max: int = 0


#: Frag-path tiles per (regime, weight kind): the fastest L1 and the fastest L2 of
#: ``bench/sweep.py`` on the H200, which times the two kernels apart (BENCHMARKS.md, "issue 11,
#: third pass"), each with its faster weight decode (plain / fold, "fourth pass": fold issues
#: fewer instructions but is slower where the tile is latency bound). "Fifth pass", on tiled
#: weights: the 128-register cap made the decode-size L1 3-8% faster, and fold overtook plain
#: for mxfp4 there: less waiting on memory left the instruction count to matter. nvfp4 prefill:
#: 64-pair row blocks (two CTAs per SM; 128-pair blocks fit one). "Eighth pass", with fold flags
#: (no scan after the loop): fold for the mxfp4 mid-size L1/L2 (6% whole layer at 512 tokens)
#: and the nvfp4 prefill L1 (5% L1); mxfp8 prefill in 4-warp, 2-stage tiles (two CTAs per SM:
#: L1 8.67 -> 7.66 ms, L2 3.97 -> 3.77 ms at 4096 tokens) and a one-dot plain L1 at mid sizes.
#: "Ninth pass": tail launches (the last field, ``KernelConfig.tail_max``): whole layer at 4096
#: tokens mxfp4 8533 -> 7530 us, nvfp4 9701 -> 9331, mxfp8 11617 -> 10235; 512 tokens (16 per
#: expert) mxfp4 2695 -> 2571, nvfp4 2892 -> 2765. With tails the 128-pair nvfp4 prefill tiles
#: (8 warps, one CTA per SM) overtake the 64-pair ones: 9196 -> 8380 us at 4096 tokens; with 33-64
#: pairs per expert ("prefill64") the 64-pair tiles stay (2048 tokens: 5428 us against 6208).
#: "few" (one or two tokens): 32 kernel rows per L1 tile for nvfp4 and mxfp8, twice the CTAs for
#: the few experts touched (1 token: nvfp4 112.9 -> 103.6 us, mxfp8 169.6 -> 158.8; mxfp4 keeps 64).
#: mxfp8 decode: 32-row, 3-stage L1 tiles (8 tokens 818.8 -> 762.0 us, 64 tokens 3134.5 -> 3024.5;
#: the fp4 rows' 64-row tiles stay fastest there).
FRAG_TILES = {
    ("few", W_E4M3_MX): FragTiles(16, True, 32, 4, 4, 64, 4, 3, "plain", "plain", 128),
    ("decode", W_E2M1_MX): FragTiles(16, True, 64, 4, 3, 128, 4, 3, "fold", "fold", 128),
    ("decode", W_E2M1_NV): FragTiles(16, True, 64, 4, 3, 128, 4, 3, "fold", "fold", 128),
    ("decode", W_E4M3_MX): FragTiles(16, True, 32, 4, 3, 64, 4, 3, "plain", "plain", 128),
    ("mid", W_E2M1_MX): FragTiles(32, True, 64, 4, 3, 128, 4, 3, "fold", "fold", None, 16),
    ("mid", W_E2M1_NV): FragTiles(32, True, 32, 4, 3, 128, 4, 3, "fold", "fold", None, 16),
    ("mid", W_E4M3_MX): FragTiles(32, True, 64, 4, 3, 128, 4, 3, "plain", "fold", None, 16),
    ("prefill64", W_E2M1_MX): FragTiles(64, True, 64, 4, 3, 128, 4, 3, "plain", "plain", None, 32),
    ("prefill64", W_E2M1_NV): FragTiles(64, True, 64, 4, 4, 256, 8, 3, "fold", "plain", None, 32),
    ("prefill64", W_E4M3_MX): FragTiles(64, True, 64, 4, 2, 128, 4, 2, "plain", "fold", None, 32),
    ("prefill", W_E2M1_MX): FragTiles(128, True, 64, 4, 3, 128, 4, 3, "plain", "plain", None, 32),
    ("prefill", W_E2M1_NV): FragTiles(128, True, 64, 8, 4, 128, 4, 2, "fold", "fold", None, 32),
    ("prefill", W_E4M3_MX): FragTiles(128, True, 64, 4, 2, 128, 4, 2, "plain", "fold", None, 32),
}
#: mxfp4 keeps its decode tiles for one or two tokens (the 32-row tiles lose there); nvfp4 starts from
#: its decode tiles there too, and the grid-fill rule (``shape_tiles``) picks 32-row L1 / 64-column L2
#: tiles from the shape (issue 28: the "few" entry it replaces was the rule's choice at one token of
#: DeepSeek-V3, and lost 5-13% on the few large experts of Mixtral / DBRX)
FRAG_TILES[("few", W_E2M1_MX)] = FRAG_TILES[("decode", W_E2M1_MX)]
FRAG_TILES[("few", W_E2M1_NV)] = FRAG_TILES[("decode", W_E2M1_NV)]
#: the tail launches' tiles (``tail_config``) where they differ from the regime-below entry: the
#: nvfp4 mid-size L1 went to 32-row one-dot tiles (issue 28 sweep); its tails keep the tiles they
#: were measured with (two 128-row dots)
TAIL_TILES = {("mid", W_E2M1_NV): FragTiles(32, False, 128, 4, 3, 128, 4, 3, "fold", "fold", None, 16)}

#: CTAs per SM that the grid-fill rule counts as resident (the decode-size tiles are 4 warps; the
#: L1 under a 128-register cap fits four per SM)
FILL_CTAS_PER_SM = 4
#: SMs when no CUDA device can be asked (an H200 / H100 SXM has 132)
DEFAULT_SMS = 132
_SMS: dict = {}


def sm_count() -> int:
    """SMs of the current CUDA device (cached), else ``DEFAULT_SMS``."""
    if "n" not in _SMS:
        n = DEFAULT_SMS
        try:
            if torch.cuda.is_available():
                n = int(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)
        except Exception:
            pass
        _SMS["n"] = n
    return _SMS["n"]


def expected_touched(n_pairs: int, num_local: int) -> float:
    """Experts expected to get at least one of ``n_pairs`` pairs spread uniformly over ``num_local``
    (Poisson: E (1 - exp(-pairs / E))). The host never sees the routing (no sync), so the tile rule
    sizes the grid from this; skewed routing touches fewer experts, which only makes small tiles
    more worth it."""
    import math

    E = max(1, num_local)
    return E * (1.0 - math.exp(-n_pairs / E))


def wave_efficiency(ctas: float, slots: int) -> float:
    """Fraction of the resident-CTA slots that ``ctas`` CTAs keep busy over their waves."""
    import math

    if ctas <= 0:
        return 0.0
    return ctas / (math.ceil(ctas / slots) * slots)


def shape_tiles(cfg: "KernelConfig", kind: int, regime: str, n_pairs: int, num_local: int, H: int, I: int,
                sms: Optional[int] = None) -> "KernelConfig":
    """The grid-fill part of the tile rule (docs/KERNELS.md "Tile rule"): at decode and mid sizes the
    kernels stream weights, and a grid of too few CTAs leaves SMs without loads in flight. From the
    shape and the pairs per expert: row blocks ~ max(experts touched, pairs / block_m); with
    ``slots = FILL_CTAS_PER_SM * SMs``:

    * L1 (decode sizes): 64-row tiles give ``blocks * I / 64`` CTAs. Under two waves, and when halving
      the tile raises the wave efficiency by more than 5%, take 32-row tiles (4 stages).
    * L2: 128-column tiles give ``blocks * H / 128`` CTAs. While that is under two waves of 16-row
      blocks' worth of rows (``ctas * block_m < 32 * slots``), take 64-column tiles, with 4 stages when
      the K loop is long (I / 128 >= 64: a few large experts).

    Measured for nvfp4 weights (issue 28 sweep); mxfp4's 32-row / 64-column tiles lost at every point
    of the set (18-44% L1, 8-39% L2), and mxfp8's decode tiles are 32 rows already, so both keep the
    table's."""
    if kind != W_E2M1_NV or regime not in ("few", "decode", "mid") or not H or not I:
        return cfg
    import math

    sms = sms or sm_count()
    slots = FILL_CTAS_PER_SM * sms
    bm = cfg.block_m or 16
    blocks = max(expected_touched(n_pairs, num_local), math.ceil(n_pairs / bm))
    if regime in ("few", "decode") and cfg.l1_bn == 64:
        n64 = blocks * (I // 64)
        if n64 < 2 * slots and wave_efficiency(2 * n64, slots) > 1.05 * wave_efficiency(n64, slots):
            cfg = dataclasses.replace(cfg, l1_bn=32, l1_stages=4)
    if cfg.l2_bn == 128 and blocks * (H // 128) * bm < 32 * slots:
        cfg = dataclasses.replace(cfg, l2_bn=64, l2_stages=4 if I // 128 >= 64 else cfg.l2_stages)
    return cfg


def default_config(n_pairs: int, num_local: int, k_order: Optional[str] = None,
                   l1_gu: Optional[bool] = None, w_kind: Optional[int] = None,
                   H: Optional[int] = None, I: Optional[int] = None) -> KernelConfig:
    """Tiles by regime: decode (few pairs per expert) streams weights with small
    row blocks; prefill uses 128-pair blocks so each weight tile feeds a full MMA.

    ``k_order`` "frag" (the MX/NV rows' default): ``FRAG_TILES`` by regime and weight kind
    ``w_kind`` (None: the mxfp4 tiles), then, given the shape (``H``, ``I``), the grid-fill rule
    ``shape_tiles`` (docs/KERNELS.md "Tile rule"). ``l1_gu`` None: env ``MEGAMOE_TRITON_L1GU``, else the
    table's; True / False flips only that field (benchmarks compare the two L1 forms). The
    decode is the table's unless env ``MEGAMOE_TRITON_DECODE`` names one."""
    import os

    mean = n_pairs / max(1, num_local)
    if k_order == "frag":
        kind = w_kind if w_kind in (W_E4M3_MX, W_E2M1_NV) else W_E2M1_MX
        t = FRAG_TILES[(frag_regime(mean, n_pairs), kind)]
        env = os.environ.get("MEGAMOE_TRITON_L1GU")
        if l1_gu is None and env is not None:
            l1_gu = env not in ("0", "false", "no", "")
        bm = t.block_m if t.block_m is not None else (64 if mean <= 64 else 128)
        cfg = _frag_config(t, bm, l1_gu)
        cfg = shape_tiles(cfg, kind, frag_regime(mean, n_pairs), n_pairs, num_local, H, I)
        # at prefill a tail is the short remainder of a compute-bound expert: always worth its own
        # launch; at mid sizes only while most experts fit in one (mean <= tail_max): there the
        # kernels are bound by the weight bytes, and a remainder in a second launch reads its
        # expert's weights again (BENCHMARKS.md, issue 11 ninth pass: 512 tokens 1.06 -> 1.11x,
        # 1024 tokens 0.98x either way, nvfp4 0.92 -> 0.87x)
        if t.tail_max and frag_regime(mean) in ("decode", "mid") and mean > t.tail_max:
            cfg = dataclasses.replace(cfg, tail_max=0)
        return cfg
    if mean <= 8:
        return KernelConfig(block_m=16, l1_bn=64, l1_bk=128, l1_warps=4, l1_stages=4,
                            l2_bn=64, l2_bk=128, l2_warps=4, l2_stages=4)
    if mean <= 32:
        return KernelConfig(block_m=16 if mean <= 16 else 32, l1_bn=128, l1_bk=128, l1_warps=4, l1_stages=3,
                            l2_bn=128, l2_bk=128, l2_warps=4, l2_stages=3)
    return KernelConfig(block_m=64 if mean <= 64 else 128, l1_bn=64, l1_bk=128, l1_warps=8, l1_stages=3,
                        l2_bn=128, l2_bk=128, l2_warps=8, l2_stages=3)


def _frag_config(t: FragTiles, bm: int, l1_gu: Optional[bool] = None) -> KernelConfig:
    import os

    # the environment's decode, when set, is forced on both kernels
    env_decode = os.environ.get("MEGAMOE_TRITON_DECODE")
    decode = env_decode or t.decode
    l2_decode = None if env_decode or t.l2_decode == decode else t.l2_decode
    return KernelConfig(block_m=bm, l1_bn=t.l1_bn, l1_bk=128, l1_warps=t.l1_warps, l1_stages=t.l1_stages,
                        l2_bn=t.l2_bn, l2_bk=128, l2_warps=t.l2_warps, l2_stages=t.l2_stages, k_order="frag",
                        l1_gu=t.l1_gu if l1_gu is None else bool(l1_gu),
                        decode=decode, l2_decode=l2_decode, l1_maxnreg=t.l1_maxnreg, tail_max=t.tail_max)


def tail_config(w_kind: Optional[int], block_m: int) -> KernelConfig:
    """Tiles of the tail launches (``KernelConfig.tail``) when a config names none: the frag
    tiles of the regime below the one whose row blocks are ``block_m`` pairs (mid-size tiles,
    32-pair blocks, under 64- and 128-pair blocks; decode tiles, 16-pair blocks, under 32), sized
    for the few pairs a tail holds. Their ``tail_max`` is 0: a tail launch never splits again."""
    kind = w_kind if w_kind in (W_E4M3_MX, W_E2M1_NV) else W_E2M1_MX
    reg = "mid" if block_m > 32 else "decode"
    t = TAIL_TILES.get((reg, kind), FRAG_TILES[(reg, kind)])
    return dataclasses.replace(_frag_config(t, t.block_m), tail_max=0)


def candidate_configs(n_pairs: int, num_local: int, k_order: Optional[str] = None) -> list[KernelConfig]:
    """What ``bench/kernel.py --tune`` tries around the default."""
    d = default_config(n_pairs, num_local, k_order)
    bm = d.block_m
    if d.l1_gu:  # one-dot L1: (l1 bn, l1 warps, l2 bn, l2 warps)
        r = [(64, 4, 64, 4), (128, 8, 128, 4), (64, 8, 64, 4)] if bm <= 32 else \
            [(64, 8, 64, 4), (64, 4, 64, 4), (32, 4, 128, 8)]
        return [d] + [dataclasses.replace(d, l1_bn=a, l1_warps=b, l2_bn=c, l2_warps=w) for a, b, c, w in r]
    if bm <= 32:
        raw = [(64, 128, 4, 4), (64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 8, 3), (32, 128, 4, 4),
               (64, 128, 4, 2), (128, 128, 4, 3)]
    else:
        raw = [(64, 128, 8, 3), (64, 128, 4, 3), (128, 128, 8, 3), (64, 256, 8, 3), (64, 128, 8, 4)]
    out = [d]
    for bn, bk, w, st in raw:
        out.append(KernelConfig(block_m=bm, l1_bn=bn, l1_bk=bk, l1_warps=w, l1_stages=st,
                                l2_bn=max(bn, 64), l2_bk=bk, l2_warps=w, l2_stages=st, k_order=k_order))
    return out


#: K order of the E2M1/E4M3 bf16 GEMMs when neither the config nor the environment names one
#: (frag: 1.2-1.9x faster than split/natural on the H200, BENCHMARKS.md issue 11)
DEFAULT_K_ORDER = "frag"
K_ORDERS = ("frag", "split")


def resolve_k_order(cfg: "KernelConfig", w_kind: int, H: int, I: int) -> str:
    """K order of the bf16 GEMMs (``KernelConfig.k_order``, env ``MEGAMOE_TRITON_KORDER``,
    ``DEFAULT_K_ORDER``): "frag" (E2M1 and E4M3 weights, H and I multiples of 128), "split"
    (E2M1 only) or "natural" (E4M3 without frag, bf16 weights)."""
    import os

    if w_kind not in (W_E2M1_MX, W_E2M1_NV, W_E4M3_MX):
        return "natural"
    k = cfg.k_order or os.environ.get("MEGAMOE_TRITON_KORDER") or DEFAULT_K_ORDER
    if k not in K_ORDERS:
        from megamoe_runtime.errors import MegaMoEError

        raise MegaMoEError(f"triton k_order {k!r}; valid: {', '.join(K_ORDERS)}")
    old = "split" if w_kind != W_E4M3_MX else "natural"
    if k == "frag" and (H % 128 or I % 128):
        return old
    return "frag" if k == "frag" else old


#: rows per tile of the weight arrangement the layer derives after a load for this backend
#: (`megamoe_runtime.format.weight_tiles`; 16 and 64 measured the same on the H200, BENCHMARKS.md issue 11
#: fifth pass); env ``MEGAMOE_TRITON_WTILE`` ("0": keep the converted layout)
DEFAULT_W_TILE = 16


def resolve_w_tile(spec: Any, device: Any, cfg: Optional["KernelConfig"] = None) -> int:
    """Rows per tile for a layer of ``spec`` on ``device`` (0: the converted layout): CUDA, a row with
    E2M1 or E4M3 weights, and the frag bf16 GEMMs (not the fp8 path, not the split order) per the
    config and environment at load time."""
    import os

    from . import mma8

    dev = torch.device(device) if device is not None else torch.device("cpu")
    w_kind = _W_KIND.get(spec.row)
    if dev.type != "cuda" or w_kind not in (W_E2M1_MX, W_E2M1_NV, W_E4M3_MX):
        return 0
    cfg = cfg or KernelConfig()
    if mma8.selected(spec.row, True, cfg.mma) or \
            resolve_k_order(cfg, w_kind, spec.hidden, spec.intermediate) != "frag":
        return 0
    v = os.environ.get("MEGAMOE_TRITON_WTILE")
    try:
        wt = DEFAULT_W_TILE if v is None or v == "" else int(v)
    except ValueError:
        from megamoe_runtime.errors import MegaMoEError

        raise MegaMoEError(f"MEGAMOE_TRITON_WTILE={v!r}; expected rows per tile (16, 32, 64, ...) or 0") from None
    if wt < 0 or (wt and ((2 * spec.intermediate) % wt or spec.hidden % wt)):
        from megamoe_runtime.errors import MegaMoEError

        raise MegaMoEError(f"MEGAMOE_TRITON_WTILE={wt}: must be 0 or divide both 2*intermediate "
                           f"({2 * spec.intermediate}) and hidden ({spec.hidden})")
    return wt


#: frag-path decode and scale loads when neither the config nor the environment names one
DECODES = ("fold", "plain")
DEFAULT_SCALE_LOAD = "bytes"  # "words" routed the E2M1 operand through shared memory with triton 3.6
SCALE_LOADS = ("words", "bytes")


def _pick(value: Optional[str], env: str, default: str, valid: tuple, what: str) -> str:
    import os

    v = value or os.environ.get(env) or default
    if v not in valid:
        from megamoe_runtime.errors import MegaMoEError

        raise MegaMoEError(f"triton {what} {v!r}; valid: {', '.join(valid)}")
    return v


def resolve_decode(cfg: "KernelConfig", w_kind: Optional[int] = None) -> tuple[bool, bool]:
    """(fold, scale words) of the frag paths from ``KernelConfig.decode`` / ``scale_load``, the
    env ``MEGAMOE_TRITON_DECODE`` / ``MEGAMOE_TRITON_SCALES``, else a row default for configs
    built by hand (``default_config`` fills ``decode`` per regime from ``FRAG_TILES``): fold
    for the NVFP4 and E4M3 rows, plain for mxfp4; scale bytes (``DEFAULT_SCALE_LOAD``)."""
    import os

    dflt = "fold" if w_kind in (W_E2M1_NV, W_E4M3_MX) else "plain"
    d = cfg.decode or os.environ.get("MEGAMOE_TRITON_DECODE") or dflt
    if d not in DECODES:
        from megamoe_runtime.errors import MegaMoEError

        raise MegaMoEError(f"triton decode {d!r}; valid: {', '.join(DECODES)}")
    return (d == "fold",
            _pick(cfg.scale_load, "MEGAMOE_TRITON_SCALES", DEFAULT_SCALE_LOAD, SCALE_LOADS, "scale_load") == "words")


def resolve_l2_fold(cfg: "KernelConfig", w_kind: Optional[int] = None) -> bool:
    """Whether the L2 kernel runs the fold decode: ``KernelConfig.l2_decode`` if set, else the
    L1's (``resolve_decode``)."""
    if cfg.l2_decode is None:
        return resolve_decode(cfg, w_kind)[0]
    if cfg.l2_decode not in DECODES:
        from megamoe_runtime.errors import MegaMoEError

        raise MegaMoEError(f"triton l2_decode {cfg.l2_decode!r}; valid: {', '.join(DECODES)}")
    return cfg.l2_decode == "fold"


_W_KIND = {"mxfp4": W_E2M1_MX, "mxfp8": W_E4M3_MX, "nvfp4": W_E2M1_NV, "bf16": W_BF16}


def _opts(maxnreg: Optional[int] = None) -> dict:
    """Compile options: no fp contraction on the GPU; a register cap where a config sets one."""
    if not hw_cvt_default():
        return {}
    return {"enable_fp_fusion": False} | ({"maxnreg": int(maxnreg)} if maxnreg else {})


def _scale_bytes(sf: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """uint8 view of the contiguous physical base ``[.., P, N]`` of an MN-major kernel view."""
    if sf is None:
        return torch.empty(4, dtype=torch.uint8, device=device)
    phys = sf.transpose(-1, -2)
    if not phys.is_contiguous():
        from megamoe_runtime.errors import LayoutError

        raise LayoutError(f"scale view {tuple(sf.shape)} strides {sf.stride()} is not MN-major over a "
                          f"contiguous physical base; the triton backend reads the kernel layout only")
    return phys.view(torch.uint8)


def _act_params(spec) -> tuple:
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


def _sword(sword: bool, frag: bool, w_kind: int) -> bool:
    """Scale words for the E2M1 frag kernels only: with E4M3 weights the word tensor's layout made
    Triton route the decoded operand through shared memory (PRMT/STS in the SASS, +30%
    instructions per step), so the mxfp8 row keeps its byte loads."""
    return bool(sword and frag and w_kind in (W_E2M1_MX, W_E2M1_NV))


def _launch_l1(cfg, x, xts, w, ws, alpha, plan, tw, act, T, H, I, K, spec_act, rsf, a2,
               w_kind, nv_in, req, apply_w, shared, split_out, bm, hw, asm, frag=False, fold=False, sword=False,
               wt=0, fflags=None):
    act_kind, has_clamp, c, a_alpha, a_beta, sb, slb = spec_act
    swe, swn = _weight_strides(w)
    bn = min(cfg.l1_bn, I)
    grid = (I // bn, triton.cdiv(T, bm) if shared else plan.max_blocks)
    dummy_i32 = act.new_empty(1, dtype=torch.int32) if shared else None
    _l1_kernel[grid](
        x, xts, _bytes_if_fp8(w), _scale_bytes(ws, w.device), alpha, x if fflags is None else fflags,
        dummy_i32 if shared else plan.sorted_pairs, dummy_i32 if shared else plan.block_expert,
        dummy_i32 if shared else plan.num_blocks, tw, act,
        T, H, I, K, swe, swn, _scale_stride(ws),
        rsf, c, a_alpha, a_beta, sb, slb, a2,
        W_KIND=w_kind, NV_IN=nv_in, ACT=act_kind, HAS_CLAMP=has_clamp, REQ=req, APPLY_W=apply_w,
        SHARED=shared, SPLIT_OUT=(2 if frag else 1) if split_out else (3 if frag else 0), BM=bm, BN=bn,
        BK=128 if frag or H % cfg.l1_bk else cfg.l1_bk,
        HW_CVT=hw, ASM=asm, FRAG=frag, FOLD=bool(fold and frag and asm), SWORD=_sword(sword, frag, w_kind),
        GU=bool(frag and resolve_l1_gu(cfg) and not shared), WT=wt, FFLAGS=fflags is not None,
        num_warps=cfg.l1_warps, num_stages=cfg.l1_stages,
        **_opts(cfg.l1_maxnreg))


def _launch_l2(cfg, act, w, ws, plan, tw, l2s, slots, T, H, I, K, nslot, a2, w_kind, nv_epi, shared, bm, hw, asm,
               frag=False, fold=False, sword=False, wt=0, fflags=None):
    swe, swn = _weight_strides(w)
    bn = min(cfg.l2_bn, H)
    grid = (H // bn, triton.cdiv(T, bm) if shared else plan.max_blocks)
    dummy_i32 = act.new_empty(1, dtype=torch.int32) if shared else None
    _l2_kernel[grid](
        act, _bytes_if_fp8(w), _scale_bytes(ws, w.device), act if fflags is None else fflags,
        dummy_i32 if shared else plan.sorted_pairs, dummy_i32 if shared else plan.block_expert,
        dummy_i32 if shared else plan.num_blocks, tw, l2s, slots,
        T, H, I, K, nslot, swe, swn, _scale_stride(ws), a2,
        W_KIND=w_kind, NV_EPI=nv_epi, SHARED=shared, BM=bm, BN=bn,
        BK=128 if frag or I % cfg.l2_bk else cfg.l2_bk, HW_CVT=hw, ASM=asm, FRAG=frag,
        FOLD=bool(fold and frag and asm), SWORD=_sword(sword, frag, w_kind),
        WT=wt, FFLAGS=fflags is not None, num_warps=cfg.l2_warps,
        num_stages=cfg.l2_stages, **_opts(cfg.l2_maxnreg))


# --------------------------------------------------------------------------- E2M1 decode self-check

_ASM_OK: dict = {}


@triton.jit
def _decode_check_kernel(b_ptr, s_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    b = tl.load(b_ptr + i)
    sc = tl.load(s_ptr + i // 4)
    lo, hi = _jit.e2m1_pair_bf16(b, sc, True)
    lo2, hi2 = _jit.e2m1_pair_bf16(b, sc, False)
    tl.store(out_ptr + i, lo)
    tl.store(out_ptr + N + i, hi)
    tl.store(out_ptr + 2 * N + i, lo2)
    tl.store(out_ptr + 3 * N + i, hi2)


@triton.jit
def _frag_decode_check_kernel(w_ptr, s_ptr, out_ptr, NW: tl.constexpr, FOLD: tl.constexpr = False):
    i = tl.arange(0, NW)
    sb = tl.load(s_ptr + i).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    outs = _jit.e2m1_frag_words(tl.load(w_ptr + i), sb | (sb << 16), FOLD)
    for k in tl.static_range(8):
        tl.store(out_ptr + i * 8 + k, outs[k])


@triton.jit
def _frag8_decode_check_kernel(w_ptr, s_ptr, out_ptr, NW: tl.constexpr, FOLD: tl.constexpr = False):
    i = tl.arange(0, NW)
    sb = tl.load(s_ptr + i).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    outs = _jit.e4m3_frag_words(tl.load(w_ptr + i), sb | (sb << 16), FOLD)
    for k in tl.static_range(4):
        tl.store(out_ptr + i * 4 + k, outs[k])


def frag_decode_expected(b_all: torch.Tensor, s_rep: torch.Tensor) -> torch.Tensor:
    """int16 bits of what ``_jit.e2m1_frag_words`` must return for bytes ``b_all`` (whole
    little-endian words) and one bf16 scale per word: per word, nibbles (0, 4, 1, 5, 2, 6, 3, 7)
    decoded by ``codecs`` times the scale."""
    from megamoe_runtime.format import codecs

    vals = codecs.e2m1_decode(codecs.unpack_e2m1(b_all)).reshape(-1, 8) * s_rep.float()[:, None]
    order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7], device=vals.device)
    return vals[:, order].reshape(-1).to(torch.bfloat16).view(torch.int16)


def asm_decode_check(device: torch.device, mx_bytes=None, nv_bytes=None) -> dict:
    """Compare the PRMT E2M1 decode and the arithmetic decode with codecs over all 256
    bytes and the given scales; returns mismatch counts (diagnostics for asm_decode_ok)."""
    from megamoe_runtime.format import codecs

    if mx_bytes is None:
        mx_bytes = list(range(100, 141, 3)) + [0, 127]
    if nv_bytes is None:
        nv_bytes = list(range(0x08, 0x7F, 9)) + [0x38, 0x7E]
    byts = torch.arange(256, dtype=torch.uint8, device=device)
    res = {}
    for name, sc in (("ue8m0", (torch.tensor(mx_bytes, dtype=torch.int32, device=device) << 23).view(
            torch.float32).to(torch.bfloat16)),
                     ("e4m3", torch.tensor(nv_bytes, dtype=torch.uint8, device=device).view(
                         torch.float8_e4m3fn).to(torch.bfloat16))):
        n = sc.numel()
        b_all = byts.repeat(n)
        s_rep = sc.repeat_interleave(64)  # one scale per 4 bytes, 256 bytes per scale
        out = torch.empty(4, b_all.numel(), dtype=torch.bfloat16, device=device)
        _decode_check_kernel[(1,)](b_all, s_rep, out, N=b_all.numel(), **_opts())
        want = codecs.e2m1_decode(codecs.unpack_e2m1(b_all)).reshape(-1, 2) * s_rep.float().repeat_interleave(4)[:, None]
        wl, wh = want[:, 0].to(torch.bfloat16).view(torch.int16), want[:, 1].to(torch.bfloat16).view(torch.int16)
        o = out.view(torch.int16)
        res[name] = {"asm_lo": int((o[0] != wl).sum()), "asm_hi": int((o[1] != wh).sum()),
                     "arith_lo": int((o[2] != wl).sum()), "arith_hi": int((o[3] != wh).sum())}
        fr = torch.empty(2 * b_all.numel(), dtype=torch.bfloat16, device=device)
        _frag_decode_check_kernel[(1,)](b_all.view(torch.int32), s_rep, fr, NW=b_all.numel() // 4, **_opts())
        fw = frag_decode_expected(b_all, s_rep)
        res[name]["frag"] = int((fr.view(torch.int16) != fw).sum())
        if name == "ue8m0":  # E4M3 weights (no NaN bytes) in the E4M3 frag order: bytes (0, 2, 1, 3)
            e8 = b_all.clone()
            e8[(e8 & 0x7F) == 0x7F] = 0
            f8 = torch.empty(b_all.numel(), dtype=torch.bfloat16, device=device)
            _frag8_decode_check_kernel[(1,)](e8.view(torch.int32), s_rep, f8, NW=b_all.numel() // 4, **_opts())
            v8 = (e8.view(torch.float8_e4m3fn).float().reshape(-1, 4) * s_rep.float()[:, None])
            w8 = v8[:, torch.tensor([0, 2, 1, 3], device=device)].reshape(-1).to(torch.bfloat16).view(torch.int16)
            res[name]["frag8"] = int((f8.view(torch.int16) != w8).sum())
        res[name].update(_fold_decode_check(name, byts, device))
        bad = ((o[0] != wl) | (o[1] != wh)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            res[name]["first"] = (int(b_all[i]), float(s_rep[i // 4]), int(o[0, i]), int(wl[i]), int(o[1, i]),
                                  int(wh[i]))
    return res


def _fold_decode_check(name: str, byts: torch.Tensor, device: torch.device) -> dict:
    """Mismatches of the FOLD decodes (bias folded into the scale operand) against codecs over
    all 256 bytes: E2M1 x UE8M0 bytes 0..128 (operand 2^(s-1)), E4M3 weights x UE8M0 bytes
    0..134 (operand 2^(s-7)), E2M1 x E4M3 block scales (operand scale * 2^118, result value *
    scale * 2^-8: the kernels restore the 2^8 on the fp32 accumulator). 16 scales per launch."""
    def chunks(t):
        t = torch.cat([t, t[-1:].expand((-t.numel()) % 16)])
        return t.split(16)

    if name == "ue8m0":
        e = torch.arange(0, 129, dtype=torch.int32, device=device)
        sc = (e << 23).view(torch.float32).to(torch.bfloat16)  # the plain decode's scale (byte 0 -> 0)
        opnd = torch.where(e == 0, 0, (e + 126) << 7).to(torch.int16).view(torch.bfloat16)
    else:
        sc = torch.arange(0, 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn).to(torch.bfloat16)
        opnd = (sc.float() * 2.0 ** 118).to(torch.bfloat16)
        sc = (sc.float() * 2.0 ** -8).to(torch.bfloat16)  # exact
    out = {"frag_fold": 0}
    for s16, o16 in zip(chunks(sc), chunks(opnd)):
        b_all = byts.repeat(16)
        s_rep, o_rep = s16.repeat_interleave(64), o16.repeat_interleave(64)
        fr = torch.empty(2 * b_all.numel(), dtype=torch.bfloat16, device=device)
        _frag_decode_check_kernel[(1,)](b_all.view(torch.int32), o_rep, fr, NW=b_all.numel() // 4, FOLD=True,
                                        **_opts())
        out["frag_fold"] += int((fr.view(torch.int16) != frag_decode_expected(b_all, s_rep)).sum())
    if name == "ue8m0":
        out["frag8_fold"] = 0
        e8 = torch.arange(0, 135, dtype=torch.int32, device=device)
        sc8 = (e8 << 23).view(torch.float32).to(torch.bfloat16)
        op8 = torch.where(e8 == 0, 0, (e8 + 120) << 7).to(torch.int16).view(torch.bfloat16)
        b8 = byts.clone()
        b8[(b8 & 0x7F) == 0x7F] = 0  # no NaN weights
        b8 = b8.repeat(16)
        for s16, o16 in zip(chunks(sc8), chunks(op8)):
            s_rep, o_rep = s16.repeat_interleave(64), o16.repeat_interleave(64)
            f8 = torch.empty(b8.numel(), dtype=torch.bfloat16, device=device)
            _frag8_decode_check_kernel[(1,)](b8.view(torch.int32), o_rep, f8, NW=b8.numel() // 4, FOLD=True,
                                             **_opts())
            v8 = b8.view(torch.float8_e4m3fn).float().reshape(-1, 4) * s_rep.float()[:, None]
            w8 = v8[:, torch.tensor([0, 2, 1, 3], device=device)].reshape(-1).to(torch.bfloat16).view(torch.int16)
            out["frag8_fold"] += int((f8.view(torch.int16) != w8).sum())
    return out


def asm_decode_ok(device: torch.device) -> bool:
    """Check once per device that the PRMT-LUT E2M1 decode equals codecs bit for bit over
    all 256 bytes and scales in the weights' range (UE8M0 bytes 100..140 and 0, normal
    E4M3 block scales); else fall back to the arithmetic decode."""
    key = str(device)
    if key in _ASM_OK:
        return _ASM_OK[key]
    if not hw_cvt_default():
        _ASM_OK[key] = False
        return False
    import warnings

    try:
        res = asm_decode_check(device)
        ok = all(v["asm_lo"] == 0 and v["asm_hi"] == 0 and v["frag"] == 0 and v.get("frag8", 0) == 0
                 and v.get("frag_fold", 0) == 0 and v.get("frag8_fold", 0) == 0 for v in res.values())
    except Exception as exc:  # pragma: no cover - depends on the GPU / PTX support
        res, ok = repr(exc), False
    if not ok:
        warnings.warn(f"triton backend: the PRMT E2M1 decode disagreed with codecs ({res}); "
                      f"using the arithmetic decode")
    _ASM_OK[key] = bool(ok)
    return _ASM_OK[key]


def moe_forward(spec, kt: Any, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, scalars: Any = None, shared: Any = None,
                config: Optional[KernelConfig] = None, return_slots: bool = False,
                shared_input: Optional[torch.Tensor] = None, asm: Optional[bool] = None, w_tile: int = 0,
                fold_flags: Optional[torch.Tensor] = None):
    """bf16 ``[T, H]`` MoE output of one layer on this EP rank (the reference's numerics).

    ``kt``: routed kernel tensors (``l1_weight``, ``l1_scale``, ``l2_weight``,
    ``l2_scale``; scales as MN-major kernel views). ``scalars`` (nvfp4):
    ``l1_alpha [E_l, 2]``, ``l2_global_scale [E_l]``, ``l2_activation_scale``.
    ``shared``: 2-D shared kernel tensors, fused as slot K and computed on
    ``shared_input`` (default: the hidden states). Top-k ids are GLOBAL (-1
    masked); only this rank's experts contribute. ``asm``: force the E2M1
    decode path (default: the PRMT path if its self-check passed). ``w_tile``: the arrangement of the
    routed weights (`megamoe_runtime.format.weight_tiles`; 0 = the converted layout), which only the frag
    K order's bf16 GEMMs read. ``fold_flags``: int32 ``[2, E_l]`` from `fold_flags` on these
    weights (the layer keeps them per load); None: each fold tile scans its own scale words.
    """
    hw = hw_cvt_default()
    row = spec.row
    H, I, K = spec.hidden, spec.intermediate, spec.top_k
    E_l = spec.experts_per_rank
    dev = hidden_states.device
    T = hidden_states.shape[0]
    _check(spec, kt, hidden_states, topk_weights, topk_ids, scalars, shared)
    if fold_flags is not None and (fold_flags.dtype != torch.int32 or tuple(fold_flags.shape) != (2, E_l)
                                   or fold_flags.device != dev or fold_flags.stride(1) != 1):
        from megamoe_runtime.errors import MegaMoEError

        raise MegaMoEError(f"fold_flags must be int32 [2, {E_l}] with contiguous rows on {dev} "
                           f"(moe.fold_flags), got {fold_flags.dtype} {tuple(fold_flags.shape)} on "
                           f"{fold_flags.device}, strides {fold_flags.stride()}")
    if asm is None:  # the inline-asm decodes (E2M1 always, E4M3 in the frag order) after their self-check
        asm = asm_decode_ok(dev) if spec.row_spec.packed_e2m1 or spec.row == "mxfp8" else False
    has_shared = shared is not None
    nslot = K + (1 if has_shared else 0)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    if T == 0:
        return (out, torch.empty(0, nslot, H, dtype=torch.bfloat16, device=dev)) if return_slots else out
    x_bf16 = hidden_states if hidden_states.stride(1) == 1 else hidden_states.contiguous()
    x_sh = x_bf16
    if has_shared and shared_input is not None and shared_input is not hidden_states:
        if tuple(shared_input.shape) != (T, H) or shared_input.dtype != torch.bfloat16:
            from megamoe_runtime.errors import MegaMoEError

            raise MegaMoEError(f"shared_input must be bf16 [{T}, {H}] like hidden_states, got "
                               f"{shared_input.dtype} {tuple(shared_input.shape)}")
        x_sh = shared_input if shared_input.stride(1) == 1 else shared_input.contiguous()
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    tw = topk_weights.to(torch.float32).contiguous()
    act_spec = _act_params(spec)
    rsf = float(spec.routed_scaling_factor)
    w_kind = _W_KIND[row]
    e2m1 = w_kind in (W_E2M1_MX, W_E2M1_NV)
    dummy_f = torch.empty(1, dtype=torch.float32, device=dev)

    cfg = config or default_config(T * K, E_l, resolve_k_order(KernelConfig(), _W_KIND[row], H, I),
                                   w_kind=_W_KIND[row], H=H, I=I)
    from . import mma8

    if w_tile and (mma8.selected(row, hw, cfg.mma) or resolve_k_order(cfg, _W_KIND[row], H, I) != "frag"):
        from megamoe_runtime.errors import MegaMoEError

        raise MegaMoEError(f"the routed weights are tiled by {w_tile} rows (layer.weight_tiles), which only the "
                           f"frag K order's bf16 GEMMs read; this config asks for mma={cfg.mma!r}, k_order="
                           f"{cfg.k_order!r} (env MEGAMOE_TRITON_MMA / MEGAMOE_TRITON_KORDER). Build and load the "
                           f"layer with MEGAMOE_TRITON_WTILE=0 to run other paths")
    if mma8.selected(row, hw, cfg.mma):
        return _forward_fp8(spec, kt, cfg, x_bf16, x_sh, tw, ids, shared, out, nslot, return_slots, act_spec, rsf,
                            w_kind, asm)
    # ---- staging: quantize the dispatch, and keep its exact bf16 dequantization for the GEMMs
    xts = dummy_f
    alpha, l2s, a2 = dummy_f, dummy_f, dummy_f
    korder = resolve_k_order(cfg, w_kind, H, I)
    frag = korder == "frag"
    fold, sword = resolve_decode(cfg, w_kind) if frag else (False, False)
    fold2 = resolve_l2_fold(cfg, w_kind) if frag else False
    if spec.row_spec.dispatch == "mxfp8":
        xq = quantize_mxfp8(x_bf16, hw_cvt=hw, dequant=korder if e2m1 or not frag else "frag8")[3]
        req, apply_w = REQ_MX8, True
    elif spec.row_spec.dispatch == "nvfp4":
        _, _, _, xts, xq = quantize_nvfp4_per_token(x_bf16, hw_cvt=hw, dequant=korder)
        alpha = scalars.l1_alpha.to(device=dev, dtype=torch.float32).contiguous()
        l2s = scalars.l2_global_scale.to(device=dev, dtype=torch.float32).contiguous()
        # a2 stays on the device (read in-kernel): no host sync, graph-capturable, reload-safe
        a2 = torch.as_tensor(scalars.l2_activation_scale).to(device=dev, dtype=torch.float32).reshape(1)
        req, apply_w = REQ_NV4, False
    else:
        xq = x_bf16
        req, apply_w = REQ_BF16, True

    slots = torch.empty(T, nslot, H, dtype=torch.bfloat16, device=dev)
    # ---- routed experts
    bm = cfg.pick_block_m(T * K, E_l)
    plan = route(ids, E_l, spec.ep_rank * E_l, bm)
    launches = [(cfg, plan, bm, fold, fold2)]
    tcfg = (cfg.tail or tail_config(w_kind, bm)) if frag and cfg.tail_max else None
    if tcfg is not None and tcfg.block_m and tcfg.block_m < bm and cfg.tail_max < bm:
        # an expert's short last block goes to a launch of small blocks (docs/KERNELS.md "Tail blocks")
        launches.append((tcfg, split_tails(plan, E_l, tcfg.block_m, cfg.tail_max), tcfg.block_m,
                         resolve_decode(tcfg, w_kind)[0], resolve_l2_fold(tcfg, w_kind)))
    for lcfg, lplan, lbm, lfold, lfold2 in launches:
        act = torch.empty(lplan.max_blocks * lbm, I, dtype=torch.bfloat16, device=dev)
        _launch_l1(lcfg, xq, xts, kt.l1_weight, kt.l1_scale, alpha, lplan, tw, act, T, H, I, K, act_spec,
                   rsf, a2, w_kind, spec.row_spec.has_alphas, req, apply_w, False, e2m1, lbm, hw, asm, frag,
                   fold=lfold, sword=sword, wt=w_tile, fflags=None if fold_flags is None else fold_flags[0])
        _launch_l2(lcfg, act, kt.l2_weight, kt.l2_scale, lplan, tw, l2s, slots, T, H, I, K, nslot, a2, w_kind,
                   spec.row_spec.has_alphas, False, lbm, hw, asm, frag, fold=lfold2, sword=sword, wt=w_tile,
                   fflags=None if fold_flags is None else fold_flags[1])
    # ---- fused shared expert (slot K, weight 1.0, every token)
    if has_shared:
        I_s = spec.shared.folded_intermediate
        scfg = config or default_config(T, 1)  # every token is routed to the shared expert
        sbm = scfg.block_m or 16
        act_s = torch.empty(T, I_s, dtype=torch.bfloat16, device=dev)
        if spec.shared.precision == "mxfp8":
            if spec.row_spec.dispatch == "mxfp8" and x_sh is x_bf16 and korder == "natural":
                sx = xq
            else:
                sx = quantize_mxfp8(x_sh, hw_cvt=hw, dequant="natural")[3]
            s_kind, s_req = W_E4M3_MX, REQ_MX8
        else:
            sx = x_sh
            s_kind, s_req = W_BF16, REQ_BF16
        s_l1s = shared.l1_scale if s_kind != W_BF16 else None
        s_l2s = shared.l2_scale if s_kind != W_BF16 else None
        _launch_l1(scfg, sx, dummy_f, shared.l1_weight, s_l1s, dummy_f, None, tw, act_s, T, H, I_s, K, act_spec,
                   1.0, dummy_f, s_kind, False, s_req, False, True, False, sbm, hw, False)
        _launch_l2(scfg, act_s, shared.l2_weight, s_l2s, None, tw, dummy_f, slots, T, H, I_s, K, nslot, dummy_f,
                   s_kind, False, True, sbm, hw, False)
    _combine(spec, cfg, slots, ids, out, has_shared, rsf, hw)
    return (out, slots) if return_slots else out


#: largest UE8M0 byte the fold decode takes exactly, by weight kind (``_fold_scale_bits``)
_FOLD_UE8M0_LIMIT = {W_E2M1_MX: 128, W_E4M3_MX: 134}
#: the E4M3 scale bytes the NVFP4 fold operand takes exactly (``_nv_fold_scale_bits``): normal, positive, finite
_FOLD_NV_BYTES = (0x08, 0x7E)


def fold_flags(spec: Any, kt: Any, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per expert, whether the fold decode takes every scale byte of its L1 / L2 weights: int32
    ``[2, E_l]`` of ``FOLD_OK`` / ``FOLD_REDO``, computed on the device without a host sync (written
    into ``out`` in place when given, so a captured CUDA graph reads the new flags after a reload).

    The same test ``_fold_bad`` makes per tile after every main loop (UE8M0 bytes above the
    kind's limit; NVFP4 bytes outside 0x08..0x7E), made once per load over the scale words the
    kernels read: the scales are weights, so they change only when a load writes them. Rows
    without a fold decode (bf16) get ``FOLD_OK``: their kernels never read the flags."""
    E_l = spec.experts_per_rank
    w_kind = _W_KIND[spec.row]
    dev = kt.l1_weight.device
    if out is not None and (tuple(out.shape) != (2, E_l) or out.dtype != torch.int32):
        from megamoe_runtime.errors import MegaMoEError

        raise MegaMoEError(f"fold flags must be int32 [2, {E_l}], got {out.dtype} {tuple(out.shape)}")
    flags = torch.empty((2, E_l), dtype=torch.int32, device=dev) if out is None else out  # each row written below
    H, I = spec.hidden, spec.intermediate
    with torch.no_grad():
        for i, (sf, nrows, k) in enumerate(((kt.l1_scale, 2 * I, H), (kt.l2_scale, H, I))):
            if sf is None or w_kind not in (W_E2M1_MX, W_E4M3_MX, W_E2M1_NV):
                flags[i].fill_(FOLD_OK)
                continue
            words = k // 64 if w_kind == W_E2M1_NV else k // 128  # the packed words per row the kernels read
            b = _scale_bytes(sf, dev).reshape(E_l, -1, sf.shape[-2] * 4)[:, :words, :nrows * 4]
            if w_kind == W_E2M1_NV:
                lo, hi = _FOLD_NV_BYTES
                bad = (torch.amin(b, dim=(1, 2)) < lo) | (torch.amax(b, dim=(1, 2)) > hi)
            else:
                bad = torch.amax(b, dim=(1, 2)) > _FOLD_UE8M0_LIMIT[w_kind]
            flags[i].copy_(bad.to(torch.int32))  # FOLD_REDO where bad
    return flags


def _combine(spec, cfg, slots, ids, out, has_shared, rsf, hw) -> None:
    H, K, E_l = spec.hidden, spec.top_k, spec.experts_per_rank
    row = spec.row_spec
    bh = min(cfg.combine_bh, triton.next_power_of_2(H))
    _combine_kernel[(out.shape[0], triton.cdiv(H, bh))](
        slots, ids, out, H, spec.ep_rank * E_l, E_l, rsf,
        TOPK=K, HAS_SHARED=has_shared, NV=row.rsf_in_combine, APPLY_RSF=(row.rsf_in_combine and rsf != 1.0),
        BH=bh, GPU=hw, num_warps=4, **_opts())


def _forward_fp8(spec, kt, cfg, x_bf16, x_sh, tw, ids, shared, out, nslot, return_slots, act_spec, rsf,
                 w_kind, asm):
    """The MX rows on FP8 tensor cores (``mma8``): E4M3 dispatch bytes + UE8M0 scales in,
    MXFP8 intermediate between L1 and L2, the same slots and combine as the bf16 path."""
    from . import mma8

    H, I, K = spec.hidden, spec.intermediate, spec.top_k
    E_l = spec.experts_per_rank
    T = x_bf16.shape[0]
    dev = x_bf16.device
    has_shared = shared is not None
    fc = cfg.fp8 or mma8.default_fp8_config(T * K, E_l, w_kind)
    q, sf, _ = quantize_mxfp8(x_bf16, hw_cvt=True)
    q = q.view(torch.uint8)
    slots = torch.empty(T, nslot, H, dtype=torch.bfloat16, device=dev)
    bm = cfg.pick_block_m(T * K, E_l)
    plan = route(ids, E_l, spec.ep_rank * E_l, bm)
    act8 = torch.empty(plan.max_blocks * bm, I, dtype=torch.uint8, device=dev)
    asf = torch.empty(plan.max_blocks * bm, I // 32, dtype=torch.uint8, device=dev)
    w1, w2 = _bytes_if_fp8(kt.l1_weight), _bytes_if_fp8(kt.l2_weight)
    mma8.launch_l1(fc, q, sf, w1, _scale_bytes(kt.l1_scale, dev), _scale_stride(kt.l1_scale), plan, tw, act8, asf,
                   T, H, I, K, act_spec, rsf, w_kind, True, False, bm, asm or w_kind == W_E4M3_MX)
    mma8.launch_l2(fc, act8, asf, w2, _scale_bytes(kt.l2_scale, dev), _scale_stride(kt.l2_scale), plan, slots,
                   T, H, I, K, nslot, w_kind, False, bm, asm or w_kind == W_E4M3_MX)
    if has_shared:
        I_s = spec.shared.folded_intermediate
        scfg = default_config(T, 1)
        sbm = (cfg.block_m if cfg is not None and cfg.block_m else None) or scfg.block_m or 16
        if spec.shared.precision == "mxfp8":
            if x_sh is x_bf16:
                sq, ssf = q, sf
            else:
                sq, ssf, _ = quantize_mxfp8(x_sh, hw_cvt=True)
                sq = sq.view(torch.uint8)
            sfc = mma8.default_fp8_config(T, 1, W_E4M3_MX)
            a8 = torch.empty(T, I_s, dtype=torch.uint8, device=dev)
            af = torch.empty(T, I_s // 32, dtype=torch.uint8, device=dev)
            mma8.launch_l1(sfc, sq, ssf, _bytes_if_fp8(shared.l1_weight), _scale_bytes(shared.l1_scale, dev), 0,
                           None, tw, a8, af, T, H, I_s, K, act_spec, 1.0, W_E4M3_MX, False, True, sbm, True)
            mma8.launch_l2(sfc, a8, af, _bytes_if_fp8(shared.l2_weight), _scale_bytes(shared.l2_scale, dev), 0,
                           None, slots, T, H, I_s, K, nslot, W_E4M3_MX, True, sbm, True)
        else:  # bf16 shared expert: the bf16 path's kernels on the bf16 input
            dummy_f = torch.empty(1, dtype=torch.float32, device=dev)
            act_s = torch.empty(T, I_s, dtype=torch.bfloat16, device=dev)
            _launch_l1(scfg, x_sh, dummy_f, shared.l1_weight, None, dummy_f, None, tw, act_s, T, H, I_s, K, act_spec,
                       1.0, dummy_f, W_BF16, False, REQ_BF16, False, True, False, sbm, True, False)
            _launch_l2(scfg, act_s, shared.l2_weight, None, None, tw, dummy_f, slots, T, H, I_s, K, nslot, dummy_f,
                       W_BF16, False, True, sbm, True, False)
    _combine(spec, cfg, slots, ids, out, has_shared, rsf, True)
    return (out, slots) if return_slots else out


def _check(spec, kt, hidden_states, topk_weights, topk_ids, scalars, shared) -> None:
    """Shape / dtype / layout checks that need no host sync."""
    from megamoe_runtime.errors import LayoutError, MegaMoEError, ScaleError
    from megamoe_runtime.format import layout

    H, K = spec.hidden, spec.top_k
    if hidden_states.dim() != 2 or hidden_states.shape[1] != H or hidden_states.dtype != torch.bfloat16:
        raise MegaMoEError(f"hidden_states must be bf16 [T, {H}], got {hidden_states.dtype} "
                           f"{tuple(hidden_states.shape)}")
    T = hidden_states.shape[0]
    for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.dim() != 2 or tuple(t.shape) != (T, K):
            raise MegaMoEError(f"{name} has shape {tuple(t.shape)}; expected [{T}, {K}]")
    if topk_ids.is_floating_point():
        raise MegaMoEError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    from megamoe_runtime.format.layout import KernelTensors

    routed = KernelTensors(kt.l1_weight, kt.l1_scale, kt.l2_weight, kt.l2_scale)
    layout.check_kernel_tensors(spec.row, routed, spec.experts_per_rank, H, spec.intermediate, "triton routed")
    for tname in ("l1_weight", "l2_weight"):
        if not getattr(kt, tname).is_contiguous():
            raise LayoutError(f"triton routed.{tname} must be contiguous (kernel layout)")
    if spec.row_spec.has_alphas and scalars is None:
        raise ScaleError("row nvfp4 needs l1_alpha, l2_global_scale and l2_activation_scale")
    if shared is not None:
        if spec.shared is None:
            raise MegaMoEError("shared kernel tensors given but spec.shared is None")
        sk = KernelTensors(shared.l1_weight, getattr(shared, "l1_scale", None), shared.l2_weight,
                           getattr(shared, "l2_scale", None))
        layout.check_kernel_tensors(spec.shared.precision, sk, None, H, spec.shared.folded_intermediate,
                                    "triton shared")
