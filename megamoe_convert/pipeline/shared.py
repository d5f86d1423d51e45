"""Shared experts: which precision they are fused in, and the re-encode into it.

Decided per layer before any byte is read (`choose_shared`, under
``--shared-precision``), recorded in the manifest with the reason and which
DeepGEMM flavour fuses what (`shared_flavour_note`), and applied while the
layer streams (`shared_to_precision`).
"""
from __future__ import annotations

import torch

from megamoe_runtime.errors import FormatError, LayerSpecError, MegaMoEError
from megamoe_runtime.format import codecs
from megamoe_runtime.format.canonical import ExpertTensors, ProjectionTensors
from megamoe_runtime.format.formats import ROWS, SHARED_PRECISIONS, Row, SharedSpec, get_row

from . import checks
from .plan import LayerPlan, layer_ranges
from ..readers.base import MoELayerInfo


def shared_to_precision(experts: list[ExpertTensors], encoding: str,
                        precision: str) -> tuple[list[ExpertTensors], dict]:
    """Shared experts from their checkpoint encoding into the fusable precision.

    Same precision: bytes unchanged. mxfp4 -> mxfp8: exact (each E2M1 value is
    an E4M3 value; the UE8M0 group scales are kept). Otherwise dequantize and
    cast to bf16, or re-quantize to mxfp8 with the reference quantizer; the
    record reports the max absolute change.
    """
    if encoding == precision:
        return experts, {"conversion": "copy", "max_abs_change": 0.0}
    src_row = get_row(encoding)
    if encoding == "mxfp4" and precision == "mxfp8":
        def up(p: ProjectionTensors) -> ProjectionTensors:
            return ProjectionTensors(codecs.e2m1_packed_to_e4m3(p.weight), p.scale)
        return [ExpertTensors(up(e.gate), up(e.up), up(e.down)) for e in experts], \
            {"conversion": "mxfp4->mxfp8 (exact)", "max_abs_change": 0.0}
    out, worst = [], 0.0
    for e in experts:
        projs = []
        for _, p in e.projections():
            if encoding == "nvfp4" and precision == "mxfp8":  # the same bits as the general path, fused
                g = 1.0 if p.global_scale is None else float(p.global_scale)
                w, s, change = codecs.nvfp4_to_mxfp8(p.weight, p.scale, g)
                worst = max(worst, float(change) if w.numel() else 0.0)
                projs.append(ProjectionTensors(w, s))
                continue
            x = p.dequantize(src_row)
            if precision == "bf16":
                q = ProjectionTensors(x.to(torch.bfloat16))
                back = q.weight.float()
            elif precision == "mxfp8":
                w, s = codecs.quantize_mxfp8(x)
                q = ProjectionTensors(w, s)
                back = codecs.dequantize_mx(w, s, "e4m3")
            else:  # pragma: no cover - SHARED_PRECISIONS is mxfp8, bf16
                raise FormatError(f"no conversion of shared experts to {precision!r}")
            worst = max(worst, float((back - x).abs().max()) if x.numel() else 0.0)
            projs.append(q)
        out.append(ExpertTensors(*projs))
    return out, {"conversion": f"{encoding}->{precision} (dequantize, re-encode)", "max_abs_change": worst}


SHARED_PRECISION_CHOICES = ("auto", *SHARED_PRECISIONS)


#: row -> DeepGEMM API flavour -> the shared precisions that flavour fuses (`Row.shared_by_flavour`,
#: docs/KERNELS.md#feature-matrix); the manifest records the choice and the alternative.
SHARED_BY_FLAVOUR = {name: dict(r.shared_by_flavour) for name, r in ROWS.items()}


_FLAVOUR_NAMES = {"dg": "newer upstream DeepGEMM", "dgv": "vLLM's DeepGEMM fork", "dgz": "DeepGEMM's alias entry point"}


def _flavour(row: Row, f: str) -> str:
    try:
        ep = row.entry_point(f)
    except FormatError:  # pragma: no cover - SHARED_BY_FLAVOUR follows formats.ROWS
        ep = "?"
    return f"{_FLAVOUR_NAMES.get(f, f)} ({ep})"


