"""Weight loaders of `DeepGemmMegaMoEExperts`: two ways in, the same bytes out.

Pre-laid-out (converted checkpoints, `megamoe.json`)
    Every stored tensor is already in kernel layout (MN-major scales in their
    physical order), so loading is ONE write per stored tensor into the
    storage the layer allocated once: no transform, no reallocation, no
    full-size temporary. From a file the bytes are read straight into the
    parameter (CPU) or through two pinned chunks (CUDA); from a tensor (or a
    meta stand-in in a dry run) it is one ``copy_``. See `copy_stored`.

Raw checkpoint, vLLM style
    ``weight_loader(param, loaded_weight, weight_name, shard_id, expert_id)``
    with ``shard_id`` in {"w1", "w2", "w3"} (gate, down, up) and a GLOBAL
    ``expert_id``: every shard goes straight into kernel layout through
    `megamoe_runtime.format.layout`'s ``write_*`` primitives (the code the converter
    uses), each one ``copy_``, in any order. Experts not on this EP rank are
    skipped, except the w2 input scales: every rank reads every expert's so
    that the global L2 activation scale ``a2`` (a max over ALL experts) agrees
    across ranks. See `raw_weight_loader`.

NVFP4 scalar state (docs/SCALES.md). Per expert: ``l1_alpha[e] =
(ws2_w1, ws2_w3)`` and ``l2_global_scale[e] = ws2_w2``; per layer: ``a2``.
The w1/w3 ``weight_scale_2`` pair is checked *within one load*, in whichever
order the two arrive, through a per-load pending dict -- never against the
value already in the parameter, which belongs to the previous load (a reload
with changed scales and shards shuffled w3-before-w1 must pass). ``a2`` and
every derived device tensor are recomputed at the end of each load and
written in place (``copy_``), so CUDA-graph-captured pointers stay valid.

Dry runs. A meta tensor as source means "record the write, touch nothing":
the loaders then skip all host-side scale state (no ``.item()``, no pending
dict, no a2), as `megamoe_runtime.load.reload.verify_reload` requires.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional, Protocol

import torch

from ..errors import CheckpointError, LayoutError, ScaleError
from ..format import formats, layout, scales
from ..files.file_io import copy_into as _copy_into
from ..format.formats import Element, get_row
from ..format.roles import STORAGE_CONTIGUOUS, STORAGE_MN_MAJOR, is_shared_role, role_of
from ..format.source_formats import (
    FAMILIES,
    PROJECTION_PATTERN,
    PROJECTION_ROLES,
    SHARD_OF_ROLE,
    SHARED_MODULE_PATTERN,
    SUFFIX_KINDS,
    UNSUPPORTED_SUFFIXES,
)

__all__ = [
    "SHARD_IDS",
    "ExpertWeightRef",
    "parse_expert_weight_name",
    "make_expert_params_mapping",
    "copy_stored",
    "raw_weight_loader",
    "shared_weight_loader",
    "LoadState",
    "LoadTarget",
]

#: vLLM's shard ids: w1 = gate, w3 = up (the two L1 halves), w2 = down (L2).
SHARD_IDS = ("w1", "w2", "w3")
#: relative tolerance within which an expert's w1 and w3 weight_scale_2 agree (docs/SCALES.md#w1-w3-agreement)
W13_RTOL = scales.W13_RTOL
_HALF = {"w1": 0, "w3": 1}
_PROJ_SHARD = {proj: SHARD_OF_ROLE[role] for proj, role in PROJECTION_ROLES.items()}

_EXPERT_RE = re.compile(
    rf"^(?P<prefix>.+?)\.experts\.(?P<expert>\d+)\.(?P<proj>{PROJECTION_PATTERN})\.(?P<suffix>\w+)$"
)
_SHARED_RE = re.compile(
    rf"^(?P<prefix>.+?)\.(?:{SHARED_MODULE_PATTERN})\.(?P<proj>{PROJECTION_PATTERN})\.(?P<suffix>\w+)$"
)


@dataclass(frozen=True)
class ExpertWeightRef:
    """What one checkpoint tensor name means to the MegaMoE loaders.

    ``param_name`` is the layer attribute it lands in (``l1_weight``,
    ``l2_scale``, ``l1_alpha``, ``l2_global_scale``; ``shared_*`` for the
    shared expert), ``l2_activation_scale`` for w2 input scales (they feed the
    layer's a2), or ``""`` for tensors that are validated but not stored (the
    w1/w3 input scales: dispatch uses a per-token scale, docs/SCALES.md#dispatch-scale).
    ``unsupported`` is a reason when the tensor exists but no row can use it.
    """

    name: str
    prefix: str
    expert_id: Optional[int]  # global id; None for the shared expert
    shard_id: str
    suffix: str
    kind: str
    divisor: bool
    param_name: str
    unsupported: Optional[str] = None

    @property
    def shared(self) -> bool:
        return self.expert_id is None

    @property
    def weight_role(self) -> str:
        """The role of the weight this tensor's projection belongs to: whether a layer has the parameter at
        all (``param_for_role``) decides if a shared-expert tensor is used or reported unused."""
        return role_of(_stage(self.shard_id), "weight", self.shared)


def _stage(shard_id: str) -> str:
    """w2 (down) feeds L2; w1 and w3 (gate, up) are the two halves of L1."""
    return "l2" if shard_id == "w2" else "l1"


def _param_name(kind: str, shard_id: str, shared: bool) -> str:
    stage = _stage(shard_id)
    if kind in ("weight", "scale"):
        return role_of(stage, kind, shared)
    elif kind == "global_scale":
        # weight_scale_2 becomes a per-expert scalar; the shared expert has none (bf16/mxfp8, docs/SCALES.md)
        return "" if shared else role_of(stage, "scalar")
    elif kind == "input_scale":
        if shared:
            return ""
        return "l2_activation_scale" if shard_id == "w2" else ""
    else:  # pragma: no cover - kinds are closed
        raise LayoutError(f"unknown tensor kind {kind!r}")


def parse_expert_weight_name(name: str) -> Optional[ExpertWeightRef]:
    """Map a checkpoint tensor name onto the MegaMoE loaders, or None if it
    is not a routed / shared expert tensor.

    Understands ``{prefix}.experts.{E}.{gate_proj|up_proj|down_proj|w1|w3|w2}.{suffix}``
    (DeepSeek V2/V3/V4, GLM, Kimi, Qwen3-MoE, Mixtral) and
    ``{prefix}.shared_experts.{proj}.{suffix}``, with the ModelOpt, Quark,
    compressed-tensors and DeepSeek-V4 suffixes of docs/CHECKPOINTS.md#source-formats.
    """
    m = _EXPERT_RE.match(name)
    expert: Optional[int] = None
    if m is not None:
        expert = int(m.group("expert"))
    else:
        m = _SHARED_RE.match(name)
        if m is None:
            return None
    shard = _PROJ_SHARD[m.group("proj")]
    suffix = m.group("suffix")
    shared = expert is None
    if suffix in UNSUPPORTED_SUFFIXES or suffix not in SUFFIX_KINDS:
        reason = UNSUPPORTED_SUFFIXES.get(
            suffix, f"unknown expert tensor suffix {suffix!r}; known: {', '.join(sorted(SUFFIX_KINDS))}"
        )
        return ExpertWeightRef(name, m.group("prefix"), expert, shard, suffix, "unsupported", False, "", reason)
    kind, divisor = SUFFIX_KINDS[suffix]
    return ExpertWeightRef(name, m.group("prefix"), expert, shard, suffix, kind, divisor,
                           _param_name(kind, shard, shared))


#: fmt -> the suffixes ``make_expert_params_mapping`` lists, from `source_formats.FAMILIES`
_FORMAT_SUFFIXES = {name: tuple(m.suffix for m in fam.suffixes) for name, fam in FAMILIES.items()}


def make_expert_params_mapping(
    num_experts: int,
    *,
    fmt: str = "modelopt",
    naming: str = "hf",
    module_prefix: str = "experts.",
) -> list[tuple[str, str, int, str]]:
    """vLLM-style ``(param_name, weight_name, expert_id, shard_id)`` tuples.

    Like vLLM's ``FusedMoE.make_expert_params_mapping``, an engine's
    ``load_weights`` finds the first tuple whose ``weight_name`` is a
    substring of the checkpoint name, replaces it by ``param_name`` and calls
    ``param.weight_loader(param, tensor, name, shard_id=..., expert_id=...)``.
    Unlike vLLM the fragments carry the full suffix (``experts.3.gate_proj.weight_scale``
    -> ``experts.l1_scale``), because the kernel-layout parameters are named by
    role, not by checkpoint suffix; longer suffixes come first so that
    ``weight`` never shadows ``weight_scale``. ``param_name`` is ``""`` for
    tensors that are validated but stored nowhere (w1/w3 input scales).

    fmt: modelopt | compressed-tensors | quark | deepseek-v4 | mx | bf16;
    naming: "hf" (gate_proj/up_proj/down_proj) or "w123" (w1/w3/w2).
    """
    try:
        suffixes = _FORMAT_SUFFIXES[fmt]
    except KeyError:
        raise CheckpointError(f"unknown fmt {fmt!r}; valid: {', '.join(_FORMAT_SUFFIXES)}") from None
    if naming == "hf":
        projs = (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3"))
    elif naming == "w123":
        projs = (("w1", "w1"), ("w2", "w2"), ("w3", "w3"))
    else:
        raise CheckpointError(f"unknown naming {naming!r}; valid: 'hf', 'w123'")
    suffixes = tuple(sorted(suffixes, key=len, reverse=True))
    out: list[tuple[str, str, int, str]] = []
    for e in range(num_experts):
        for proj, shard in projs:
            for suf in suffixes:
                kind, _ = SUFFIX_KINDS[suf]
                pname = _param_name(kind, shard, False)
                out.append((f"{module_prefix}{pname}" if pname else "", f"experts.{e}.{proj}.{suf}", e, shard))
    return out


# --------------------------------------------------------------------------- load state


@dataclass
class LoadState:
    """Host-side bookkeeping of one load pass (never of a dry run).

    ``pieces``: what a raw pass wrote, so that its end can refuse a local expert it left unwritten where
    the pass must be complete (``require_all``).
    ``ws2``: global expert -> {half: weight_scale_2} for the pairwise w1/w3
    check; ``w2_global``: experts whose w2 weight_scale_2 arrived; ``a2_inputs``:
    global expert -> w2 input scale (multiplier convention), over ALL experts.
    """

    mode: str = "raw"
    #: (kind, shard_id, global expert) of every routed weight / block scale this raw pass wrote
    pieces: set[tuple[str, str, int]] = field(default_factory=set)
    #: the pass must write every local expert (`load_raw_weights` with ``strict``); a pass into a layer that
    #: is not usable (never loaded, or a failed load) must as well (`finish_raw_load`)
    require_all: bool = False
    ws2: dict[int, dict[int, float]] = field(default_factory=dict)
    w2_global: set[int] = field(default_factory=set)
    a2_inputs: dict[int, float] = field(default_factory=dict)
    written: int = 0
    skipped: int = 0


class LoadTarget(Protocol):
    """What the loaders read and write of the layer they are handed (`DeepGemmMegaMoEExperts` is one):
    declared here so that the loaders depend on these names only and never on the layer's module."""

    spec: formats.LayerSpec
    prefix: str
    layer_index: Optional[int]
    shared_fused: bool
    l1_weight: torch.Tensor
    l2_weight: torch.Tensor
    l1_scale: Optional[torch.Tensor]
    l2_scale: Optional[torch.Tensor]
    l1_alpha: Optional[torch.Tensor]
    l2_global_scale: Optional[torch.Tensor]
    l2_activation_scale: Optional[torch.Tensor]

    def param_for_role(self, role: str) -> Optional[torch.Tensor]: ...

    def role_of(self, t: torch.Tensor) -> str: ...

    def load_state(self, mode: Optional[str] = None) -> Optional[LoadState]: ...


def _is_meta(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_meta


def _where(layer: LoadTarget, what: str) -> str:
    name = layer.prefix or (f"layer {layer.layer_index}" if layer.layer_index is not None else "layer")
    return f"{name}: {what}"


def _scalar(src: torch.Tensor, what: str) -> torch.Tensor:
    if src.numel() != 1:
        raise ScaleError(f"{what}: expected a scalar (0-d or [1]) tensor, got shape {list(src.shape)}")
    return src.reshape(())


def _check_scale_value(v: float, what: str) -> None:
    if not scales.is_valid_scale(v):
        raise ScaleError(f"{what} = {v!r}; scales must be {scales.SCALE_RULE}")


# --------------------------------------------------------------------------- pre-laid-out


def _stored_destination(layer: LoadTarget, role: str, storage: str = STORAGE_CONTIGUOUS,
                       experts: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """The view of `layer`'s storage that a stored (file) tensor of ``role``
    copies into: the parameter itself, its contiguous physical base for
    ``mn_major_physical`` storage, restricted to the global experts
    ``[lo, hi)`` (which must be local) for expert-stacked roles."""
    param = layer.param_for_role(role)
    if param is None:
        raise LayoutError(_where(layer, f"the layer has no {role!r} parameter (row {layer.spec.row}, "
                                        f"shared fused={layer.shared_fused})"))
    if storage == STORAGE_MN_MAJOR:
        dst = layout.physical(param)
    elif storage == STORAGE_CONTIGUOUS:
        dst = param
        if not dst.is_contiguous():
            raise LayoutError(_where(layer, f"{role} is stored contiguous but the parameter is not contiguous"))
    else:
        raise LayoutError(_where(layer, f"unknown storage {storage!r} for {role}"))
    if experts is not None and not is_shared_role(role):
        lo, hi = experts
        loc = layer.spec.local_experts
        if not (loc.start <= lo <= hi <= loc.stop):
            raise LayoutError(_where(layer, f"{role} experts [{lo}, {hi}) are not all local to rank "
                                            f"{layer.spec.ep_rank} (local experts [{loc.start}, {loc.stop}))"))
        dst = dst[lo - loc.start:hi - loc.start]
    return dst


def check_stored_source(layer: LoadTarget, role: str, dtype: Optional[torch.dtype],
                        shape: tuple[int, ...], *, storage: str = STORAGE_CONTIGUOUS,
                        experts: Optional[tuple[int, int]] = None, name: str = "") -> torch.Tensor:
    """The destination view of a stored tensor of this dtype and shape, or LayoutError: the checks `copy_stored`
    makes before its copy, callable on header facts alone (`load_checks` runs them before a load's first byte)."""
    dst = _stored_destination(layer, role, storage, experts)
    what = name or role
    if dtype != dst.dtype:
        raise LayoutError(_where(layer, f"{what}: stored dtype {dtype} != parameter dtype {dst.dtype}; "
                                        "pre-laid-out loading copies bytes and never converts"))
    if tuple(shape) != tuple(dst.shape):
        raise LayoutError(_where(layer, f"{what}: stored shape {list(shape)} != destination "
                                        f"{list(dst.shape)} ({role}, storage {storage}, experts {experts})"))
    return dst


def copy_stored(layer: LoadTarget, role: str, src: Any, *,
                storage: str = STORAGE_CONTIGUOUS, experts: Optional[tuple[int, int]] = None,
                name: str = "") -> None:
    """Pre-laid-out load of one stored tensor into the layer's allocated
    storage, bytes unchanged (dtype and shape must match exactly: nothing is
    converted, so a mismatch is an error, not a cast).

    ``src`` is the stored tensor in stored order: a tensor (CPU/GPU, a
    zero-copy mmap view, or a meta stand-in during a dry run) goes in with
    exactly one ``copy_``; a `file_io.FileSlice` is read from the file
    straight into the destination (what `Checkpoint.load_layer` does).
    """
    dst = check_stored_source(layer, role, src.dtype, tuple(src.shape), storage=storage, experts=experts, name=name)
    if isinstance(src, torch.Tensor):
        _copy_into(dst, src)
    else:  # a FileSlice: the file's bytes straight into the destination storage
        src.read_into(dst)
    st = layer.load_state()
    if st is not None and not _is_meta(src):
        st.written += 1


# --------------------------------------------------------------------------- raw (vLLM style)


def _suffix(weight_name: str) -> str:
    return weight_name.rsplit(".", 1)[-1]


def _resolve_kind(weight_name: str) -> tuple[str, bool, str]:
    suf = _suffix(weight_name)
    if suf in UNSUPPORTED_SUFFIXES:
        raise CheckpointError(f"{weight_name}: {UNSUPPORTED_SUFFIXES[suf]}")
    try:
        kind, divisor = SUFFIX_KINDS[suf]
    except KeyError:
        raise CheckpointError(
            f"{weight_name}: unknown expert tensor suffix {suf!r}; known: {', '.join(sorted(SUFFIX_KINDS))}"
        ) from None
    return kind, divisor, suf


def _check_param(layer: LoadTarget, param: Any, expected: str, weight_name: str) -> None:
    if param is None or expected == "":
        return
    want = layer.param_for_role(expected) if expected != "l2_activation_scale" else layer.l2_activation_scale
    if want is None or param is not want:
        got = layer.role_of(param) if isinstance(param, torch.Tensor) else type(param).__name__
        raise LayoutError(_where(layer, f"{weight_name}: passed parameter {got!r}, but this tensor loads "
                                        f"into {expected!r}"))


def _as_bf16(src: torch.Tensor) -> torch.Tensor:
    if src.dtype in (torch.float16, torch.float32, torch.float64):
        return src.to(torch.bfloat16)
    return src


def _scalar_value(src: torch.Tensor, divisor: bool) -> torch.Tensor:
    """The multiplier as a 0-d tensor: the stored value, or its reciprocal in
    float64 for divisor conventions (as the converter's readers compute it)."""
    if divisor:
        return torch.reciprocal(src.to(torch.float64))
    return src


def raw_weight_loader(layer: LoadTarget, param: Optional[torch.Tensor],
                      loaded_weight: torch.Tensor, weight_name: str, shard_id: str,
                      expert_id: int) -> bool:
    """vLLM-style loader for one raw routed-expert checkpoint tensor.

    Returns True when the tensor was written or consumed, False when it was
    skipped because its expert lives on another EP rank. ``param`` may be
    None (the destination follows from ``weight_name`` and ``shard_id``);
    when given it must be the parameter the tensor belongs in.
    """
    if shard_id not in SHARD_IDS:
        raise LayoutError(_where(layer, f"{weight_name}: shard_id={shard_id!r}; valid: 'w1' (gate), "
                                        f"'w3' (up), 'w2' (down)"))
    spec = layer.spec
    if not isinstance(expert_id, int) or isinstance(expert_id, bool) or not 0 <= expert_id < spec.num_experts:
        raise LayoutError(_where(layer, f"{weight_name}: expert_id={expert_id!r} is not a global expert id "
                                        f"in [0, {spec.num_experts})"))
    kind, divisor, suf = _resolve_kind(weight_name)
    expected = _param_name(kind, shard_id, False)
    _check_param(layer, param, expected, weight_name)
    row = spec.row_spec
    meta = _is_meta(loaded_weight)
    # A meta source is a dry run: record the write only, keep no host-side state.
    st = None if meta else layer.load_state("raw")
    loc = spec.local_experts
    local = loc.start <= expert_id < loc.stop
    e = expert_id - loc.start
    where = _where(layer, f"{weight_name} (expert {expert_id}, {shard_id})")

    if kind == "input_scale":
        if not row.has_alphas:
            raise CheckpointError(f"{where}: row {row.name} has no input scales")
        if meta:
            return True
        v = float(_scalar_value(_scalar(loaded_weight, where), divisor))
        _check_scale_value(v, f"{where} input scale")
        if shard_id == "w2":
            st.a2_inputs[expert_id] = v
        return True
    if not local:
        if st is not None:
            st.skipped += 1
        return False

    if kind == "global_scale":
        if not row.has_alphas:
            raise CheckpointError(f"{where}: row {row.name} has no global scales ({suf})")
        src = _scalar_value(_scalar(loaded_weight, where), divisor)
        if shard_id == "w2":
            dst = layer.l2_global_scale[e]
        else:
            dst = layer.l1_alpha[e, _HALF[shard_id]]
        dst.copy_(src)
        if not meta:
            v = float(src)
            _check_scale_value(v, f"{where} weight_scale_2")
            st.written += 1
            if shard_id == "w2":
                st.w2_global.add(expert_id)
            else:
                pair = st.ws2.setdefault(expert_id, {})
                pair[_HALF[shard_id]] = v
                if len(pair) == 2:
                    g, u = pair[0], pair[1]
                    if not scales.gate_up_agree(g, u):
                        raise ScaleError(
                            _where(layer, f"expert {expert_id}: w1 (gate) weight_scale_2 = {g!r} and w3 (up) "
                                          f"weight_scale_2 = {u!r} differ by more than relative 1e-5 in this load; "
                                          "the kernels need one L1 global scale per expert. Convert with "
                                          "megamoe-convert --on-scale-mismatch requantize to repair explicitly")
                        )
        return True

    if kind == "weight":
        src = loaded_weight if row.weight.element != Element.BF16 else _as_bf16(loaded_weight)
        if shard_id == "w2":
            layout.write_l2_weight(layer.l2_weight[e], src, where=where)
        else:
            layout.write_l1_weight(layer.l1_weight[e], src, _HALF[shard_id], where=where)
    elif kind == "scale":
        if not row.has_scales:
            raise CheckpointError(f"{where}: row {row.name} has no block scales")
        if shard_id == "w2":
            layout.write_l2_scale(layer.l2_scale[e], loaded_weight, where=where)
        else:
            layout.write_l1_scale(layer.l1_scale[e], loaded_weight, _HALF[shard_id], where=where)
    if st is not None:
        st.written += 1
        st.pieces.add((kind, shard_id, expert_id))
    return True


def shared_weight_loader(layer: LoadTarget, param: Optional[torch.Tensor],
                         loaded_weight: torch.Tensor, weight_name: str, shard_id: str) -> bool:
    """Raw loader for the (folded, S*I_s wide) shared expert's weight / block
    scale, into the layer's shared parameters (fused or the layer-built shared
    MLP). The source must already be in the shared precision (bf16 weights
    for a bf16 shared spec, e4m3 + UE8M0/32 for mxfp8); anything else needs
    a quantization, which is the converter's job."""
    if shard_id not in SHARD_IDS:
        raise LayoutError(_where(layer, f"{weight_name}: shard_id={shard_id!r}; valid: 'w1', 'w3', 'w2'"))
    kind, _, suf = _resolve_kind(weight_name)
    where = _where(layer, f"{weight_name} (shared, {shard_id})")
    if kind in ("global_scale", "input_scale"):
        raise CheckpointError(f"{where}: shared experts have no {suf} in any fusable precision (mxfp8, bf16); "
                              "an NVFP4 shared expert must be re-quantized, which is the converter's job: "
                              "convert with megamoe-convert, or raw-load with the shared expert left to the engine")
    expected = _param_name(kind, shard_id, True)
    dst = layer.param_for_role(expected)
    if dst is None:
        raise LayoutError(f"{where}: the layer has no shared expert parameters (spec.shared is None)")
    if param is not None and param is not dst:
        raise LayoutError(f"{where}: passed parameter {layer.role_of(param)!r}, but this tensor loads into {expected!r}")
    prec = layer.spec.shared.precision
    src = loaded_weight
    if kind == "weight":
        if prec == "bf16":
            src = _as_bf16(src)
        elif src.dtype in (torch.uint8, torch.int8) and src.shape[-1] * 2 == dst.shape[-1]:
            # packed E2M1. In an mxfp4 checkpoint (UE8M0 group scales) every E2M1 value is an
            # E4M3 value, so mxfp4 -> mxfp8 is exact with the scales unchanged, as in the
            # converter. NVFP4 (E4M3 scales, global scale) would need a re-quantization.
            row = layer.spec.row_spec
            if not (row.packed_e2m1 and row.embeds_exactly_in(prec)):
                raise CheckpointError(
                    f"{where}: packed E2M1 shared expert in a {layer.spec.row} checkpoint; turning it into "
                    f"{prec} is a re-quantization, which is the converter's job (megamoe-convert)")
            from ..format import codecs

            src = codecs.e4m3_encode(codecs.e2m1_decode(codecs.unpack_e2m1(src.view(torch.uint8))))
        elif src.dtype not in (torch.float8_e4m3fn, torch.uint8, torch.int8):
            raise CheckpointError(f"{where}: shared precision mxfp8 needs e4m3 (or exactly convertible mxfp4) "
                                  f"weights, got {src.dtype}; convert the checkpoint (megamoe-convert re-quantizes "
                                  "shared experts)")
        if shard_id == "w2":
            layout.write_l2_weight(dst, src, where=where)
        else:
            layout.write_l1_weight(dst, src, _HALF[shard_id], where=where)
    else:
        if not get_row(prec).has_scales:
            raise CheckpointError(f"{where}: shared precision {prec} has no block scales")
        if shard_id == "w2":
            layout.write_l2_scale(dst, src, where=where)
        else:
            layout.write_l1_scale(dst, src, _HALF[shard_id], where=where)
    if not _is_meta(loaded_weight):
        layer.load_state("raw").written += 1
    return True


def finish_raw_load(layer: LoadTarget, st: LoadState, require_all: bool = False) -> Optional[float]:
    """End of a raw load: where the pass must be complete (``require_all`` or ``st.require_all``) and wrote
    any routed tensor, it wrote every local expert's w1, w3 and w2 weights (and block scales) -- an expert
    left out keeps the bytes it had: another checkpoint's, or none in a layer never loaded. (A partial pass
    into a usable layer, one expert updated, is the caller's choice.) Every NVFP4 pair complete; returns a2
    from ALL experts for the layer to write (None: nothing to write)."""
    spec = layer.spec
    if st.pieces and (require_all or st.require_all):
        kinds = ("weight", "scale") if spec.row_spec.has_scales else ("weight",)
        gaps = [f"{shard} {kind} for experts {_short(miss)}" for kind in kinds for shard in SHARD_IDS
                if (miss := [e for e in spec.local_experts if (kind, shard, e) not in st.pieces])]
        if gaps:
            raise CheckpointError(_where(layer, "raw load incomplete, the pass wrote no " + "; no ".join(gaps)
                                         + " (a raw load writes every local expert in one pass)"))
    if not spec.row_spec.has_alphas:
        return None
    if st.written == 0 and not st.a2_inputs:
        return None  # nothing loaded in this pass (e.g. a dry run): leave state alone
    loc = spec.local_experts
    missing_pair = [e for e in loc if len(st.ws2.get(e, {})) != 2]
    missing_w2 = [e for e in loc if e not in st.w2_global]
    missing_in = [e for e in range(spec.num_experts) if e not in st.a2_inputs]
    problems = []
    if missing_pair:
        problems.append(f"w1/w3 weight_scale_2 incomplete for experts {_short(missing_pair)}")
    if missing_w2:
        problems.append(f"w2 weight_scale_2 missing for experts {_short(missing_w2)}")
    if missing_in:
        problems.append(
            f"w2 input scale missing for experts {_short(missing_in)} (every rank reads every expert's w2 "
            "input scale: a2 is the max over ALL experts)"
        )
    if problems:
        raise ScaleError(_where(layer, "raw NVFP4 load incomplete: " + "; ".join(problems)))
    a2 = scales.global_l2_activation_scale(st.a2_inputs.values())
    _check_scale_value(a2, _where(layer, "global L2 activation scale a2"))
    return a2  # finish_load writes it and refreshes the derived scalars once


def _short(ids: list[int]) -> str:
    return str(ids[:8])[:-1] + (", ...]" if len(ids) > 8 else "]")
