"""Canonical per-expert tensors: what every reader yields and layout consumes.

Readers translate a checkpoint's names and conventions into these, in the
checkpoint's own encoding (no repacking), so `layout` never parses names and
readers never pack. `validate` is the single place that says what shape and
dtype each role has for each row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CheckpointError, MegaMoEError, ScaleError
from .formats import Element, Row, get_row
from .scales import SCALE_RULE, is_valid_scale

__all__ = ["ProjectionTensors", "ExpertTensors", "expected_shapes"]

_ROLES = ("gate", "up", "down")


def expected_shapes(row: "Row | str", hidden: int, intermediate: int, role: str) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """(weight shape, scale shape or None) of one projection in canonical encoding.

    gate/up are [I, H] (out, in); down is [H, I]. Packed E2M1 halves the in dim.
    """
    row = get_row(row)
    if role in ("gate", "up"):
        out, k = intermediate, hidden
    elif role == "down":
        out, k = hidden, intermediate
    else:
        raise CheckpointError(f"unknown projection role {role!r}; valid: {', '.join(_ROLES)}")
    w = (out, row.weight.stored_cols(k))
    return w, row.weight.scale_shape(out, k)


_finite_pos = is_valid_scale


@dataclass
class ProjectionTensors:
    """One projection (gate, up or down) of one expert, in checkpoint encoding.

    weight: mxfp4/nvfp4 uint8 packed [out, in/2] (element 2j in the low
    nibble); mxfp8 float8_e4m3fn [out, in]; bf16 bfloat16 [out, in].
    scale: mx uint8 UE8M0 [out, in/32]; nvfp4 float8_e4m3fn [out, in/16];
    fp8_block float32 [out/128, in/128] (the multiplier); bf16 None.
    global_scale: nvfp4 dequant multiplier (ModelOpt weight_scale_2; CT's
    reciprocal already inverted). input_scale: nvfp4 activation scale multiplier.
    """

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    global_scale: float | None = None
    input_scale: float | None = None

    def validate(
        self,
        row: "Row | str",
        hidden: int,
        intermediate: int,
        role: str,
        where: str,
        error: type[MegaMoEError] = CheckpointError,
    ) -> None:
        """Raise `error` (CheckpointError by default; layout passes LayoutError)
        naming `where` unless dtype and shape match the row's canonical encoding.
        Bad scalar values raise ScaleError."""
        row = get_row(row)
        wshape, sshape = expected_shapes(row, hidden, intermediate, role)
        wdt = row.weight.checkpoint_dtype
        if not isinstance(self.weight, torch.Tensor):
            raise error(f"{where}: weight is {type(self.weight).__name__}, expected a tensor")
        if self.weight.dtype != wdt:
            raise error(
                f"{where}: weight dtype {self.weight.dtype} does not match row {row.name} "
                f"(expected {wdt}{'; view int8 bytes as uint8' if wdt == torch.uint8 else ''})"
            )
        if tuple(self.weight.shape) != wshape:
            raise error(
                f"{where}: weight shape {list(self.weight.shape)} != expected {list(wshape)} "
                f"for {role} of row {row.name} with hidden={hidden}, intermediate={intermediate}"
            )
        if sshape is None:
            if self.scale is not None:
                raise error(f"{where}: row {row.name} has no scales, but a scale {list(self.scale.shape)} was given")
        else:
            sdt = row.weight.scale_checkpoint_dtype
            if self.scale is None:
                raise error(f"{where}: row {row.name} needs a scale {list(sshape)} {sdt}, got None")
            if self.scale.dtype != sdt:
                raise error(f"{where}: scale dtype {self.scale.dtype} does not match row {row.name} (expected {sdt})")
            if tuple(self.scale.shape) != sshape:
                raise error(
                    f"{where}: scale shape {list(self.scale.shape)} != expected {list(sshape)} "
                    f"for {role} of row {row.name} ("
                    + (f"one per {row.weight.scale_block_rows}x{row.weight.scale_group} block)"
                       if row.weight.block_scaled else f"group {row.weight.scale_group} along K)")
                )
        if row.has_alphas:
            for label in ("global_scale", "input_scale"):
                v = getattr(self, label)
                if v is not None and not _finite_pos(v):
                    raise ScaleError(f"{where}: {label}={v!r} must be a float {SCALE_RULE}")
        else:
            for label in ("global_scale", "input_scale"):
                if getattr(self, label) is not None:
                    raise error(f"{where}: row {row.name} has no {label}, got {getattr(self, label)!r}")

    @classmethod
    def quantize(cls, row: "Row | str", w: torch.Tensor) -> "ProjectionTensors":
        """Encode a float weight ``[out, in]`` in ``row``'s checkpoint encoding
        with the reference quantizers: the inverse of :meth:`dequantize`, and
        the one place that picks a quantizer from a row's weight format.
        NVFP4 takes its own global scale (ModelOpt's convention,
        ``codecs.quantize_nvfp4_weight``); no input scale (uncalibrated)."""
        from . import codecs

        spec = get_row(row).weight
        if spec.element == Element.BF16:
            return cls(w.to(torch.bfloat16).contiguous())
        if spec.block_scaled:
            return cls(*codecs.quantize_fp8_block(w, spec.scale_group))
        if spec.scale_encoding == "ue8m0":
            quant = codecs.quantize_mxfp4 if spec.element == "e2m1" else codecs.quantize_mxfp8
            return cls(*quant(w))
        if spec.element == "e2m1" and spec.has_global_scale:
            p, sf, g = codecs.quantize_nvfp4_weight(w)
            return cls(p, sf, global_scale=g)
        raise MegaMoEError(f"no reference quantizer for row {get_row(row).name} ({spec})")  # pragma: no cover

    def dequantize(self, row: "Row | str") -> torch.Tensor:
        """float32 [out, in]. nvfp4 multiplies by global_scale (1.0 if None,
        e.g. after unpacking kernel bytes, which carry no globals)."""
        from . import codecs  # late: codecs is written alongside this module

        row = get_row(row)
        w = row.weight
        if w.element == Element.BF16:
            return self.weight.float()
        if w.scale_encoding == "ue8m0":
            return codecs.dequantize_mx(self.weight, self.scale, w.element)
        if w.block_scaled:
            return codecs.dequantize_fp8_block(self.weight, self.scale, w.scale_group)
        g = 1.0 if self.global_scale is None else float(self.global_scale)
        return codecs.dequantize_nvfp4(self.weight, self.scale, g)


@dataclass
class ExpertTensors:
    """gate (w1), up (w3), down (w2) of one expert."""

    gate: ProjectionTensors
    up: ProjectionTensors
    down: ProjectionTensors

    def projections(self) -> tuple[tuple[str, ProjectionTensors], ...]:
        return (("gate", self.gate), ("up", self.up), ("down", self.down))

    def infer_sizes(self, row: "Row | str") -> tuple[int, int]:
        """(hidden, intermediate) from the down weight [H, I or I/2]."""
        row = get_row(row)
        h, iw = self.down.weight.shape[-2:]
        return int(h), int(iw) * (2 if row.weight.elements_per_byte == 2 else 1)

    def validate(
        self,
        row: "Row | str",
        hidden: int,
        intermediate: int,
        where: str,
        error: type[MegaMoEError] = CheckpointError,
    ) -> None:
        for role, p in self.projections():
            if not isinstance(p, ProjectionTensors):
                raise error(f"{where}.{role}: expected ProjectionTensors, got {type(p).__name__}")
            p.validate(row, hidden, intermediate, role, f"{where}.{role}", error)

    @classmethod
    def quantize(cls, row: "Row | str", gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                 shared_gate_up_global: bool = True) -> "ExpertTensors":
        """Encode one expert's float weights (:meth:`ProjectionTensors.quantize`
        per projection). With a global scale and ``shared_gate_up_global``,
        gate and up are quantized together so they share one global scale, as
        ModelOpt >= 0.47 exports do (docs/SCALES.md#w1-w3-agreement holds by
        construction)."""
        r = get_row(row)
        if not (r.has_alphas and shared_gate_up_global):
            return cls(*(ProjectionTensors.quantize(r, t) for t in (gate, up, down)))
        I = gate.shape[0]
        l1 = ProjectionTensors.quantize(r, torch.cat([gate.float(), up.float()], 0))
        return cls(
            gate=ProjectionTensors(l1.weight[:I].contiguous(), l1.scale[:I].contiguous(), l1.global_scale, None),
            up=ProjectionTensors(l1.weight[I:].contiguous(), l1.scale[I:].contiguous(), l1.global_scale, None),
            down=ProjectionTensors.quantize(r, down),
        )

    def dequantize(self, row: "Row | str") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I, H], up [I, H], down [H, I]) float32, global scales applied."""
        return self.gate.dequantize(row), self.up.dequantize(row), self.down.dequantize(row)
