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

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .configs import (
    KernelConfig, REQ_BF16, REQ_MX8, REQ_NV4, ROW_W_KIND, W_BF16, W_E2M1_MX, W_E2M1_NV, W_E4M3_B128, W_E4M3_MX,
    default_config, fp8_selected, local_pairs, resolve_decode, resolve_k_order, resolve_l2_fold, resolve_scale_ahead,
    tail_config,
)
from .decode_check import asm_decode_ok
from .l1 import launch_l1
from .l2 import combine, l2_split, launch_l2, reduce_l2_split
from .launch import Activation, L1Epilogue, L2Epilogue, Rows, WeightOperand, scale_bytes
from .operands import FOLD_OK
from .staging import hw_cvt_default, quantize_mxfp8, quantize_nvfp4_per_token, route, split_tails


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

    Three stages (docs/KERNELS.md "Launch types"): the dispatch is staged (``_stage``), the experts write
    their bf16 slots (``_routed_experts``, ``_shared_expert``), the combine adds a token's slots.
    """
    hw = hw_cvt_default()
    H, K = spec.hidden, spec.top_k
    dev = hidden_states.device
    T = hidden_states.shape[0]
    x_bf16, x_sh, tw, ids = _inputs(spec, kt, hidden_states, topk_weights, topk_ids, scalars, shared, shared_input,
                                    fold_flags)
    if asm is None:  # the inline-asm decodes (E2M1 always, E4M3 in the frag order) after their self-check
        asm = asm_decode_ok(dev) if spec.row_spec.packed_e2m1 or spec.row == "mxfp8" else False
    has_shared = shared is not None
    nslot = K + (1 if has_shared else 0)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    if T == 0:
        return (out, torch.empty(0, nslot, H, dtype=torch.bfloat16, device=dev)) if return_slots else out
    rsf = float(spec.routed_scaling_factor)
    w_kind = ROW_W_KIND[spec.row]
    if w_kind == W_E4M3_B128:  # block-FP8: E4M3 x E4M3 wgmma with block-128 fp32 scales (block8)
        from . import block8

        if w_tile or has_shared:
            from megamoe_runtime.errors import MegaMoEError

            raise MegaMoEError(f"row {spec.row} runs routed experts only, from the converted layout; got "
                               f"weight tiles {w_tile}, a fused shared expert: {has_shared}")
        return block8.forward(spec, kt, config or KernelConfig(), x_bf16, tw, ids, out, nslot, rsf, hw, return_slots)

    cfg = _config(spec, config, T, w_tile, hw)
    slots = torch.empty(T, nslot, H, dtype=torch.bfloat16, device=dev)
    act = Activation.of(spec)
    if fp8_selected(spec.row, hw, cfg.mma):  # (on a GPU only: hw holds)
        dispatch = _forward_fp8(spec, kt, cfg, x_bf16, tw, ids, slots, act, rsf, w_kind, asm)
        if has_shared:
            _fp8_shared_expert(spec, shared, cfg, dispatch if x_sh is x_bf16 else None, x_sh, tw, act, slots)
    else:
        staged = _stage(spec, cfg, x_bf16, tw, scalars, act, rsf, hw)
        _routed_experts(spec, kt, cfg, staged, ids, slots, hw, asm, w_tile, fold_flags)
        if has_shared:
            _shared_expert(spec, shared, config, staged, x_bf16, x_sh, tw, act, slots, hw)
    combine(spec, cfg, slots, ids, out, has_shared, rsf, hw)
    return (out, slots) if return_slots else out


def _inputs(spec, kt: Any, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            scalars: Any, shared: Any, shared_input: Optional[torch.Tensor], fold_flags: Optional[torch.Tensor]):
    """The checked inputs as the kernels read them: (hidden states with unit column stride, the shared
    expert's input, fp32 top-k weights, contiguous top-k ids)."""
    _check(spec, kt, hidden_states, topk_weights, topk_ids, scalars, shared)
    E_l = spec.experts_per_rank
    dev = hidden_states.device
    T, H = hidden_states.shape
    if fold_flags is not None and (fold_flags.dtype != torch.int32 or tuple(fold_flags.shape) != (2, E_l)
                                   or fold_flags.device != dev or fold_flags.stride(1) != 1):
        from megamoe_runtime.errors import MegaMoEError

        raise MegaMoEError(f"fold_flags must be int32 [2, {E_l}] with contiguous rows on {dev} "
                           f"(moe.fold_flags), got {fold_flags.dtype} {tuple(fold_flags.shape)} on "
                           f"{fold_flags.device}, strides {fold_flags.stride()}")
    x_bf16 = hidden_states if hidden_states.stride(1) == 1 else hidden_states.contiguous()
    x_sh = x_bf16
    if shared is not None and shared_input is not None and shared_input is not hidden_states:
        if tuple(shared_input.shape) != (T, H) or shared_input.dtype != torch.bfloat16:
            from megamoe_runtime.errors import MegaMoEError

            raise MegaMoEError(f"shared_input must be bf16 [{T}, {H}] like hidden_states, got "
                               f"{shared_input.dtype} {tuple(shared_input.shape)}")
        x_sh = shared_input if shared_input.stride(1) == 1 else shared_input.contiguous()
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    return x_bf16, x_sh, topk_weights.to(torch.float32).contiguous(), ids


def _config(spec, config: Optional[KernelConfig], T: int, w_tile: int, hw: bool) -> KernelConfig:
    """The forward's tiles: ``config``, else the default for this batch and shape (``configs.default_config``);
    refuses tiled weights on a path that cannot read them."""
    H, I = spec.hidden, spec.intermediate
    w_kind = ROW_W_KIND[spec.row]
    cfg = config or default_config(T * spec.top_k, spec.experts_per_rank,
                                   resolve_k_order(KernelConfig(), w_kind, H, I), w_kind=w_kind, H=H, I=I,
                                   num_experts=spec.num_experts)
    if w_tile and (fp8_selected(spec.row, hw, cfg.mma) or resolve_k_order(cfg, w_kind, H, I) != "frag"):
        from megamoe_runtime.errors import MegaMoEError

        raise MegaMoEError(f"the routed weights are tiled by {w_tile} rows (layer.weight_tiles), which only the "
                           f"frag K order's bf16 GEMMs read; this config asks for mma={cfg.mma!r}, k_order="
                           f"{cfg.k_order!r} (env MEGAMOE_TRITON_MMA / MEGAMOE_TRITON_KORDER). Build and load the "
                           f"layer with MEGAMOE_TRITON_WTILE=0 to run other paths")
    return cfg


@dataclass(frozen=True)
class _Staged:
    """The dispatch as the routed GEMMs read it: ``x`` (the exact bf16 dequantization of the row's
    dispatch quantization, in ``korder``, the weights' K order; bf16 rows: the hidden states), the
    epilogues the dispatch decides (NVFP4: alphas, token scales and ``a2``; else the top-k weight in the
    L1), and ``x_mx`` where ``x`` is the natural-order MXFP8 dequantization the mxfp8 shared expert reads."""

    x: torch.Tensor
    korder: str
    l1: L1Epilogue
    l2: L2Epilogue
    x_mx: Optional[torch.Tensor] = None


def _stage(spec, cfg: KernelConfig, x_bf16: torch.Tensor, tw: torch.Tensor, scalars: Any, act: Activation,
           rsf: float, hw: bool) -> _Staged:
    """Quantize the dispatch by the row's rule and keep its exact bf16 dequantization for the GEMMs."""
    H, I = spec.hidden, spec.intermediate
    dev = x_bf16.device
    w_kind = ROW_W_KIND[spec.row]
    e2m1 = w_kind in (W_E2M1_MX, W_E2M1_NV)
    korder = resolve_k_order(cfg, w_kind, H, I)
    frag = korder == "frag"
    out_order = L1Epilogue.order_for(e2m1, frag)
    if spec.row_spec.dispatch == "mxfp8":
        xq = quantize_mxfp8(x_bf16, hw_cvt=hw, dequant=korder if e2m1 or not frag else "frag8")[3]
        return _Staged(xq, korder, L1Epilogue(act, tw, rsf, True, REQ_MX8, out_order), L2Epilogue(tw),
                       x_mx=xq if korder == "natural" else None)
    if spec.row_spec.dispatch == "nvfp4":
        _, _, _, xts, xq = quantize_nvfp4_per_token(x_bf16, hw_cvt=hw, dequant=korder)
        alpha = scalars.l1_alpha.to(device=dev, dtype=torch.float32).contiguous()
        l2s = scalars.l2_global_scale.to(device=dev, dtype=torch.float32).contiguous()
        # a2 stays on the device (read in-kernel): no host sync, graph-capturable, reload-safe
        a2 = torch.as_tensor(scalars.l2_activation_scale).to(device=dev, dtype=torch.float32).reshape(1)
        nv = spec.row_spec.has_alphas
        return _Staged(xq, korder, L1Epilogue(act, tw, rsf, False, REQ_NV4, out_order, nv, xts, alpha, a2),
                       L2Epilogue(tw, nv, l2s, a2))
    return _Staged(x_bf16, korder, L1Epilogue(act, tw, rsf, True, REQ_BF16, out_order), L2Epilogue(tw))


def _routed_experts(spec, kt: Any, cfg: KernelConfig, staged: _Staged, ids: torch.Tensor, slots: torch.Tensor,
                    hw: bool, asm: bool, w_tile: int, fold_flags: Optional[torch.Tensor]) -> None:
    """The routed experts' bf16 slots of this rank: one L1 + L2 pair per launch (the row blocks of the
    routing plan; with tails, a second pair for the short last blocks, docs/KERNELS.md "Tail blocks"),
    the split L2's reduce after them."""
    H, I, K = spec.hidden, spec.intermediate, spec.top_k
    E_l = spec.experts_per_rank
    T = slots.shape[0]
    w_kind = ROW_W_KIND[spec.row]
    frag = staged.korder == "frag"
    fold, sword = resolve_decode(cfg, w_kind) if frag else (False, False)
    fold2 = resolve_l2_fold(cfg, w_kind) if frag else False
    ahead = resolve_scale_ahead(cfg) if frag else False
    bm = cfg.pick_block_m(local_pairs(T * K, E_l, spec.num_experts), E_l)  # the pairs this rank expects
    plan = route(ids, E_l, spec.ep_rank * E_l, bm)
    launches = [(cfg, plan, bm, fold, fold2)]
    tcfg = (cfg.tail or tail_config(w_kind, bm)) if frag and cfg.tail_max else None
    if tcfg is not None and tcfg.block_m and tcfg.block_m < bm and cfg.tail_max < bm:
        # an expert's short last block goes to a launch of small blocks (docs/KERNELS.md "Tail blocks")
        launches.append((tcfg, split_tails(plan, E_l, tcfg.block_m, cfg.tail_max), tcfg.block_m,
                         resolve_decode(tcfg, w_kind)[0], resolve_l2_fold(tcfg, w_kind)))
    ks = l2_split(cfg, I) if frag else 1
    part = torch.empty(ks, T * slots.shape[1], H, dtype=torch.float32, device=slots.device) if ks > 1 else None
    ff1, ff2 = (None, None) if fold_flags is None else (fold_flags[0], fold_flags[1])
    for lcfg, lplan, lbm, lfold, lfold2 in launches:
        rows = Rows(T, K, lbm, lplan)
        w1 = WeightOperand.of(kt.l1_weight, kt.l1_scale, w_kind, asm=asm, frag=frag, fold=lfold, sword=sword,
                              w_tile=w_tile, fold_flags=ff1, sahead=ahead)
        w2 = WeightOperand.of(kt.l2_weight, kt.l2_scale, w_kind, asm=asm, frag=frag, fold=lfold2, sword=sword,
                              w_tile=w_tile, fold_flags=ff2, sahead=ahead)
        act = torch.empty(lplan.max_blocks * lbm, I, dtype=torch.bfloat16, device=slots.device)
        launch_l1(lcfg, staged.x, w1, rows, staged.l1, act, H, I, hw)
        launch_l2(lcfg, act, w2, rows, staged.l2, slots, H, I, hw, part=part)
    if part is not None:  # the split L2's slices added in order, its epilogue, into the routed slots
        reduce_l2_split(part, ids, staged.l2, slots, spec.ep_rank * E_l, E_l, hw)


def _shared_expert(spec, shared: Any, config: Optional[KernelConfig], staged: _Staged, x_bf16: torch.Tensor,
                   x_sh: torch.Tensor, tw: torch.Tensor, act: Activation, slots: torch.Tensor, hw: bool) -> None:
    """The fused shared expert into slot K (weight 1.0, every token) on the bf16 GEMMs: an mxfp8 shared
    expert reads the MXFP8 dispatch's dequantization where the routed launches staged it in the natural
    order for the same input, else quantizes its input itself."""
    T = slots.shape[0]
    scfg = config or default_config(T, 1)  # every token is routed to the shared expert
    if spec.shared.precision == "mxfp8":
        if staged.x_mx is not None and x_sh is x_bf16:
            sx = staged.x_mx
        else:
            sx = quantize_mxfp8(x_sh, hw_cvt=hw, dequant="natural")[3]
        _shared_bf16_gemms(spec, shared, scfg, scfg.block_m or 16, sx, W_E4M3_MX, REQ_MX8, tw, act, slots, hw)
    else:
        _shared_bf16_gemms(spec, shared, scfg, scfg.block_m or 16, x_sh, W_BF16, REQ_BF16, tw, act, slots, hw)


def _shared_bf16_gemms(spec, shared: Any, scfg: KernelConfig, sbm: int, sx: torch.Tensor, kind: int, req: int,
                       tw: torch.Tensor, act: Activation, slots: torch.Tensor, hw: bool) -> None:
    """The shared expert's L1 + L2 on the bf16 GEMMs (natural K order, no top-k weight, no decode
    choices): ``sx`` its staged input, ``kind`` its weights (mxfp8 or bf16), ``req`` its intermediate."""
    T, _, H = slots.shape
    I_s = spec.shared.folded_intermediate
    rows = Rows(T, spec.top_k, sbm)
    scaled = kind != W_BF16
    w1 = WeightOperand.of(shared.l1_weight, shared.l1_scale if scaled else None, kind)
    w2 = WeightOperand.of(shared.l2_weight, shared.l2_scale if scaled else None, kind)
    act_s = torch.empty(T, I_s, dtype=torch.bfloat16, device=slots.device)
    launch_l1(scfg, sx, w1, rows, L1Epilogue(act, tw, 1.0, False, req, 0), act_s, H, I_s, hw)
    launch_l2(scfg, act_s, w2, rows, L2Epilogue(tw), slots, H, I_s, hw)


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
    w_kind = ROW_W_KIND[spec.row]
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
            b = scale_bytes(sf, dev).reshape(E_l, -1, sf.shape[-2] * 4)[:, :words, :nrows * 4]
            if w_kind == W_E2M1_NV:
                lo, hi = _FOLD_NV_BYTES
                bad = (torch.amin(b, dim=(1, 2)) < lo) | (torch.amax(b, dim=(1, 2)) > hi)
            else:
                bad = torch.amax(b, dim=(1, 2)) > _FOLD_UE8M0_LIMIT[w_kind]
            flags[i].copy_(bad.to(torch.int32))  # FOLD_REDO where bad
    return flags


def _forward_fp8(spec, kt, cfg: KernelConfig, x_bf16: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor,
                 slots: torch.Tensor, act: Activation, rsf: float, w_kind: int, asm: bool) -> tuple:
    """The MX rows' routed experts on FP8 tensor cores (``mma8``): E4M3 dispatch bytes + UE8M0 scales in,
    MXFP8 intermediate between L1 and L2, into the same slots the bf16 path writes (its combine follows).
    Returns the dispatch (E4M3 bytes, UE8M0 bytes) for a shared expert on the same input."""
    from . import mma8

    H, I, K = spec.hidden, spec.intermediate, spec.top_k
    E_l = spec.experts_per_rank
    T = x_bf16.shape[0]
    fc = cfg.fp8 or mma8.default_fp8_config(T * K, E_l, w_kind)
    q, sf, _ = quantize_mxfp8(x_bf16, hw_cvt=True)
    bm = cfg.pick_block_m(local_pairs(T * K, E_l, spec.num_experts), E_l)  # the pairs this rank expects
    rows = Rows(T, K, bm, route(ids, E_l, spec.ep_rank * E_l, bm))
    act8 = torch.empty(rows.plan.max_blocks * bm, I, dtype=torch.uint8, device=slots.device)
    asf = torch.empty(rows.plan.max_blocks * bm, I // 32, dtype=torch.uint8, device=slots.device)
    a = asm or w_kind == W_E4M3_MX
    mma8.launch_l1(fc, q.view(torch.uint8), sf, WeightOperand.of(kt.l1_weight, kt.l1_scale, w_kind, asm=a), rows,
                   L1Epilogue(act, tw, rsf, True, REQ_MX8, 0), act8, asf, H, I)
    mma8.launch_l2(fc, act8, asf, WeightOperand.of(kt.l2_weight, kt.l2_scale, w_kind, asm=a), rows, slots, H, I)
    return q, sf


def _fp8_shared_expert(spec, shared: Any, cfg: KernelConfig, dispatch: Optional[tuple], x_sh: torch.Tensor,
                       tw: torch.Tensor, act: Activation, slots: torch.Tensor) -> None:
    """The fused shared expert beside ``_forward_fp8``: mxfp8 on the FP8 tensor cores (``dispatch``: the
    routed dispatch's MXFP8 bytes when the input is the same, else ``x_sh`` is quantized here), bf16 on the
    bf16 path's kernels."""
    from . import mma8

    T, _, H = slots.shape
    scfg = default_config(T, 1)
    sbm = (cfg.block_m if cfg is not None and cfg.block_m else None) or scfg.block_m or 16
    if spec.shared.precision != "mxfp8":
        _shared_bf16_gemms(spec, shared, scfg, sbm, x_sh, W_BF16, REQ_BF16, tw, act, slots, True)
        return
    sq, ssf = dispatch if dispatch is not None else quantize_mxfp8(x_sh, hw_cvt=True)[:2]
    I_s = spec.shared.folded_intermediate
    sfc = mma8.default_fp8_config(T, 1, W_E4M3_MX)
    srows = Rows(T, spec.top_k, sbm)
    a8 = torch.empty(T, I_s, dtype=torch.uint8, device=slots.device)
    af = torch.empty(T, I_s // 32, dtype=torch.uint8, device=slots.device)
    mma8.launch_l1(sfc, sq.view(torch.uint8), ssf, WeightOperand.of(shared.l1_weight, shared.l1_scale, W_E4M3_MX,
                                                                    asm=True),
                   srows, L1Epilogue(act, tw, 1.0, False, REQ_MX8, 0), a8, af, H, I_s)
    mma8.launch_l2(sfc, a8, af, WeightOperand.of(shared.l2_weight, shared.l2_scale, W_E4M3_MX, asm=True), srows,
                   slots, H, I_s)


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
