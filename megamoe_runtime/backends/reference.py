"""Reference backend: the MegaMoE forward numerics, defined once.

Every other backend (DeepGEMM kernels, triton) is tested against this module,
so it follows docs/NUMERICS.md step by step, in plain fp32 torch, from the
same kernel-layout bytes the GPU kernels read. Weights are decoded exactly
(through ``layout``'s readers and ``codecs``' dequantizers), activations are
quantized with the same reference quantizers the kernels reproduce, and every
rounding point of the kernels (bf16 after L1, requantization of the
intermediate, bf16 slot outputs, fp32 combine) is modelled explicitly.

Rounding points and operation order, per row (w = top-k weight in fp32,
rsf = ``spec.routed_scaling_factor``, c = bf16(clamp)):

mxfp4 / mxfp8 (``fp8_fp4_mega_moe``)
    x   = dequant(quantize_mxfp8(x))                 per token, per 32
    h   = x @ W13^T                                   fp32
    g,u = bf16(h_gate), bf16(h_up); g = min(g, c); u = clamp(u, -c, c)
    a   = act(g, u) * (w * rsf)                       fp32, rsf folded into w
    a   = dequant(quantize_mxfp8(a))                  per token, per 32
    slot_k = bf16(a @ W2^T)
    out = bf16(sum of valid slots, ascending k, shared slot K last, fp32)

bf16 (``bf16_mega_moe``)
    as above without the two quantizations and with ``a = bf16(act * w)``.

fp8_block (SM90 ``fp8_mega_moe``, docs/NUMERICS.md#fp8-block; w13 / w2 E4M3 with
fp32 128x128 block scales)
    (xq, sx) = quantize_fp8_act(x, 128)               per token, s = max(amax,1e-10)/448
    acc = sum over 128-blocks k of (sx[k] * sw13[n/128, k]) * (xq_k @ w13q_k^T)   fp32
    g,u = fp32 acc (no bf16 rounding); g = min(g, c); u = clamp(u, -c, c), c fp32
    h   = ((g * (1 / (1 + exp(-g)))) * u) * (w * rsf)
    (hq, sh) = quantize_fp8_act(h, 64), s = max(amax,1e-10) * fp32(1/448)
    slot_k = bf16(sum over 64-chunks j of (sh[j] * sw2[n/128, j/2]) * (hq_j @ w2q_j^T))
    out = bf16(sum of valid slots, ascending k, fp32); no fused shared expert.

nvfp4 (newer DG ``fp4_fp4_mega_moe`` / DGv ``nvfp4_mega_moe``; the dispatch
quantization follows the entry point, ``nvfp4_entry_point``, see
`NVFP4_DISPATCH_BY_ENTRY`)
    per_token   (DGv ``nvfp4_mega_moe(use_x_scales=True)``, the default, and
                the triton backend):
                (xq, sfx, s_t) = quantize_nvfp4_per_token(x)
    unit_global (upstream ``fp4_fp4_mega_moe``): (xq, sfx) = quantize_nvfp4(x, 1.0),
                s_t = 1.0 (the kernel has no per-token or input-global scale)
                ties: _NVFP4_DISPATCH_TIES
    acc = dequant(xq, sfx) @ dequant(W13 nibbles, e4m3 sf)^T    fp32, no globals
    g   = bf16(acc_g * (s_t * l1_alpha[e,0]))         scalar product first
    u   = bf16(acc_u * (s_t * l1_alpha[e,1]))
    clamp; a = act(g, u)                              fp32, UNWEIGHTED
    (aq, sfa) = quantize_nvfp4(a, global_scale=a2)    per token, per 16, inv = 1/a2 fp32
    p   = bf16((dequant(aq, sfa) @ dequant(W2)^T) * (l2_global_scale[e] * a2))
    slot_k = bf16(float(p) * w)                       top-k weight AFTER L2
    r   = bf16(sum of valid routed slots, ascending k, fp32)
    r   = bf16(float(r) * rsf)  if rsf != 1
    out = bf16(float(r) + float(shared slot))  if a fused shared expert runs

Fused shared expert (slot K, weight 1.0, every token):
    mxfp8 shared: x -> MXFP8 (as the mx rows), L1, bf16, clamp, act,
                  requant MXFP8, L2 -> bf16.
    bf16 shared:  bf16 x, L1 -> bf16 g,u -> clamp -> bf16(act) -> L2 -> bf16.
    The layer's activation (kind, clamp, alpha/beta) applies to it as well;
    for plain SwiGLU that is newer DG's ``silu(g) * u``.

Not modelled: DGv ``nvfp4_mega_moe``'s combine, which multiplies the bf16 L2
output by its weight in fp32 without a bf16 rounding and takes rsf folded
into the weights; the reference follows newer DG's combine (above).

Activations, fp32 on the bf16-rounded, clamped g and u:
    swiglu: (g / (1 + exp(-(alpha * g)))) * (u + beta)
    situ:   (((sigmoid(g) * b) * tanh(g / b)) * bl) * tanh(u / bl),
            sigmoid(g) = 1 / (1 + exp(-g))

``fast_math`` only changes GPU kernels (``__expf`` and a fast reciprocal);
the reference always uses ``exp`` and true division, whatever the flag, and
fast-math kernels are compared to it with a tolerance rather than bitwise.

The fp32 matmuls here accumulate in torch's order, not the tensor cores'
order, so the reference matches a kernel to fp32 accumulation noise (and the
rare bf16 / requant rounding flip it causes), not bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from megamoe_runtime.errors import LayerSpecError, MegaMoEError, ScaleError
from megamoe_runtime.format import codecs, layout, scales
from megamoe_runtime.format.formats import SHARED_PRECISIONS, ActivationSpec, Element, LayerSpec, Row, get_row
from megamoe_runtime.format.roles import KERNEL_ROLES, SHARED_PREFIX


#: E2M1 tie rule of the NVFP4 dispatch quantization. "even" is the kernels'
#: ``cvt.rn.satfinite`` (and what the triton staging kernel must reproduce);
#: DGv's Python ``per_token_cast_to_nvfp4`` rounds ties down instead, so a
#: comparison against x quantized by that helper has to pass "down".
_NVFP4_DISPATCH_TIES = "even"

#: The two NVFP4 dispatch conventions (how x reaches the L1 GEMM).
#:
#: ``unit_global``: upstream deepseek-ai/DeepGEMM ``fp4_fp4_mega_moe`` has no
#: per-token and no input-global scale: its test stages x quantized with
#: global scale 1.0 (``tests/test_nvfp4_mega_moe.py`` @794783a, L26-38
#: ``_cast_to_nvfp4`` with ``global_scale=None`` -> ``inv_global = 1.0``,
#: ``sf = e4m3(max(amax/6, 2^-9))``, RNE codes; ``run_fused`` copies it into
#: ``buffer.x`` / ``buffer.x_sf``) and its reference scales the L1
#: accumulator by ``l1_alphas`` only (same file, L71-73:
#: ``gate = bf16(h1[:, :I] * l1_alpha[0])``).
#:
#: ``per_token``: vllm-project/DeepGEMM ``nvfp4_mega_moe(use_x_scales=True)``
#: reads one FP32 dequant scale per token from ``sym_buffer.x_scales`` and
#: multiplies it into the L1 accumulator together with ``l1_alpha`` before the
#: bf16 rounding (``deep_gemm/mega/nvfp4.py`` @6901431, L113-115, the
#: ``nvfp4_mega_moe`` docstring); the scale is ``amax_t / 2688``
#: (`codecs.quantize_nvfp4_per_token`). The triton backend follows this one.
#:
#: Per entry point, the convention the reference must model for a layer that
#: runs on it (docs/NUMERICS.md, nvfp4); on the reference test layer the two
#: forwards differ by a calc_diff of 4.8e-3, far above any kernel-vs-reference
#: tolerance, so a kernel compared with the other convention's reference fails.
NVFP4_DISPATCH_BY_ENTRY = {"fp4_fp4_mega_moe": "unit_global", "nvfp4_mega_moe": "per_token"}
#: the entry point ``reference_forward`` models when none is named
_DEFAULT_NVFP4_ENTRY = "nvfp4_mega_moe"


def _nvfp4_dispatch_convention(entry_point: Optional[str]) -> str:
    """``"per_token"`` or ``"unit_global"`` for an NVFP4 entry point name
    (None: `_DEFAULT_NVFP4_ENTRY`); MegaMoEError listing the known ones."""
    name = _DEFAULT_NVFP4_ENTRY if entry_point is None else entry_point
    try:
        return NVFP4_DISPATCH_BY_ENTRY[name]
    except KeyError:
        raise MegaMoEError(f"unknown NVFP4 entry point {entry_point!r}; known: "
                           f"{', '.join(sorted(NVFP4_DISPATCH_BY_ENTRY))}") from None


def quantize_dispatch_nvfp4(x: Tensor, entry_point: Optional[str] = None
                            ) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """The NVFP4 dispatch input of ``entry_point``: ``(packed uint8 [T, H/2],
    sf float8_e4m3fn [T, H/16], token_scale float32 [T] or None)``.

    The one definition both the reference forward and the deepgemm backend's
    staging use, so the bytes the kernel reads are the bytes the reference
    decodes (``token_scale`` is None for ``unit_global``: the kernel takes none).
    """
    if _nvfp4_dispatch_convention(entry_point) == "per_token":
        return codecs.quantize_nvfp4_per_token(x.to(torch.float32), _NVFP4_DISPATCH_TIES)
    packed, sf = codecs.quantize_nvfp4(x.to(torch.float32), 1.0, _NVFP4_DISPATCH_TIES)
    return packed, sf, None

__all__ = [
    "NVFP4_DISPATCH_BY_ENTRY",
    "NvScalars",
    "ReferenceBackend",
    "ReferenceSlots",
    "activation_fp32",
    "apply_clamp",
    "block_scaled_mm",
    "combine_slots",
    "quantize_dispatch_nvfp4",
    "reference_forward",
    "reference_pairs",
    "reference_slots",
    "shared_slot",
]


@dataclass(frozen=True)
class NvScalars:
    """The per-layer NVFP4 scalars the kernels read besides the weight bytes.

    * ``l1_alpha`` f32 ``[E_l, 2]``: gate and up ``weight_scale_2`` (the input
      scale is per token, so it is not folded in, docs/SCALES.md#dispatch-scale).
    * ``l2_global_scale`` f32 ``[E_l]``: w2 ``weight_scale_2`` (newer DG
      ``l2_alphas``; the kernel multiplies it by ``a2`` itself).
    * ``l2_activation_scale`` 0-dim f32: ``a2``, the global scale of the
      requantized intermediate, max over ALL experts (docs/SCALES.md#a2).
    """

    l1_alpha: Tensor
    l2_global_scale: Tensor
    l2_activation_scale: Tensor


class ReferenceSlots(NamedTuple):
    """Per-slot bf16 partials before the combine.

    ``slots`` bf16 ``[T, K(+1), H]`` and ``valid`` bool ``[T, K(+1)]``; the
    extra column is the fused shared expert. Invalid slots hold zeros. On an
    EP rank only slots whose expert is local are valid, so an EP combine can
    merge the ranks' slots (each slot is valid on exactly one rank) and then
    call :func:`combine_slots`.
    """

    slots: Tensor
    valid: Tensor


# --------------------------------------------------------------------------
# activation math (fp32)
# --------------------------------------------------------------------------


def apply_clamp(g: Tensor, u: Tensor, clamp: Optional[float]) -> tuple[Tensor, Tensor]:
    """Clamp bf16-rounded accumulators the way the kernels do.

    The bound is cast to bf16 first; the gate is clamped from above only
    (``min(g, c)``), the up projection on both sides. ``None`` = +inf.
    Returns bf16 tensors.
    """
    g = g.to(torch.bfloat16)
    u = u.to(torch.bfloat16)
    if clamp is None:
        return g, u
    c = torch.tensor(float(clamp), dtype=torch.bfloat16, device=g.device)
    g = torch.minimum(g, c)
    u = torch.maximum(torch.minimum(u, c), -c)
    return g, u


def activation_fp32(act: ActivationSpec, g: Tensor, u: Tensor, fast_math: bool = False) -> Tensor:
    """``act(g, u)`` in fp32 on already rounded and clamped g, u.

    ``fast_math`` is accepted for signature parity with the kernels and
    ignored: the reference is the precise definition (``exp``, true division).
    """
    del fast_math
    g = g.to(torch.float32)
    u = u.to(torch.float32)
    dev = g.device
    one = torch.tensor(1.0, dtype=torch.float32, device=dev)
    if act.kind == "swiglu":
        alpha = torch.tensor(float(act.alpha), dtype=torch.float32, device=dev)
        beta = torch.tensor(float(act.beta), dtype=torch.float32, device=dev)
        return (g / (one + torch.exp(-(alpha * g)))) * (u + beta)
    if act.kind == "situ":
        b = torch.tensor(float(act.situ_beta), dtype=torch.float32, device=dev)
        bl = torch.tensor(float(act.situ_linear_beta), dtype=torch.float32, device=dev)
        sig = one / (one + torch.exp(-g))
        return (((sig * b) * torch.tanh(g / b)) * bl) * torch.tanh(u / bl)
    raise LayerSpecError(f"activation kind {act.kind!r} is not supported; valid: 'swiglu', 'situ'")


# --------------------------------------------------------------------------
# decoding kernel-layout weights (exact)
# --------------------------------------------------------------------------


def _decode_expert(row: Row, kt: Any, e: Optional[int]) -> tuple[Tensor, Tensor]:
    """Expert ``e`` of a kernel stack (``e=None``: a 2-D shared expert) ->
    fp32 ``(w13 [2I, H] = [gate | up], w2 [H, I])``.

    Bytes are read back through ``layout.read_expert`` (de-interleave, undo
    UTCCP, unpack the int32 words) and decoded by ``codecs`` (exact). NVFP4
    global scales are NOT applied (the readers carry none): the kernels apply
    them through the alphas after the block-scaled MMA, and so does this.
    """
    ex = layout.read_expert(row, kt, e, where="expert" if e is None else f"expert {e}")
    gate, up, down = ex.dequantize(row)
    return torch.cat((gate, up), dim=0), down


# --------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------


def _check_inputs(spec: LayerSpec, hidden_states: Tensor, topk_weights: Tensor,
                  topk_ids: Tensor) -> None:
    if hidden_states.dim() != 2 or hidden_states.shape[1] != spec.hidden:
        raise MegaMoEError(
            f"hidden_states has shape {tuple(hidden_states.shape)}; expected [T, {spec.hidden}]")
    if hidden_states.dtype != torch.bfloat16:
        raise MegaMoEError(f"hidden_states has dtype {hidden_states.dtype}; the MegaMoE forward "
                           f"takes torch.bfloat16")
    T = hidden_states.shape[0]
    for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.dim() != 2 or t.shape[0] != T or t.shape[1] != spec.top_k:
            raise MegaMoEError(f"{name} has shape {tuple(t.shape)}; expected [{T}, {spec.top_k}] "
                               f"(T tokens, top_k={spec.top_k})")
    if not topk_weights.is_floating_point():
        raise MegaMoEError(f"topk_weights has dtype {topk_weights.dtype}; expected a float dtype")
    if topk_ids.is_floating_point() or topk_ids.dtype == torch.bool:
        raise MegaMoEError(f"topk_ids has dtype {topk_ids.dtype}; expected an integer dtype")
    check_routing(spec, topk_ids)


def check_routing(spec: LayerSpec, topk_ids: Tensor) -> None:
    """Refuse ``topk_ids`` [T, K] holding an id outside -1..num_experts-1 or an expert twice in one token,
    naming the first such entry. The reference backend checks every forward; the layer runs it on any backend
    under ``MEGAMOE_CHECK_ROUTING=1`` (the GPU backends would drop such ids or sum a repeat twice, and checking
    costs a host sync)."""
    if topk_ids.numel() == 0:
        return
    ids = topk_ids.long()
    bad = (ids < -1) | (ids >= spec.num_experts)
    if bool(bad.any()):
        t, k = (int(v) for v in bad.nonzero()[0])
        raise MegaMoEError(f"topk_ids[{t}, {k}] = {int(ids[t, k])} is out of range; valid: -1 "
                           f"(masked) or 0..{spec.num_experts - 1} (global expert ids)")
    if spec.top_k > 1:
        srt, _ = ids.sort(dim=1)
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        if bool(dup.any()):
            t, j = (int(v) for v in dup.nonzero()[0])
            raise MegaMoEError(f"token {t} routes to expert {int(srt[t, j + 1])} more than once "
                               f"(topk_ids[{t}] = {ids[t].tolist()}); each expert may appear once "
                               f"per token, mask repeats with -1")


def _as_kernel_tensors(kt: Any) -> layout.KernelTensors:
    if isinstance(kt, layout.KernelTensors):
        return kt
    return layout.KernelTensors(*(getattr(kt, r, None) for r in KERNEL_ROLES))


def _check_scalars(spec: LayerSpec, scalars: Optional[NvScalars]) -> None:
    if scalars is None:
        raise ScaleError("row nvfp4 needs NvScalars (l1_alpha [E_l, 2], l2_global_scale [E_l], "
                         "l2_activation_scale); got None")
    E_l = spec.experts_per_rank
    for name, shape in (("l1_alpha", (E_l, 2)), ("l2_global_scale", (E_l,)),
                        ("l2_activation_scale", ())):
        t = getattr(scalars, name)
        if not isinstance(t, Tensor):
            t = torch.as_tensor(t, dtype=torch.float32)
        if tuple(t.shape) != shape:
            raise ScaleError(f"NvScalars.{name} has shape {tuple(t.shape)}; expected {shape} "
                             f"(E_l = {E_l} local experts)")
        vals = t.detach().flatten().tolist()  # at most 2 * E_l + E_l + 1 values
        bad = [i for i, v in enumerate(vals) if not scales.is_valid_scale(v)]
        if bad:
            raise ScaleError(f"NvScalars.{name}{_index(bad[0], shape)} = {vals[bad[0]]!r} ({len(bad)} of "
                             f"{len(vals)} invalid); it must be {scales.SCALE_RULE}")


def _index(flat: int, shape: tuple[int, ...]) -> str:
    """``[i, j]`` of flat index `flat` in `shape` ('' for a scalar), for messages."""
    idx = []
    for d in reversed(shape):
        flat, i = divmod(flat, d)
        idx.append(i)
    return f"[{', '.join(map(str, reversed(idx)))}]" if idx else ""


# --------------------------------------------------------------------------
# quantize-dequantize helpers (exact round trips through codecs)
# --------------------------------------------------------------------------


def _mxfp8_qdq(x: Tensor) -> Tensor:
    """Per-row MXFP8 (UE8M0 per 32, e4m3 RNE satfinite), dequantized exactly."""
    q, sf = codecs.quantize_mxfp8(x.to(torch.float32))
    return codecs.dequantize_mx(q, sf, "e4m3")


def _nvfp4_qdq_no_global(x: Tensor, global_scale: Tensor) -> Tensor:
    """quantize_nvfp4(x, global) decoded as e2m1 * e4m3 (global NOT applied)."""
    packed, sf = codecs.quantize_nvfp4(x.to(torch.float32), global_scale)
    return codecs.dequantize_nvfp4(packed, sf, 1.0)


def _f32(v: Any, device: torch.device) -> Tensor:
    return torch.as_tensor(v, dtype=torch.float32, device=device)


# --------------------------------------------------------------------------
# the forward
# --------------------------------------------------------------------------


def shared_slot(spec: LayerSpec, shared: Any, hidden_states: Tensor,
                fast_math: bool = False) -> Tensor:
    """Fused shared expert output, bf16 ``[T, H]`` (slot K, weight 1.0).

    ``shared`` holds the 2-D shared kernel tensors (``l1_weight``
    ``[2*S*I_s, Dw]``, ``l1_scale``, ``l2_weight``, ``l2_scale``; bf16: no
    scales). mxfp8: x -> MXFP8, L1, bf16 g/u, clamp, act, requant MXFP8, L2.
    bf16: bf16 x, L1, bf16 g/u, clamp, bf16(act), L2. Both -> bf16. The
    layer's activation (incl. clamp/alpha/beta) applies to the shared expert.
    """
    if spec.shared is None:
        raise LayerSpecError("shared_slot needs spec.shared (a SharedSpec)")
    prec = spec.shared.precision
    inter = spec.shared.folded_intermediate
    if prec not in SHARED_PRECISIONS:
        raise LayerSpecError(f"shared precision {prec!r}; valid: 'mxfp8', 'bf16'")
    srow = get_row(prec)  # a shared precision names the row whose 2-D layout it uses
    kt = _as_kernel_tensors(shared)
    layout.check_kernel_tensors(srow, kt, None, spec.hidden, inter, "shared kernel tensors")
    w13, w2 = _decode_expert(srow, kt, None)
    requant = srow.has_scales  # mxfp8: dispatch and intermediate quantized as the mx rows; bf16: neither
    x = _mxfp8_qdq(hidden_states) if requant else hidden_states.to(torch.float32)
    h = x @ w13.t()
    g, u = apply_clamp(h[:, :inter], h[:, inter:], spec.activation.clamp)
    a = activation_fp32(spec.activation, g, u, fast_math)
    if requant:
        a = _mxfp8_qdq(a)  # weight 1.0: a * 1.0 == a
    else:
        a = a.to(torch.bfloat16).to(torch.float32)
    return (a @ w2.t()).to(torch.bfloat16)


#: per-token group of the block-FP8 row's dispatch quantization, and of its intermediate's requantization
_FP8_DISPATCH_GROUP = 128
FP8_INTERMEDIATE_GROUP = 64


def _check_plain_swiglu(spec: LayerSpec) -> None:
    if not spec.activation.is_plain_swiglu:
        raise LayerSpecError(f"row {spec.row} runs plain SwiGLU (with an optional clamp) only; got "
                             f"{spec.activation.to_dict()}")


def block_scaled_mm(a_q: Tensor, a_s: Tensor, w_q: Tensor, w_s: Tensor, block: int = 128) -> Tensor:
    """fp32 ``[n, N]`` of a block-scaled FP8 GEMM as the SM90 kernel sums it: for each group j of K (width
    ``K / a_s.shape[1]``, 128 or 64), the group's product of the E4M3 values ``a_q [n, K] @ w_q[N, K]^T``,
    scaled by ``a_s[:, j] * w_s[N/block, (j * width) / block]`` and added in ascending j, all fp32."""
    n, K = a_q.shape
    width = K // a_s.shape[1]
    w_rows = w_s.repeat_interleave(block, 0)  # [N, K/block]: each output row's block scales
    acc = torch.zeros(n, w_q.shape[0], dtype=torch.float32, device=a_q.device)
    for j in range(a_s.shape[1]):
        k0 = j * width
        part = a_q[:, k0:k0 + width] @ w_q[:, k0:k0 + width].t()
        acc = acc + (a_s[:, j, None] * w_rows[None, :, k0 // block]) * part
    return acc


def _block_fp8_expert(spec: LayerSpec, kt: Any, e_l: int, x_q: Tensor, x_s: Tensor, w: Tensor) -> Tensor:
    """bf16 slot outputs of one block-FP8 expert (docs/NUMERICS.md#fp8-block): x_q decoded E4M3 values,
    x_s their per-128 scales, w the top-k weights with rsf folded in."""
    I = spec.intermediate
    ex = layout.read_expert(spec.row_spec, kt, e_l, where=f"expert {e_l}")
    w13_q = codecs.e4m3_decode(torch.cat((ex.gate.weight, ex.up.weight), 0))
    w13_s = torch.cat((ex.gate.scale, ex.up.scale), 0)
    acc = block_scaled_mm(x_q, x_s, w13_q, w13_s)
    g, u = acc[:, :I], acc[:, I:]
    if spec.activation.clamp is not None:
        c = _f32(spec.activation.clamp, g.device)
        g = torch.minimum(g, c)
        u = torch.maximum(torch.minimum(u, c), -c)
    one = _f32(1.0, g.device)
    h = ((g * (one / (one + torch.exp(-g)))) * u) * w[:, None]
    h_q, h_s = codecs.quantize_fp8_act(h, FP8_INTERMEDIATE_GROUP, reciprocal_scale=True)
    y = block_scaled_mm(codecs.e4m3_decode(h_q), h_s, codecs.e4m3_decode(ex.down.weight), ex.down.scale)
    return y.to(torch.bfloat16)


def _check_routed(spec: LayerSpec, kt: Any, scalars: Optional[NvScalars]) -> None:
    layout.check_kernel_tensors(spec.row_spec, _as_kernel_tensors(kt), spec.experts_per_rank,
                                spec.hidden, spec.intermediate, "routed kernel tensors")
    if spec.row_spec.has_alphas:
        _check_scalars(spec, scalars)


def _pairs(spec: LayerSpec, kt: Any, rows: Tensor, weights: Tensor, ids: Tensor,
           scalars: Optional[NvScalars], fast_math: bool, nvfp4_entry_point: Optional[str] = None) -> Tensor:
    """Unchecked body of :func:`reference_pairs`."""
    row = spec.row_spec
    element = row.weight.element
    kt = _as_kernel_tensors(kt)
    I, H = spec.intermediate, spec.hidden
    dev = rows.device
    N = rows.shape[0]
    out = torch.zeros(N, H, dtype=torch.bfloat16, device=dev)
    if N == 0:
        return out
    is_nv = row.has_alphas
    w_all = weights.to(device=dev, dtype=torch.float32)
    ids = ids.to(device=dev, dtype=torch.long)

    # Dispatch quantization is per row (token), so quantizing all rows at once
    # is identical to the kernels' per-(token, slot) quantization.
    if is_nv:
        xq, xsf, tok_scale = quantize_dispatch_nvfp4(rows, nvfp4_entry_point)
        x_l1 = codecs.dequantize_nvfp4(xq, xsf, 1.0)  # token scale NOT applied
        if tok_scale is None:  # unit_global: s_t = 1.0, so s_t * alpha == alpha exactly
            tok_scale = torch.ones(N, dtype=torch.float32, device=dev)
        tok_scale = tok_scale.to(device=dev, dtype=torch.float32).reshape(N)
        a2 = _f32(scalars.l2_activation_scale, dev).reshape(())
        l1_alpha = _f32(scalars.l1_alpha, dev)
        l2_gs = _f32(scalars.l2_global_scale, dev)
    elif element == Element.BF16:
        x_l1 = rows.to(torch.float32)
    elif row.weight.block_scaled:
        _check_plain_swiglu(spec)
        x_q, x_s = codecs.quantize_fp8_act(rows, _FP8_DISPATCH_GROUP, reciprocal_scale=False)
        x_q = codecs.e4m3_decode(x_q)
    else:
        x_l1 = _mxfp8_qdq(rows)
    if row.topk_weight_stage == "l1":
        # mx rows and bf16: rsf folded into the top-k weight, in fp32.
        w_all = w_all * _f32(spec.routed_scaling_factor, dev)

    lo = spec.local_experts.start
    for e_l in range(spec.experts_per_rank):
        sel = (ids == lo + e_l).nonzero().squeeze(1)
        if sel.numel() == 0:
            continue
        w = w_all[sel]
        if row.weight.block_scaled:
            out[sel] = _block_fp8_expert(spec, kt, e_l, x_q[sel], x_s[sel], w)
            continue
        w13, w2 = _decode_expert(row, kt, e_l)
        acc = x_l1[sel] @ w13.t()  # [n, 2I] fp32, gate | up
        acc_g, acc_u = acc[:, :I], acc[:, I:]
        if is_nv:
            # fp32: s = token_scale[t] * l1_alpha[e, half] first, then acc * s
            acc_g = acc_g * (tok_scale[sel] * l1_alpha[e_l, 0])[:, None]
            acc_u = acc_u * (tok_scale[sel] * l1_alpha[e_l, 1])[:, None]
        g, u = apply_clamp(acc_g, acc_u, spec.activation.clamp)
        a = activation_fp32(spec.activation, g, u, fast_math)
        if is_nv:
            a = _nvfp4_qdq_no_global(a, a2)  # unweighted, global a2 (inv = 1/a2 in fp32)
            p = ((a @ w2.t()) * (l2_gs[e_l] * a2)).to(torch.bfloat16)  # fp32 scalar product first
            y = (p.to(torch.float32) * w[:, None]).to(torch.bfloat16)  # weight after L2
        elif element == Element.BF16:
            a = (a * w[:, None]).to(torch.bfloat16).to(torch.float32)
            y = (a @ w2.t()).to(torch.bfloat16)
        else:
            a = _mxfp8_qdq(a * w[:, None])  # weight before the requant
            y = (a @ w2.t()).to(torch.bfloat16)
        out[sel] = y
    return out


def reference_pairs(spec: LayerSpec, kt: Any, rows: Tensor, weights: Tensor, ids: Tensor,
                    scalars: Optional[NvScalars] = None, fast_math: bool = False,
                    nvfp4_entry_point: Optional[str] = None) -> Tensor:
    """Slot outputs of (token row, top-k weight, expert) pairs, bf16 ``[N, H]``.

    The expert-side half of the forward, with the signature of
    ``megamoe_runtime.layer.ep.PairCompute`` once ``spec``, ``kt`` and ``scalars``
    are bound: ``rows`` bf16 ``[N, H]``, ``weights`` the RAW router weights
    ``[N]`` (mx/bf16 rows fold ``spec.routed_scaling_factor`` in here; nvfp4
    applies it in the combine), ``ids`` GLOBAL expert ids ``[N]``, every one
    local to ``spec``'s rank. Each output row depends only on its own pair.
    ``nvfp4_entry_point`` picks the NVFP4 dispatch convention (see
    `NVFP4_DISPATCH_BY_ENTRY`).
    """
    if rows.dim() != 2 or rows.shape[1] != spec.hidden or rows.dtype != torch.bfloat16:
        raise MegaMoEError(f"rows must be bf16 [N, {spec.hidden}], got {rows.dtype} "
                           f"{tuple(rows.shape)}")
    N = rows.shape[0]
    if tuple(weights.shape) != (N,) or tuple(ids.shape) != (N,):
        raise MegaMoEError(f"weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must both "
                           f"be [{N}] (one per row)")
    loc = spec.local_experts
    bad = (ids < loc.start) | (ids >= loc.stop)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise MegaMoEError(f"pair {i} names expert {int(ids[i])}, which rank {spec.ep_rank} of "
                           f"{spec.ep_size} does not own; valid: {loc.start}..{loc.stop - 1}")
    _check_routed(spec, kt, scalars)
    _nvfp4_dispatch_convention(nvfp4_entry_point)  # an unknown name fails before any work
    return _pairs(spec, kt, rows, weights, ids, scalars, fast_math, nvfp4_entry_point)


def reference_slots(spec: LayerSpec, kt: Any, hidden_states: Tensor, topk_weights: Tensor,
                    topk_ids: Tensor, scalars: Optional[NvScalars] = None, shared: Any = None,
                    fast_math: bool = False,
                    shared_input: Optional[Tensor] = None,
                    nvfp4_entry_point: Optional[str] = None) -> ReferenceSlots:
    """Per-slot bf16 partials ``(slots [T, K(+1), H], valid [T, K(+1)])``.

    Slot k of token t holds that expert's bf16 output already multiplied by
    the top-k weight (mx/bf16 rows: in L1, with rsf folded; nvfp4: after L2,
    rsf not applied). Only experts in ``spec.local_experts`` are computed;
    others (and -1) are invalid and their weight is never read, so a NaN
    weight there cannot leak. Column K is the fused shared expert when
    ``shared`` is given, computed on ``shared_input`` (default: the hidden
    states; newer DG's ``x_bf16``). See the module docstring for the order.
    """
    _check_inputs(spec, hidden_states, topk_weights, topk_ids)
    _check_routed(spec, kt, scalars)
    _nvfp4_dispatch_convention(nvfp4_entry_point)
    if shared is not None and spec.shared is None:
        raise LayerSpecError("shared kernel tensors were given but the layer spec has no shared "
                             "experts (spec.shared is None); pass shared=None or set spec.shared")
    T, K, H = hidden_states.shape[0], spec.top_k, spec.hidden
    dev = hidden_states.device
    n_slots = K + (1 if shared is not None else 0)
    slots = torch.zeros(T, n_slots, H, dtype=torch.bfloat16, device=dev)
    valid = torch.zeros(T, n_slots, dtype=torch.bool, device=dev)
    if T == 0:
        return ReferenceSlots(slots, valid)
    ids = topk_ids.to(device=dev, dtype=torch.long)
    loc = spec.local_experts
    hit = ((ids >= loc.start) & (ids < loc.stop)).nonzero()  # token-major, slot-minor
    t_idx, k_idx = hit[:, 0], hit[:, 1]
    if hit.shape[0]:
        slots[t_idx, k_idx] = _pairs(spec, kt, hidden_states[t_idx], topk_weights[t_idx, k_idx],
                                     ids[t_idx, k_idx], scalars, fast_math, nvfp4_entry_point)
        valid[t_idx, k_idx] = True
    if shared is not None:
        x_sh = hidden_states if shared_input is None else shared_input
        if tuple(x_sh.shape) != tuple(hidden_states.shape) or x_sh.dtype != torch.bfloat16:
            raise MegaMoEError(f"shared_input must be bf16 {tuple(hidden_states.shape)} like "
                               f"hidden_states, got {x_sh.dtype} {tuple(x_sh.shape)}")
        slots[:, K] = shared_slot(spec, shared, x_sh, fast_math)
        valid[:, K] = True
    return ReferenceSlots(slots, valid)


def combine_slots(spec: LayerSpec, slots: Tensor, valid: Tensor) -> Tensor:
    """Combine bf16 slot partials into the bf16 output, as the kernels do.

    A column ``spec.top_k`` (if present) is the shared expert. mx/bf16 rows:
    fp32 sum of the valid slots in ascending slot order (shared last), one
    bf16 rounding. nvfp4: routed fp32 sum -> bf16 -> (rsf != 1) bf16(x*rsf)
    -> + shared in fp32 -> bf16.
    """
    T, n_slots, H = slots.shape
    K = spec.top_k
    if n_slots not in (K, K + 1) or tuple(valid.shape) != (T, n_slots):
        raise MegaMoEError(f"slots {tuple(slots.shape)} / valid {tuple(valid.shape)} do not match "
                           f"top_k={K}; expected [T, {K} or {K + 1}, H] and [T, {K} or {K + 1}]")
    has_shared = n_slots == K + 1
    acc = torch.zeros(T, H, dtype=torch.float32, device=slots.device)

    def add(acc: Tensor, k: int) -> Tensor:
        return torch.where(valid[:, k, None], acc + slots[:, k].to(torch.float32), acc)

    if not spec.row_spec.rsf_in_combine:
        for k in range(n_slots):
            acc = add(acc, k)
        return acc.to(torch.bfloat16)
    for k in range(K):
        acc = add(acc, k)
    r = acc.to(torch.bfloat16)
    rsf = float(spec.routed_scaling_factor)
    if rsf != 1.0:
        r = (r.to(torch.float32) * _f32(rsf, slots.device)).to(torch.bfloat16)
    if has_shared:
        r = add(r.to(torch.float32), K).to(torch.bfloat16)
    return r


def reference_forward(spec: LayerSpec, kt: Any, hidden_states: Tensor, topk_weights: Tensor,
                      topk_ids: Tensor, scalars: Optional[NvScalars] = None, shared: Any = None,
                      fast_math: bool = False, return_slots: bool = False,
                      shared_input: Optional[Tensor] = None,
                      nvfp4_entry_point: Optional[str] = None):
    """The MegaMoE forward of one layer on this EP rank, bf16 ``[T, H]``.

    ``kt`` holds the routed experts in kernel layout (``layout.KernelTensors``
    or anything with ``l1_weight``, ``l1_scale``, ``l2_weight``, ``l2_scale``),
    ``topk_ids`` are GLOBAL expert ids (-1 masked); only local experts
    contribute (the EP combine is elsewhere). ``scalars`` is required for
    nvfp4. ``shared`` (2-D shared kernel tensors) fuses the shared expert as
    slot K. With ``return_slots`` the result is ``(out, ReferenceSlots)``.
    ``nvfp4_entry_point`` (nvfp4 row): the DeepGEMM entry point the layer runs
    on, ``"nvfp4_mega_moe"`` (default, per-token dispatch scale) or
    ``"fp4_fp4_mega_moe"`` (global 1.0); the reference then quantizes x as
    that entry point receives it (`NVFP4_DISPATCH_BY_ENTRY`).
    """
    rs = reference_slots(spec, kt, hidden_states, topk_weights, topk_ids, scalars=scalars,
                         shared=shared, fast_math=fast_math, shared_input=shared_input,
                         nvfp4_entry_point=nvfp4_entry_point)
    out = combine_slots(spec, rs.slots, rs.valid)
    return (out, rs) if return_slots else out


# --------------------------------------------------------------------------
# the Backend
# --------------------------------------------------------------------------

def _layer_kernel_tensors(layer: Any, prefix: str) -> Optional[layout.KernelTensors]:
    """KernelTensors over a layer's ``{prefix}l1_weight`` ... attributes (the
    on-disk role names), or None when the layer has no ``{prefix}l1_weight``."""
    if getattr(layer, prefix + "l1_weight", None) is None:
        return None
    kt = layout.KernelTensors(*(getattr(layer, prefix + r, None) for r in KERNEL_ROLES))
    wt = getattr(layer, "weight_tiles", 0) if not prefix else 0
    if wt:  # another backend's in-memory arrangement: read copies in the converted layout
        from ..format.weight_tiles import untiled_copy

        kt = layout.KernelTensors(untiled_copy(kt.l1_weight, wt), kt.l1_scale, untiled_copy(kt.l2_weight, wt),
                                  kt.l2_scale)
    return kt


class ReferenceBackend:
    """fp32 torch backend; runs every row, activation and shared precision on
    any device. Slow by design: it is the definition the others test against."""

    name = "reference"

    def __init__(self, nvfp4_entry_point: Optional[str] = None) -> None:
        """``nvfp4_entry_point``: the DeepGEMM NVFP4 entry point whose dispatch
        convention nvfp4 layers follow. None: the one the layer's own backend
        names (``layer.backend.entry_point(spec)``, e.g. a layer built for the
        deepgemm backend on upstream DeepGEMM gets ``"fp4_fp4_mega_moe"``), else
        ``"nvfp4_mega_moe"`` (`_DEFAULT_NVFP4_ENTRY`)."""
        _nvfp4_dispatch_convention(nvfp4_entry_point)
        self.nvfp4_entry_point = nvfp4_entry_point

    def entry_point_for(self, layer: Any) -> str:
        """The NVFP4 entry point whose dispatch this backend models for ``layer``."""
        if self.nvfp4_entry_point is not None:
            return self.nvfp4_entry_point
        own = getattr(getattr(layer, "backend", None), "entry_point", None)
        name = own(layer.spec) if callable(own) else None
        return name if name in NVFP4_DISPATCH_BY_ENTRY else _DEFAULT_NVFP4_ENTRY

    def supports(self, spec: LayerSpec) -> bool | str:
        return True

    def supports_fused_shared(self, spec: LayerSpec) -> bool:
        return True

    @staticmethod
    def _scalars(layer: Any, device: torch.device) -> Optional[NvScalars]:
        if not layer.spec.row_spec.has_alphas:
            return None
        return NvScalars(layer.l1_alpha, layer.l2_global_scale, _f32(layer.l2_activation_scale, device))

    def pairs(self, layer: Any, rows: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """Expert-side half of an EP forward (`megamoe_runtime.layer.ep`): the bf16
        slot outputs of (row, raw top-k weight, global expert id) pairs that
        all belong to this rank."""
        return reference_pairs(layer.spec, _layer_kernel_tensors(layer, ""), rows, weights, ids,
                               scalars=self._scalars(layer, rows.device),
                               nvfp4_entry_point=self.entry_point_for(layer))

    def shared_slot(self, layer: Any, shared_input: Tensor) -> Tensor:
        """The fused shared expert's bf16 slot (column K) on ``shared_input``."""
        shared = _layer_kernel_tensors(layer, SHARED_PREFIX)
        if shared is None:
            raise MegaMoEError("the layer holds no fused shared expert tensors (shared_l1_weight is missing)")
        return shared_slot(layer.spec, shared, shared_input)

    def forward(self, layer: Any, hidden_states: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                shared_input: Optional[Tensor] = None) -> Tensor:
        """Run ``layer`` through :func:`reference_forward`.

        ``layer`` is a ``DeepGemmMegaMoEExperts`` or anything with ``spec``
        and the on-disk role attributes (``l1_weight`` ... ``l2_scale``;
        nvfp4 also ``l1_alpha``, ``l2_global_scale``, ``l2_activation_scale``;
        fused shared: ``shared_l1_weight`` ...). The fused shared expert runs
        (slot K) exactly when ``shared_input`` is given, on that input.
        """
        spec = layer.spec
        scalars = self._scalars(layer, hidden_states.device)
        shared = None
        if shared_input is not None:
            shared = _layer_kernel_tensors(layer, SHARED_PREFIX)
            if shared is None:
                raise MegaMoEError("shared_input was given but the layer holds no fused shared "
                                   "expert tensors (shared_l1_weight is missing); pass "
                                   "shared_input=None and run the shared expert outside")
        return reference_forward(spec, _layer_kernel_tensors(layer, ""), hidden_states,
                                 topk_weights, topk_ids, scalars=scalars, shared=shared,
                                 shared_input=shared_input, nvfp4_entry_point=self.entry_point_for(layer))
