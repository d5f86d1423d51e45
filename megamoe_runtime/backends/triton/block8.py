"""The block-FP8 row (``fp8_block``) on Hopper's FP8 tensor cores (wgmma e4m3 x e4m3, fp32 accumulators).

The row (docs/NUMERICS.md#fp8-block, the SM90 recipe (128, 128, 128)): E4M3 weights with one fp32
scale per 128x128 block; activations quantized to E4M3 with one fp32 scale per token and 128 of K.
Both operands stay 8-bit all the way into the MMA:

* dispatch: ``quantize_b128`` writes the tokens' E4M3 bytes and their fp32 scales
  (``codecs.quantize_fp8_act(x, 128)``: ``s = max(amax, 1e-10) / 448``, ``q = e4m3(x * (1 / s))``);
  ``row_scales`` copies the scales into the routing plan's row order, K-block major ``[H/128, rows]``;
* main loop: one fresh ``tl.dot`` per block of K (128 in L1; in L2 the intermediate's scale group,
  64), whose fp32 partial leaves the tensor core once and is added to the fp32 accumulator as
  ``acc + p * (s_w * s_x)``, in ascending K, as ``reference.block_scaled_mm``. Hopper has no
  block-scaled MMA, so the scales are applied here, one promotion per block (bench/mx_mma_rate.py
  ``fp8-k128``: 0.92x the chained bf16 rate for one per 128). The L1 runs its gate rows and its up rows
  as two dots (kernel row ``16 * (j // 8) + j % 8`` is gate column j, 8 rows further its up column,
  docs/LAYOUT.md#sm90-block-fp8), so every row of a dot shares one weight scale per K block and
  ``s_w * s_x`` is formed once per token; the pointers are typed E4M3, so both tiles go from the
  shared memory their copies land in straight into the MMA (docs/KERNELS.md "The block-FP8 row");
* L1 epilogue: the fp32 clamp, ``(g * (1 / (1 + exp(-g)))) * u``, times the top-k weight times the
  routed scaling factor, and the intermediate's requantization to E4M3 per token and 64 columns
  (``s = max(amax, 1e-10) * fp32(1/448)``), its scales K-block major ``[I/64, rows]``; padding rows
  are written too (zeros), so the L2 reads whole row blocks unmasked;
* L2: bf16 slot outputs, summed by the rows' common ``l2.combine`` (fp32, ascending slot).

Weight scales are fp32 ``[E_l, N/128, K/128]`` read through their strides; the L1 scale rows are in
the source's ``[gate | up]`` order (only the weight rows are interleaved): intermediate column j's gate
scale row is ``j // 128``, its up scale row ``I/128 + j // 128``.

Numerics: every step is the reference's except the sum of the exact E4M3 products inside one MMA
block, which the tensor core adds in its own order and with fewer than fp32's bits (docs/KERNELS.md
"The block-FP8 row"); the promotions, the epilogue's rounding points and the combine are the
reference's to the bit. Under ``TRITON_INTERPRET=1`` the operands are decoded to fp32 and multiplied
with an IEEE dot instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import triton
import triton.language as tl

from megamoe_runtime.format.codecs import FP8_ACT_AMAX_FLOOR
from megamoe_runtime.backends.reference import FP8_INTERMEDIATE_GROUP

from . import _jit
from .configs import W_E4M3_B128  # noqa: F401  (the weight kind of this row)

#: K per weight scale block and per dispatch scale
_BLOCK = 128
#: the same, for the kernels
_KB = tl.constexpr(_BLOCK)


# --------------------------------------------------------------------------- rounding rules

#: fp32 values of the reference's constants (``codecs.quantize_fp8_act``), exact as Triton constants
_AMAX_FLOOR = tl.constexpr(float(torch.tensor(FP8_ACT_AMAX_FLOOR, dtype=torch.float32)))
_INV_E4M3_MAX = tl.constexpr(float(torch.tensor(1.0 / 448.0, dtype=torch.float32)))


@triton.jit
def _scale_and_inverse(amax, RECIPROCAL: tl.constexpr):
    """(s, 1/s) of a 1xG block with absolute maximum ``amax``: ``m = max(amax, 1e-10)``, then
    ``s = m / 448`` (a true division: the dispatch) or ``s = m * fp32(1/448)`` (RECIPROCAL: the
    intermediate), and a true reciprocal (``codecs.quantize_fp8_act``)."""
    a = tl.maximum(amax, _AMAX_FLOOR)
    if RECIPROCAL:
        s = a * _INV_E4M3_MAX
    else:
        s = tl.math.div_rn(a, tl.full(a.shape, 448.0, tl.float32))
    inv = tl.math.div_rn(tl.full(a.shape, 1.0, tl.float32), s)
    return s, inv


@triton.jit
def _silu_mul(g, u, clamp_c, HAS_CLAMP: tl.constexpr, GPU: tl.constexpr):
    """``(g * (1 / (1 + exp(-g)))) * u`` on the fp32 accumulators, clamped first (``min(g, c)``,
    ``clamp(u, -c, c)``, c the fp32 clamp): the row's activation (``reference._block_fp8_expert``)."""
    if HAS_CLAMP:
        g = tl.minimum(g, clamp_c)
        u = tl.maximum(tl.minimum(u, clamp_c), -clamp_c)
    one = tl.full(g.shape, 1.0, tl.float32)
    return (g * tl.math.div_rn(one, one + _jit.expf(-g, GPU))) * u


