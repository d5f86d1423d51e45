"""The PTX of the triton backend's inline-asm weight decodes, as text.

Why a module of its own: the asm is data the kernels paste into ``tl.inline_asm_elementwise``
(``_jit``), and it can be checked without a GPU or triton: ``tests/runtime/backends/
test_triton_decode_asm.py`` runs these exact strings through a small PTX interpreter against
``codecs`` for every nibble / byte value and scale. On the GPU ``decode_check.asm_decode_check`` checks
the compiled code the same way before the kernels use it. Operands: ``$0..`` the outputs, then
the inputs, in the order of each wrapper in ``_jit``.
"""
from __future__ import annotations

__all__ = ["E2M1_PRMT", "E2M1_FRAG", "E2M1_FRAG_FOLD", "E2M1_FRAG_TILED", "E2M1_FRAG_TILED_FOLD", "E4M3_FRAG",
           "E4M3_FRAG_FOLD", "NV_FOLD_SCALE_MUL", "NV_FOLD_SCALE_ADD", "NV_FOLD_SCALE_BYTES"]

# E2M1 -> bf16 by byte permutes (PRMT as an 8-entry lookup table), then one
# bf16x2 multiply by the block scale. Per 4 packed bytes: ~10 integer ops and 2
# HMUL2 per nibble half, no float conversions (which run at a quarter of the
# FMA rate on Hopper and bounded the arithmetic decode). Tables: bf16 bits of
# the E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 = 0000 3F00 3F80 3FC0 4000 4040
# 4080 40C0 (high bytes LH, low bytes LL). The sign (nibble bit 3) goes to bit 7
# of the high byte. Exact: every E2M1 value times a UE8M0 or E4M3 scale is a
# bf16 value (the product is one rounding-free bf16 multiply).
E2M1_PRMT = """
{
.reg .b32 m7, t, sel, h, l, r4, sg, LH0, LH1, LL0, LL1;
mov.b32 LH0, 0x3F3F3F00;
mov.b32 LH1, 0x40404040;
mov.b32 LL0, 0xC0800000;
mov.b32 LL1, 0xC0804000;
and.b32 m7, $4, 0x07070707;
shr.b32 t, m7, 4;
or.b32 t, t, m7;
prmt.b32 sel, t, t, 0x0020;
prmt.b32 h, LH0, LH1, sel;
prmt.b32 l, LL0, LL1, sel;
shl.b32 sg, $4, 4;
and.b32 sg, sg, 0x80808080;
or.b32 h, h, sg;
prmt.b32 t, l, h, 0x5140;
mul.rn.bf16x2 $0, t, $5;
prmt.b32 t, l, h, 0x7362;
mul.rn.bf16x2 $1, t, $6;
shr.b32 r4, $4, 4;
and.b32 m7, r4, 0x07070707;
shr.b32 t, m7, 4;
or.b32 t, t, m7;
prmt.b32 sel, t, t, 0x0020;
prmt.b32 h, LH0, LH1, sel;
prmt.b32 l, LL0, LL1, sel;
and.b32 sg, $4, 0x80808080;
or.b32 h, h, sg;
prmt.b32 t, l, h, 0x5140;
mul.rn.bf16x2 $2, t, $5;
prmt.b32 t, l, h, 0x7362;
mul.rn.bf16x2 $3, t, $6;
}
"""


# Nibbles j and j+4 of a word (bits 4j..4j+3 and 4j+16..4j+19) -> one bf16x2 register:
# magnitude bits to 6..8 / 22..24 and sign to 15 / 31 make the bf16 of (E2M1 value * 2^-126)
# (E2M1 code 1 = 0.5 lands on the bf16 subnormal 2^-127, so the subnormal case needs no
# branch); mul.bf16x2 by 2^126 restores the value and a second by the block scale applies it.
# Both products are exact (E2M1 * 2^k and E2M1 * E4M3 fit in bf16), bf16 multiplies keep
# subnormal inputs on sm_90.
# The bit moves are integer multiplies (IMAD, FMA pipe) rather than shifts (ALU pipe): 29 fewer
# SASS instructions per 128-wide K step of the decode tile and 2-3% faster E2M1 GEMMs on the
# H200 (docs/bench-log/kernels.md; the same idea for E4M3 weights was slower).
# Masking both nibbles of a register to c and multiplying by 2^p + 2^q puts one copy of them
# p bits up (magnitude in place) and one q bits up (sign in place); the two copies occupy
# disjoint bits (no carries), and one mask keeps the wanted ones.
# Nibbles 2, 3, 6, 7 first come down 8 bits by mul.hi (x * 2^24 / 2^32). Per word: 8 masks,
# 5 multiplies, 8 HMUL2 (fold: 4). The asm takes one int32 word per element (pack=1), so its
# result never depends on how Triton packs elements.
E2M1_FRAG = """
{
.reg .b32 c, t, r, x8, bias;
mov.b32 bias, 0x7E807E80;
and.b32 c, $8, 0x000F000F;
mul.lo.u32 t, c, 0x1040;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 t, t, bias;
mul.rn.bf16x2 r, t, $9;
mov.b32 {$0, $1}, r;
and.b32 c, $8, 0x00F000F0;
mul.lo.u32 t, c, 0x104;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 t, t, bias;
mul.rn.bf16x2 r, t, $9;
mov.b32 {$2, $3}, r;
mul.hi.u32 x8, $8, 0x1000000;
and.b32 c, x8, 0x000F000F;
mul.lo.u32 t, c, 0x1040;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 t, t, bias;
mul.rn.bf16x2 r, t, $9;
mov.b32 {$4, $5}, r;
and.b32 c, x8, 0x00F000F0;
mul.lo.u32 t, c, 0x104;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 t, t, bias;
mul.rn.bf16x2 r, t, $9;
mov.b32 {$6, $7}, r;
}
"""


