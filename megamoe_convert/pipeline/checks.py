"""Every rule that must hold before a converted byte is trusted.

The converter runs these in two places, both before anything is written
under the final output name (it writes into a temporary folder and renames it
only at the end):

* **preflight** (cheap, whole model, before the first shard byte): each
  layer's spec against its row's size rules (`layer_spec`), and the
  per-expert float scales of every expert of every layer
  (`check_layer_scalars`: present, finite, > 0; NVFP4 w1/w3 `weight_scale_2`
  agreement; the global L2 activation scale a2 = max over ALL experts of the
  w2 input scale). A w1/w3 mismatch or a bad global scale fails here, before
  any weight is read.
* **per expert, as each is read** (`check_expert`): presence, shapes and dtypes
  against the config (ExpertTensors.validate) and block-scale bytes (no
  E8M0 0xFF, no E4M3 NaN / negative / zero). These need the block scales,
  which are read once, with their weights, in the streaming pass.

Policy for w1/w3 disagreement (docs/SCALES.md#w1-w3-agreement): raise ScaleError
naming layer, expert and both values; or, with ``on_scale_mismatch =
"requantize"``, re-encode the smaller half onto ``s2 = max(s2_w1, s2_w3)``:
``ws' = e4m3_RNE(ws * s2_old / s2)`` with the E2M1 nibbles unchanged, and
report the numeric change (`requantize_gate_up`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch

from megamoe_runtime.errors import CheckpointError, LayerSpecError, ScaleError
from megamoe_runtime.format import codecs, scales
from megamoe_runtime.format.canonical import ExpertTensors, ProjectionTensors
from megamoe_runtime.format.formats import LayerSpec, Row, SharedSpec
from megamoe_runtime.format.source_formats import is_quantized_linear

from ..readers.base import ExpertScalars, ModelFacts, MoELayerInfo
from ..readers.common import all_finite, non_finite_message

#: relative tolerance within which w1 and w3 weight_scale_2 count as equal (the runtime's rule)
GATE_UP_RTOL = scales.W13_RTOL
SCALE_MISMATCH_POLICIES = ("error", "requantize")

_ROLE_ALIASES = {"gate": ("gate_proj", "w1", "gate_up_proj"), "up": ("up_proj", "w3", "gate_up_proj"),
                 "down": ("down_proj", "w2")}


_finite_pos = scales.is_valid_scale


#: the stored names of a weight's global scale (ModelOpt / Quark, compressed-tensors), for `_named`
_GLOBAL_SCALE_NAMES = ("weight_scale_2", "weight_global_scale")


def _source_names(info: MoELayerInfo, expert: int, role: str, kind: "str | tuple[str, ...]" = "") -> list[str]:
    """Best-effort source tensor names of one expert's projection (for messages). `kind`: a part of the last
    name component, or a tuple of whole last components."""
    if isinstance(kind, tuple):
        return [n for n in _source_names(info, expert, role) if n.rsplit(".", 1)[-1] in kind]
    aliases = _ROLE_ALIASES.get(role, (role,))
    marks = (f"experts.{expert}.",)
    out = []
    for n in sorted(info.expert_tensor_names):
        if not any(m in n for m in marks):
            continue
        if not any(f".{a}." in n or n.endswith(f".{a}") for a in aliases):
            continue
        if kind and kind not in n.rsplit(".", 1)[-1]:
            continue
        out.append(n)
    exact = [n for n in out if n.rsplit(".", 1)[-1] == kind]
    return exact or out  # "weight" names the weight, not also its weight_scale_inv


def _shared_source_names(info: MoELayerInfo, role: str, kind: str = "") -> list[str]:
    """Best-effort source tensor names of one shared-expert projection (for messages)."""
    if info.shared is None:
        return []
    aliases = _ROLE_ALIASES.get(role, (role,))
    return [n for n in sorted(info.shared.tensor_names)
            if any(f".{a}." in n for a in aliases) and (not kind or kind in n.rsplit(".", 1)[-1])]


def named_shared(info: MoELayerInfo, role: str, kind: str, source=None) -> str:
    """' (source tensor NAME in FILE)' for a shared-expert projection, when found."""
    return _where_names(source_names=_shared_source_names(info, role, kind)[:2], source=source)


def _where_names(source_names: list[str], source=None) -> str:
    if not source_names:
        return ""
    where = []
    for n in source_names:
        try:
            where.append(f"{n} in {source.file_of(n).name}" if source is not None else n)
        except Exception:  # naming is best effort
            where.append(n)
    return f" (source tensor {', '.join(where)})"


def _named(info: MoELayerInfo | None, expert: int | None, role: str, kind: "str | tuple[str, ...]",
           source=None) -> str:
    """' (source tensor NAME in FILE)' for messages, when the name can be found."""
    if info is None or expert is None:
        return ""
    return _where_names(_source_names(info, expert, role, kind)[:2], source)


# --------------------------------------------------------------------------- structure


def shared_spec_for(info: MoELayerInfo, row: Row) -> tuple[SharedSpec | None, dict]:
    """The shared-expert spec the layer can fuse, and the manifest's shared record.

    The precision is the shared experts' own encoding when the row can fuse it
    (bytes copied unchanged), else the first precision the row fuses (the
    writer converts to it). A shared expert that cannot be fused is passed
    through unchanged and the record says why.
    """
    sh = info.shared
    if sh is None:
        return None, {"present": False, "fused_capable": False, "reason": "the layer has no shared experts"}
    rec = {"present": True, "num_shared": sh.num_shared, "intermediate": sh.intermediate,
           "source_encoding": sh.encoding}
    if sh.unsupported_reason:
        return None, {**rec, "fused_capable": False, "reason": sh.unsupported_reason}
    if not row.fusable_shared:
        return None, {**rec, "fused_capable": False,
                      "reason": f"row {row.name} cannot fuse shared experts; they stay in the pass-through files"}
    precision = sh.encoding if sh.encoding in row.fusable_shared else row.fusable_shared[0]
    try:
        spec = SharedSpec(precision, sh.num_shared, sh.intermediate)
    except LayerSpecError as e:
        return None, {**rec, "fused_capable": False,
                      "reason": f"{e}; the shared experts stay in the pass-through files"}
    return spec, {**rec, "fused_capable": True, "reason": "", "precision": precision}


def layer_spec(info: MoELayerInfo, facts: ModelFacts, row: Row, ep_size: int,
               shared: SharedSpec | None) -> LayerSpec:
    """The layer's LayerSpec (ep_rank 0); LayerSpecError names the layer when
    its sizes, experts or activation break a rule of the row."""
    try:
        return LayerSpec(
            row=row.name, hidden=info.hidden, intermediate=info.intermediate,
            num_experts=info.num_experts, top_k=facts.top_k, activation=facts.activation,
            ep_rank=0, ep_size=ep_size, shared=shared,
            routed_scaling_factor=float(facts.routed_scaling_factor),
        )
    except LayerSpecError as e:
        raise LayerSpecError(f"MoE layer {info.index} ({info.prefix}): {e}") from None


# --------------------------------------------------------------------------- scalars


@dataclass
class LayerScalarReport:
    """Preflight findings for one layer's float scales."""

    index: int
    scalars: dict = field(default_factory=dict)  # manifest scalars (l2_activation_scale, ...)
    mismatches: list[tuple[int, float, float]] = field(default_factory=list)  # (expert, w1, w3)
    missing_input: list[int] = field(default_factory=list)  # experts without a w2 input scale
    gate_global: list[float] = field(default_factory=list)
    up_global: list[float] = field(default_factory=list)
    down_global: list[float] = field(default_factory=list)
    missing_a2: str | None = None  # the refusal when a2 cannot be derived (report_missing_a2=True)


