"""Triton staging kernels: what the serving path runs before the MoE GEMMs.

* :func:`quantize_mxfp8` -- hidden states -> MXFP8 dispatch (E4M3 elements,
  one UE8M0 scale per 32 along H, ceil with DeepGEMM's 1e-4 floor), the scales
  also as DeepGEMM's packed int32 row-major ``x_sf`` ``[T, H/128]``.
* :func:`quantize_nvfp4_per_token` -- hidden states -> NVFP4 (E2M1 nibbles,
  E4M3 scale per 16, one FP32 scale per token; DGv ``use_x_scales``), the
  block scales also as packed int32 ``[T, H/64]``.
* :func:`bf16_passthrough` -- the BF16 row's dispatch (a copy into a fresh
  buffer, as the symmetric buffer's ``x`` would be filled).
* :func:`route` -- routing metadata: (token, slot) pairs grouped by local
  expert, each expert's run padded to a multiple of the GEMM row block, masked
  slots (-1) and other ranks' experts dropped, zero tokens handled.

All quantizers are bit-exact with ``megamoe_runtime.format.codecs`` (the reference
numerics): ``tests/runtime/backends/test_triton.py`` checks that on the GPU
over random and adversarial inputs. Nothing here syncs with the host, so the
whole staging + MoE forward can be captured in a CUDA graph.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from megamoe_runtime import knobs

from . import _jit

__all__ = [
    "hw_cvt_default",
    "quantize_mxfp8",
    "quantize_nvfp4_per_token",
    "bf16_passthrough",
    "RoutingPlan",
    "route",
    "route_slice",
]


def hw_cvt_default() -> bool:
    """Use the hardware E4M3 conversion unless running under the Triton interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True")


def pdl(device: torch.device) -> dict:
    """Launch arguments of a kernel that starts with ``_jit.pdl_wait``: its ``PDL`` flag and, where set, Triton's
    ``launch_pdl``, so that no kernel carries the attribute without the wait. Programmatic dependent launch on
    Hopper and later GPUs (and when compiling for sm_90 without one: ``tools/sm90_compile.py``); ``PDL``
    False under the interpreter, on older GPUs and with ``MEGAMOE_TRITON_PDL=0``. Same bits either way:
    every such kernel waits for the previous grid before it touches memory."""
    if not hw_cvt_default() or knobs.value("MEGAMOE_TRITON_PDL") != "1":
        return {"PDL": False}
    if device.type == "cuda" and _capability_major(device.index) < 9:
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


@functools.lru_cache(maxsize=None)
def _capability_major(index: Optional[int]) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _launch_opts() -> dict:
    # No fp contraction: the reference rounds every multiply and add on its own.
    if hw_cvt_default():
        return {"enable_fp_fusion": False}
    return {}


# --------------------------------------------------------------------------- MXFP8

_DEQUANT_MODES = (None, "natural", "split", "frag", "frag8")


