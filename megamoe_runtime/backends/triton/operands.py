"""Device helpers the L1 and L2 kernels share: row blocks, operand tiles and the fold flags.

The rows of a program (`block_expert`, `block_rows`, `act_rows`, `slot_rows`: a routing plan's row
blocks, or every token once for the shared expert), the K blocks of a loop trip (`trip_block`), the
activation tiles (`x_tiles`), the weight tiles decoded to bf16 in the split / natural order (`_w_tiles`) and in the frag order (`_w_frag`,
`_w_frag8`, plain or fold decode), the UTCCP row map of the scales (`utccp`), one K block's MMA
(`mm_block`), the per-tile fold checks (`_fold_bad`, `fold_flag`, `fold_redo`; flag values
`FOLD_OK` / `FOLD_REDO` / `FOLD_SCAN`), and the K loop of a one-dot tile with its fold redo (`k_loop`: the
one-dot L1's and the L2's).
Imports `_jit` and `decode_asm` only.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import _jit, decode_asm


# --------------------------------------------------------------------------- device helpers


@triton.jit
def block_expert(blk_ptr, nblk_ptr, pid_m, SHARED: tl.constexpr):
    """(local expert, past) of row block ``pid_m``; the kernel returns at once where ``past`` holds.

    Routed launches (a routing plan's blocks): the block count and the expert id go out together
    (``blk`` holds ``max_blocks`` entries, the grid's size) instead of one round trip after the other;
    ``e < 0`` never holds for a routed block, it keeps the compiler from sinking the expert's load below
    the exit. SHARED (every token once, the shared expert): expert 0, never past."""
    if SHARED:
        return pid_m * 0, pid_m < 0
    else:
        nb = tl.load(nblk_ptr)
        e = tl.load(blk_ptr + pid_m)
        return e, (pid_m >= nb) | (e < 0)


@triton.jit
def block_rows(pair_ptr, pid_m, T, TOPK, SHARED: tl.constexpr, BM: tl.constexpr):
    """(pairs ``t * TOPK + k``, valid, tokens) of row block ``pid_m``: a routed block's padding (-1)
    masked and clamped to pair 0. SHARED: tokens ``pid_m * BM ..`` (their own pairs), those past ``T``
    masked and clamped to token 0."""
    if SHARED:
        tok = pid_m * BM + tl.arange(0, BM)
        mvalid = tok < T
        tok = tl.where(mvalid, tok, 0)
        return tok, mvalid, tok
    else:
        pair = tl.load(pair_ptr + pid_m * BM + tl.arange(0, BM))
        mvalid = pair >= 0
        pair = tl.where(mvalid, pair, 0)
        return pair, mvalid, pair // TOPK


@triton.jit
def act_rows(pid_m, tok, SHARED: tl.constexpr, BM: tl.constexpr):
    """int64 rows of the intermediate that row block ``pid_m`` writes (L1) and reads (L2): a routed
    block's own ``BM`` rows of the plan; SHARED: its tokens."""
    if SHARED:
        return tok.to(tl.int64)
    else:
        return (pid_m * BM + tl.arange(0, BM)).to(tl.int64)


@triton.jit
def slot_rows(pid_m, pair, tok, TOPK, NSLOT, SHARED: tl.constexpr, BM: tl.constexpr):
    """(intermediate rows, slots) of an L2 row block: the rows ``act_rows`` gives and the int64 slot
    ``token * NSLOT + k`` each row writes, k of its pair (SHARED: slot ``TOPK``)."""
    if SHARED:
        return act_rows(pid_m, tok, SHARED, BM), tok.to(tl.int64) * NSLOT + TOPK
    else:
        return act_rows(pid_m, tok, SHARED, BM), tok.to(tl.int64) * NSLOT + pair % TOPK


@triton.jit
def utccp(r):
    return (r // 128) * 128 + (r % 32) * 4 + (r // 32) % 4


@triton.jit
def x_tiles(x_ptr, xrow, mvalid, k0, HALF, SPLIT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
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
def mx_scales(wsb_ptr, srows, NROWS, k0, k_last, SAHEAD: tl.constexpr):
    """The UE8M0 bytes ``[BN, 4]`` of K-block ``min(k0, k_last)`` for an E4M3 frag kernel that loads its scales
    one K step ahead (SAHEAD; else 0, unused). Why: a tile of 64 kernel rows has 2 scale bytes per thread,
    under cp.async's 4-byte minimum, so Triton leaves that load out of its software pipeline and every K step
    waits one DRAM latency for it (Nsight: 32% of the decode-size mxfp8 L1's stall samples,
    docs/KERNELS.md "Scale bytes one K step ahead"). Loaded here, one step before its use, the latency
    hides behind the step in between. ``k_last``: the loop's last block (the step after it reloads that
    block instead of reading past the expert's scales)."""
    if SAHEAD:
        return _scale_bytes_mx(wsb_ptr, srows, srows, NROWS, tl.minimum(k0, k_last), False)
    else:
        return 0


@triton.jit
def trip_block(kk, u: tl.constexpr, BK: tl.constexpr):
    """K offset of block ``u`` of a K-loop trip that starts at ``kk`` (``KernelConfig.k_unroll``: KU blocks
    per trip, the same blocks in the same order as one per trip)."""
    return kk + u * BK


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
NV_REDO_SCALE = tl.constexpr(0.00390625)
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
    if ASM or WT > 0:  # int32 words of 8 nibbles: the asm decode's operand, and the unit of the tiled bit order
        iw = tl.arange(0, 4)
        w32 = w_ptr.to(tl.pointer_type(tl.int32))
        wd = tl.load(w32 + _w_run(rows, k0, stride_wn // 4, 16, WT)[:, None, None] + q[None, :, None] * 4
                     + iw[None, None, :])
    if ASM:  # one int32 word = 8 nibbles per element, so the asm is elementwise whatever the layout
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
        n0, n4, n1, n5, n2, n6, n3, n7 = _jit.e2m1_frag_words(wd, s2, FOLD, WT > 0)
        # nibble j + 4h of word w -> k = 16(2w + j//2) + 8(j%2) + 2q + h, j = 2o + j'
        b0 = tl.join(tl.join(n0, n4), tl.join(n1, n5))  # (n, q, w, h, j') for o = 0
        b1 = tl.join(tl.join(n2, n6), tl.join(n3, n7))  # o = 1
        v = tl.join(b0, b1)  # (n, q, w, h, j', o)
        v = tl.permute(v, (0, 2, 5, 4, 1, 3))  # (n, w, o, j', q, h)
    else:  # arithmetic decode of the bytes: natural nibble i = 2 * byte + (high nibble) = 4h + 2o + j'
        i = tl.arange(0, 16)
        if WT == 0:
            off = _w_run(rows, k0, stride_wn, 64, WT)[:, None, None] + q[None, :, None] * 16 + i[None, None, :]
            b = tl.load(w_ptr + off)
        else:  # tiled weights: the words (loaded above) in the tiled bit order, back to the natural one, then bytes
            wd = _jit.e2m1_bits_moved(wd, False)
            b = ((wd[:, :, :, None] >> (8 * iw)[None, None, None, :]) & 0xFF).reshape(BN, 4, 16)
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
             ASM: tl.constexpr, FOLD: tl.constexpr = False, SWORD: tl.constexpr = False, WT: tl.constexpr = 0,
             s_ahead=0, SAHEAD: tl.constexpr = False):
    """E4M3 weight tile ``[BN, 128]`` of K-block k0, decoded to bf16 in the E4M3 frag K order
    (``_jit.frag8_pos``): per row and thread, 32 contiguous bytes with one UE8M0 scale. FOLD (asm
    only): the 2^120 bias rides on the scale operand, exact for UE8M0 bytes <= 134, which the
    caller checks (``_fold_bad``). SAHEAD: ``s_ahead`` holds the block's scale bytes (``mx_scales``)."""
    q = tl.arange(0, 4)
    if SAHEAD:
        s = s_ahead
    else:
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
def mm_block(acc, w_ptr, wsb_ptr, rows, srows, NROWS, stride_wn, k0, xa, xb,
              W_KIND: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HW_CVT: tl.constexpr, ASM: tl.constexpr,
              FRAG: tl.constexpr = False, FOLD: tl.constexpr = False, SWORD: tl.constexpr = False,
              WT: tl.constexpr = 0, s_ahead=0, SAHEAD: tl.constexpr = False):
    """acc + W[rows, k0:k0+BK] @ x^T (WT: ``_w_run``; frag only; SAHEAD, E4M3 only: the block's scale bytes
    are ``s_ahead``, ``mx_scales``)."""
    if FRAG:  # activations stored in the frag K order of the weight kind, BK == 128
        if W_KIND == 1:
            wf = _w_frag8(w_ptr, wsb_ptr, rows, srows, NROWS, stride_wn, k0, BN, HW_CVT, ASM, FOLD, SWORD, WT,
                          s_ahead, SAHEAD)
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
FOLD_SCAN_CONSTEXPR = tl.constexpr(FOLD_SCAN)


@triton.jit
def fold_flag(fflag_ptr, e64, FOLD: tl.constexpr, FFLAGS: tl.constexpr):
    """The expert's fold flag, loaded at the start of the tile so its latency hides behind the main
    loop (FOLD_SCAN where the kernel has no flags)."""
    if FOLD and FFLAGS:
        return tl.load(fflag_ptr + e64)
    else:
        return FOLD_SCAN_CONSTEXPR


@triton.jit
def fold_redo(fflag, wsb_ptr, srows, NROWS, K, W_KIND: tl.constexpr, BN: tl.constexpr):
    """Whether the tile must be computed again with the plain decode: by the expert's flag, which
    the layer computes once per load from the same bytes (``fold_flags``), or by scanning the tile's
    scale words where the flag says FOLD_SCAN. Why: the scan reads 1/16 (MX: 1/32) of the bytes the
    loop read, unpipelined, after the loop; at decode sizes it was 8% of the nvfp4 L1's stall
    samples (docs/bench-log/kernels.md)."""
    if fflag == FOLD_SCAN_CONSTEXPR:
        return _fold_bad(wsb_ptr, srows, NROWS, K, W_KIND, BN)
    else:
        return fflag != 0


@triton.jit
def k_loop(x_ptr, xrow, mvalid, K, we, wse, rows, srows, NROWS, stride_wn, k_lo, k_hi, fflag,
           W_KIND: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, HW_CVT: tl.constexpr,
           ASM: tl.constexpr, FRAG: tl.constexpr, FOLD: tl.constexpr, SWORD: tl.constexpr, SPLIT: tl.constexpr,
           WT: tl.constexpr, SAHEAD: tl.constexpr, KU: tl.constexpr):
    """The fp32 ``[BN, BM]`` product of ``rows`` (of NROWS kernel rows) and the activation rows ``xrow`` (``K``
    long, ``x_tiles``) over the K blocks ``k_lo`` to ``k_hi``: the main loop of the one-dot L1 (the 2BN
    gate/up rows) and of the L2. KU blocks per loop trip (``trip_block``); SAHEAD: each block's scale bytes
    loaded one step ahead (``mx_scales``). FOLD: where ``fold_redo`` says the fold decode cannot take a scale
    of the tile (its scan reads the whole K), the tile is computed again with the plain decode, unpipelined
    (rare: no registers taken from the main loop), and NVFP4 accumulators are scaled by NV_REDO_SCALE so that
    the caller's 2^8 restores them."""
    acc = tl.zeros((BN, BM), tl.float32)
    s_next = mx_scales(wse, srows, NROWS, k_lo, k_hi - BK, SAHEAD)
    for kk in range(k_lo, k_hi, BK * KU):
        for u in tl.static_range(KU):
            k0 = trip_block(kk, u, BK)
            s_cur = s_next
            if SAHEAD:  # the next step's scale bytes, used one iteration later
                s_next = mx_scales(wse, srows, NROWS, k0 + BK, k_hi - BK, SAHEAD)
            xa, xb = x_tiles(x_ptr, xrow, mvalid, k0, K // 2, SPLIT, BM, BK)
            acc = mm_block(acc, we, wse, rows, srows, NROWS, stride_wn, k0, xa, xb, W_KIND, BN, BK, HW_CVT, ASM,
                           FRAG, FOLD, SWORD, WT, s_cur, SAHEAD)
    if FOLD:
        if fold_redo(fflag, wse, srows, NROWS, K, W_KIND, BN):  # a scale the fold cannot take: plain again
            acc = tl.zeros((BN, BM), tl.float32)
            for k0 in tl.range(k_lo, k_hi, BK, num_stages=1):  # rare: unpipelined, no registers taken
                xa, xb = x_tiles(x_ptr, xrow, mvalid, k0, K // 2, SPLIT, BM, BK)
                acc = mm_block(acc, we, wse, rows, srows, NROWS, stride_wn, k0, xa, xb, W_KIND, BN, BK, HW_CVT,
                               ASM, FRAG, False, SWORD, WT)
            if W_KIND == 2:  # the caller restores the fold's 2^8 (exact: see NV_REDO_SCALE)
                acc = acc * NV_REDO_SCALE
    return acc
