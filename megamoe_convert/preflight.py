"""The preflight: every layer checked before the first byte is written.

Each layer's spec against its row, its shared-expert decision and every
expert's float scales (w1/w3 agreement, a2 = max over all experts, see
``checks``), read from headers and scalar tensors only, so bad input is
refused in seconds, not after hours of writing.
"""
from __future__ import annotations

from megamoe_runtime.formats import Row

from . import checks
from .output_dir import Log
from .plan import LayerPlan
from .readers.base import CheckpointReader
from .shared import choose_shared
from .source import CheckpointSource


def preflight(reader: CheckpointReader, source: CheckpointSource, row: Row, facts, infos, ep_size: int,
               on_scale_mismatch: str, allow_missing: bool, log: Log,
               shared_precision: str = "auto", l2_activation_scale: float | None = None) -> list[LayerPlan]:
    plans = []
    for info in infos:
        shared, shared_rec = choose_shared(info, row, shared_precision)
        spec = checks.layer_spec(info, facts, row, ep_size, shared)
        scal = [reader.read_expert_scalars(info.index, e) for e in range(info.num_experts)]
        rep = checks.check_layer_scalars(info, scal, row, on_scale_mismatch=on_scale_mismatch,
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


__all__ = ["preflight"]