@triton.jit
def _mxfp8_kernel(x_ptr, q_ptr, sf_ptr, xd_ptr, H, stride_x, stride_q, stride_sf,
                  BLOCK_G: tl.constexpr, HW_CVT: tl.constexpr, DQ: tl.constexpr, PDL: tl.constexpr = False):
    _jit.pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    pid_g = tl.program_id(1)
    g = pid_g * BLOCK_G + tl.arange(0, BLOCK_G)
    i = tl.arange(0, 32)
    col = g[:, None] * 32 + i[None, :]
    mask = col < H
    x = tl.load(x_ptr + t * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    e = _jit.ue8m0_ceil_byte(amax, 448.0)
    inv = _jit.inv_pow2_from_byte(e)
    q = _jit.e4m3_round(x * inv[:, None], HW_CVT)
    if HW_CVT:
        tl.store(q_ptr + t * stride_q + col, q.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=mask)
    else:
        tl.store(q_ptr + t * stride_q + col, _jit.e4m3_value_to_byte(q).to(tl.uint8), mask=mask)
    tl.store(sf_ptr + t * stride_sf + g, e.to(tl.uint8), mask=g * 32 < H)
    if DQ == 1:  # exact dequant, natural order
        d = (q * _jit.pow2_from_byte(e)[:, None]).to(tl.bfloat16)
        tl.store(xd_ptr + t * H + col, d, mask=mask)
    elif DQ == 2:  # exact dequant as [even k | odd k]
        d = (q * _jit.pow2_from_byte(e)[:, None]).to(tl.bfloat16)
        de, do = tl.split(d.reshape(BLOCK_G, 16, 2))
        h = g[:, None] * 16 + tl.arange(0, 16)[None, :]
        hm = h * 2 < H
        tl.store(xd_ptr + t * H + h, de, mask=hm)
        tl.store(xd_ptr + t * H + H // 2 + h, do, mask=hm)
    elif DQ == 3:  # exact dequant in the frag K order of the e2m1 GEMMs (_jit.frag_pos)
        d = (q * _jit.pow2_from_byte(e)[:, None]).to(tl.bfloat16)
        tl.store(xd_ptr + t * H + _jit.frag_pos(col), d, mask=mask)
    elif DQ == 4:  # exact dequant in the E4M3 frag K order (_jit.frag8_pos)
        d = (q * _jit.pow2_from_byte(e)[:, None]).to(tl.bfloat16)
        tl.store(xd_ptr + t * H + _jit.frag8_pos(col), d, mask=mask)


def _dq_code(dequant) -> int:
    if dequant not in _DEQUANT_MODES:
        raise _err(f"dequant={dequant!r}; valid: None, 'natural', 'split', 'frag', 'frag8'")
    return _DEQUANT_MODES.index(dequant)


#: (groups of 32 per program, warps). Plain quantization: (64, 4), the fastest shape on the
#: H200 at H 5120 and close to it at 7168 (bench/staging.py: 92% of a copy of the same bytes
#: at 4096 tokens, (32, 4) 87%); with a dequantized copy: (32, 4), as measured (92%).
_MXFP8_CONFIG = (64, 4)
_MXFP8_DQ_CONFIG = (32, 4)


def quantize_mxfp8(x: torch.Tensor, *, hw_cvt: bool | None = None, dequant: str | None = None,
                   config: tuple[int, int] | None = None):
    """MXFP8 dispatch of ``x`` bf16/fp32 ``[T, H]`` (H % 128 == 0).

    Returns ``(q float8_e4m3fn [T, H], sf uint8 [T, H/32], x_sf int32 [T, H/128])``;
    ``x_sf`` is a view of ``sf`` (DeepGEMM's packed row-major activation scales).
    With ``dequant`` ("natural", "split" = [even k | odd k], "frag" / "frag8" = the frag K
    orders of ``_jit.frag_pos`` / ``_jit.frag8_pos``) a fourth output is the
    exact bf16 dequantization ``q * 2^(sf-127)`` the GEMMs read. ``config``
    ``(groups of 32 per program, warps)`` overrides the launch shape (benchmarks).
    Bit-exact with ``codecs.quantize_mxfp8``.
    """
    _check_x(x, 128, "quantize_mxfp8")
    T, H = x.shape
    hw = hw_cvt_default() if hw_cvt is None else hw_cvt
    dq = _dq_code(dequant)
    q = torch.empty(T, H, dtype=torch.uint8, device=x.device)
    sf = torch.empty(T, H // 32, dtype=torch.uint8, device=x.device)
    xd = torch.empty(T, H, dtype=torch.bfloat16, device=x.device) if dq else q
    if T:
        block_g, warps = config or (_MXFP8_DQ_CONFIG if dq else _MXFP8_CONFIG)
        grid = (T, triton.cdiv(H // 32, block_g))
        _mxfp8_kernel[grid](x, q, sf, xd, H, x.stride(0), q.stride(0), sf.stride(0),
                            BLOCK_G=block_g, HW_CVT=hw, DQ=dq, num_warps=warps, **_launch_opts(), **pdl(x.device))
    out = (q.view(torch.float8_e4m3fn), sf, sf.view(torch.int32))
    return out + (xd,) if dq else out


# --------------------------------------------------------------------------- NVFP4


@triton.jit
def _nvfp4_token_kernel(x_ptr, p_ptr, sf_ptr, ts_ptr, xd_ptr, H, stride_x, stride_p, stride_sf,
                        NB: tl.constexpr, HW_CVT: tl.constexpr, DQ: tl.constexpr, PDL: tl.constexpr = False):
    _jit.pdl_start(PDL)
    # one token per program, in chunks of NB blocks of 16 = [NB, 8] (even, odd) pairs:
    # pass 1 finds the token amax, pass 2 quantizes (the re-read hits L1/L2)
    t = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, NB)
    i = tl.arange(0, 8)
    base = x_ptr + t * stride_x
    amax_v = tl.zeros((NB, 8), tl.float32)
    for c0 in range(0, H, NB * 16):
        col_e = c0 + b[:, None] * 16 + i[None, :] * 2
        mask = col_e < H
        xe = tl.load(base + col_e, mask=mask, other=0.0).to(tl.float32)
        xo = tl.load(base + col_e + 1, mask=mask, other=0.0).to(tl.float32)
        amax_v = tl.maximum(amax_v, tl.maximum(tl.abs(xe), tl.abs(xo)))
    amax_t = tl.max(tl.max(amax_v, axis=1), axis=0)
    # token_scale = max(amax, 1e-12) / 2688, a true division
    ts = tl.math.div_rn(tl.maximum(amax_t, 1e-12), 2688.0)
    tl.store(ts_ptr + t, ts)
    tsv = tl.full((NB, 8), 0.0, tl.float32) + ts
    for c0 in range(0, H, NB * 16):
        col_e = c0 + b[:, None] * 16 + i[None, :] * 2
        mask = col_e < H
        xe = tl.load(base + col_e, mask=mask, other=0.0).to(tl.float32)
        xo = tl.load(base + col_e + 1, mask=mask, other=0.0).to(tl.float32)
        ye = tl.math.div_rn(xe, tsv)
        yo = tl.math.div_rn(xo, tsv)
        # quantize_nvfp4(y, global 1.0): inv = 1; sf = e4m3(max(amax/6 * 1, 2^-9))
        amax_b = tl.max(tl.maximum(tl.abs(ye), tl.abs(yo)), axis=1)
        sfv = tl.maximum(tl.math.div_rn(amax_b, tl.full((NB,), 6.0, tl.float32)), _jit.E4M3_MIN_SUB)
        sfv = _jit.e4m3_round(sfv, HW_CVT)
        d = tl.full((NB, 8), 1.0, tl.float32) * sfv[:, None]
        ce = _jit.e2m1_code(tl.math.div_rn(ye, d))
        co = _jit.e2m1_code(tl.math.div_rn(yo, d))
        byte = (ce | (co << 4)).to(tl.uint8)
        pc = c0 // 2 + b[:, None] * 8 + i[None, :]
        tl.store(p_ptr + t * stride_p + pc, byte, mask=mask)
        if HW_CVT:
            sb = sfv.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            sb = _jit.e4m3_value_to_byte(sfv).to(tl.uint8)
        tl.store(sf_ptr + t * stride_sf + c0 // 16 + b, sb, mask=c0 + b * 16 < H)
        if DQ == 2:  # exact dequant (token scale NOT applied) as [even k | odd k]
            tl.store(xd_ptr + t * H + pc, (_jit.e2m1_value(ce) * d).to(tl.bfloat16), mask=mask)
            tl.store(xd_ptr + t * H + H // 2 + pc, (_jit.e2m1_value(co) * d).to(tl.bfloat16), mask=mask)
        elif DQ == 3:  # the same values in the frag K order (natural column 2*pc and 2*pc + 1)
            tl.store(xd_ptr + t * H + _jit.frag_pos(2 * pc), (_jit.e2m1_value(ce) * d).to(tl.bfloat16), mask=mask)
            tl.store(xd_ptr + t * H + _jit.frag_pos(2 * pc + 1), (_jit.e2m1_value(co) * d).to(tl.bfloat16),
                     mask=mask)


# The row kernel: one program holds a whole token in registers (H/16 blocks split into
# at most four power-of-two pieces, e.g. 448 = 256 + 128 + 64), so the token amax
# needs no second pass over memory, and each element costs a few flops instead of
# two IEEE divisions:
# * the token is held as int32 words of two bf16 (even, odd element): 16-byte loads, half
#   the registers of fp32, and each word unpacks into the pair that shares one output byte.
#   The token amax is a packed bf16x2 max over the words (one op per two elements).
# * y = |x| / ts: the multiply by the correctly rounded reciprocal of the token scale
#   and residual steps r = |x| - ts*q (exact in an FMA), q += r * (1/ts) (``_jit.div_markstein``;
#   FAST_DIV 1: two steps, Markstein's theorem; 2: one step, which bench/staging.py
#   --prove-div checked against div_rn for every bf16 numerator significand and every fp32
#   divisor significand). FAST_DIV=0 uses div_rn.
# * the block scale: RN is monotone, so RN(max|x| / ts) is the block's largest quotient.
# * e2m1(y / d) compares the quotient with the E2M1 midpoints m: because m (<= 3
#   significant bits) times the E4M3 scale d (<= 4 bits) is exact in fp32,
#   RN(y / d) >= m  <=>  y >= m*d  and  RN(y / d) > m  <=>  y > m*d (a quotient on
#   the wrong side of m*d cannot round onto m: it is at least ulp(m*d)/d away, more
#   than half an ulp of m). Three compares (binary search over the 7 midpoints)
#   give the magnitude code. Proven on the GPU by bench/staging.py and the tests.

_BF16X2_ABSMAX_ASM = tl.constexpr("{ .reg .b32 t; and.b32 t, $2, 0x7FFF7FFF; max.bf16x2 $0, $1, t; }")


@triton.jit
def _nv_load(x_row, OFF: tl.constexpr, NBP: tl.constexpr):
    """Words ``[NBP, 8]`` of blocks OFF.. of a bf16 row: word i of a block = elements 2i, 2i+1."""
    w_row = x_row.to(tl.pointer_type(tl.int32))
    return tl.load(w_row + OFF * 8 + tl.arange(0, NBP)[:, None] * 8 + tl.arange(0, 8)[None, :])


@triton.jit
def _bf16x2_absmax_step(m, w):
    return tl.inline_asm_elementwise(_BF16X2_ABSMAX_ASM, "=r,r,r", [m, w], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _max_combine(a, b):
    return tl.inline_asm_elementwise("max.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def _words_amax(w, ASM: tl.constexpr):
    """max |x| over the bf16 pairs of words ``w`` as fp32 (NaN ignored, like fmax)."""
    if ASM:
        m = tl.reduce(_bf16x2_absmax_step(tl.zeros_like(w), w), 1, _max_combine)
        m = tl.reduce(m, 0, _max_combine)
        return tl.maximum((m << 16).to(tl.float32, bitcast=True), (m & -65536).to(tl.float32, bitcast=True))
    else:
        lo = tl.abs((w << 16).to(tl.float32, bitcast=True))
        hi = tl.abs((w & -65536).to(tl.float32, bitcast=True))
        return tl.max(tl.max(tl.maximum(lo, hi), axis=1), axis=0)


@triton.jit
def _quotient(a, ts, rcp, FAST_DIV: tl.constexpr):
    """RN(a / ts) (see the comment above ``_nv_load``)."""
    if FAST_DIV:
        return _jit.div_markstein(a, ts, rcp, 3 - FAST_DIV)
    else:
        return tl.math.div_rn(a, tl.zeros_like(a) + ts)


@triton.jit
def _nv_piece(w, ts, rcp, p_row, sf_row, xd_row, H, OFF: tl.constexpr, NBP: tl.constexpr,
              HW_CVT: tl.constexpr, DQ: tl.constexpr, FAST_DIV: tl.constexpr):
    y_e = _quotient(tl.abs((w << 16).to(tl.float32, bitcast=True)), ts, rcp, FAST_DIV)
    y_o = _quotient(tl.abs((w & -65536).to(tl.float32, bitcast=True)), ts, rcp, FAST_DIV)
    yb = tl.max(tl.maximum(y_e, y_o), axis=1)  # = RN(max|x| / ts): RN is monotone
    if FAST_DIV:
        sfv = _jit.div_markstein(yb, 6.0, _jit.RCP6, 2)  # RN(yb / 6); RN(1/6) as fp32
    else:
        sfv = tl.math.div_rn(yb, tl.full((NBP,), 6.0, tl.float32))
    sfv = _jit.e4m3_round(tl.maximum(sfv, _jit.E4M3_MIN_SUB), HW_CVT)
    d = sfv[:, None]
    ce = _jit.e2m1_magnitude(y_e, d) | ((w >> 12) & 8)  # the sign bits of the even and odd element
    co = _jit.e2m1_magnitude(y_o, d) | ((w >> 28) & 8)
    pc = OFF * 8 + tl.arange(0, NBP)[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(p_row + pc, (ce | (co << 4)).to(tl.uint8))
    if HW_CVT:
        sb = sfv.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        sb = _jit.e4m3_value_to_byte(sfv).to(tl.uint8)
    tl.store(sf_row + OFF + tl.arange(0, NBP), sb)
    if DQ == 2:  # exact dequant (token scale NOT applied) as [even k | odd k]
        tl.store(xd_row + pc, (_jit.e2m1_value(ce) * d).to(tl.bfloat16))
        tl.store(xd_row + H // 2 + pc, (_jit.e2m1_value(co) * d).to(tl.bfloat16))
    elif DQ == 3:  # exact dequant in the frag K order
        if NBP % 8 == 0:
            _store_frag_order(xd_row, OFF, NBP, (_jit.e2m1_value(ce) * d).to(tl.bfloat16),
                              (_jit.e2m1_value(co) * d).to(tl.bfloat16))
        else:  # a piece shorter than a 128 block: per element (_jit.frag_pos of natural 2*pc, 2*pc + 1)
            tl.store(xd_row + _jit.frag_pos(2 * pc), (_jit.e2m1_value(ce) * d).to(tl.bfloat16))
            tl.store(xd_row + _jit.frag_pos(2 * pc + 1), (_jit.e2m1_value(co) * d).to(tl.bfloat16))


@triton.jit
def _store_frag_order(xd_row, OFF: tl.constexpr, NBP: tl.constexpr, v_e, v_o):
    """Store the bf16 pairs ``[NBP, 8]`` (even, odd element of word i of block b) in the frag K
    order as whole contiguous rows instead of 2-byte stores scattered by ``_jit.frag_pos``.

    Natural column m of a 128 block is ``32q + 8w + 4h + 2j1 + j0`` and is stored at
    ``32w + 16j1 + 8j0 + 2q + h`` (``_jit.frag_pos``). Here m = 16b + 2i + e, so q = b//2 within
    the block, w = 2(b%2) + i//4, h = (i//2)%2, j1 = i%2, j0 = e: the stored order is a permute
    of the dims (q, b%2, i//4, h, j1, e), which Triton lowers to one exchange through shared
    memory and 16-byte stores."""
    v = tl.join(v_e, v_o)  # [NBP, 8, 2]: (b, i, e)
    v = v.reshape(NBP // 8, 4, 2, 2, 2, 2, 2)  # (block128, q, b%2, i//4, h, j1, e)
    v = tl.permute(v, (0, 2, 3, 5, 6, 1, 4))  # (block128, b%2, i//4, j1, e, q, h) = stored order
    tl.store(xd_row + OFF * 16 + tl.arange(0, NBP * 16), v.reshape(NBP * 16))


@triton.jit
def _nvfp4_row_kernel(x_ptr, p_ptr, sf_ptr, ts_ptr, xd_ptr, H, stride_x, stride_p, stride_sf,
                      P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr,
                      HW_CVT: tl.constexpr, DQ: tl.constexpr, FAST_DIV: tl.constexpr, PDL: tl.constexpr = False):
    _jit.pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + t * stride_x
    p_row = p_ptr + t * stride_p
    sf_row = sf_ptr + t * stride_sf
    xd_row = xd_ptr + t * H
    x0 = _nv_load(x_row, 0, P0)
    amax = _words_amax(x0, HW_CVT)
    if P1 > 0:
        x1 = _nv_load(x_row, P0, P1)
        amax = tl.maximum(amax, _words_amax(x1, HW_CVT))
    if P2 > 0:
        x2 = _nv_load(x_row, P0 + P1, P2)
        amax = tl.maximum(amax, _words_amax(x2, HW_CVT))
    if P3 > 0:
        x3 = _nv_load(x_row, P0 + P1 + P2, P3)
        amax = tl.maximum(amax, _words_amax(x3, HW_CVT))
    # token_scale = max(amax, 1e-12) / 2688, a true division
    ts = tl.math.div_rn(tl.maximum(amax, 1e-12), 2688.0)
    tl.store(ts_ptr + t, ts)
    rcp = tl.math.div_rn(1.0, ts)
    _nv_piece(x0, ts, rcp, p_row, sf_row, xd_row, H, 0, P0, HW_CVT, DQ, FAST_DIV)
    if P1 > 0:
        _nv_piece(x1, ts, rcp, p_row, sf_row, xd_row, H, P0, P1, HW_CVT, DQ, FAST_DIV)
    if P2 > 0:
        _nv_piece(x2, ts, rcp, p_row, sf_row, xd_row, H, P0 + P1, P2, HW_CVT, DQ, FAST_DIV)
    if P3 > 0:
        _nv_piece(x3, ts, rcp, p_row, sf_row, xd_row, H, P0 + P1 + P2, P3, HW_CVT, DQ, FAST_DIV)


#: The largest row the row kernel holds in registers, and its piece count.
_NV_ROW_MAX_H = 8192
_NV_ROW_MAX_PIECES = 4
_NVFP4_IMPLS = ("row", "chunk")


def _nv_pieces(H: int) -> list[int] | None:
    """H/16 blocks as descending powers of two (at most four), or None if the row kernel cannot hold it."""
    nb = H // 16
    if H > _NV_ROW_MAX_H:
        return None
    pieces = [1 << b for b in range(nb.bit_length() - 1, -1, -1) if nb >> b & 1]
    return pieces if len(pieces) <= _NV_ROW_MAX_PIECES else None


@triton.jit
def _div_proof_kernel(out_ptr, STEPS: tl.constexpr, SIX: tl.constexpr, BLOCK: tl.constexpr):
    # divisors: BLOCK consecutive fp32 significands in [1, 2); numerators: the 128 bf16
    # significands in [1, 2) (SIX: every fp32 significand in [1, 2), divided by 6)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bad = tl.zeros((BLOCK,), tl.int32)
    if SIX:
        a = (0x3F800000 + i).to(tl.float32, bitcast=True)
        b = tl.zeros((BLOCK,), tl.float32) + 6.0
        q = _jit.div_markstein(a, b, _jit.RCP6, STEPS)
        bad += (q != tl.math.div_rn(a, b)).to(tl.int32)
    else:
        b = (0x3F800000 + i).to(tl.float32, bitcast=True)
        rcp = tl.math.div_rn(tl.zeros((BLOCK,), tl.float32) + 1.0, b)
        for m in range(128):
            a = tl.zeros((BLOCK,), tl.int32).to(tl.float32, bitcast=True) + (0x3F800000 + m * 65536).to(
                tl.float32, bitcast=True)
            q = _jit.div_markstein(a, b, rcp, STEPS)
            bad += (q != tl.math.div_rn(a, b)).to(tl.int32)
    tl.atomic_add(out_ptr, tl.sum(bad, axis=0))


def division_mismatches(steps: int, six: bool = False, device: str = "cuda") -> int:
    """Quotients where ``_jit.div_markstein`` with ``steps`` residual steps differs from div_rn.

    ``six=False``: every bf16 numerator significand (128) against every fp32 divisor significand
    (2^23), the row kernel's |x| / token_scale; ``six=True``: every fp32 numerator significand
    divided by 6 (the block scale). Power-of-two scaling of both operands scales every step
    exactly, so this covers all operands whose quotient and residuals stay normal; smaller
    quotients (< 2^-49 here) are far below every E2M1 decision threshold (>= 2^-11)."""
    out = torch.zeros(1, dtype=torch.int32, device=device)
    block = 1024
    _div_proof_kernel[((1 << 23) // block,)](out, STEPS=steps, SIX=six, BLOCK=block, **_launch_opts())
    return int(out.item())


#: Residual steps of the row kernel's fast division (``_jit.div_markstein``): 2 is Markstein's proof;
#: 1 is what the kernel runs, because ``division_mismatches(1)`` is 0 on the H200 (every bf16
#: numerator significand against every fp32 divisor significand; ``bench/staging.py
#: --prove-div`` and the GPU test ``test_staging_fast_division_proof`` check it again).
NV_DIV_STEPS = 1


def quantize_nvfp4_per_token(x: torch.Tensor, *, hw_cvt: bool | None = None, dequant: str | None = None,
                             impl: str | None = None, fast_div: bool | None = None, num_warps: int | None = None,
                             div_steps: int | None = None, maxnreg: int | None = None):
    """NVFP4 dispatch of ``x`` ``[T, H]`` (H % 64 == 0) with one FP32 scale per token.

    Returns ``(packed uint8 [T, H/2], sf float8_e4m3fn [T, H/16],
    x_sf int32 [T, H/64] (view of sf), token_scale float32 [T])``, plus with
    ``dequant="split"`` the exact bf16 ``e2m1 * sf`` (token scale not applied)
    as [even k | odd k] (``"frag"``: in the frag K order of ``_jit.frag_pos``). Bit-exact with ``codecs.quantize_nvfp4_per_token`` (ties even).

    ``impl``: "row" (default where it fits: a whole token per program, see
    ``_nvfp4_row_kernel``) or "chunk" (the two-pass kernel, any H); ``fast_div``
    (default: on with the hardware conversions) picks the FMA-corrected division in
    the row kernel, ``div_steps`` its residual steps (default ``NV_DIV_STEPS``);
    ``num_warps`` and ``maxnreg`` override its launch width and register cap (benchmarks).
    """
    _check_x(x, 64, "quantize_nvfp4_per_token")
    T, H = x.shape
    hw = hw_cvt_default() if hw_cvt is None else hw_cvt
    dq = _dq_code(dequant)
    if dq in (1, 4):
        raise _err("quantize_nvfp4_per_token: only dequant='split' or 'frag' is implemented (the e2m1 GEMM orders)")
    packed = torch.empty(T, H // 2, dtype=torch.uint8, device=x.device)
    sf = torch.empty(T, H // 16, dtype=torch.uint8, device=x.device)
    ts = torch.empty(T, dtype=torch.float32, device=x.device)
    xd = torch.empty(T, H, dtype=torch.bfloat16, device=x.device) if dq else packed
    if impl not in (None,) + _NVFP4_IMPLS:
        raise _err(f"quantize_nvfp4_per_token: impl={impl!r}; valid: {', '.join(_NVFP4_IMPLS)}")
    pieces = _nv_pieces(H) if impl != "chunk" else None
    if impl == "row" and pieces is None:
        raise _err(f"quantize_nvfp4_per_token: impl='row' cannot hold H={H} "
                   f"(at most {_NV_ROW_MAX_H}, H/16 a sum of at most {_NV_ROW_MAX_PIECES} powers of two)")
    if T and pieces is not None:
        pp = pieces + [0] * (_NV_ROW_MAX_PIECES - len(pieces))
        fd = hw if fast_div is None else fast_div
        steps = NV_DIV_STEPS if div_steps is None else div_steps
        if steps not in (1, 2):
            raise _err(f"quantize_nvfp4_per_token: div_steps={steps!r}; valid: 1, 2")
        opts = _launch_opts() | ({"maxnreg": maxnreg} if maxnreg else {})
        # 4 warps measured fastest for the plain quantization (bench/staging.py: 63 vs 77 us at
        # 4096 x 7168); the dequantizing variant keeps the 8 it was measured with at H >= 4096
        nw = num_warps or (8 if dq and H >= 4096 else 4)
        _nvfp4_row_kernel[(T,)](x, packed, sf, ts, xd, H, x.stride(0), packed.stride(0), sf.stride(0),
                                P0=pp[0], P1=pp[1], P2=pp[2], P3=pp[3], HW_CVT=hw, DQ=dq,
                                FAST_DIV=(3 - steps) if fd else 0, num_warps=nw, **opts, **pdl(x.device))
    elif T:
        nb = min(64, triton.next_power_of_2(H // 16))
        _nvfp4_token_kernel[(T,)](x, packed, sf, ts, xd, H, x.stride(0), packed.stride(0), sf.stride(0),
                                  NB=nb, HW_CVT=hw, DQ=dq, num_warps=4, **_launch_opts(), **pdl(x.device))
    out = (packed, sf.view(torch.float8_e4m3fn), sf.view(torch.int32), ts)
    return out + (xd,) if dq else out


# --------------------------------------------------------------------------- BF16


@triton.jit
def _copy_kernel(x_ptr, y_ptr, H, stride_x, stride_y, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < H
    tl.store(y_ptr + t * stride_y + c, tl.load(x_ptr + t * stride_x + c, mask=m), mask=m)


def bf16_passthrough(x: torch.Tensor) -> torch.Tensor:
    """The BF16 row's dispatch: the hidden states copied unchanged into a fresh buffer."""
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise _err(f"bf16_passthrough: expected bf16 [T, H], got {x.dtype} {tuple(x.shape)}")
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    T, H = x.shape
    if T:
        blk = 2048
        _copy_kernel[(T, triton.cdiv(H, blk))](x, y, H, x.stride(0), y.stride(0), BLOCK=blk, num_warps=4)
    return y


# --------------------------------------------------------------------------- routing


@dataclass(frozen=True)
class RoutingPlan:
    """Device-side routing metadata for a grouped GEMM over local experts.

    ``sorted_pairs`` int32 ``[max_blocks*block_m]``: pair ids ``t*K + k``
    grouped by local expert, each expert's run padded with -1 to a multiple
    of ``block_m``; ``block_expert`` int32 ``[max_blocks]``: the local expert
    of each row block (-1 past the end); ``num_blocks`` int32 ``[1]``.
    ``max_blocks`` is a host bound (no sync): ``n_pairs // block_m +
    min(n_pairs, E_l)``. Order within one expert's run is unspecified (each
    pair's output depends only on that pair).
    """

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    num_blocks: torch.Tensor
    block_m: int
    max_blocks: int
    top_k: int


def _max_blocks_for(n_pairs: int, num_local: int, block_m: int) -> int:
    return n_pairs // block_m + min(n_pairs, num_local)


@triton.jit
def _route_block_table(incl, e, E_l, nblk, blk_ptr, max_blocks, BM: tl.constexpr, NB_CHUNK: tl.constexpr):
    # block b belongs to the expert whose padded run holds row b * BM: the number of runs that
    # end at or before it (incl = inclusive sum of the padded counts); -1 past the last block
    for s in range(0, max_blocks, NB_CHUNK):
        b = s + tl.arange(0, NB_CHUNK)
        below = (incl[None, :] <= (b * BM)[:, None]) & (e[None, :] < E_l)
        ex = tl.sum(below.to(tl.int32), axis=1)
        tl.store(blk_ptr + b, tl.where(b < nblk, ex, -1), mask=b < max_blocks)


@triton.jit
def _route_local_ids(ids_ptr, o, n_pairs, e_lo, E_l):
    m = o < n_pairs
    le = tl.load(ids_ptr + o, mask=m, other=-1).to(tl.int32) - e_lo
    valid = m & (le >= 0) & (le < E_l)
    return tl.where(valid, le, 0), valid


@triton.jit
def _route_hist_kernel(ids_ptr, n_pairs, e_lo, E_l, hist_ptr, SLICE: tl.constexpr, E_LP: tl.constexpr,
                       PDL: tl.constexpr = False):
    _jit.pdl_start(PDL)
    # one histogram row per slice of pairs, no atomics
    p = tl.program_id(0)
    le, valid = _route_local_ids(ids_ptr, p * SLICE + tl.arange(0, SLICE), n_pairs, e_lo, E_l)
    tl.store(hist_ptr + p * E_LP + tl.arange(0, E_LP), tl.histogram(le, E_LP, mask=valid))


@triton.jit
def _route_place_kernel(ids_ptr, n_pairs, e_lo, E_l, hist_ptr, cur_ptr, n_slices, sorted_ptr, blk_ptr, nblk_ptr,
                        max_blocks, max_pad, BM: tl.constexpr, E_LP: tl.constexpr, SLICE: tl.constexpr,
                        H_CHUNK: tl.constexpr, NB_CHUNK: tl.constexpr, PAD_J: tl.constexpr,
                        TAIL: tl.constexpr, PDL: tl.constexpr = False):
    _jit.pdl_start(PDL)
    # Every program reads all the histogram rows: the expert totals give the padded runs (the
    # same layout as _route_kernel), the rows before its own give where its slice's pairs of
    # each expert start. Then it places its pairs with atomics on its own counter row only
    # (contention inside one CTA, not across the grid), fills the padding of the experts it
    # owns (e % n_slices) and its share of the tail; program 0 writes the block table.
    p = tl.program_id(0)
    e = tl.arange(0, E_LP)
    c = tl.zeros((E_LP,), tl.int32)
    before = tl.zeros((E_LP,), tl.int32)
    for s in range(0, n_slices, H_CHUNK):
        r = s + tl.arange(0, H_CHUNK)
        h = tl.load(hist_ptr + r[:, None] * E_LP + e[None, :], mask=(r < n_slices)[:, None], other=0)
        c += tl.sum(h, axis=0)
        before += tl.sum(tl.where((r < p)[:, None], h, 0), axis=0)
    pc = (c + BM - 1) // BM * BM
    incl = tl.cumsum(pc, 0)
    excl = incl - pc
    nblk = tl.sum(pc, 0) // BM
    if p == 0:
        tl.store(nblk_ptr, nblk)
        _route_block_table(incl, e, E_l, nblk, blk_ptr, max_blocks, BM, NB_CHUNK)
    mine = (e % n_slices) == p
    for j0 in range(0, BM, PAD_J):
        j = j0 + tl.arange(0, PAD_J)
        pad = (excl + c)[:, None] + j[None, :]
        tl.store(sorted_ptr + pad, tl.full((E_LP, PAD_J), -1, tl.int32),
                 mask=mine[:, None] & (j[None, :] < (pc - c)[:, None]))
    for s in range(nblk * BM + p * TAIL, max_pad, n_slices * TAIL):
        o = s + tl.arange(0, TAIL)
        tl.store(sorted_ptr + o, tl.full((TAIL,), -1, tl.int32), mask=o < max_pad)
    tl.store(cur_ptr + p * E_LP + e, excl + before)
    tl.debug_barrier()
    o = p * SLICE + tl.arange(0, SLICE)
    le, valid = _route_local_ids(ids_ptr, o, n_pairs, e_lo, E_l)
    pos = tl.atomic_add(cur_ptr + p * E_LP + le, tl.full((SLICE,), 1, tl.int32), mask=valid, sem="relaxed")
    tl.store(sorted_ptr + pos, o, mask=valid)


@triton.jit
def _route_kernel(ids_ptr, n_pairs, e_lo, E_l, cnt_ptr, sorted_ptr, blk_ptr, nblk_ptr, max_blocks, max_pad,
                  BM: tl.constexpr, E_LP: tl.constexpr, CHUNK: tl.constexpr, NB_CHUNK: tl.constexpr,
                  PDL: tl.constexpr = False):
    _jit.pdl_start(PDL)
    # Single program. Phases are separated by CTA barriers; scratch written in
    # this kernel is read back with volatile loads (L1 is not coherent with atomics).
    e = tl.arange(0, E_LP)
    tl.store(cnt_ptr + e, tl.zeros((E_LP,), tl.int32))
    neg = tl.full((CHUNK,), -1, tl.int32)
    for s in range(0, max_pad, CHUNK):
        o = s + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + o, neg, mask=o < max_pad)
    tl.debug_barrier()
    for s in range(0, n_pairs, CHUNK):
        le, valid = _route_local_ids(ids_ptr, s + tl.arange(0, CHUNK), n_pairs, e_lo, E_l)
        tl.atomic_add(cnt_ptr + le, tl.full((CHUNK,), 1, tl.int32), mask=valid, sem="relaxed")
    tl.debug_barrier()
    c = tl.load(cnt_ptr + e, volatile=True)
    pc = (c + BM - 1) // BM * BM
    incl = tl.cumsum(pc, 0)
    excl = incl - pc
    nblk = tl.sum(pc, 0) // BM
    tl.store(nblk_ptr, nblk)
    _route_block_table(incl, e, E_l, nblk, blk_ptr, max_blocks, BM, NB_CHUNK)
    tl.debug_barrier()
    tl.store(cnt_ptr + e, excl)
    tl.debug_barrier()
    for s in range(0, n_pairs, CHUNK):
        p = s + tl.arange(0, CHUNK)
        le, valid = _route_local_ids(ids_ptr, p, n_pairs, e_lo, E_l)
        pos = tl.atomic_add(cnt_ptr + le, tl.full((CHUNK,), 1, tl.int32), mask=valid, sem="relaxed")
        tl.store(sorted_ptr + pos, p, mask=valid)


#: up to this many pairs the routing is one single-program launch; above, its atomics on a few
#: hundred shared counters cost more than a second launch (``bench/route.py``; docs/bench-log/kernels.md:
#: 121 -> 32 us at 32768 pairs, 29.5 -> 22 us at 4096, 6.9 vs 9.4 us at 8)
ROUTE_ONE_PROGRAM_MAX = 1024


def route_slice(n_pairs: int) -> int:
    """Pairs per program of the routing for ``n_pairs`` (0: the single-program kernel): more
    programs pay off while each still has a few pairs per expert; past that, every program
    rereads all the histogram rows, so slices grow with the pair count."""
    if n_pairs <= ROUTE_ONE_PROGRAM_MAX:
        return 0
    return 256 if n_pairs <= 8192 else 1024


def route(topk_ids: torch.Tensor, num_local: int, expert_offset: int, block_m: int,
          slice_pairs: Optional[int] = None) -> RoutingPlan:
    """Group the (token, slot) pairs of ``topk_ids`` ``[T, K]`` (GLOBAL ids, -1 masked)
    by local expert ``id - expert_offset`` in ``[0, num_local)``; other ids are dropped.

    ``slice_pairs``: 0 runs the single-program kernel, a power of two the two-launch form with
    that many pairs per program (histograms, then placement); None: ``route_slice``.
    Both give the same plan up to the order inside each expert's run."""
    if topk_ids.dim() != 2:
        raise _err(f"route: topk_ids must be [T, K], got {tuple(topk_ids.shape)}")
    if slice_pairs and (slice_pairs < 16 or slice_pairs & (slice_pairs - 1)):
        raise _err(f"route: slice_pairs must be 0 or a power of two >= 16, got {slice_pairs}")
    T, K = topk_ids.shape
    n = T * K
    dev = topk_ids.device
    mb = _max_blocks_for(n, num_local, block_m)
    sorted_pairs = torch.empty(max(mb * block_m, 1), dtype=torch.int32, device=dev)
    block_expert = torch.empty(max(mb, 1), dtype=torch.int32, device=dev)
    # the routing kernel stores the block count unconditionally: a zero fill (one more launch in
    # every forward, docs/bench-log/kernels.md) is needed only when it does not run
    num_blocks = (torch.empty if n else torch.zeros)(1, dtype=torch.int32, device=dev)
    if n:
        e_lp = max(triton.next_power_of_2(num_local), 16)
        nb_chunk = max(16, min(64, 8192 // e_lp))
        ids = topk_ids.reshape(-1)
        if not ids.is_contiguous():
            ids = ids.contiguous()
        if slice_pairs is None:
            slice_pairs = route_slice(n)
        if slice_pairs:
            n_slices = triton.cdiv(n, slice_pairs)
            scratch = torch.empty(2, n_slices, e_lp, dtype=torch.int32, device=dev)
            _route_hist_kernel[(n_slices,)](ids, n, expert_offset, num_local, scratch[0], SLICE=slice_pairs,
                                            E_LP=e_lp, num_warps=4, **pdl(dev))
            _route_place_kernel[(n_slices,)](ids, n, expert_offset, num_local, scratch[0], scratch[1], n_slices,
                                             sorted_pairs, block_expert, num_blocks, mb, mb * block_m, BM=block_m,
                                             E_LP=e_lp, SLICE=slice_pairs, H_CHUNK=max(1, min(16, 4096 // e_lp)),
                                             NB_CHUNK=nb_chunk, PAD_J=16, TAIL=1024, num_warps=8, **pdl(dev))
        else:
            cnt = torch.empty(e_lp, dtype=torch.int32, device=dev)
            _route_kernel[(1,)](ids, n, expert_offset, num_local, cnt, sorted_pairs, block_expert, num_blocks, mb,
                                mb * block_m, BM=block_m, E_LP=e_lp, CHUNK=1024, NB_CHUNK=nb_chunk, num_warps=8,
                                **pdl(dev))
    return RoutingPlan(sorted_pairs, block_expert, num_blocks, block_m, mb, K)


@triton.jit
def _split_tails_kernel(sorted_ptr, blk_ptr, nblk_ptr, max_blocks, tsorted_ptr, tblk_ptr, tnblk_ptr, max_tail,
                        BM: tl.constexpr, TBM: tl.constexpr, TMAX: tl.constexpr, CB: tl.constexpr,
                        TCHUNK: tl.constexpr, PDL: tl.constexpr = False):
    _jit.pdl_start(PDL)
    # Single program, CB row blocks at a time. A block is its expert's last when the next block's
    # expert differs; its pairs sit first (the padding follows them), so counting ids >= 0 gives its
    # fill. Blocks are only ever read before this program marks them, so no barrier is needed.
    nblk = tl.load(nblk_ptr)
    carry = nblk * 0
    for s in range(0, max_blocks, CB):
        b = s + tl.arange(0, CB)
        inb = b < nblk
        e = tl.load(blk_ptr + b, mask=inb, other=-1)
        e_next = tl.load(blk_ptr + b + 1, mask=(b + 1) < nblk, other=-1)
        last = inb & (e >= 0) & (e_next != e)
        i = tl.arange(0, BM)
        rows = tl.load(sorted_ptr + b[:, None] * BM + i[None, :], mask=last[:, None], other=-1)
        fill = tl.sum((rows >= 0).to(tl.int32), axis=1)
        tail = last & (fill > 0) & (fill <= TMAX)
        ns = tl.where(tail, (fill + TBM - 1) // TBM, 0)
        start = carry + tl.cumsum(ns, 0) - ns
        tl.store(blk_ptr + b, tl.full((CB,), -1, tl.int32), mask=tail)
        it = tl.arange(0, TBM)
        for j in tl.static_range(TMAX // TBM + (TMAX % TBM > 0)):
            ok = tail & (j < ns)
            t = start + j
            tl.store(tblk_ptr + t, e, mask=ok)
            v = tl.load(sorted_ptr + b[:, None] * BM + j * TBM + it[None, :], mask=ok[:, None], other=-1)
            tl.store(tsorted_ptr + t[:, None] * TBM + it[None, :], v, mask=ok[:, None])
        carry += tl.sum(ns, 0)
    tl.store(tnblk_ptr, carry)
    for s in range(0, max_tail, TCHUNK):
        t = s + tl.arange(0, TCHUNK)
        tl.store(tblk_ptr + t, tl.full((TCHUNK,), -1, tl.int32), mask=(t >= carry) & (t < max_tail))


def split_tails(plan: RoutingPlan, num_local: int, tail_block_m: int, tail_max: int) -> RoutingPlan:
    """Move each expert's last row block of ``plan`` into a plan of ``tail_block_m``-pair blocks
    when it holds at most ``tail_max`` pairs; those blocks of ``plan`` get expert -1 (the GEMM
    tiles skip them). Why: at prefill a 128-pair tile costs the same with 9 pairs as with 128 (the
    whole expert tile is decoded and every MMA row is issued), and about half the experts end in
    such a short block; a small-block launch for them costs a fraction of that (docs/KERNELS.md,
    "Tail blocks"). The rows of both plans are the same pairs, so each pair is computed once and
    the output does not change. One single-program launch, no host sync."""
    bm = plan.block_m
    if tail_block_m < 16 or tail_block_m & (tail_block_m - 1) or bm % tail_block_m:
        raise _err(f"split_tails: tail_block_m must be a power of two >= 16 dividing {bm}, got {tail_block_m}")
    if not 0 < tail_max < bm:
        raise _err(f"split_tails: tail_max must be in 1..{bm - 1} pairs, got {tail_max}")
    dev = plan.block_expert.device
    per_expert = triton.cdiv(tail_max, tail_block_m)
    # host bound without a sync: at most one tail per local expert (and per row block)
    max_tail = max(1, min(plan.max_blocks, num_local) * per_expert)
    tsorted = torch.empty(max_tail * tail_block_m, dtype=torch.int32, device=dev)
    tblk = torch.empty(max_tail, dtype=torch.int32, device=dev)
    tnblk = torch.empty(1, dtype=torch.int32, device=dev)
    _split_tails_kernel[(1,)](plan.sorted_pairs, plan.block_expert, plan.num_blocks, plan.max_blocks,
                              tsorted, tblk, tnblk, max_tail, BM=bm, TBM=tail_block_m, TMAX=tail_max,
                              CB=max(1, min(64, 4096 // bm)), TCHUNK=1024, num_warps=8,
                              **pdl(plan.sorted_pairs.device))
    return RoutingPlan(tsorted, tblk, tnblk, tail_block_m, max_tail, plan.top_k)


# --------------------------------------------------------------------------- checks


def _err(msg: str):
    from megamoe_runtime.errors import MegaMoEError

    return MegaMoEError(msg)


def _check_x(x: torch.Tensor, multiple: int, what: str) -> None:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise _err(f"{what}: expected hidden states [T, H] in bf16/fp16/fp32, got {x.dtype} {tuple(x.shape)}")
    if x.shape[1] % multiple:
        raise _err(f"{what}: H={x.shape[1]} must be a multiple of {multiple}")
    if x.stride(1) != 1:
        raise _err(f"{what}: the last dim must be contiguous (stride {x.stride()})")
