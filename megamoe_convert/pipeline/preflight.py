"""The preflight: every layer checked before the first byte is written.

Each layer's spec against its row, its shared-expert decision and every
expert's float scales (w1/w3 agreement, a2 = max over all experts, see
``checks``), read from headers and scalar tensors only, so bad input is
refused in seconds, not after hours of writing.
"""
from __future__ import annotations

from megamoe_runtime.errors import MegaMoEError
from megamoe_runtime.format.formats import LayerSpec, Row, SharedSpec

from . import checks
from ..output.output_dir import Log
from .plan import LayerPlan
from ..readers.base import CheckpointReader, MoELayerInfo
from .shared import choose_shared
from ..readers.source import CheckpointSource


def layer_decisions(info: MoELayerInfo, row: Row, facts, ep_size: int, shared_precision: str = "auto",
                    problems: list[str] | None = None) -> tuple[SharedSpec | None, dict, LayerSpec | None]:
    """The first decisions of a layer, convert's and inspect's alike: its fused shared expert (spec and
    manifest record, under ``--shared-precision``) and its LayerSpec.

    ``problems`` None (convert): a refusal raises. A list (inspect): the refusal is appended and the check
    goes on, with the row's own shared decision (`checks.shared_spec_for`) or no spec, so one run lists them
    all."""
    try:
        shared, shared_rec = choose_shared(info, row, shared_precision)
    except MegaMoEError as e:  # e.g. an explicit precision the layer's sizes refuse
        if problems is None:
            raise
        problems.append(str(e))
        shared, shared_rec = checks.shared_spec_for(info, row)
    spec = None
    try:
        spec = checks.layer_spec(info, facts, row, ep_size, shared)
    except MegaMoEError as e:
        if problems is None:
            raise
        problems.append(str(e))
    return shared, shared_rec, spec


def layer_scalars(reader: CheckpointReader, info: MoELayerInfo, row: Row, **policy) -> checks.LayerScalarReport:
    """Every expert's scalar scales of one layer, read and checked (`checks.check_layer_scalars` under
    `policy`: convert's options, or inspect's report-everything ones)."""
    scal = [reader.read_expert_scalars(info.index, e) for e in range(info.num_experts)]
    return checks.check_layer_scalars(info, scal, row, **policy)


def preflight(reader: CheckpointReader, source: CheckpointSource, row: Row, facts, infos, ep_size: int,
               on_scale_mismatch: str, allow_missing: bool, log: Log,
               shared_precision: str = "auto", l2_activation_scale: float | None = None) -> list[LayerPlan]:
    """Every layer's plan (spec, shared decision, checked scalars, source bytes), or the first refusal."""
    plans = []
    for info in infos:
        shared, shared_rec, spec = layer_decisions(info, row, facts, ep_size, shared_precision)
        rep = layer_scalars(reader, info, row, on_scale_mismatch=on_scale_mismatch,
                            allow_missing_input_scales=allow_missing, source=source,
                            l2_activation_scale=l2_activation_scale)
        if l2_activation_scale is not None:
            log(f"MoE layer {info.index}: a2 = {l2_activation_scale!r} as given (--l2-activation-scale; "
                "the checkpoint has no w2 input scales)")
        if rep.mismatches:
            log(f"MoE layer {info.index}: {len(rep.mismatches)} expert(s) with w1/w3 weight_scale_2 mismatch "
                "will be requantized onto the larger scale")
        if rep.missing_input:
            log(f"MoE layer {info.index}: {len(rep.missing_input)} expert(s) without a w2 input scale; "
                f"a2 = max over the others = {rep.scalars['l2_activation_scale']!r}")
        nbytes = sum(source.nbytes(n) for n in info.expert_tensor_names)
        if shared is not None:
            nbytes += sum(source.nbytes(n) for n in info.shared.tensor_names)
        plans.append(LayerPlan(info, spec, shared_rec, rep, nbytes))
    return plans


__all__ = ["preflight", "layer_decisions", "layer_scalars"]
