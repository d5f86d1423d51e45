"""AMD Quark (amd-quark) HF exports: MXFP4, NVFP4 (two-stage), MXFP8.

Detected from ``config.json`` ``quantization_config`` with ``quant_method ==
"quark"``; the weight spec is ``global_quant_config.weight`` unless a
``layer_quant_config`` / ``layer_type_quant_config`` entry overrides it for
the experts (docs/CHECKPOINTS.md#quark). A spec is a dict
(``dtype``, ``qscheme``, ``group_size``, ``scale_format``, ...) or, for a
two-stage quantizer, a list of dicts.

* MXFP4: ``dtype: fp4`` per_group 32 with e8m0 scales (or legacy ``dtype: mx``
  with ``mx_element_dtype: fp4``): ``weight`` U8 ``[out, in/2]`` +
  ``weight_scale`` U8 ``[out, in/32]``.
* NVFP4: list ``[fp4 per_group 16 (e4m3 scale), fp8 per_tensor]``:
  ``weight``, ``weight_scale`` F8_E4M3, ``weight_scale_2`` F32 (multiplier) and
  ``input_scale_2`` F32 (the activation's per-tensor stage; Quark writes no
  ``input_scale`` for it).
* MXFP8: ``dtype: fp8_e4m3`` per_group 32 with e8m0 scales: ``weight`` F8_E4M3
  + ``weight_scale`` U8, per row or per block of R rows (vLLM reports
  ``per_block [R, 32]``), expanded exactly to per-row scales.
* MXFP8 **fake-quantized** (``export.weight_format: fake_quantized``, the only
  way amd-quark 0.13 can write MXFP8: its real_quantized export fails for
  per_group fp8): ``weight`` BF16 holding the quantize-dequantize values and
  ``weight_scale`` F32 holding the power-of-two block scales. Converted
  exactly (`fake_quantized_to_mxfp8`): each scale must be a power of two in
  E8M0's range and each weight divided by its scale an E4M3 value, so the
  E4M3 bytes and UE8M0 scales written are the ones Quark's real quantizer
  computes (round-to-nearest-even of weight / recorded scale); anything else
  is refused naming the tensor, the element and its value. The recorded
  scales are kept, not recomputed: megamoe's own quantizer rounds some block
  scales differently (tests/fixtures/real/README.md, cross-checks). Other
  fake-quantized rows are refused with the export that works.

The experts' ``input_tensors`` spec is the activation recipe (`recipe`):
``None`` (weight-only, e.g. ``mxfp4_weight_only``) means BF16 activations,
which every quantized row makes coarser: ``--accept-activation-change``.
``mxfp4_fp8`` (per-tensor FP8 activations, a BF16 ``input_scale`` per
module) converts by default on the mxfp4 row (MXFP8 per 32 is finer); the
``input_scale`` is consumed unused.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any, ClassVar

import torch

from megamoe_runtime.errors import FormatError, ScaleError
from megamoe_runtime.format.canonical import ProjectionTensors

from .base import register_reader
from .common import FLOAT_DTYPES, Param, Resolved, Scheme, SchemeReader, quant_config_of
from .naming import EXPERT_RE
from .recipe import ActivationRecipe, unknown


def _norm_dtype(d: Any) -> str:
    return str(d or "").lower().replace("-", "_")


def _classify_spec(spec: Any) -> tuple[str | None, str]:
    """(row or None, human description) of a Quark weight spec."""
    if isinstance(spec, list):
        if not spec:
            return None, "empty spec list"
        first = spec[0] or {}
        d = _norm_dtype(first.get("dtype"))
        gs = first.get("group_size")
        sf = _norm_dtype(first.get("scale_format"))
        stages = ", ".join(f"{_norm_dtype(s.get('dtype'))}/{s.get('qscheme')}" for s in spec if isinstance(s, dict))
        if d == "fp4" and gs == 16 and len(spec) == 2:
            return "nvfp4", f"two-stage [{stages}] (NVFP4)"
        if len(spec) == 1:
            return _classify_spec(first)
        return None, f"multi-stage spec [{stages}]"
    if not isinstance(spec, dict):
        return None, f"weight spec {spec!r}"
    d = _norm_dtype(spec.get("dtype"))
    gs = spec.get("group_size")
    qs = spec.get("qscheme")
    sf = _norm_dtype(spec.get("scale_format"))
    if d == "mx":
        el = _norm_dtype(spec.get("mx_element_dtype"))
        if el == "fp4":
            return "mxfp4", "legacy dtype mx/fp4 (MXFP4)"
        if el in ("fp8_e4m3", "fp8"):
            return "mxfp8", "legacy dtype mx/fp8_e4m3 (MXFP8)"
        return None, f"legacy dtype mx with element {el}"
    if d == "fp4" and gs == 32 and sf in ("e8m0", ""):
        return "mxfp4", "fp4 per_group 32 e8m0 (MXFP4)"
    if d == "fp4" and gs == 16:
        return None, "single-stage fp4 per_group 16 (NVFP4 without its per-tensor stage)"
    if d in ("fp8_e4m3",) and gs == 32 and sf == "e8m0":
        return "mxfp8", "fp8_e4m3 per_group 32 e8m0 (MXFP8)"
    return None, f"dtype {d or '?'} qscheme {qs or '?'} group_size {gs} scale_format {sf or '?'}"


def _expert_config(qc: dict, source) -> tuple[dict, str]:
    """The quant config (weight, input_tensors, ...) that applies to routed
    experts, and where it came from."""
    layer_cfg = qc.get("layer_quant_config") or {}
    expert_mods = [n[: n.rfind(".")] for n in source.tensor_names() if EXPERT_RE.match(n)]
    sample = expert_mods[0] if expert_mods else None
    if sample is not None:
        for pat, cfg in layer_cfg.items():
            if fnmatchcase(sample, pat) and isinstance(cfg, dict) and "weight" in cfg:
                return cfg, f"layer_quant_config[{pat!r}]"
    type_cfg = qc.get("layer_type_quant_config") or {}
    for key in ("Linear", "nn.Linear", "torch.nn.Linear"):
        cfg = type_cfg.get(key)
        if isinstance(cfg, dict) and "weight" in cfg:
            return cfg, f"layer_type_quant_config[{key!r}]"
    g = qc.get("global_quant_config") or {}
    return (g if isinstance(g, dict) else {}), "global_quant_config"


def _expert_spec(qc: dict, source) -> tuple[Any, str]:
    """The weight spec that applies to routed experts, and where it came from."""
    cfg, where = _expert_config(qc, source)
    return cfg.get("weight"), where


def _classify_input_spec(spec: Any) -> ActivationRecipe:
    """The activation recipe of a Quark ``input_tensors`` spec (dict, list or None)."""
    if spec is None:
        return ActivationRecipe("bf16", False, "Quark weight-only (input_tensors: null): not quantized (BF16)")
    if isinstance(spec, list):
        if len(spec) == 1:
            return _classify_input_spec(spec[0])
        first = spec[0] if spec and isinstance(spec[0], dict) else {}
        if _norm_dtype(first.get("dtype")) == "fp4" and first.get("group_size") == 16 and len(spec) == 2:
            return ActivationRecipe("nvfp4", True, "Quark two-stage [fp4 per_group 16, fp8 per_tensor] (NVFP4, "
                                                   "calibrated input_scale_2)")
        return unknown(f"Quark multi-stage input spec ({len(spec)} stages)")
    if not isinstance(spec, dict):
        return unknown(f"Quark input spec {spec!r}")
    d, gs, qs = _norm_dtype(spec.get("dtype")), spec.get("group_size"), spec.get("qscheme")
    dyn = bool(spec.get("is_dynamic"))
    how = "dynamic" if dyn else "static, calibrated"
    if d == "fp8_e4m3" and qs == "per_tensor":
        return ActivationRecipe("fp8", not dyn, f"Quark fp8_e4m3 per_tensor ({how}): FP8 E4M3 with one scale per "
                                                f"tensor")
    if d == "fp4" and gs == 32:
        return ActivationRecipe("mxfp4", not dyn, f"Quark fp4 per_group 32 (MXFP4, {how})")
    if d == "fp8_e4m3" and gs == 32:
        return ActivationRecipe("mxfp8", not dyn, f"Quark fp8_e4m3 per_group 32 (MXFP8, {how})")
    if d == "mx":
        el = _norm_dtype(spec.get("mx_element_dtype"))
        kind = {"fp4": "mxfp4", "fp8_e4m3": "mxfp8", "fp8": "mxfp8"}.get(el, "unknown")
        return ActivationRecipe(kind, not dyn, f"Quark legacy mx/{el} input ({how})")
    return unknown(f"Quark input dtype {d or '?'} qscheme {qs or '?'} group_size {gs}")


def weight_format(source) -> str:
    """``export.weight_format`` of a Quark config ("real_quantized" when absent, Quark's default)."""
    exp = quant_config_of(source).get("export") or {}
    return str(exp.get("weight_format") or "real_quantized").lower() if isinstance(exp, dict) else "real_quantized"


#: how to make a Quark export megamoe reads, for the refusal of a fake-quantized one it cannot
_REAL_EXPORT_HINT = ("re-export it with quark.torch.export_safetensors(model, out, weight_format=\"real_quantized\"), "
                    "or convert the unquantized model with --quantize mxfp4|mxfp8|nvfp4|fp8_block")


def fake_quantized_to_mxfp8(w: torch.Tensor, scale: torch.Tensor, where: str, wname: str, sname: str
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 weight, UE8M0 scale bytes) of one fake-quantized MXFP8 projection: ``w`` [out, in] float
    (the quantize-dequantize values), ``scale`` [out, in/32] float (power-of-two block scales).

    Exact or refused: a scale must be 2^e with -127 <= e <= 127 (the E8M0 byte e + 127; 0xFF is NaN),
    and w / scale (exact in fp32, the scale being a power of two) must be an E4M3 value, |q| <= 448.
    Then the E4M3 byte of q is what Quark's real quantizer stores for that element with that scale:
    its fake quantization wrote fl(q * scale), which a BF16 holds exactly, and this recovers q."""
    s = scale.float()
    e = torch.log2(s)
    bad = ~(torch.isfinite(e) & (e == e.round()) & (e >= -127) & (e <= 127))
    if bool(bad.any()):
        r, c = (int(i) for i in bad.nonzero()[0])
        raise ScaleError(
            f"{where}: {sname} [{r}, {c}] = {float(s[r, c])!r} ({int(bad.sum())} such block scale(s)); a Quark "
            "MXFP8 block scale must be a power of two 2^-127..2^127 (an E8M0 value), so this fake-quantized export "
            "cannot be re-encoded exactly")
    q = w.float() / s.repeat_interleave(32, dim=-1)
    f8 = q.to(torch.float8_e4m3fn)
    off = ~((f8.float() == q) & (q.abs() <= 448))
    if bool(off.any()):
        r, c = (int(i) for i in off.nonzero()[0])
        raise FormatError(
            f"{where}: {wname} [{r}, {c}] = {float(w[r, c])!r} with block scale {float(s[r, c // 32])!r} is "
            f"{float(q[r, c])!r} x scale, not an E4M3 value x scale ({int(off.sum())} of {q.numel()} elements); "
            "these BF16 weights are not a Quark MXFP8 quantize-dequantize with the recorded scales, so they cannot "
            "be converted to the bytes Quark's quantizer would write. Convert the model's unquantized BF16 source "
            "with --quantize mxfp8 instead")
    return f8, (e.to(torch.int32) + 127).to(torch.uint8)


def _quark_row(source) -> tuple[str | None, str] | None:
    qc = quant_config_of(source)
    if str(qc.get("quant_method", "")).lower() != "quark":
        return None
    spec, where = _expert_spec(qc, source)
    row, desc = _classify_spec(spec)
    return row, f"{where}.weight = {desc}"


class _QuarkReader(SchemeReader):
    direct_weight_bytes = True  # weights are the stored bytes, viewed (convert reads them in place)
    quark_row: ClassVar[str] = ""

    def __init__(self, source) -> None:
        super().__init__(source)
        self._ignore_patterns = tuple(str(x) for x in (quant_config_of(source).get("exclude") or ()))

    @classmethod
    def detect(cls, source) -> bool:
        r = _quark_row(source)
        return r is not None and r[0] == cls.quark_row

    @classmethod
    def activation_recipe(cls, source) -> ActivationRecipe:
        cfg, _ = _expert_config(quant_config_of(source), source)
        return _classify_input_spec(cfg.get("input_tensors"))

    @classmethod
    def unsupported_reason(cls, source) -> str | None:
        r = _quark_row(source)
        if r is not None and r[0] not in (None, "mxfp8") and weight_format(source) == "fake_quantized":
            return (
                f"Quark export with {r[1]} was exported fake-quantized (export.weight_format fake_quantized: BF16 "
                f"quantize-dequantize weights plus weight_scale tensors); megamoe re-encodes that form only for "
                f"MXFP8. To convert this model: {_REAL_EXPORT_HINT}"
            )
        if r is None or r[0] is not None:
            return None
        return (
            f"Quark export with {r[1]} is not supported. Supported Quark weight specs: fp4 per_group 32 e8m0 "
            "(MXFP4), [fp4 per_group 16, fp8 per_tensor] (NVFP4), fp8_e4m3 per_group 32 e8m0 (MXFP8). To convert "
            "this model: re-export it with one of those (Quark schemes mxfp4, mxfp4_fp8, nvfp4; the weight-only "
            "mxfp4_weight_only with --accept-activation-change), or convert the unquantized model with "
            "--quantize mxfp4|mxfp8|nvfp4|fp8_block"
        )

    @classmethod
    def synthetic_quant_config(cls, variant: str, ignore: list[str]) -> tuple[dict | None, dict | None]:
        """An amd-quark 0.13 export: the ``global_quant_config`` weight spec of
        ``quark_row`` with dynamic inputs of the same kind."""
        if cls.quark_row == "nvfp4":
            weight: Any = [
                {"dtype": "fp4", "qscheme": "per_group", "group_size": 16, "scale_format": "e4m3",
                 "is_dynamic": False, "round_method": "half_even"},
                {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False},
            ]
            inp: Any = [
                {"dtype": "fp4", "qscheme": "per_group", "group_size": 16, "scale_format": "e4m3", "is_dynamic": True},
                {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False},
            ]
        elif cls.quark_row == "mxfp4":
            weight = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0",
                      "scale_calculation_mode": "even", "round_method": "half_even", "is_dynamic": False}
            inp = dict(weight, is_dynamic=True)
        else:
            weight = {"dtype": "fp8_e4m3", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0",
                      "scale_calculation_mode": "even", "is_dynamic": False}
            inp = dict(weight, is_dynamic=True)
        return {
            "quant_method": "quark",
            "global_quant_config": {"weight": weight, "input_tensors": inp, "output_tensors": None, "bias": None},
            "layer_quant_config": {},
            "layer_type_quant_config": {},
            "exclude": ignore,
            "export": {"kv_cache_group": [], "pack_method": "reorder", "weight_format": "real_quantized"},
            "version": "0.13",
        }, None


@register_reader
class QuarkMXFP4Reader(_QuarkReader):
    format_name = "quark-mxfp4"
    row = "mxfp4"
    quark_row = "mxfp4"
    synthetic_formats = ("quark-mxfp4",)
    description = "Quark MXFP4 (weight U8 packed E2M1, weight_scale E8M0/32)"
    scheme = Scheme(
        name="Quark MXFP4",
        encoding="mxfp4",
        params=(
            Param("weight", ("weight",), ("U8", "I8")),
            Param("scale", ("weight_scale",), ("U8", "F8_E8M0")),
        ),
        ignored=("input_scale",),  # mxfp4_fp8's per-tensor FP8 activation scale: the kernel quantizes per 32
    )


@register_reader
class QuarkNVFP4Reader(_QuarkReader):
    format_name = "quark-nvfp4"
    row = "nvfp4"
    quark_row = "nvfp4"
    synthetic_formats = ("quark-nvfp4",)
    description = "Quark NVFP4 (weight, weight_scale E4M3/16, weight_scale_2, input_scale_2)"
    scheme = Scheme(
        name="Quark NVFP4",
        encoding="nvfp4",
        params=(
            Param("weight", ("weight",), ("U8", "I8")),
            Param("scale", ("weight_scale",), ("F8_E4M3",)),
            Param("global", ("weight_scale_2",), ("F32",)),
            Param("input", ("input_scale_2", "input_scale"), ("F32",), required=False),
        ),
    )


@register_reader
class QuarkMXFP8Reader(_QuarkReader):
    format_name = "quark-mxfp8"
    row = "mxfp8"
    quark_row = "mxfp8"
    synthetic_formats = ("quark-mxfp8",)
    description = "Quark MXFP8 (weight E4M3, weight_scale E8M0/32, per row or per block of rows)"
    scheme = Scheme(
        name="Quark MXFP8",
        encoding="mxfp8",
        params=(
            Param("weight", ("weight",), ("F8_E4M3",)),
            Param("scale", ("weight_scale",), ("U8", "F8_E8M0")),
        ),
        blocked_scales=True,
        ignored=("input_scale",),  # a per-tensor FP8 activation scale: the kernel quantizes per 32 itself
    )
    #: the fake-quantized export's tensors: BF16 weights and float (power-of-two) per-32 block scales
    _fake_scheme = Scheme(
        name="Quark MXFP8 (fake-quantized)",
        encoding="mxfp8",
        params=(
            Param("weight", ("weight",), FLOAT_DTYPES),
            Param("scale", ("weight_scale",), FLOAT_DTYPES),
        ),
        ignored=("input_scale",),
    )

    def __init__(self, source) -> None:
        super().__init__(source)
        self.fake_quantized = weight_format(source) == "fake_quantized"
        if self.fake_quantized:
            self.scheme = self._fake_scheme  # per instance: the class's scheme stays the real export's
            self.direct_weight_bytes = False  # the weights are re-encoded, never copied
            #: what the summary and megamoe.json (``source.recipe.weights``) say about the weights
            self.weights_note = ("Quark fake-quantized MXFP8 (BF16 quantize-dequantize weights + float block "
                                 "scales): re-encoded exactly as E4M3 with the recorded power-of-two scales "
                                 "(every weight checked to be an E4M3 value x its scale: the bytes Quark's real "
                                 "quantizer writes)")

    def _read_projection(self, scheme: Scheme, r: Resolved, where: str, weights: bool = True) -> ProjectionTensors:
        if scheme is not self._fake_scheme:
            return super()._read_projection(scheme, r, where, weights)
        wname, sname = r.names["weight"], r.names["scale"]
        w, sc = fake_quantized_to_mxfp8(self.source.get_tensor(wname), self.source.get_tensor(sname), where,
                                        self._where(wname), self._where(sname))
        return ProjectionTensors(weight=w, scale=sc)