gate_up_agree = scales.gate_up_agree


def check_l2_activation_scale(row: Row, value: float | None) -> None:
    """A given ``--l2-activation-scale`` is one the row has and FP32 can hold
    (ScaleError otherwise); None passes."""
    if value is None:
        return
    if not row.has_alphas:
        raise ScaleError(f"--l2-activation-scale {value!r}: only the nvfp4 row has a global L2 activation scale; "
                         f"this checkpoint converts to row {row.name}, whose kernels scale activations per block "
                         "themselves. Drop it")
    if not scales.is_valid_fp32_scale(value):
        raise ScaleError(f"--l2-activation-scale {value!r} must be {scales.SCALE_RULE} as a float32 (a2 is stored "
                         "as one)")


def check_layer_scalars(info: MoELayerInfo, scalars: list[ExpertScalars], row: Row, *,
                        on_scale_mismatch: str = "error", allow_missing_input_scales: bool = False,
                        source=None, l2_activation_scale: float | None = None,
                        report_missing_a2: bool = False) -> LayerScalarReport:
    """Check every expert's float scales of one layer and derive the layer scalars.

    NVFP4: every global scale present, finite, > 0; w1/w3 agreement (ScaleError
    for the first mismatch unless the policy is "requantize"); a2 = max over
    all experts of the w2 input scale, which must be present for every expert
    (ScaleError naming the experts) unless ``allow_missing_input_scales``, when
    a2 = max over the experts that have one (ModelOpt gives uncalibrated experts
    the max amax too). w1/w3 input scales are validated and their max recorded
    as ``l1_activation_scale`` (used only by a static-dispatch consumer).
    Other rows carry no float scales; any given are refused. `source`
    (optional) lets messages name the file of the offending tensor.
    ``l2_activation_scale`` supplies a2 for an uncalibrated checkpoint (no
    expert has a w2 input scale, e.g. ``--quantize nvfp4`` from BF16); it is
    refused when the checkpoint determines a2 itself. ``report_missing_a2``
    (inspect): an underivable a2 is recorded in ``rep.missing_a2`` instead of
    raised, so the layer's other findings (w1/w3 mismatches) still reach the report.
    """
    if on_scale_mismatch not in SCALE_MISMATCH_POLICIES:
        raise ScaleError(f"on_scale_mismatch={on_scale_mismatch!r}; valid: {', '.join(SCALE_MISMATCH_POLICIES)}")
    rep = LayerScalarReport(info.index)
    where = f"MoE layer {info.index} ({info.prefix})"
    if len(scalars) != info.num_experts:
        raise CheckpointError(f"{where}: {len(scalars)} experts' scales read, config says {info.num_experts}")
    check_l2_activation_scale(row, l2_activation_scale)
    if not row.has_alphas:
        for e, s in enumerate(scalars):
            given = {k: v for k, v in vars(s).items() if v is not None}
            if given:
                raise ScaleError(f"{where} expert {e}: row {row.name} has no float scales, got {given}")
        return rep
    w2_inputs: list[float] = []
    a13_ok = True
    a13 = 0.0
    for e, s in enumerate(scalars):
        for role, label in (("gate", "gate_global"), ("up", "up_global"), ("down", "down_global")):
            v = getattr(s, label)
            if v is None:
                raise ScaleError(
                    f"{where} expert {e}: the {role} projection has no global scale (weight_scale_2)"
                    f"{_named(info, e, role, 'scale', source)}; NVFP4 needs one per projection")
            if not _finite_pos(v):
                raise ScaleError(
                    f"{where} expert {e}: {role} global scale (weight_scale_2) = {v!r}"
                    f"{_named(info, e, role, _GLOBAL_SCALE_NAMES, source)}; it must be {scales.SCALE_RULE}")
        rep.gate_global.append(float(s.gate_global))
        rep.up_global.append(float(s.up_global))
        rep.down_global.append(float(s.down_global))
        if not gate_up_agree(s.gate_global, s.up_global):
            if on_scale_mismatch == "error":
                raise ScaleError(
                    f"{where} expert {e}: w1 (gate) weight_scale_2 = {s.gate_global!r} and w3 (up) "
                    f"weight_scale_2 = {s.up_global!r} differ by {_rel(s.gate_global, s.up_global):.3g} relative "
                    f"(tolerance {GATE_UP_RTOL:g}); the fused L1 GEMM needs one value per expert. Re-run with "
                    f"--on-scale-mismatch requantize to re-encode both halves onto the larger one "
                    f"(block scales rescaled, nibbles unchanged; the numeric change is reported)")
            rep.mismatches.append((e, float(s.gate_global), float(s.up_global)))
        for role, label in (("gate", "gate_input"), ("up", "up_input")):
            v = getattr(s, label)
            if v is None:
                a13_ok = False
            elif not _finite_pos(v):
                raise ScaleError(f"{where} expert {e}: {role} input scale = {v!r}"
                                 f"{_named(info, e, role, 'input', source)}; it must be {scales.SCALE_RULE}")
            else:
                a13 = max(a13, float(v))
        v = s.down_input
        if v is None:
            rep.missing_input.append(e)
        elif not _finite_pos(v):
            raise ScaleError(f"{where} expert {e}: down (w2) input scale = {v!r}"
                             f"{_named(info, e, 'down', 'input', source)}; it must be {scales.SCALE_RULE} "
                             "(a2 = max over all experts)")
        else:
            w2_inputs.append(float(v))
    a2 = scales.global_l2_activation_scale(w2_inputs)
    if l2_activation_scale is not None:
        if a2 is not None:
            raise ScaleError(
                f"{where}: the checkpoint's w2 input scales determine a2 = {a2!r} (max over the experts); "
                "--l2-activation-scale is only for uncalibrated checkpoints, drop it")
        a2 = float(l2_activation_scale)
        rep.missing_input = []
    if a2 is None:
        msg = (f"{where}: no expert has a w2 (down) input scale, so the global L2 activation scale a2 cannot be "
               "derived. Use a calibrated checkpoint (ModelOpt input_scale, Quark input_scale_2, "
               "compressed-tensors input_global_scale), or give it with --l2-activation-scale (the expected amax "
               "of the expert intermediate activation divided by 2688; e.g. from a calibration run)")
        if not report_missing_a2:
            raise ScaleError(msg)
        rep.missing_a2, rep.missing_input = msg, []
        return rep
    if rep.missing_input and not allow_missing_input_scales:
        shown = rep.missing_input[:8]
        raise ScaleError(
            f"{where}: {len(rep.missing_input)} of {info.num_experts} experts have no w2 (down) input scale "
            f"(experts {shown}{' ...' if len(rep.missing_input) > 8 else ''}); a2 must be the max over ALL experts. "
            "Pass --allow-missing-input-scales to use the max over the experts that have one "
            f"(here {a2!r}, what ModelOpt assigns uncalibrated experts)")
    rep.scalars["l2_activation_scale"] = a2
    if a13_ok and a13 > 0:
        rep.scalars["l1_activation_scale"] = a13
    return rep


