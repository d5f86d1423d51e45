"""Triton device helpers shared by the staging and MoE kernels.

Every helper reproduces one rounding step of ``megamoe_runtime.format.codecs`` bit
for bit (the reference backend's numerics, docs/FORMATS.md and docs/NUMERICS.md):

* UE8M0 ceil with DeepGEMM's 1e-4 amax floor, from the fp32 bits of a true
  (``div_rn``) division, as ``codecs.ue8m0_ceil_exponent``;
* E4M3 round-to-nearest-even with saturation, either through the hardware
  ``cvt.rn.satfinite`` (``HW_CVT``, GPU) or in integer arithmetic (used under
  ``TRITON_INTERPRET=1``, whose fp8 casts round wrongly near powers of two);
* E2M1 round-to-nearest-even by counting midpoints (``codecs.e2m1_encode``,
  ties even, the sign bit of the input kept, so tiny negatives give -0);
* exact decodes of E2M1 nibbles, E4M3 bytes and UE8M0 bytes.

Divisions use ``tl.math.div_rn`` (Triton's ``/`` is an approximate
``div.full.f32``), and the kernels are compiled without fp contraction so no
multiply-add is fused into an FMA that torch would round twice.
"""
from __future__ import annotations

import triton
import triton.language as tl

from megamoe_runtime.format import weight_tiles
from . import decode_asm

_E4M3_MAX = tl.constexpr(448.0)
E4M3_MIN_SUB = tl.constexpr(0.001953125)  # 2^-9


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """First statement of a kernel launched with programmatic dependent launch (``staging.pdl``; docs/KERNELS.md
    "Programmatic dependent launch"): wait until the grid before this one in the stream has finished and its
    writes are visible. Nothing is read or written before it, so the kernels keep the plain stream order."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the grid after this one start its CTAs once every CTA of this grid has come here (or exited). Only
    the short kernels call it. The GEMMs (L1, L2) do not: CTAs of the next grid placed while a GEMM's only
    wave holds most of the SMs crowd onto the few SMs left free (measured: Mixtral's one-token layer 13%
    slower with the L1 releasing the L2 at its start), and releasing after the K loop instead holds
    registers across the K loop (the mxfp4 prefill tiles went from 154 to 255 registers and spilled,
    compiled for sm_90). A GEMM's successor starts when the GEMM's CTAs have exited, as without PDL, and
    still saves the wait for the launch itself."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """``pdl_wait`` then ``pdl_release``: the start of the short kernels (routing, staging, combine), whose
    successors launch while they run."""
    pdl_wait(PDL)
    pdl_release(PDL)


@triton.jit
def ue8m0_ceil_byte(amax, ELEM_MAX: tl.constexpr):
    """int32 UE8M0 byte of ``ceil_to_ue8m0(max(amax, 1e-4) / ELEM_MAX)``, clamped to [1, 254]."""
    a = tl.maximum(amax, 1e-4)
    s = tl.math.div_rn(a, tl.full(a.shape, ELEM_MAX, tl.float32))
    bits = s.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return tl.minimum(tl.maximum(e, 1), 254)


@triton.jit
def pow2_from_byte(e):
    """fp32 2^(e-127) for int32 bytes e in [1, 254] (byte 0 -> 0.0, the bit-shift decode)."""
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def inv_pow2_from_byte(e):
    """Exact fp32 1 / 2^(e-127) for e in [1, 253] (254 only arises from inf/NaN amax)."""
    return ((254 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_round(v, HW_CVT: tl.constexpr):
    """Round fp32 to the nearest E4M3fn value (RNE, saturating to +-448); returns fp32."""
    v = tl.minimum(tl.maximum(v, -_E4M3_MAX), _E4M3_MAX)
    if HW_CVT:
        return v.to(tl.float8e4nv).to(tl.float32)
    else:
        bits = v.to(tl.int32, bitcast=True)
        sign = bits & (-2147483648)
        mag = bits & 0x7FFFFFFF
        a = mag.to(tl.float32, bitcast=True)
        # normal E4M3 (|v| >= 2^-6): keep 3 mantissa bits, RNE on the integer bits
        rn = (mag + 0x7FFFF + ((mag >> 20) & 1)) & (-1048576)
        # subnormal E4M3: multiples of 2^-9; 1.5*2^23 forces rint at that quantum
        big = 12582912.0
        q = (a * 512.0 + big) - big
        rs = (q * E4M3_MIN_SUB).to(tl.int32, bitcast=True)
        r = tl.where(a >= 0.015625, rn, rs)
        return (r | sign).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_value_to_byte(r):
    """Byte of an fp32 that is exactly an E4M3fn value (output of ``e4m3_round``)."""
    bits = r.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    mag_bits = bits & 0x7FFFFFFF
    normal = (((mag_bits >> 23) - 120) << 3) | ((mag_bits >> 20) & 7)
    sub = (a * 512.0).to(tl.int32)
    return (tl.where(a >= 0.015625, normal, sub) | sign) & 0xFF


@triton.jit
def e4m3_byte_to_f32(b, HW_CVT: tl.constexpr):
    """Exact fp32 value of E4M3fn bytes (uint8 / int32 tensors holding 0..255)."""
    if HW_CVT:
        return b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        bi = b.to(tl.int32) & 0xFF
        ex = (bi >> 3) & 15
        m = bi & 7
        normal = (((ex + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * E4M3_MIN_SUB
        v = tl.where(ex == 0, sub, normal)
        return tl.where((bi & 0x80) != 0, -v, v)


#: RN(1 / 6) in fp32: with it `div_markstein` divides an NVFP4 block amax by 6 (the staging quantizer, the L1)
RCP6 = tl.constexpr(0.16666667163372039795)


@triton.jit
def div_markstein(a, b, rcp, STEPS: tl.constexpr):
    """RN(a / b) from ``rcp = RN(1 / b)``: the product, then STEPS residual corrections
    ``r = a - b*q`` (exact in an FMA), ``q += r * rcp``. Two steps are Markstein's correctly rounded
    quotient wherever the residuals stay normal; `staging.division_mismatches` checks the forms in use
    exhaustively (docs/KERNELS.md, "Staging: the NVFP4 per-token quantizer"). Five flops against an
    IEEE division's reciprocal, refinement, range check and slow-path branch."""
    q = a * rcp
    if STEPS >= 1:  # (0 only as the proof's negative control)
        r = tl.fma(-b, q, a)
        q = tl.fma(r, rcp, q)
    if STEPS == 2:
        r = tl.fma(-b, q, a)
        q = tl.fma(r, rcp, q)
    return q