@triton.jit
def _e4m3_bytes(q, HW_CVT: tl.constexpr):
    """uint8 bytes of fp32 values that are exactly E4M3 (``_jit.e4m3_round``'s output)."""
    if HW_CVT:
        return q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return _jit.e4m3_value_to_byte(q).to(tl.uint8)


# --------------------------------------------------------------------------- dispatch


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, H, stride_x, G: tl.constexpr, BLOCK_G: tl.constexpr, HW_CVT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    col = g[:, None] * G + tl.arange(0, G)[None, :]
    mask = col < H
    x = tl.load(x_ptr + t * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    s, inv = _scale_and_inverse(tl.max(tl.abs(x), axis=1), False)
    q = _jit.e4m3_round(x * inv[:, None], HW_CVT)
    tl.store(q_ptr + t * H + col, _e4m3_bytes(q, HW_CVT), mask=mask)
    tl.store(s_ptr + t * (H // G) + g, s, mask=g * G < H)


# --------------------------------------------------------------------------- GEMM


@triton.jit
def _row_scales_kernel(xs_ptr, pair_ptr, out_ptr, NROWS, NK, TOPK, NPAIRS, BR: tl.constexpr, BK: tl.constexpr):
    """out[k, r] = the dispatch scale of row r's token at K block k (0 on a padding row)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    pair = tl.load(pair_ptr + r, mask=r < NROWS, other=-1)
    ok = (pair >= 0) & (pair < NPAIRS)
    valid = ok[:, None] & (k < NK)[None, :]
    tok = (tl.where(ok, pair, 0) // TOPK).to(tl.int64)
    v = tl.load(xs_ptr + tok[:, None] * NK + k[None, :], mask=valid, other=0.0)
    tl.store(out_ptr + k[None, :].to(tl.int64) * NROWS + r[:, None], v, mask=(r < NROWS)[:, None] & (k < NK)[None, :])




@triton.jit
def _e4m3_ptr(ptr, HW_CVT: tl.constexpr):
    """The same bytes typed E4M3 on the GPU, so a tile reaches the MMA straight from the shared memory its
    copy landed in (a uint8 tile bitcast in registers is copied through shared memory again every block)."""
    if HW_CVT:
        return ptr.to(tl.pointer_type(tl.float8e4nv))
    else:
        return ptr


@triton.jit
def _dot8(w, x, HW_CVT: tl.constexpr, EXACT: tl.constexpr):
    """fp32 ``w @ x^T`` of E4M3 tiles ``w [R, KB]`` and ``x [BM, KB]`` (typed E4M3 by ``_e4m3_ptr``): the FP8
    MMA on the GPU; EXACT: the same E4M3 values as bf16 (exact) through the bf16 MMA, which sums the exact
    products to fp32's precision (a diagnostic: it isolates the FP8 MMA's own sum); exact fp32 operands
    decoded from the bytes and an IEEE dot under the interpreter."""
    if HW_CVT and EXACT:
        return tl.dot(w.to(tl.bfloat16), tl.trans(x.to(tl.bfloat16)))
    elif HW_CVT:
        return tl.dot(w, tl.trans(x))
    else:
        return tl.dot(_jit.e4m3_byte_to_f32(w, False), tl.trans(_jit.e4m3_byte_to_f32(x, False)),
                      input_precision="ieee")


@triton.jit
def _promote(acc, p, sw, sx, ROW_SCALES: tl.constexpr):
    """acc + p * (s_w * s_x): the scale product rounded once, then the multiply and the add each rounded
    (the kernels are compiled without fp contraction). ``sw`` is one scale for every row of the tile, or
    (ROW_SCALES) one per row; either way each element gets the same three roundings, but with one scale the
    products are formed once per token instead of once per element."""
    if ROW_SCALES:
        return acc + p * (sw[:, None] * sx[None, :])
    else:
        return acc + p * (sw * sx)[None, :]


@triton.jit
def _l1_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, pair_ptr, blk_ptr, nblk_ptr, tw_ptr, act_ptr, as_ptr,
               NROWS, H, I, TOPK, stride_we, stride_wn, ws_se, ws_sn, ws_sk,
               rsf, clamp_c, HAS_CLAMP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GA: tl.constexpr,
               PAIRED: tl.constexpr, HW_CVT: tl.constexpr, EXACT: tl.constexpr):
    """h = x @ W13^T for BN intermediate columns (their BN gate and BN up kernel rows) of one row block,
    then the epilogue (clamp, silu(g) * u, top-k weight * rsf, E4M3 requant per GA) -> act bytes + scales.

    Gate and up are two dots of BN rows each (kernel row ``16 * (j // 8) + j % 8`` is gate column j, 8
    rows further its up column): the split needs no shuffle of the accumulator, and each dot's rows share
    one weight scale per K block (the tile lies in one 128-column scale block: BN divides 128). PAIRED
    issues both dots of a K block before the first promotion; otherwise each dot is promoted before the next
    is issued (one fp32 partial live instead of two). The promotions stay in ascending K per element."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    nb = tl.load(nblk_ptr)
    e = tl.load(blk_ptr + pid_m)
    if (pid_m >= nb) | (e < 0):  # past the plan's blocks (``e < 0`` keeps the expert's load above the exit)
        return
    pair = tl.load(pair_ptr + pid_m * BM + tl.arange(0, BM))
    mvalid = pair >= 0
    pair = tl.where(mvalid, pair, 0)
    tok = (pair // TOPK).to(tl.int64)
    e64 = e.to(tl.int64)
    j = pid_n * BN + tl.arange(0, BN)
    i = tl.arange(0, _KB)
    wg = _e4m3_ptr(w_ptr, HW_CVT) + e64 * stride_we + (16 * (j // 8) + j % 8)[:, None] * stride_wn + i[None, :]
    wu = wg + 8 * stride_wn
    xp = _e4m3_ptr(x_ptr, HW_CVT) + (tok * H)[:, None] + i[None, :]
    orow = pid_m * BM + tl.arange(0, BM)
    # scale rows in the source's [gate | up] order: gate column j's block j // 128, up's I/128 further
    sgp = ws_ptr + e64 * ws_se + ((pid_n * BN) // _KB) * ws_sn
    sup = sgp + (I // _KB) * ws_sn
    acc_g = tl.zeros((BN, BM), tl.float32)
    acc_u = tl.zeros((BN, BM), tl.float32)
    for k0 in range(0, H, _KB):
        x = tl.load(xp + k0)  # a padding row reads token 0; its scale is 0
        sx = tl.load(xs_ptr + (k0 // _KB) * NROWS + orow)
        kb = (k0 // _KB) * ws_sk
        p_g = _dot8(tl.load(wg + k0), x, HW_CVT, EXACT)
        if PAIRED:
            p_u = _dot8(tl.load(wu + k0), x, HW_CVT, EXACT)
            acc_g = _promote(acc_g, p_g, tl.load(sgp + kb), sx, False)
            acc_u = _promote(acc_u, p_u, tl.load(sup + kb), sx, False)
        else:
            acc_g = _promote(acc_g, p_g, tl.load(sgp + kb), sx, False)
            p_u = _dot8(tl.load(wu + k0), x, HW_CVT, EXACT)
            acc_u = _promote(acc_u, p_u, tl.load(sup + kb), sx, False)
    a = _silu_mul(acc_g, acc_u, clamp_c, HAS_CLAMP, HW_CVT)
    w = tl.load(tw_ptr + pair, mask=mvalid, other=0.0) * rsf
    q, s = _requant(a * w[None, :], BN, BM, GA, HW_CVT)
    # padding rows too (zeros, finite scales): the L2 then reads every row of a block unmasked
    tl.store(act_ptr + orow.to(tl.int64)[None, :] * I + j[:, None], q)
    jg = pid_n * (BN // GA) + tl.arange(0, BN // GA)
    tl.store(as_ptr + jg[:, None] * NROWS + orow[None, :], s)


@triton.jit
def _requant(a, BN: tl.constexpr, BM: tl.constexpr, GA: tl.constexpr, HW_CVT: tl.constexpr):
    """E4M3 of ``a`` [BN (K of L2), BM] per GA rows of a column: (uint8 bytes [BN, BM], fp32 scales
    [BN / GA, BM]), the intermediate's rule (``s = max(amax, 1e-10) * fp32(1/448)``)."""
    a3 = a.reshape(BN // GA, GA, BM)
    s, inv = _scale_and_inverse(tl.max(tl.abs(a3), axis=1), True)
    q = _jit.e4m3_round(a3 * inv[:, None, :], HW_CVT)
    return _e4m3_bytes(q, HW_CVT).reshape(BN, BM), s


@triton.jit
def _l2_kernel(act_ptr, as_ptr, w_ptr, ws_ptr, pair_ptr, blk_ptr, nblk_ptr, slot_ptr,
               NROWS, H, I, TOPK, NSLOT, stride_we, stride_wn, ws_se, ws_sn, ws_sk,
               BM: tl.constexpr, BN: tl.constexpr, GA: tl.constexpr, GPI: tl.constexpr, HW_CVT: tl.constexpr,
               EXACT: tl.constexpr):
    """y = act @ W2^T for BN output columns of one row block -> bf16 slot outputs.

    One promotion per GA (the intermediate's scale group) of K, ascending; GPI (1 or 2) such blocks per
    loop step, both MMAs issued before the first promotion. A tile of at most 128 rows lies in one weight
    scale block (one scale per K block); a 256-row tile reads one per row."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    nb = tl.load(nblk_ptr)
    e = tl.load(blk_ptr + pid_m)
    if (pid_m >= nb) | (e < 0):
        return
    pair = tl.load(pair_ptr + pid_m * BM + tl.arange(0, BM))
    mvalid = pair >= 0
    pair = tl.where(mvalid, pair, 0)
    e64 = e.to(tl.int64)
    arow = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    i = tl.arange(0, GA)
    wp = _e4m3_ptr(w_ptr, HW_CVT) + e64 * stride_we + n[:, None] * stride_wn + i[None, :]
    xp = _e4m3_ptr(act_ptr, HW_CVT) + (arow.to(tl.int64) * I)[:, None] + i[None, :]
    ROWS: tl.constexpr = BN > _KB
    if ROWS:
        swp = ws_ptr + e64 * ws_se + (n // _KB) * ws_sn
    else:
        swp = ws_ptr + e64 * ws_se + ((pid_n * BN) // _KB) * ws_sn
    acc = tl.zeros((BN, BM), tl.float32)
    for k1 in range(0, I, GA * GPI):
        p0 = _dot8(tl.load(wp + k1), tl.load(xp + k1), HW_CVT, EXACT)
        if GPI >= 2:
            p1 = _dot8(tl.load(wp + k1 + GA), tl.load(xp + k1 + GA), HW_CVT, EXACT)
        acc = _promote(acc, p0, tl.load(swp + (k1 // _KB) * ws_sk), tl.load(as_ptr + (k1 // GA) * NROWS + arow),
                       ROWS)
        if GPI >= 2:
            acc = _promote(acc, p1, tl.load(swp + ((k1 + GA) // _KB) * ws_sk),
                           tl.load(as_ptr + ((k1 + GA) // GA) * NROWS + arow), ROWS)
    slot = (pair // TOPK).to(tl.int64) * NSLOT + pair % TOPK
    tl.store(slot_ptr + slot[None, :] * H + n[:, None], _jit.bf16r(acc, HW_CVT).to(tl.bfloat16),
             mask=mvalid[None, :])


# --------------------------------------------------------------------------- host side


#: the intermediate's requant group (per token, along I): the L2 promotes once per such block of its K
_INTER_GROUP = FP8_INTERMEDIATE_GROUP


def _opts(hw: bool) -> dict:
    return {"enable_fp_fusion": False} if hw else {}


def quantize_b128(x: torch.Tensor, hw_cvt: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``[T, H]`` -> (E4M3 bytes uint8 ``[T, H]``, fp32 scales ``[T, H/128]``), per token and
    128 columns: ``codecs.quantize_fp8_act(x, 128, reciprocal_scale=False)`` to the bit."""
    T, H = x.shape
    q = torch.empty(T, H, dtype=torch.uint8, device=x.device)
    s = torch.empty(T, H // _BLOCK, dtype=torch.float32, device=x.device)
    if T:
        bg = min(8, triton.next_power_of_2(H // _BLOCK))
        _quant_kernel[(T, triton.cdiv(H // _BLOCK, bg))](
            x, q, s, H, x.stride(0), G=_BLOCK, BLOCK_G=bg, HW_CVT=hw_cvt,
            num_warps=4, **_opts(hw_cvt))
    return q, s


def row_scales(xs: torch.Tensor, plan: Any, top_k: int, hw_cvt: bool = True) -> torch.Tensor:
    """The dispatch scales ``xs [T, H/128]`` in the plan's row order, K-block major: fp32 ``[H/128, rows]``
    (0 on padding rows). The L1 then reads a block's token scales at consecutive addresses instead of
    holding one gathered address per token across its whole K loop."""
    rows = plan.sorted_pairs.shape[0]
    nk = xs.shape[1]
    out = torch.empty(nk, rows, dtype=torch.float32, device=xs.device)
    if rows:
        _row_scales_kernel[(triton.cdiv(rows, 64), triton.cdiv(nk, 64))](
            xs, plan.sorted_pairs, out, rows, nk, top_k, xs.shape[0] * top_k, BR=64, BK=64, num_warps=4, **_opts(hw_cvt))
    return out


def _scale_strides(sf: torch.Tensor, what: str) -> tuple[int, int, int]:
    """Element strides (expert, row block, K block) of an fp32 block-scale tensor."""
    if sf is None or sf.dtype != torch.float32 or sf.dim() not in (2, 3):
        from megamoe_runtime.errors import ScaleError

        raise ScaleError(f"{what}: block-FP8 weight scales must be fp32 [E_l, N/128, K/128], got "
                         f"{None if sf is None else (sf.dtype, tuple(sf.shape))}")
    if sf.dim() == 2:
        return 0, sf.stride(0), sf.stride(1)
    return sf.stride(0), sf.stride(1), sf.stride(2)


def _weight_bytes(w: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    b = w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w
    return (b, b.stride(0), b.stride(1)) if b.dim() == 3 else (b, 0, b.stride(0))


@dataclass(frozen=True)
class Block8Config:
    """Tiles of this row. The first five fields are ``mma8.Fp8Config``'s (which is accepted too, through
    ``KernelConfig.fp8``): ``l1_bn`` intermediate columns (2x kernel rows; 64 or 128) per L1 program,
    ``l2_bn`` output rows per L2 program, ``gpi`` K blocks per L2 loop step, warps and pipeline stages.
    ``l2_*`` give the L2 its own where they differ (None: the L1's); ``block_m`` the token row block (None:
    ``KernelConfig.pick_block_m``; an explicit ``KernelConfig.block_m`` wins); ``paired``: the L1 issues
    its gate and up dots of a K block before promoting either (else one after the other); ``exact`` runs
    the GEMMs on the bf16 MMA instead of the FP8 one (the numerics diagnostic of ``_dot8``); ``l2_gluon``
    runs the L2 through ``block8_gluon`` (the same bytes, TMA and asynchronous wgmma) where it applies
    (``gluon_l2_applies``; on in the prefill tile; env ``MEGAMOE_BLOCK8_L2`` overrides it for every tile)."""

    l1_bn: int = 64
    l2_bn: int = 128
    gpi: int = 1
    warps: int = 4
    stages: int = 4
    l2_gpi: Optional[int] = None
    l2_warps: Optional[int] = None
    l2_stages: Optional[int] = None
    block_m: Optional[int] = None
    exact: bool = False
    paired: bool = True
    l2_gluon: bool = False


def _l2_tiles(fc: Any) -> tuple[int, int, int]:
    """(gpi, warps, stages) of the L2 launch."""
    def pick(name: str, base: str) -> int:
        v = getattr(fc, name, None)
        return getattr(fc, base) if v is None else v

    return pick("l2_gpi", "gpi"), pick("l2_warps", "warps"), pick("l2_stages", "stages")


def launch_l1(fc: Any, xq, xs, w, ws, plan, tw, act, asf, H, I, K, clamp: Optional[float], rsf, bm, hw):
    wb, swe, swn = _weight_bytes(w)
    se, sn, sk = _scale_strides(ws, "l1_scale")
    # whole requant groups of the intermediate (>= 64), inside one 128-column weight scale block (<= 128)
    bn = min(max(min(fc.l1_bn, I), _INTER_GROUP), _BLOCK)
    c = 0.0 if clamp is None else float(torch.tensor(float(clamp), dtype=torch.float32))  # the fp32 clamp
    _l1_kernel[(I // bn, plan.max_blocks)](
        xq, xs, wb, ws, plan.sorted_pairs, plan.block_expert, plan.num_blocks, tw, act, asf,
        plan.max_blocks * bm, H, I, K, swe, swn, se, sn, sk, rsf, c,
        HAS_CLAMP=clamp is not None, BM=bm, BN=bn, GA=_INTER_GROUP, PAIRED=bool(getattr(fc, "paired", True)),
        HW_CVT=hw, EXACT=bool(getattr(fc, "exact", False)), num_warps=fc.warps, num_stages=fc.stages, **_opts(hw))


def gluon_l2_applies(fc: Any, act: torch.Tensor, w: torch.Tensor, I: int, bm: int, hw: bool) -> bool:
    """Whether the L2 of this launch runs through ``block8_gluon``: asked for (``MEGAMOE_BLOCK8_L2=gluon``, or
    the tile's ``l2_gluon`` when the variable is unset; ``=triton`` refuses it), on the GPU path, and in the
    one tile its bytes were proven equal to this module's L2 in (128 rows, 4 warps, one K block per step,
    32-token row blocks, I a multiple of 128, contiguous bytes; docs/KERNELS.md "The Gluon L2 of the block-FP8
    row"). Anything else keeps block8's L2."""
    from megamoe_runtime import knobs

    asked = knobs.get("MEGAMOE_BLOCK8_L2")
    if not (asked == "gluon" if asked else bool(getattr(fc, "l2_gluon", False))):
        return False
    gpi, warps, _ = _l2_tiles(fc)
    if not hw or bool(getattr(fc, "exact", False)) or fc.l2_bn != 128 or warps != 4 or gpi != 1 or bm != 32:
        return False
    if I % 128 or not act.is_contiguous() or not w.is_contiguous() or act.device.type != "cuda":
        return False
    from . import block8_gluon

    return block8_gluon.GLUON_ERROR is None and _GLUON_LAUNCH_ERROR is None


#: why the Gluon L2 failed to build or launch in this process (None: it has not): Gluon is Triton's
#: experimental dialect, and a Triton whose Gluon imports but compiles it differently must not take the layer
#: down when block8's L2 gives the same bytes
_GLUON_LAUNCH_ERROR: Optional[str] = None


def launch_l2(fc: Any, act, asf, w, ws, plan, slots, H, I, K, nslot, bm, hw):
    global _GLUON_LAUNCH_ERROR
    if gluon_l2_applies(fc, act, w, I, bm, hw):
        from . import block8_gluon

        try:
            block8_gluon.launch_l2(act, asf, w, ws, _scale_strides(ws, "l2_scale"), plan, slots, H, I, K, nslot,
                                   bm)
            return
        except Exception as exc:  # noqa: BLE001 -- compile / launch refusals; block8's L2 below, once warned
            import warnings

            _GLUON_LAUNCH_ERROR = f"{type(exc).__name__}: {exc}"[:500]
            warnings.warn(f"block-FP8 Gluon L2 unavailable in this process ({_GLUON_LAUNCH_ERROR}); "
                          "block8's L2 (the same bytes) runs instead", RuntimeWarning, stacklevel=2)
    wb, swe, swn = _weight_bytes(w)
    se, sn, sk = _scale_strides(ws, "l2_scale")
    bn = min(fc.l2_bn, H)
    gpi, warps, stages = _l2_tiles(fc)
    _l2_kernel[(H // bn, plan.max_blocks)](
        act, asf, wb, ws, plan.sorted_pairs, plan.block_expert, plan.num_blocks, slots,
        plan.max_blocks * bm, H, I, K, nslot, swe, swn, se, sn, sk,
        BM=bm, BN=bn, GA=_INTER_GROUP, GPI=gpi, HW_CVT=hw, EXACT=bool(getattr(fc, "exact", False)),
        num_warps=warps, num_stages=stages, **_opts(hw))


#: tiles by regime (mean (token, expert) pairs per local expert): "decode" up to 32, "prefill" above. Prefill:
#: of ``bench/block8_gpu.py sweep --grid split --tokens 2048,4096 --bm 32,64,128`` (DeepSeek-V3's shape, H100),
#: the L1 and L2 fastest summed over both token counts, every configuration bitwise the previous kernels' slot
#: outputs: 32-token row blocks; L1 128 intermediate columns (gate and up dots of 128 rows), 8 warps, 3 stages;
#: L2 128 rows, 4 warps, 4 stages: L1 + L2 5.35 + 3.19 ms at 4096 tokens, 3.38 + 2.15 at 2048 (the previous
#: kernels with their tiles, same process: 6.04 + 3.77 and 3.83 + 2.32). Decode keeps its tiles (at 1024 tokens
#: no tile of an earlier sweep beat them by more than 2%). The prefill L2 runs through the Gluon kernel where it
#: applies: the same bytes, the layer 0.96x / 0.90x / 1.00x of block8's L2 at 4096 / 2048 / 512 tokens (H100,
#: docs/bench-log/kernels.md "The Gluon L2 through the runtime").
TILES: dict[str, Block8Config] = {
    "decode": Block8Config(l1_bn=64, l2_bn=128, gpi=1, warps=4, stages=4),
    "prefill": Block8Config(l1_bn=128, l2_bn=128, gpi=1, warps=8, stages=3, l2_gpi=1, l2_warps=4, l2_stages=4,
                            block_m=32, paired=True, l2_gluon=True),
}


def _regime(n_pairs: int, num_local: int) -> str:
    return "decode" if n_pairs / max(1, num_local) <= 32 else "prefill"


def default_config(n_pairs: int, num_local: int) -> Block8Config:
    """Tiles by regime (``TILES``); ``n_pairs``: the (token, expert) pairs of this rank's experts (under
    expert parallelism ``configs.local_pairs`` of the batch's)."""
    return TILES[_regime(n_pairs, num_local)]


def candidate_configs(n_pairs: int, num_local: int) -> list:
    """What ``bench/kernel.py --tune`` tries for this row."""
    out = [default_config(n_pairs, num_local)]
    for bn1, bn2, gpi, w, st in ((64, 128, 1, 4, 3), (128, 128, 1, 4, 4), (64, 64, 1, 4, 4), (64, 128, 2, 4, 3),
                                 (128, 128, 2, 8, 3), (128, 256, 1, 8, 3)):
        out.append(Block8Config(bn1, bn2, gpi, w, st))
    out.append(Block8Config(128, 128, 1, 8, 3, paired=False))
    return out


def pick_block_m(cfg: Any, fc: Any, n_pairs: int, num_local: int) -> int:
    """The token row block: ``KernelConfig.block_m`` if set, else the tiles' ``block_m``, else by the
    mean pairs per expert (``KernelConfig.pick_block_m``)."""
    if cfg.block_m is None and getattr(fc, "block_m", None) is not None:
        return fc.block_m
    return cfg.pick_block_m(n_pairs, num_local)


def tiles_for(spec: Any, cfg: Any, T: int) -> tuple[Any, int]:
    """(tiles, token row block) of a T-token forward: ``cfg.fp8`` or the regime's ``TILES``, then
    ``pick_block_m``. Under expert parallelism the rank sees every token's ids but computes only its own
    experts' pairs, so both follow the pairs expected on the rank (``configs.local_pairs``), as the MX rows'
    tile rule does: the same choice as one rank holding all experts at the same T."""
    from .configs import local_pairs

    E_l = spec.experts_per_rank
    n_local = local_pairs(T * spec.top_k, E_l, spec.num_experts)
    fc = cfg.fp8 or default_config(n_local, E_l)
    return fc, pick_block_m(cfg, fc, n_local, E_l)


def _routed_slots(spec: Any, kt: Any, cfg: Any, x_bf16: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor,
                 slots: torch.Tensor, rsf: float, hw: bool) -> None:
    """The routed experts' bf16 slot outputs of this rank into ``slots [T, nslot, H]``."""
    from .staging import route

    H, I, K = spec.hidden, spec.intermediate, spec.top_k
    E_l = spec.experts_per_rank
    fc, bm = tiles_for(spec, cfg, x_bf16.shape[0])
    xq, xs = quantize_b128(x_bf16, hw)
    plan = route(ids, E_l, spec.ep_rank * E_l, bm)
    act = torch.empty(plan.max_blocks * bm, I, dtype=torch.uint8, device=x_bf16.device)
    asf = torch.empty(I // _INTER_GROUP, plan.max_blocks * bm, dtype=torch.float32, device=x_bf16.device)
    xs = row_scales(xs, plan, K, hw)
    launch_l1(fc, xq, xs, kt.l1_weight, kt.l1_scale, plan, tw, act, asf, H, I, K, spec.activation.clamp, rsf, bm, hw)
    launch_l2(fc, act, asf, kt.l2_weight, kt.l2_scale, plan, slots, H, I, K, slots.shape[1], bm, hw)


def forward(spec: Any, kt: Any, cfg: Any, x_bf16: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor,
            out: torch.Tensor, nslot: int, rsf: float, hw: bool, return_slots: bool = False):
    """The layer's forward for this row (routed experts only: the row fuses no shared expert):
    routed slots, then the rows' common combine."""
    from .l2 import combine

    if not spec.activation.is_plain_swiglu:
        from megamoe_runtime.errors import LayerSpecError

        raise LayerSpecError(f"row {spec.row} runs plain SwiGLU (with an optional clamp) only; got "
                             f"{spec.activation.to_dict()}")
    T, H = x_bf16.shape
    slots = torch.empty(T, nslot, H, dtype=torch.bfloat16, device=x_bf16.device)
    _routed_slots(spec, kt, cfg, x_bf16, tw, ids, slots, rsf, hw)
    combine(spec, cfg, slots, ids, out, False, rsf, hw)
    return (out, slots) if return_slots else out