_rel = scales.gate_up_relative_difference


# --------------------------------------------------------------------------- block scales


def check_block_scales(p: ProjectionTensors, row: Row, where: str,
                       name_hint: Callable[[], str] | None = None,
                       weight: Callable[[], torch.Tensor] | None = None) -> None:
    """Block-scale bytes must decode to finite values > 0.

    E8M0: 0xFF (NaN) refused. E4M3: NaN and negative refused. A zero scale
    (E8M0 byte 0, which DeepGEMM decodes to 0.0; E4M3 +-0) is accepted only
    when every element of its block is zero too: ModelOpt marks all-zero
    blocks that way, and the block dequantizes to 0 either way. A zero scale
    over nonzero elements would silently erase them, so it is refused.
    `name_hint()` (called only on error) adds the source tensor name.
    `weight()`, when given, supplies the weight values in place of
    ``p.weight`` (called only when a scale is zero): the converter's direct
    reads leave ``p.weight`` a meta tensor and the bytes in the kernel buffer.

    Runs on every expert of every layer, so the common case is two
    reductions (min and max of the bytes); the element-wise masks are built
    only when a byte is out of the always-valid range.
    """
    if p.scale is None:
        return
    if row.weight.block_scaled:
        _check_fp32_block_scales(p, row, where, name_hint, weight)
        return
    b = p.scale.view(torch.uint8)
    if b.numel() == 0:
        return
    lo, hi = int(b.min()), int(b.max())
    ue8m0 = row.weight.scale_encoding == "ue8m0"
    if lo >= 1 and hi <= (0xFE if ue8m0 else 0x7E):  # all finite and > 0
        return
    full = f"{where}{name_hint() if name_hint else ''}"
    if ue8m0:
        bad = b == 0xFF
        if bool(bad.any()):
            _raise_first(bad, b, full, "UE8M0 scale byte(s) are 0xFF (E8M0 NaN); valid bytes are 0..254")
        zero = b == 0
    else:
        nan = (b & 0x7F) == 0x7F
        if bool(nan.any()):
            _raise_first(nan, b, full, "E4M3 block scale(s) are NaN")
        neg = (b & 0x80).bool() & ((b & 0x7F) != 0)
        if bool(neg.any()):
            _raise_first(neg, b, full, "E4M3 block scale(s) are negative; block scales must be > 0")
        zero = (b & 0x7F) == 0
    if bool(zero.any()):
        bad = zero & _live_blocks(p.weight if weight is None else weight(), row)
        if bool(bad.any()):
            _raise_first(bad, b, full, "block scale(s) are zero while their block has nonzero elements "
                                       "(the elements would be erased); block scales must be > 0")


