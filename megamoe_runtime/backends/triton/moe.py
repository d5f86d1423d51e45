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

from typing import Any, Optional

import torch

from .configs import (
    KernelConfig, REQ_BF16, REQ_MX8, REQ_NV4, ROW_W_KIND, W_BF16, W_E2M1_MX, W_E2M1_NV, W_E4M3_B128, W_E4M3_MX,
    default_config,
    fp8_selected, resolve_decode, resolve_k_order, resolve_l2_fold, tail_config,
)
from .decode_check import asm_decode_ok
from .l1 import launch_l1
from .l2 import combine, l2_split, launch_l2, reduce_l2_split
from .launch import act_params, bytes_if_fp8, scale_bytes, scale_stride
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
    act_spec = act_params(spec)
    rsf = float(spec.routed_scaling_factor)
    w_kind = ROW_W_KIND[row]
    e2m1 = w_kind in (W_E2M1_MX, W_E2M1_NV)
    dummy_f = torch.empty(1, dtype=torch.float32, device=dev)
    if w_kind == W_E4M3_B128:  # block-FP8: E4M3 x E4M3 wgmma with block-128 fp32 scales (block8)
        from . import block8

        if w_tile or has_shared:
            from megamoe_runtime.errors import MegaMoEError

            raise MegaMoEError(f"row {row} runs routed experts only, from the converted layout; got "
                               f"weight tiles {w_tile}, a fused shared expert: {has_shared}")
        return block8.forward(spec, kt, config or KernelConfig(), x_bf16, tw, ids, out, nslot, rsf, hw, return_slots)

    cfg = config or default_config(T * K, E_l, resolve_k_order(KernelConfig(), ROW_W_KIND[row], H, I),
                                   w_kind=ROW_W_KIND[row], H=H, I=I)
    if w_tile and (fp8_selected(row, hw, cfg.mma) or resolve_k_order(cfg, ROW_W_KIND[row], H, I) != "frag"):
        from megamoe_runtime.errors import MegaMoEError

        raise MegaMoEError(f"the routed weights are tiled by {w_tile} rows (layer.weight_tiles), which only the "
                           f"frag K order's bf16 GEMMs read; this config asks for mma={cfg.mma!r}, k_order="
                           f"{cfg.k_order!r} (env MEGAMOE_TRITON_MMA / MEGAMOE_TRITON_KORDER). Build and load the "
                           f"layer with MEGAMOE_TRITON_WTILE=0 to run other paths")
    if fp8_selected(row, hw, cfg.mma):
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
    ks = l2_split(cfg, I) if frag else 1
    part = torch.empty(ks, T * nslot, H, dtype=torch.float32, device=dev) if ks > 1 else None
    for lcfg, lplan, lbm, lfold, lfold2 in launches:
        act = torch.empty(lplan.max_blocks * lbm, I, dtype=torch.bfloat16, device=dev)
        launch_l1(lcfg, xq, xts, kt.l1_weight, kt.l1_scale, alpha, lplan, tw, act, T, H, I, K, act_spec,
                   rsf, a2, w_kind, spec.row_spec.has_alphas, req, apply_w, False, e2m1, lbm, hw, asm, frag,
                   fold=lfold, sword=sword, wt=w_tile, fflags=None if fold_flags is None else fold_flags[0])
        launch_l2(lcfg, act, kt.l2_weight, kt.l2_scale, lplan, tw, l2s, slots, T, H, I, K, nslot, a2, w_kind,
                   spec.row_spec.has_alphas, False, lbm, hw, asm, frag, fold=lfold2, sword=sword, wt=w_tile,
                   fflags=None if fold_flags is None else fold_flags[1], part=part)
    if part is not None:  # the split L2's slices added in order, its epilogue, into the routed slots
        reduce_l2_split(part, ids, tw, l2s, a2, slots, T, H, K, nslot, spec.ep_rank * E_l, E_l,
                        spec.row_spec.has_alphas, hw)
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
        launch_l1(scfg, sx, dummy_f, shared.l1_weight, s_l1s, dummy_f, None, tw, act_s, T, H, I_s, K, act_spec,
                   1.0, dummy_f, s_kind, False, s_req, False, True, False, sbm, hw, False)
        launch_l2(scfg, act_s, shared.l2_weight, s_l2s, None, tw, dummy_f, slots, T, H, I_s, K, nslot, dummy_f,
                   s_kind, False, True, sbm, hw, False)
    combine(spec, cfg, slots, ids, out, has_shared, rsf, hw)
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
    w1, w2 = bytes_if_fp8(kt.l1_weight), bytes_if_fp8(kt.l2_weight)
    mma8.launch_l1(fc, q, sf, w1, scale_bytes(kt.l1_scale, dev), scale_stride(kt.l1_scale), plan, tw, act8, asf,
                   T, H, I, K, act_spec, rsf, w_kind, True, False, bm, asm or w_kind == W_E4M3_MX)
    mma8.launch_l2(fc, act8, asf, w2, scale_bytes(kt.l2_scale, dev), scale_stride(kt.l2_scale), plan, slots,
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
            mma8.launch_l1(sfc, sq, ssf, bytes_if_fp8(shared.l1_weight), scale_bytes(shared.l1_scale, dev), 0,
                           None, tw, a8, af, T, H, I_s, K, act_spec, 1.0, W_E4M3_MX, False, True, sbm, True)
            mma8.launch_l2(sfc, a8, af, bytes_if_fp8(shared.l2_weight), scale_bytes(shared.l2_scale, dev), 0,
                           None, slots, T, H, I_s, K, nslot, W_E4M3_MX, True, sbm, True)
        else:  # bf16 shared expert: the bf16 path's kernels on the bf16 input
            dummy_f = torch.empty(1, dtype=torch.float32, device=dev)
            act_s = torch.empty(T, I_s, dtype=torch.bfloat16, device=dev)
            launch_l1(scfg, x_sh, dummy_f, shared.l1_weight, None, dummy_f, None, tw, act_s, T, H, I_s, K, act_spec,
                       1.0, dummy_f, W_BF16, False, REQ_BF16, False, True, False, sbm, True, False)
            launch_l2(scfg, act_s, shared.l2_weight, None, None, tw, dummy_f, slots, T, H, I_s, K, nslot, dummy_f,
                       W_BF16, False, True, sbm, True, False)
    combine(spec, cfg, slots, ids, out, has_shared, rsf, True)
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