def shared_flavour_note(row: Row, precision: str) -> str:
    """Which DeepGEMM flavours fuse `precision` shared experts for `row`, and
    what the others need instead."""
    table = SHARED_BY_FLAVOUR.get(row.name, {})
    runs = [_flavour(row, f) for f, ps in table.items() if precision in ps]
    note = f"{precision} shared experts fuse on {' and '.join(runs) or 'no known DeepGEMM flavour'}"
    for f, ps in table.items():
        if precision in ps:
            continue
        if ps:
            note += (f"; {_flavour(row, f)} fuses only {' or '.join(ps)} shared experts: "
                     f"convert with --shared-precision {ps[0]} for it")
        else:
            note += f"; {_flavour(row, f)} fuses no shared experts (they run outside the kernel there)"
    return note


def check_shared_precision(row: Row, shared_precision: str) -> None:
    """Usage check of ``--shared-precision`` against the row (before any work):
    an explicit precision the row cannot fuse is refused, naming what it can."""
    if shared_precision not in SHARED_PRECISION_CHOICES:
        raise MegaMoEError(f"--shared-precision {shared_precision!r}; valid: {', '.join(SHARED_PRECISION_CHOICES)}")
    if shared_precision == "auto" or shared_precision in row.fusable_shared:
        return
    if not row.fusable_shared:
        raise FormatError(f"--shared-precision {shared_precision}: row {row.name} cannot fuse shared experts at "
                          "all (they stay in the pass-through files); use --shared-precision auto")
    raise FormatError(f"--shared-precision {shared_precision}: row {row.name} fuses shared experts only as "
                      f"{' or '.join(row.fusable_shared)} "
                      f"({'; '.join(shared_flavour_note(row, p) for p in row.fusable_shared)}); "
                      f"use --shared-precision {' | '.join(('auto',) + row.fusable_shared)}")


def choose_shared(info: MoELayerInfo, row: Row, shared_precision: str = "auto"
                  ) -> tuple[SharedSpec | None, dict]:
    """The layer's fused shared-expert spec and the manifest's shared record,
    under ``--shared-precision``.

    ``auto``: the shared experts' own encoding when the row fuses it (bytes
    copied), else the row's first fusable precision. An explicit precision
    replaces that (the row must fuse it: see `check_shared_precision`). The
    record says what was requested, why this precision, and which DeepGEMM
    flavour needs which precision (``precision_reason``, ``flavour_note``).
    """
    check_shared_precision(row, shared_precision)
    spec, rec = checks.shared_spec_for(info, row)
    if spec is None:
        return None, {**rec, "requested_precision": shared_precision} if rec.get("present") else rec
    sh = info.shared
    if shared_precision == "auto":
        precision = spec.precision
        if precision == sh.encoding:
            why = f"auto: the shared experts' own encoding ({precision}), fusable by row {row.name}: bytes copied"
        else:
            why = (f"auto: the shared experts are {sh.encoding}, which row {row.name} cannot fuse; "
                   f"{precision} is the row's first fusable precision")
    else:
        precision = shared_precision
        why = f"--shared-precision {precision}"
        if precision != spec.precision:
            try:
                spec = SharedSpec(precision, sh.num_shared, sh.intermediate)
            except LayerSpecError as e:
                raise LayerSpecError(f"MoE layer {info.index} ({info.prefix}): --shared-precision {precision}: "
                                     f"{e}") from None
    note = shared_flavour_note(row, precision)
    return spec, {**rec, "precision": precision, "requested_precision": shared_precision,
                  "precision_reason": why, "flavour_note": note}


def shared_decisions(plans: list["LayerPlan"]) -> list[dict]:
    """The per-layer shared records of the summary, grouped by decision."""
    groups: list[dict] = []
    for lp in plans:
        r = lp.shared_record
        if not r.get("present"):
            continue
        d = {"precision": r.get("precision") if r.get("fused_capable") else None,
             "requested": r.get("requested_precision", "auto"),
             "reason": r.get("precision_reason") or r.get("reason", ""), "note": r.get("flavour_note", "")}
        for g in groups:
            if all(g[k] == v for k, v in d.items()):
                g["layer_list"].append(lp.info.index)
                break
        else:
            groups.append({**d, "layer_list": [lp.info.index]})
    return [{"layers": layer_ranges(g.pop("layer_list")), **g} for g in groups]


__all__ = ["shared_to_precision", "SHARED_PRECISION_CHOICES", "SHARED_BY_FLAVOUR",
           "shared_flavour_note", "check_shared_precision", "choose_shared", "shared_decisions"]