@triton.jit
def e2m1_code(v):
    """E2M1 code (int32 0..15) of fp32 v: RNE on the E2M1 grid, saturating at 6, sign bit kept."""
    a = tl.abs(v)
    c = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) \
        + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) \
        + (a > 5.0).to(tl.int32)
    sign = (v.to(tl.int32, bitcast=True) >> 28) & 8
    return c | sign


@triton.jit
def e2m1_magnitude(y, d):
    """E2M1 magnitude code (0..7, ties even, saturating) of ``RN(y / d)`` for ``y >= 0`` (or NaN: 0) and E4M3
    block scales ``d`` (broadcast against ``y``), without the division: ``e2m1_code(div_rn(y, d))``'s
    magnitude bit for bit. Why exact: every rounding midpoint m of the E2M1 grid times an E4M3 value is an
    fp32 (3 + 4 significant bits), the quotient's own rounding cannot carry it across ``m * d``, so
    ``RN(y / d) >= m`` is ``y >= m * d`` (``>`` for the midpoints that round down); three compares search
    the seven midpoints (docs/KERNELS.md, "Staging: the NVFP4 per-token quantizer"). An IEEE division is
    about ten instructions and a branch per element; the staging quantizer rounds every activation this
    way."""
    p2 = y >= d * 1.75
    p1 = y >= tl.where(p2, d * 3.5, d * 0.75)
    t0 = tl.where(p1, tl.where(p2, d * 5.0, d * 1.25), tl.where(p2, d * 2.5, d * 0.25))
    return tl.where(p2, 4, 0) | tl.where(p1, 2, 0) | tl.where(y > t0, 1, 0)


@triton.jit
def e2m1_scaled16(c):
    """fp32 ``e2m1_value(c) * 2^-14`` for int32 codes c (0..15), via the fp16 bit pattern.

    Placing the 3 magnitude bits at fp16 bits 9..11 gives exactly the E2M1
    value times 2^-14 (code 1 lands on the fp16 subnormal 2^-15); fp16 -> fp32
    is exact. Callers fold 2^14 into the scale they multiply by.
    """
    h = ((c & 8) << 12) | ((c & 7) << 9)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e2m1_value(c):
    """Exact fp32 E2M1 value of int32 codes."""
    return e2m1_scaled16(c) * 16384.0


