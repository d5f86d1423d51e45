"""NVIDIA ModelOpt (nvidia-modelopt) unified HF exports: NVFP4, MXFP4, MXFP8.

Detected from ``hf_quant_config.json`` (``producer.name == "modelopt"``,
``quantization.quant_algo``) or ``config.json`` ``quantization_config``
(``quant_method == "modelopt"``, ``quant_algo``). docs/CHECKPOINTS.md#modelopt.

Per expert projection module:

* NVFP4: ``weight`` U8 ``[out, in/2]``, ``weight_scale`` F8_E4M3 ``[out, in/16]``,
  ``weight_scale_2`` F32 scalar (a dequant *multiplier*), ``input_scale`` F32
  scalar (optional: only when the input was calibrated);
* MXFP4: ``weight`` U8 ``[out, in/2]``, ``weight_scale`` U8 (E8M0) ``[out, in/32]``;
* MXFP8: ``weight`` F8_E4M3 ``[out, in]``, ``weight_scale`` U8 ``[out, in/32]``.

Activation recipes other than the kernels' own (`recipe`; the weights are
the same bytes either way):

* W4A8_MXFP4_FP8 (MXFP4 weights, per-tensor FP8 activations) is read by the
  MXFP4 reader and converts by default: the mxfp4 kernel feeds activations as
  MXFP8 per 32, finer than one FP8 scale per tensor (as for plain MXFP4,
  whose W4A4 recipe becomes MXFP8 too). Any ``input_scale`` is consumed unused.
* W4A16_NVFP4 (weight-only) is read by the NVFP4 reader; the kernels quantize
  activations to 4 bits, so it needs ``--accept-activation-change`` and, with
  no w2 input scale, ``--l2-activation-scale``.
* W4A8_NVFP4_FP8 (its own reader): E4M3 block scales per **32** elements,
  each written as two equal per-16 scales (exact), and FP8 per-tensor
  ``input_scale`` (amax/448) taken as the NVFP4 global activation scale
  (amax/2688): ``fl32(fl32(input_scale * 448) / 2688)``, so
  a2 = max over all experts of that (docs/SCALES.md#a2). Needs
  ``--accept-activation-change`` (FP8 activations become NVFP4).

Refused, with the reason and what would convert it: *_AWQ (per-channel
``pre_quant_scale`` has no slot), NVFP4_SVDQUANT (low-rank branches), FP8*,
INT4/INT8, and MIXED_PRECISION whose routed experts use different
algorithms. MIXED_PRECISION with one supported algorithm for every routed
expert is read as that algorithm.
"""

from __future__ import annotations

from typing import Any, ClassVar

from megamoe_runtime.errors import FormatError

from .base import register_reader
from .common import Param, Scheme, SchemeReader, ignore_list
from .naming import EXPERT_RE
from .recipe import UNDECLARED, ActivationRecipe

#: quant_algo -> row of the reader that reads it
_SUPPORTED = {"NVFP4": "nvfp4", "MXFP4": "mxfp4", "MXFP8": "mxfp8", "W4A8_MXFP4_FP8": "mxfp4",
             "W4A16_NVFP4": "nvfp4", "W4A8_NVFP4_FP8": "nvfp4"}
#: what the producer does to the experts' inputs, per quant_algo (the kernels do their own; `recipe`)
_ACTIVATIONS = {
    "NVFP4": ActivationRecipe("nvfp4", True, "ModelOpt NVFP4 (W4A4): NVFP4 per 16 with a calibrated per-tensor "
                                             "global scale (input_scale)"),
    "MXFP4": ActivationRecipe("mxfp4", False, "ModelOpt MXFP4 (W4A4): MXFP4 per 32, dynamic"),
    "MXFP8": ActivationRecipe("mxfp8", False, "ModelOpt MXFP8: MXFP8 per 32, dynamic"),
    "W4A8_MXFP4_FP8": ActivationRecipe("fp8", True, "ModelOpt W4A8_MXFP4_FP8: FP8 E4M3 with one calibrated scale "
                                                    "per tensor"),
    "W4A16_NVFP4": ActivationRecipe("bf16", False, "ModelOpt W4A16_NVFP4: not quantized (BF16; weight-only)"),
    "W4A8_NVFP4_FP8": ActivationRecipe("fp8", True, "ModelOpt W4A8_NVFP4_FP8: FP8 E4M3 with one calibrated scale "
                                                    "per tensor (input_scale)"),
}
#: what would convert such a model instead (every remaining refusal says it)
_CONVERTIBLE = ("re-export the BF16 model with a ModelOpt recipe these kernels read (NVFP4, MXFP4, MXFP8, "
               "W4A8_MXFP4_FP8; W4A16_NVFP4 / W4A8_NVFP4_FP8 with --accept-activation-change), or convert the "
               "unquantized model with --quantize mxfp4|mxfp8|nvfp4|fp8_block")