def _check_fp32_block_scales(p: ProjectionTensors, row: Row, where: str,
                             name_hint: Callable[[], str] | None,
                             weight: Callable[[], torch.Tensor] | None) -> None:
    """fp32 block scales finite and > 0 (zero only over an all-zero block), not fp32 subnormals over a block
    with a nonzero element (docs/FORMATS.md#subnormal-scales), and small enough that the block's
    largest E4M3 magnitude times its scale stays finite in fp32 (a finite scale such as 1e38 would dequantize
    the block to inf, and the layer's output to NaN)."""
    s = p.scale
    w = (p.weight if weight is None else weight()).view(torch.uint8)
    full = lambda: f"{where}{name_hint() if name_hint else ''}"  # noqa: E731
    bad = ~torch.isfinite(s) | (s < 0)
    b = row.weight.scale_block_rows
    zero = s == 0
    small = (s > 0) & (s < scales.FP32_MIN_NORMAL)  # fp32 subnormal: docs/FORMATS.md#subnormal-scales
    live = None
    if bool(zero.any()) or bool(small.any()):
        live = ((w & 0x7F) != 0).unflatten(-1, (-1, row.weight.scale_group)).any(-1)
        live = live.unflatten(-2, (-1, b)).any(-2)
        bad |= zero & live
    if bool(bad.any()):
        _raise_first_block(bad, s, full(), "are not finite and > 0 (a zero scale only over an all-zero block)")
    if live is not None:
        sub = small & live
        if bool(sub.any()):
            _raise_first_block(sub, s, full(), "are fp32 subnormals (< 2^-126) over a block with nonzero elements",
                               tail=". No producer writes one (amax/448 of such a block is under 5.3e-36) and the "
                                    "kernel would lose the block: a corrupt scale (docs/FORMATS.md#subnormal-scales)")
    if float(s.max()) * _E4M3_MAX > _F32_MAX:  # only then can a block overflow: look at its magnitudes
        # E4M3 magnitudes order as their low 7 bits, so the block's largest byte is its largest |element|
        mag = (w & 0x7F).unflatten(-1, (-1, row.weight.scale_group)).amax(-1).unflatten(-2, (-1, b)).amax(-2)
        top = mag.view(torch.float8_e4m3fn).float()
        over = ~torch.isfinite(top * s)
        if bool(over.any()):
            _raise_first_block(over, s, full(), "make their block overflow fp32 (largest |E4M3| of the block x "
                                                 "scale is inf)",
                               at=lambda first: f" over |E4M3| {float(top[first])!r}")