@triton.jit
def expf(x, GPU: tl.constexpr):
    """CUDA ``expf`` (libdevice ``__nv_expf``, what torch's exp runs) on the GPU; numpy exp
    under the interpreter (which cannot call libdevice)."""
    if GPU:
        return tl.extra.cuda.libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def tanhf(x, GPU: tl.constexpr):
    """CUDA ``tanhf`` (libdevice) on the GPU; an exp-based stand-in under the interpreter."""
    if GPU:
        return tl.extra.cuda.libdevice.tanh(x)
    else:
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)


@triton.jit
def bf16r(x, GPU: tl.constexpr):
    """fp32 -> bf16 (RNE) -> fp32. The interpreter's bf16 cast truncates, so it
    gets the integer RNE (NaN aside); the GPU uses cvt.rn.bf16.f32."""
    if GPU:
        return x.to(tl.bfloat16).to(tl.float32)
    else:
        b = x.to(tl.int32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) & (-65536)
        return r.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_pair_bf16(b, sc, ASM: tl.constexpr):
    """(low-nibble values, high-nibble values) * sc as bf16, for uint8/int8 bytes b and a
    bf16 scale sc of the same shape (constant over each run of 4 bytes).

    ASM: the PRMT lookup-table decode (``decode_asm.E2M1_PRMT``, GPU); else the arithmetic
    decode (interpreter, and the fallback if the GPU self-check of the asm path fails)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            _E2M1_ASM_C, "=r,=r,=r,=r,r,r,r", [b.to(tl.uint8, bitcast=True), sc],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return lo, hi
    else:
        bi = b.to(tl.int32) & 0xFF
        s = sc.to(tl.float32) * 16384.0
        lo = (e2m1_scaled16(bi & 15) * s).to(tl.bfloat16)
        hi = (e2m1_scaled16(bi >> 4) * s).to(tl.bfloat16)
        return lo, hi


_E2M1_ASM_C = tl.constexpr(decode_asm.E2M1_PRMT)


# "frag" K order (docs/KERNELS.md, "The frag K order"): inside every 128-wide block of K,
# natural element m = 32q + 8w + 4h + j (q, w, j in 0..3, h in 0..1) is stored at position
# k = 16(2w + j//2) + 8(j%2) + 2q + h. A thread of the Hopper wgmma A-operand layout (bf16,
# per k16 step the k pairs 2q, 2q+1 and 2q+8, 2q+9, q = lane % 4) then owns over 8 k16 steps
# exactly the 32 weights of MX group q of its rows: 4 contiguous words of E2M1 nibbles, one
# scale; and each bf16x2 register of the operand holds nibbles j and j+4 of one word, which
# two shifts and two masks extract (_E2M1_FRAG_ASM). Our staging and L1 epilogue write the
# activations in this order, so the GEMM still sums every weight with its own activation.


@triton.jit
def frag_pos(c):
    """Stored column of natural column ``c`` in the frag K order (blocks of 128)."""
    m = c % 128
    j = m % 4
    return (c - m) + 16 * (2 * ((m // 8) % 4) + j // 2) + 8 * (j % 2) + 2 * (m // 32) + (m // 4) % 2


# the decodes' PTX (and why each instruction is there) lives in ``decode_asm``
_E2M1_FRAG_ASM = tl.constexpr(decode_asm.E2M1_FRAG)
_E2M1_FRAG_FOLD_ASM = tl.constexpr(decode_asm.E2M1_FRAG_FOLD)
_E2M1_TILED_ASM = tl.constexpr(decode_asm.E2M1_FRAG_TILED)
_E2M1_TILED_FOLD_ASM = tl.constexpr(decode_asm.E2M1_FRAG_TILED_FOLD)


@triton.jit
def _e2m1_words_asm(wd, sc2, TEXT: tl.constexpr):
    return tl.inline_asm_elementwise(TEXT, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [wd, sc2], dtype=(tl.bfloat16,) * 8,
                                     is_pure=True, pack=1)


@triton.jit
def e2m1_frag_words(wd, sc2, FOLD: tl.constexpr = False, TILED: tl.constexpr = False):
    """Decode int32 words ``wd`` of 8 E2M1 nibbles (n_i = bits 4i..4i+3) times the bf16 scale
    whose bits are both halves of int32 ``sc2``; returns 8 bf16 tensors of wd's shape:
    nibbles (n0, n4, n1, n5, n2, n6, n3, n7). FOLD: ``sc2`` already holds scale * 2^126.
    TILED: the words hold their bits in the tiled order (``weight_tiles.E2M1_WORD_BITS``)."""
    if TILED:
        if FOLD:
            return _e2m1_words_asm(wd, sc2, _E2M1_TILED_FOLD_ASM)
        else:
            return _e2m1_words_asm(wd, sc2, _E2M1_TILED_ASM)
    else:
        if FOLD:
            return _e2m1_words_asm(wd, sc2, _E2M1_FRAG_FOLD_ASM)
        else:
            return _e2m1_words_asm(wd, sc2, _E2M1_FRAG_ASM)


def _moves(to_tiled: bool) -> list:
    """The five (shift, mask) bit moves of ``weight_tiles.e2m1_bit_moves`` as constexprs, masks as the
    signed int32 values of their bits."""
    moves = weight_tiles.e2m1_bit_moves(to_tiled)
    assert len(moves) == 5, moves
    return [(tl.constexpr(d), tl.constexpr(m - (1 << 32) if m >> 31 else m)) for d, m in moves]


(_TD0, _TM0), (_TD1, _TM1), (_TD2, _TM2), (_TD3, _TM3), (_TD4, _TM4) = _moves(True)
(_ND0, _NM0), (_ND1, _NM1), (_ND2, _NM2), (_ND3, _NM3), (_ND4, _NM4) = _moves(False)


@triton.jit
def _bit_move(w, D: tl.constexpr, M: tl.constexpr):
    if D >= 0:
        return (w << D) & M
    else:
        return (w >> -D) & M  # arithmetic shift: the sign copies land outside M


@triton.jit
def e2m1_bits_moved(wd, TO_TILED: tl.constexpr):
    """int32 words of packed E2M1 weights with their bits moved to the tiled order (TO_TILED) or back to
    the natural one (``weight_tiles.E2M1_WORD_BITS``): the load's permutation on the GPU
    (``bit_order``), and how the decodes without the inline asm (interpreter, or a GPU whose asm
    self-check failed) read tiled weights."""
    if TO_TILED:
        return (_bit_move(wd, _TD0, _TM0) | _bit_move(wd, _TD1, _TM1) | _bit_move(wd, _TD2, _TM2)
                | _bit_move(wd, _TD3, _TM3) | _bit_move(wd, _TD4, _TM4))
    else:
        return (_bit_move(wd, _ND0, _NM0) | _bit_move(wd, _ND1, _NM1) | _bit_move(wd, _ND2, _NM2)
                | _bit_move(wd, _ND3, _NM3) | _bit_move(wd, _ND4, _NM4))


# The same idea for E4M3 weights ("frag" of the mxfp8 row): a thread owns 32 contiguous bytes
# (8 words, MX group q) of a row per 128-block; natural m = 32q + 4w + 2h + p (byte b = 2h + p
# of word w) is stored at k = 16w + 8p + 2q + h, so each bf16x2 operand register holds bytes
# (p, p + 2) of one word.


@triton.jit
def frag8_pos(c):
    """Stored column of natural column ``c`` in the E4M3 frag K order (blocks of 128)."""
    m = c % 128
    b = m % 4
    return (c - m) + 16 * ((m // 4) % 8) + 8 * (b % 2) + 2 * (m // 32) + b // 2


_E4M3_FRAG_ASM = tl.constexpr(decode_asm.E4M3_FRAG)
_E4M3_FRAG_FOLD_ASM = tl.constexpr(decode_asm.E4M3_FRAG_FOLD)


@triton.jit
def e4m3_frag_words(wd, sc2, FOLD: tl.constexpr = False):
    """Decode int32 words of 4 E4M3 bytes times the bf16 scale in both halves of ``sc2``;
    returns 4 bf16 tensors of wd's shape: bytes (0, 2, 1, 3). FOLD: ``sc2`` holds scale * 2^120."""
    if FOLD:
        return tl.inline_asm_elementwise(_E4M3_FRAG_FOLD_ASM, "=h,=h,=h,=h,r,r", [wd, sc2],
                                         dtype=(tl.bfloat16,) * 4, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_E4M3_FRAG_ASM, "=h,=h,=h,=h,r,r", [wd, sc2],
                                         dtype=(tl.bfloat16,) * 4, is_pure=True, pack=1)