_WHY_NOT = {
    "W4A8_AWQ": "INT4 AWQ weights with FP8 activations are not an MX/NV FP4 format and carry pre_quant_scale",
    "NVFP4_AWQ": "its per-channel pre_quant_scale (AWQ smoothing) has no slot in the kernels",
    "NVFP4_SVDQUANT": "its low-rank correction branches have no slot in the kernels",
    "FP8": "per-tensor FP8 is not one of the MegaMoE rows (mxfp4, mxfp8, nvfp4, bf16)",
    "FP8_PB_WO": "block FP8 weight-only is not one of the MegaMoE rows",
    "FP8_PB_REAL": "block FP8 is not one of the MegaMoE rows",
    "FP8_PC_PT": "per-channel FP8 is not one of the MegaMoE rows",
    "INT4_AWQ": "INT4 is not one of the MegaMoE rows",
    "INT8_SQ": "INT8 is not one of the MegaMoE rows",
    "INT8_WO": "INT8 is not one of the MegaMoE rows",
}


def modelopt_quant(source) -> dict[str, Any] | None:
    """``{"algo": str|None, "exclude": [...], "layers": {...}}`` when the
    checkpoint is a ModelOpt export, else None."""
    hq = source.hf_quant_config
    if isinstance(hq, dict) and str((hq.get("producer") or {}).get("name", "")).lower() == "modelopt":
        q = hq.get("quantization") or {}
        return {
            "algo": q.get("quant_algo"),
            "exclude": list(q.get("exclude_modules") or []),
            "layers": q.get("quantized_layers") or {},
        }
    cq = source.config_quant_config
    if isinstance(cq, dict) and str(cq.get("quant_method", "")).lower() == "modelopt":
        q = cq.get("quantization") if isinstance(cq.get("quantization"), dict) else cq
        return {
            "algo": q.get("quant_algo"),
            "exclude": list(ignore_list(q, "exclude_modules", "ignore")),
            "layers": q.get("quantized_layers") or {},
        }
    return None


def effective_algo(source) -> str | None:
    """The routed experts' quant_algo (upper case); MIXED_PRECISION resolved
    over the expert modules; FormatError when experts disagree."""
    mq = modelopt_quant(source)
    if mq is None:
        return None
    algo = str(mq["algo"] or "").upper()
    if algo != "MIXED_PRECISION":
        return algo
    layers: dict[str, Any] = mq["layers"]
    algos: dict[str, list[str]] = {}
    for mod, spec in layers.items():
        if EXPERT_RE.match(mod + ".weight"):
            a = str((spec or {}).get("quant_algo", "")).upper()
            algos.setdefault(a, []).append(mod)
    if not algos:
        raise FormatError(
            f"{source.id}: ModelOpt MIXED_PRECISION export lists no routed-expert modules in quantized_layers; "
            "the experts' format cannot be determined (the experts may be unquantized)"
        )
    if len(algos) > 1:
        detail = "; ".join(f"{a}: {len(m)} modules (e.g. {m[0]})" for a, m in sorted(algos.items()))
        raise FormatError(
            f"{source.id}: ModelOpt MIXED_PRECISION export quantizes routed experts with different algorithms "
            f"({detail}); a MegaMoE layer needs one format for all experts. To convert it: re-export with one "
            "algorithm for every routed expert"
        )
    return next(iter(algos))


class _ModelOptReader(SchemeReader):
    #: the quant_algo values this reader reads (same weight encoding, different activation recipes)
    algos: ClassVar[tuple[str, ...]] = ()
    direct_weight_bytes = True  # weights are the stored bytes, viewed (convert reads them in place)

    def __init__(self, source) -> None:
        super().__init__(source)
        mq = modelopt_quant(source) or {}
        self._ignore_patterns = tuple(mq.get("exclude") or ())

    @classmethod
    def detect(cls, source) -> bool:
        return modelopt_quant(source) is not None and effective_algo(source) in cls.algos

    @classmethod
    def activation_recipe(cls, source) -> ActivationRecipe:
        return _ACTIVATIONS.get(effective_algo(source) or "", UNDECLARED)

    @classmethod
    def unsupported_reason(cls, source) -> str | None:
        mq = modelopt_quant(source)
        if mq is None:
            return None
        algo = effective_algo(source)
        if algo in _SUPPORTED or algo in ("", "NONE"):
            return None  # no weight quantization (e.g. FP8 KV cache only): the unquantized reader takes it
        why = _WHY_NOT.get(algo or "", "it is not one of the formats this converter reads")
        return (
            f"ModelOpt quant_algo {algo or mq['algo']!r} is not supported: {why}. "
            f"Supported ModelOpt algorithms: {', '.join(_SUPPORTED)}. To convert this model: {_CONVERTIBLE}"
        )

    @classmethod
    def synthetic_quant_config(cls, variant: str, ignore: list[str]) -> tuple[dict | None, dict | None]:
        """A ModelOpt 0.47 export of ``algos[0]``: ``hf_quant_config.json`` and its
        ``quantization_config`` copy."""
        algo, kind = cls.algos[0], cls.row
        group = 16 if kind == "nvfp4" else 32
        hf = {
            "producer": {"name": "modelopt", "version": "0.47.0"},
            "quantization": {
                "quant_algo": algo,
                "kv_cache_quant_algo": None,
                "group_size": group,
                "exclude_modules": ignore,
            },
        }
        cq = {
            "quant_method": "modelopt",
            "quant_algo": algo,
            "producer": {"name": "modelopt", "version": "0.47.0"},
            "ignore": ignore,
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4 if kind != "mxfp8" else 8, "type": "float", "group_size": group},
                }
            },
        }
        return cq, hf