def _raise_first_block(mask: torch.Tensor, s: torch.Tensor, where: str, what: str,
                       at: Callable[[tuple], str] | None = None, tail: str = "") -> None:
    """ScaleError for the fp32 block scales `s` where `mask` holds, in one line: how many `what`, the first one's
    [row block, col block] and value (``at(first)`` after it), the scale shape, then `tail`."""
    first = tuple(int(i) for i in mask.nonzero()[0].tolist())
    raise ScaleError(
        f"{where}: {int(mask.sum())} of {mask.numel()} fp32 block scale(s) {what}; first at [row block, col block] = "
        f"{list(first)} = {float(s[first])!r}{at(first) if at else ''}, scale shape {list(s.shape)}{tail}")


_E4M3_MAX = 448.0
_F32_MAX = float(torch.finfo(torch.float32).max)


def _check_e4m3_weight(weight: torch.Tensor, where: str, name_hint: Callable[[], str]) -> None:
    """No E4M3 NaN byte (S.1111.111: 0x7F / 0xFF) in a weight."""
    w = weight.view(torch.uint8)
    nan_w = (w & 0x7F) == 0x7F
    if bool(nan_w.any()):
        count, first = int(nan_w.sum()), [int(i) for i in nan_w.nonzero()[0].tolist()]
        raise ScaleError(f"{where}{name_hint()}: {count} E4M3 weight byte(s) are NaN (0x7F / 0xFF); first at "
                         f"[row, col] = {first} (byte 0x{int(w[tuple(first)]):02X})")


