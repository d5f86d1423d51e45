"""The block-FP8 row (``fp8_block``) on Hopper's FP8 tensor cores (wgmma e4m3 x e4m3, fp32 accumulators).

The row (docs/NUMERICS.md#fp8-block, the SM90 recipe (128, 128, 128)): E4M3 weights with one fp32
scale per 128x128 block; activations quantized to E4M3 with one fp32 scale per token and 128 of K.
Both operands stay 8-bit all the way into the MMA:

* dispatch: ``quantize_b128`` writes the tokens' E4M3 bytes and their fp32 scales
  (``codecs.quantize_fp8_act(x, 128)``: ``s = max(amax, 1e-10) / 448``, ``q = e4m3(x * (1 / s))``);
* main loop: one fresh ``tl.dot`` per block of K (128 in L1; in L2 the intermediate's scale group,
  64), whose fp32 partial leaves the tensor core once and is added to the fp32 accumulator as
  ``acc + (s_x * s_w) * p``, in ascending K, as ``reference.block_scaled_mm``. Hopper has no
  block-scaled MMA, so the scales are applied here, one promotion per block (bench/mx_mma_rate.py
  ``fp8-k128``: 0.92x the chained bf16 rate for one per 128);
* L1 epilogue: gate/up split (the kernel rows are interleaved by 8, as in ``mma8``), the fp32 clamp,
  ``(g * (1 / (1 + exp(-g)))) * u``, times the top-k weight times the routed scaling factor, and
  the intermediate's requantization to E4M3 per token and 64 columns (``s = max(amax, 1e-10) *
  fp32(1/448)``);
* L2: bf16 slot outputs, summed by the rows' common ``l2.combine`` (fp32, ascending slot).

Weight scales are fp32 ``[E_l, N/128, K/128]`` read through their strides; the L1 scale rows are in
the source's ``[gate | up]`` order (only the weight rows are interleaved, docs/LAYOUT.md#sm90-block-fp8),
so kernel row ``r`` of the L1 reads scale row ``(r // 8 % 2) * I/128 + (8 * (r // 16) + r % 8) // 128``.

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
def _dot8(w, x, HW_CVT: tl.constexpr, EXACT: tl.constexpr):
    """fp32 ``w @ x^T`` of E4M3 bytes ``w [R, KB]`` and ``x [BM, KB]``: the FP8 MMA on the GPU;
    EXACT: the same E4M3 values as bf16 (exact) through the bf16 MMA, which sums the exact products
    to fp32's precision (a diagnostic: it isolates the FP8 MMA's own sum); exact fp32 operands and an
    IEEE dot under the interpreter."""
    if HW_CVT and EXACT:
        return tl.dot(w.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16),
                      tl.trans(x.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)))
    elif HW_CVT:
        return tl.dot(w.to(tl.float8e4nv, bitcast=True), tl.trans(x.to(tl.float8e4nv, bitcast=True)))
    else:
        return tl.dot(_jit.e4m3_byte_to_f32(w, False), tl.trans(_jit.e4m3_byte_to_f32(x, False)),
                      input_precision="ieee")


@triton.jit
def _block(w_ptr, ws_ptr, rows, wsoff, stride_wn, ws_sk, x_ptr, xs_ptr, xrow, xsrow, mvalid, k0,
           KB: tl.constexpr, HW_CVT: tl.constexpr, EXACT: tl.constexpr):
    """(partial fp32 [R, BM], weight scales [R], activation scales [BM]) of the K block at k0."""
    i = tl.arange(0, KB)
    w = tl.load(w_ptr + rows[:, None] * stride_wn + k0 + i[None, :])
    x = tl.load(x_ptr + xrow[:, None] + k0 + i[None, :], mask=mvalid[:, None], other=0)
    sw = tl.load(ws_ptr + wsoff + (k0 // 128) * ws_sk)
    sx = tl.load(xs_ptr + xsrow + k0 // KB, mask=mvalid, other=0.0)
    return _dot8(w, x, HW_CVT, EXACT), sw, sx


@triton.jit
def _promote(acc, p, sw, sx):
    """acc + p * (s_w * s_x): the scale product rounded once, then the multiply and the add each
    rounded (the kernels are compiled without fp contraction)."""
    return acc + p * (sw[:, None] * sx[None, :])


@triton.jit
def _gemm(w_ptr, ws_ptr, rows, wsoff, stride_wn, ws_sk, x_ptr, xs_ptr, xrow, xsrow, mvalid, K,
          KB: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, GPI: tl.constexpr, HW_CVT: tl.constexpr,
          EXACT: tl.constexpr):
    """fp32 [R, BM] = sum over the KB-wide blocks of K, in ascending order, of the promoted partials.

    GPI (1 or 2) blocks per loop step: both MMAs are issued before the first promotion, so the
    tensor cores work while the other partial is scaled; the promotions stay in K order."""
    acc = tl.zeros((R, BM), tl.float32)
    for k1 in range(0, K, KB * GPI):
        p0, w0, x0 = _block(w_ptr, ws_ptr, rows, wsoff, stride_wn, ws_sk, x_ptr, xs_ptr, xrow, xsrow, mvalid,
                            k1, KB, HW_CVT, EXACT)
        if GPI >= 2:
            p1, w1, x1 = _block(w_ptr, ws_ptr, rows, wsoff, stride_wn, ws_sk, x_ptr, xs_ptr, xrow, xsrow, mvalid,
                                k1 + KB, KB, HW_CVT, EXACT)
        acc = _promote(acc, p0, w0, x0)
        if GPI >= 2:
            acc = _promote(acc, p1, w1, x1)
    return acc


@triton.jit
def _requant(a, BN: tl.constexpr, BM: tl.constexpr, GA: tl.constexpr, HW_CVT: tl.constexpr):
    """E4M3 of ``a`` [BN (K of L2), BM] per GA rows of a column: (uint8 bytes [BN, BM], fp32 scales
    [BN / GA, BM]), the intermediate's rule (``s = max(amax, 1e-10) * fp32(1/448)``)."""
    a3 = a.reshape(BN // GA, GA, BM)
    s, inv = _scale_and_inverse(tl.max(tl.abs(a3), axis=1), True)
    q = _jit.e4m3_round(a3 * inv[:, None, :], HW_CVT)
    return _e4m3_bytes(q, HW_CVT).reshape(BN, BM), s


@triton.jit
def _l1_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, pair_ptr, blk_ptr, nblk_ptr, tw_ptr, act_ptr, as_ptr,
               H, I, TOPK, stride_we, stride_wn, ws_se, ws_sn, ws_sk,
               rsf, clamp_c, HAS_CLAMP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GA: tl.constexpr,
               GPI: tl.constexpr, HW_CVT: tl.constexpr, EXACT: tl.constexpr):
    """h = x @ W13^T on 2*BN consecutive kernel rows (BN gate + BN up columns) of one row block,
    then the epilogue (clamp, silu(g) * u, top-k weight * rsf, E4M3 requant per GA) -> act bytes + scales."""
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
    R: tl.constexpr = 2 * BN
    rows = pid_n * R + tl.arange(0, R)
    # kernel row r: gate (r // 8 even) or up column 8 * (r // 16) + r % 8; scales in [gate | up] rows
    srow = ((rows // 8) % 2) * (I // 128) + (8 * (rows // 16) + rows % 8) // 128
    acc = _gemm(w_ptr + e64 * stride_we, ws_ptr + e64 * ws_se, rows, srow * ws_sn, stride_wn, ws_sk,
                x_ptr, xs_ptr, tok * H, tok * (H // 128), mvalid, H, 128, R, BM, GPI, HW_CVT, EXACT)
    a4 = tl.permute(tl.reshape(acc, (R // 16, 2, 8, BM)), (0, 2, 3, 1))  # (slab, i, token, gate/up)
    acc_g, acc_u = tl.split(a4)
    a = _silu_mul(tl.reshape(acc_g, (BN, BM)), tl.reshape(acc_u, (BN, BM)), clamp_c, HAS_CLAMP, HW_CVT)
    w = tl.load(tw_ptr + pair, mask=mvalid, other=0.0) * rsf
    q, s = _requant(a * w[None, :], BN, BM, GA, HW_CVT)
    orow = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    j = pid_n * BN + tl.arange(0, BN)
    tl.store(act_ptr + orow[None, :] * I + j[:, None], q, mask=mvalid[None, :])
    jg = pid_n * (BN // GA) + tl.arange(0, BN // GA)
    tl.store(as_ptr + orow[None, :] * (I // GA) + jg[:, None], s, mask=mvalid[None, :])


@triton.jit
def _l2_kernel(act_ptr, as_ptr, w_ptr, ws_ptr, pair_ptr, blk_ptr, nblk_ptr, slot_ptr,
               H, I, TOPK, NSLOT, stride_we, stride_wn, ws_se, ws_sn, ws_sk,
               BM: tl.constexpr, BN: tl.constexpr, GA: tl.constexpr, GPI: tl.constexpr, HW_CVT: tl.constexpr,
               EXACT: tl.constexpr):
    """y = act @ W2^T for BN output columns of one row block -> bf16 slot outputs."""
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
    arow = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    acc = _gemm(w_ptr + e64 * stride_we, ws_ptr + e64 * ws_se, n, (n // 128) * ws_sn, stride_wn, ws_sk,
                act_ptr, as_ptr, arow * I, arow * (I // GA), mvalid, I, GA, BN, BM, GPI, HW_CVT, EXACT)
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
    ``KernelConfig.fp8``): ``l1_bn`` intermediate columns (2x kernel rows) per L1 program, ``l2_bn``
    output rows per L2 program, ``gpi`` K blocks per loop step, warps and pipeline stages. ``l2_*``
    give the L2 its own where they differ (None: the L1's); ``block_m`` the token row block (None:
    ``KernelConfig.pick_block_m``; an explicit ``KernelConfig.block_m`` wins); ``exact`` runs the
    GEMMs on the bf16 MMA instead of the FP8 one (the numerics diagnostic of ``_dot8``)."""

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


def l2_tiles(fc: Any) -> tuple[int, int, int]:
    """(gpi, warps, stages) of the L2 launch."""
    def pick(name: str, base: str) -> int:
        v = getattr(fc, name, None)
        return getattr(fc, base) if v is None else v

    return pick("l2_gpi", "gpi"), pick("l2_warps", "warps"), pick("l2_stages", "stages")


def launch_l1(fc: Any, xq, xs, w, ws, plan, tw, act, asf, H, I, K, clamp: Optional[float], rsf, bm, hw):
    wb, swe, swn = _weight_bytes(w)
    se, sn, sk = _scale_strides(ws, "l1_scale")
    bn = max(min(fc.l1_bn, I), _INTER_GROUP)  # a tile holds whole requant groups of the intermediate
    c = 0.0 if clamp is None else float(torch.tensor(float(clamp), dtype=torch.float32))  # the fp32 clamp
    _l1_kernel[(I // bn, plan.max_blocks)](
        xq, xs, wb, ws, plan.sorted_pairs, plan.block_expert, plan.num_blocks, tw, act, asf,
        H, I, K, swe, swn, se, sn, sk, rsf, c,
        HAS_CLAMP=clamp is not None, BM=bm, BN=bn, GA=_INTER_GROUP, GPI=fc.gpi, HW_CVT=hw,
        EXACT=bool(getattr(fc, "exact", False)), num_warps=fc.warps, num_stages=fc.stages, **_opts(hw))


def launch_l2(fc: Any, act, asf, w, ws, plan, slots, H, I, K, nslot, bm, hw):
    wb, swe, swn = _weight_bytes(w)
    se, sn, sk = _scale_strides(ws, "l2_scale")
    bn = min(fc.l2_bn, H)
    gpi, warps, stages = l2_tiles(fc)
    _l2_kernel[(H // bn, plan.max_blocks)](
        act, asf, wb, ws, plan.sorted_pairs, plan.block_expert, plan.num_blocks, slots,
        H, I, K, nslot, swe, swn, se, sn, sk,
        BM=bm, BN=bn, GA=_INTER_GROUP, GPI=gpi, HW_CVT=hw, EXACT=bool(getattr(fc, "exact", False)),
        num_warps=warps, num_stages=stages, **_opts(hw))


#: tiles by regime (mean (token, expert) pairs per local expert): "decode" up to 32, "prefill" above. Prefill:
#: the fastest L1 and L2 of ``bench/block8_gpu.py sweep`` at 4096 tokens of DeepSeek-V3's shape on an H100
#: (64-token row blocks; L1 256 kernel rows, 8 warps, 3 stages: 6.03 ms; L2 128 rows, 4 warps, 5 stages:
#: 3.75 ms; before, 128-token blocks with 128-row 8-warp tiles: 12.3 + 7.0 ms), bitwise the same outputs.
#: Decode keeps its tiles: at 1024 tokens (32 pairs per expert) no tile of the sweep beat them by more than 2%.
TILES: dict[str, Block8Config] = {
    "decode": Block8Config(l1_bn=64, l2_bn=128, gpi=1, warps=4, stages=4),
    "prefill": Block8Config(l1_bn=128, l2_bn=128, gpi=1, warps=8, stages=3, l2_gpi=1, l2_warps=4, l2_stages=5,
                            block_m=64),
}


def _regime(n_pairs: int, num_local: int) -> str:
    return "decode" if n_pairs / max(1, num_local) <= 32 else "prefill"


def default_config(n_pairs: int, num_local: int) -> Block8Config:
    """Tiles by regime (``TILES``)."""
    return TILES[_regime(n_pairs, num_local)]


def candidate_configs(n_pairs: int, num_local: int) -> list:
    """What ``bench/kernel.py --tune`` tries for this row."""
    out = [default_config(n_pairs, num_local)]
    for bn1, bn2, gpi, w, st in ((64, 128, 1, 4, 3), (128, 128, 1, 4, 4), (64, 64, 1, 4, 4), (64, 128, 2, 4, 3),
                                 (64, 128, 1, 8, 4), (128, 256, 1, 8, 3)):
        out.append(Block8Config(bn1, bn2, gpi, w, st))
    return out


def pick_block_m(cfg: Any, fc: Any, n_pairs: int, num_local: int) -> int:
    """The token row block: ``KernelConfig.block_m`` if set, else the tiles' ``block_m``, else by the
    mean pairs per expert (``KernelConfig.pick_block_m``)."""
    if cfg.block_m is None and getattr(fc, "block_m", None) is not None:
        return fc.block_m
    return cfg.pick_block_m(n_pairs, num_local)


def _routed_slots(spec: Any, kt: Any, cfg: Any, x_bf16: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor,
                 slots: torch.Tensor, rsf: float, hw: bool) -> None:
    """The routed experts' bf16 slot outputs of this rank into ``slots [T, nslot, H]``."""
    from .staging import route

    H, I, K = spec.hidden, spec.intermediate, spec.top_k
    E_l = spec.experts_per_rank
    T = x_bf16.shape[0]
    fc = cfg.fp8 or default_config(T * K, E_l)
    xq, xs = quantize_b128(x_bf16, hw)
    bm = pick_block_m(cfg, fc, T * K, E_l)
    plan = route(ids, E_l, spec.ep_rank * E_l, bm)
    act = torch.empty(plan.max_blocks * bm, I, dtype=torch.uint8, device=x_bf16.device)
    asf = torch.empty(plan.max_blocks * bm, I // _INTER_GROUP, dtype=torch.float32, device=x_bf16.device)
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