@register_reader
class ModelOptNVFP4Reader(_ModelOptReader):
    format_name = "modelopt-nvfp4"
    row = "nvfp4"
    algos = ("NVFP4", "W4A16_NVFP4")
    aliases = ("modelopt-w4a16-nvfp4",)  # the quant_algo of the weight-only variant (same weight encoding)
    synthetic_formats = ("modelopt-nvfp4",)
    description = ("ModelOpt NVFP4 / W4A16_NVFP4 (weight U8, weight_scale E4M3/16, weight_scale_2, input_scale "
                   "when calibrated)")
    scheme = Scheme(
        name="ModelOpt NVFP4",
        encoding="nvfp4",
        params=(
            Param("weight", ("weight",), ("U8",)),
            Param("scale", ("weight_scale",), ("F8_E4M3",)),
            Param("global", ("weight_scale_2",), ("F32",)),
            Param("input", ("input_scale",), ("F32",), required=False),
        ),
    )


@register_reader
class ModelOptMXFP4Reader(_ModelOptReader):
    format_name = "modelopt-mxfp4"
    row = "mxfp4"
    algos = ("MXFP4", "W4A8_MXFP4_FP8")
    aliases = ("modelopt-w4a8-mxfp4-fp8",)
    synthetic_formats = ("modelopt-mxfp4",)
    description = "ModelOpt MXFP4 / W4A8_MXFP4_FP8 (weight U8 packed E2M1, weight_scale E8M0/32)"
    scheme = Scheme(
        name="ModelOpt MXFP4",
        encoding="mxfp4",
        params=(
            Param("weight", ("weight",), ("U8", "I8")),
            Param("scale", ("weight_scale",), ("U8", "F8_E8M0")),
        ),
        # W4A8_MXFP4_FP8's per-tensor FP8 activation scale: the kernel quantizes per 32 itself
        ignored=("input_scale",),
    )


@register_reader
class ModelOptMXFP8Reader(_ModelOptReader):
    format_name = "modelopt-mxfp8"
    row = "mxfp8"
    algos = ("MXFP8",)
    synthetic_formats = ("modelopt-mxfp8",)
    description = "ModelOpt MXFP8 (weight E4M3, weight_scale E8M0/32)"
    scheme = Scheme(
        name="ModelOpt MXFP8",
        encoding="mxfp8",
        params=(
            Param("weight", ("weight",), ("F8_E4M3",)),
            Param("scale", ("weight_scale",), ("U8", "F8_E8M0")),
        ),
    )


@register_reader
class ModelOptW4A8NVFP4FP8Reader(_ModelOptReader):
    """W4A8_NVFP4_FP8: NVFP4 weights with E4M3 block scales per 32 (each becomes
    two equal per-16 scales) and FP8 per-tensor input scales, rescaled to the
    NVFP4 global-scale convention (amax/448 -> amax/2688)."""

    format_name = "modelopt-w4a8-nvfp4-fp8"
    row = "nvfp4"
    algos = ("W4A8_NVFP4_FP8",)
    description = ("ModelOpt W4A8_NVFP4_FP8 (weight U8, weight_scale E4M3/32, weight_scale_2, FP8 input_scale; "
                   "needs --accept-activation-change)")
    scheme = Scheme(
        name="ModelOpt W4A8_NVFP4_FP8",
        encoding="nvfp4",
        params=(
            Param("weight", ("weight",), ("U8",)),
            Param("scale", ("weight_scale",), ("F8_E4M3",)),
            Param("global", ("weight_scale_2",), ("F32",)),
            Param("input", ("input_scale",), ("F32",), required=False, rescale=(448.0, 2688.0)),
        ),
        stored_scale_group=32,
    )
    #: how a2 is derived, for the manifest (``source.recipe.l2_activation_scale``)
    l2_activation_scale_rule = ("max over all experts of fl32(fl32(w2 input_scale * 448) / 2688): the FP8 "
                                "per-tensor scale (amax/448) in the NVFP4 global-scale convention (amax/2688)")