def _live_blocks(weight: torch.Tensor, row: Row) -> torch.Tensor:
    """[rows, groups] True where a scale group has a nonzero element."""
    w = weight.view(torch.uint8)
    if row.weight.element == "e2m1":
        nz = (codecs.unpack_e2m1(w) & 7) != 0
    else:  # e4m3: magnitude bits
        nz = (w & 0x7F) != 0
    return nz.reshape(*nz.shape[:-1], -1, row.weight.scale_group).any(-1)


def _raise_first(mask: torch.Tensor, b: torch.Tensor, where: str, what: str) -> None:
    count = int(mask.sum())
    first = tuple(int(i) for i in mask.nonzero()[0].tolist())
    raise ScaleError(
        f"{where}: {count} of {mask.numel()} {what}; first at [row, group] = {list(first)} "
        f"(byte 0x{int(b[first]):02X}), scale shape {list(b.shape)}")


def check_expert(et: ExpertTensors, row: Row, info: MoELayerInfo, expert: int, source=None,
                 weights: "dict[str, Callable[[], torch.Tensor]] | None" = None) -> None:
    """Shapes and dtypes against the config (CheckpointError) and block-scale
    values (ScaleError), naming layer, expert, projection and source tensor.
    ``weights`` (role -> callable): the weight values where ``et`` holds meta
    weights (see `check_block_scales`)."""
    where = f"MoE layer {info.index} ({info.prefix}) expert {expert}"
    et.validate(row, info.hidden, info.intermediate, where)
    for role, p in et.projections():
        if row.weight.block_scaled:  # E4M3 NaN bytes would reach the kernel as NaN
            w = (weights or {}).get(role)
            _check_e4m3_weight(p.weight if w is None else w(), f"{where} {role} weight",
                               lambda role=role: _named(info, expert, role, "weight", source))
        check_block_scales(p, row, f"{where} {role} scale",
                           lambda role=role: _named(info, expert, role, "scale", source),
                           (weights or {}).get(role))


# --------------------------------------------------------------------------- pass-through values


#: safetensors dtype -> torch dtype of the plain float tensors whose values the pass-through copy checks
_PASSTHROUGH_FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
                             "F64": torch.float64}


def passthrough_checked(dtypes: Mapping[str, str]) -> dict[str, torch.dtype]:
    """Which pass-through tensors the copy checks for NaN / inf (name -> torch dtype), from every pass-through
    tensor's safetensors dtype (`dtypes`): the plain float tensors (F16, BF16, F32, F64: attention, norms,
    embeddings, the router, a dense MLP, unfused BF16 shared experts), which an engine uses as they are.

    Not checked: quantized storage (packed U8 / I8, F8 elements), and the float scales that belong to a
    linear stored quantized (`format.source_formats.is_quantized_linear`: its ``weight_scale``,
    ``weight_scale_inv``, ``weight_scale_2``, input scales; not its bias). Those are decoded together with
    their weight, and the engine integration's decode checks them, naming the linear
    (docs/ENGINES.md#non-expert-linears): a producer may legitimately leave a linear it did not quantize
    with a NaN scale there (transformers' FineGrainedFP8 for linears 128 does not tile,
    docs/CHECKPOINTS.md), which converts and is refused only if that linear is loaded."""
    modules: dict[str, dict[str, str]] = {}
    for name, dt in dtypes.items():
        mod, _, suffix = name.rpartition(".")
        modules.setdefault(mod, {})[suffix] = dt
    quantized = {mod for mod, d in modules.items() if is_quantized_linear(d)}
    out = {}
    for name, dt in dtypes.items():
        mod, _, suffix = name.rpartition(".")
        if dt in _PASSTHROUGH_FLOAT_DTYPES and (mod not in quantized or suffix == "bias"):
            out[name] = _PASSTHROUGH_FLOAT_DTYPES[dt]
    return out