# "fold" decode: the same registers without the multiply by the bias 2^126 (E4M3: 2^120),
# which the caller has folded into the scale operand (``sc2`` = bf16 of scale * 2^126): one
# HMUL2 per register instead of two, the same single rounding of the same exact product
# (a = value * 2^-126 is exact, so a * (scale * 2^126) rounds value * scale once, as the
# plain decode's second multiply does). Only valid where scale * 2^126 is a finite bf16:
# UE8M0 bytes <= 128 (E4M3 weights: <= 134); the kernels check that and redo a tile with
# the plain decode otherwise (docs/KERNELS.md "Hopper triton kernels: the frag K order").
def _without_bias(asm: str) -> str:
    """The fold variant of a frag decode: the same asm without its bias register and the
    ``mul.bf16x2`` by it (the caller's scale operand carries the bias instead)."""
    return "\n".join(ln.replace(", bias;", ";") if ln.startswith(".reg") else ln
                     for ln in asm.splitlines() if ln.startswith(".reg") or "bias" not in ln)



E2M1_FRAG_FOLD = _without_bias(E2M1_FRAG)


# The same registers from a word of tiled weights, whose bits the load stored in another order
# (``format.weight_tiles.E2M1_WORD_BITS``) so that each register is one or two moves and a mask away:
# nibbles 0, 4 by a shift left of 6 (mul.lo, FMA pipe), nibbles 1, 5 by a shift left of 2, nibbles
# 3, 7 by a rotation right of 4 (shf.wrap), and nibbles 2, 6, stored in place but for the lowest
# magnitude bit of each, 8 places up, by one multiply-add of that masked part (x * 2^24 / 2^32 = x >> 8)
# onto the masked rest (no carries: the two parts hold disjoint bits). Per word 9 integer instructions
# against 13 for the natural order; 4 or 8 HMUL2 as there. An exhaustive search of such placements found
# none at two instructions for every register; of those at 9 this one has the fewest distinct bit moves
# (five) for the load's permutation.
E2M1_FRAG_TILED = """
{
.reg .b32 c, t, r, bias;
mov.b32 bias, 0x7E807E80;
mul.lo.u32 t, $8, 64;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 t, t, bias;
mul.rn.bf16x2 r, t, $9;
mov.b32 {$0, $1}, r;
mul.lo.u32 t, $8, 4;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 t, t, bias;
mul.rn.bf16x2 r, t, $9;
mov.b32 {$2, $3}, r;
and.b32 c, $8, 0x40004000;
and.b32 t, $8, 0x81808180;
mad.hi.u32 t, c, 0x1000000, t;
mul.rn.bf16x2 t, t, bias;
mul.rn.bf16x2 r, t, $9;
mov.b32 {$4, $5}, r;
shf.r.wrap.b32 t, $8, $8, 4;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 t, t, bias;
mul.rn.bf16x2 r, t, $9;
mov.b32 {$6, $7}, r;
}
"""


E2M1_FRAG_TILED_FOLD = _without_bias(E2M1_FRAG_TILED)


# Bytes (0, 2) and (1, 3) of a word -> two bf16x2 registers: the 7 magnitude bits (exponent,
# mantissa) of E4M3 moved to bf16 bits 4..10 / 20..26 and the sign to 15 / 31 give the bf16 of
# (E4M3 value * 2^-120) for normals and subnormals alike; mul.bf16x2 by 2^120, then by the block
# scale (both exact). NaN bytes (0x7F/0xFF) would decode as 480 * scale: weights carry none.
E4M3_FRAG = """
{
.reg .b32 a, s, r, bias;
mov.b32 bias, 0x7B807B80;
shl.b32 a, $4, 4;
and.b32 a, a, 0x07F007F0;
shl.b32 s, $4, 8;
and.b32 s, s, 0x80008000;
or.b32 a, a, s;
mul.rn.bf16x2 a, a, bias;
mul.rn.bf16x2 r, a, $5;
mov.b32 {$0, $1}, r;
shr.b32 a, $4, 4;
and.b32 a, a, 0x07F007F0;
and.b32 s, $4, 0x80008000;
or.b32 a, a, s;
mul.rn.bf16x2 a, a, bias;
mul.rn.bf16x2 r, a, $5;
mov.b32 {$2, $3}, r;
}
"""


E4M3_FRAG_FOLD = _without_bias(E4M3_FRAG)


# The NVFP4 fold decode's scale operand, from the E4M3 byte by one integer multiply-add
# (``operands._nv_fold_scale_bits``): byte b = e << 3 | m, shifted left by 4, is the bf16 pattern
# of E4M3(b) * 2^-120 when e >= 1; adding 238 to the exponent field makes it E4M3(b) * 2^118,
# the value the FOLD decode wants, and ``* 0x100010`` puts it in both halves of a bf16x2.
# Exact for the bytes of NV_FOLD_SCALE_BYTES (normal, positive, finite); the kernels detect any
# other byte and compute that tile with the plain decode.
NV_FOLD_SCALE_MUL = 0x100010
NV_FOLD_SCALE_ADD = 0x77007700
NV_FOLD_SCALE_BYTES = range(0x08, 0x7F)