def finite_passthrough_chunks(chunks: Iterable[memoryview], dtype: torch.dtype, name: str, path: Path, pos: int,
                              shape: tuple[int, ...]) -> Iterator[memoryview]:
    """Pass the byte chunks of pass-through tensor `name` (at byte `pos` of `path`) on unchanged, each one
    checked for NaN / inf before it goes on (`all_finite`: one sum per chunk, element-wise only where the sum
    is not finite). A non-finite value: CheckpointError naming the tensor, its file, how many values, the
    first one's index and value (`non_finite_message`, from the whole tensor read again on that path only).
    A chunk that ends inside an element carries its tail into the next."""
    item = torch.empty((), dtype=dtype).element_size()
    tail = b""
    for c in chunks:
        data = bytearray(tail) + c if tail else c  # `c` itself in the common case: chunks are element-aligned
        n = len(data) - len(data) % item
        if n and not all_finite(torch.frombuffer(data, dtype=dtype, count=n // item)):
            raise CheckpointError(non_finite_message(
                f"non-expert tensor {name} in {path.name}", _read_tensor(path, pos, dtype, shape),
                "It is copied unchanged and an engine would compute with it: fix the source"))
        tail = bytes(data[n:])
        yield c


def _read_tensor(path: Path, pos: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor of `dtype` and `shape` stored at byte `pos` of `path` (for messages)."""
    n = torch.empty((), dtype=dtype).element_size() * math.prod(shape)
    buf = bytearray(n)
    with open(path, "rb") as f:
        f.seek(pos)
        if f.readinto(buf) != n:
            raise CheckpointError(f"{path}: unexpected end of file reading {n} bytes at {pos}")
    return torch.frombuffer(buf, dtype=dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


# --------------------------------------------------------------------------- repair


def requantize_gate_up(et: ExpertTensors, where: str) -> tuple[ExpertTensors, dict]:
    """Put w1 and w3 onto one global scale s2 = max(s2_w1, s2_w3).

    The half with the smaller s2_old keeps its E2M1 nibbles; its block scales
    become ``e4m3_RNE(ws * s2_old / s2)`` (factor <= 1, one extra E4M3
    rounding). Returns the repaired expert and a report: which half, both old
    values, s2, the max absolute and relative change of its dequantized
    values, and how many blocks fell below the E4M3 minimum subnormal 2^-9
    (``underflow_blocks``; those that rounded to 0 are ``zeroed_blocks`` and
    now dequantize to 0).
    """
    g, u = float(et.gate.global_scale), float(et.up.global_scale)
    s2 = max(g, u)
    half = "gate" if g < u else "up"
    p = et.gate if half == "gate" else et.up
    s_old = g if half == "gate" else u
    ws = codecs.e4m3_decode(p.scale).double()
    scaled = ws * (s_old / s2)
    new_scale = codecs.e4m3_encode(scaled)
    new_ws = codecs.e4m3_decode(new_scale)
    nonzero = ws > 0
    underflow = int(((scaled < codecs.E4M3_MIN_SUBNORMAL) & nonzero).sum())  # below it: precision lost, or 0
    zeroed = int(((new_ws == 0) & nonzero).sum())
    old = codecs.dequantize_nvfp4(p.weight, p.scale, s_old).double()
    new = codecs.dequantize_nvfp4(p.weight, new_scale, s2).double()
    diff = (new - old).abs()
    nz = old != 0
    max_rel = float((diff[nz] / old[nz].abs()).max()) if bool(nz.any()) else 0.0
    fixed = ProjectionTensors(p.weight, new_scale, s2, p.input_scale)
    other = et.up if half == "gate" else et.gate
    other = ProjectionTensors(other.weight, other.scale, s2, other.input_scale)
    out = ExpertTensors(fixed, other, et.down) if half == "gate" else ExpertTensors(other, fixed, et.down)
    report = {
        "where": where, "requantized": half, "gate_weight_scale_2": g, "up_weight_scale_2": u,
        "weight_scale_2": s2, "max_abs_change": float(diff.max()) if diff.numel() else 0.0,
        "max_rel_change": max_rel, "underflow_blocks": underflow, "zeroed_blocks": zeroed,
    }
    return out, report


__all__ = [
    "GATE_UP_RTOL", "SCALE_MISMATCH_POLICIES", "shared_spec_for", "layer_spec", "LayerScalarReport",
    "gate_up_agree", "check_layer_scalars", "check_block_scales", "check_expert", "requantize_gate_up",
    "passthrough_checked", "finite_passthrough_chunks",
]
