"""compressed-tensors (llm-compressor) exports: nvfp4-pack-quantized,
mxfp4-pack-quantized, mxfp8-quantized.

Detected from ``config.json`` ``quantization_config`` with ``quant_method ==
"compressed-tensors"`` and its ``format`` (for ``mixed-precision``, the
formats of the ``config_groups``). docs/CHECKPOINTS.md#compressed-tensors.

Per expert projection module:

* nvfp4: ``weight_packed`` U8 ``[out, in/2]`` (byte-identical to ModelOpt's
  ``weight``), ``weight_scale`` F8_E4M3 ``[out, in/16]``, ``weight_global_scale``
  F32 ``[1]`` and optional ``input_global_scale`` F32 ``[1]``. Both globals are
  **divisors** (``global = 6*448/amax``): the reader returns their reciprocals,
  so canonical scales are multipliers like ModelOpt's (fp32 reciprocals are
  within 1 ulp of the ModelOpt value, not bit-identical).
* mxfp4: ``weight_packed`` U8 + ``weight_scale`` U8 ``[out, in/32]``.
* mxfp8: ``weight`` F8_E4M3 + ``weight_scale`` U8 ``[out, in/32]``.
* float-quantized with weights strategy ``block`` [128, 128] (llm-compressor FP8_BLOCK) -> the fp8_block
  row: ``weight`` F8_E4M3 + ``weight_scale`` ``[out/128, in/128]`` (a multiplier, BF16 or F32).

``weight_shape`` (kept by some packed compressors) is consumed and ignored.

The experts' config group ``input_activations`` is the activation recipe
(`recipe`): ``null`` (the weight-only presets NVFP4A16, MXFP4A16, MXFP8A16:
no ``input_global_scale``) means BF16 activations, which every quantized row
makes coarser, so they need ``--accept-activation-change`` (NVFP4A16 also
``--l2-activation-scale``: it has no w2 input scale).
Refused with the reason: float-quantized FP8 per tensor or channel, or blocks other than 128x128,
pack-quantized / int-quantized (INT4/INT8, e.g. Kimi-K2-Thinking),
naive-quantized, sparse formats, and mixed-precision whose groups use
different formats for the experts.
"""

from __future__ import annotations

from typing import ClassVar

from .base import register_reader
from .common import Param, Scheme, SchemeReader, ignore_list, quant_config_of
from .recipe import UNDECLARED, ActivationRecipe, unknown

_SUPPORTED = {"nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4", "mxfp8-quantized": "mxfp8",
             "float-quantized": "fp8_block"}
_WHY_NOT = {
    "float-quantized": "FP8 per tensor or per channel is not one of the MegaMoE rows (128x128 blocks are: "
    "llm-compressor scheme FP8_BLOCK); re-quantizing would be lossy",
    "pack-quantized": "INT4/INT8 packed weights are not one of the MegaMoE rows",
    "int-quantized": "INT8 weights are not one of the MegaMoE rows",
    "naive-quantized": "naive (unpacked integer) quantization is not one of the MegaMoE rows",
    "marlin-24": "2:4 sparse Marlin weights are not one of the MegaMoE rows",
    "sparse-bitmask": "sparse weights are not one of the MegaMoE rows",
    "sparse-24-bitmask": "sparse weights are not one of the MegaMoE rows",
}


def _ct_format(source) -> str | None:
    """The experts' compressed-tensors format string, or None if not CT."""
    qc = quant_config_of(source)
    if str(qc.get("quant_method", "")).lower() != "compressed-tensors":
        return None
    fmt = str(qc.get("format") or "")
    if fmt in ("mixed-precision", ""):
        groups = qc.get("config_groups") or {}
        fmts = sorted({str(g.get("format")) for g in groups.values() if isinstance(g, dict) and g.get("format")})
        # float-quantized (FP8) groups usually cover the attention next to other expert formats: a group of
        # another supported format is the experts' one; float-quantized alone may be (FP8_BLOCK)
        supported = [f for f in fmts if f in _SUPPORTED and f != "float-quantized"]
        if len(supported) == 1:
            return supported[0]
        if len(fmts) == 1:
            return fmts[0]
        if fmts:
            return "mixed-precision:" + ",".join(fmts)
    if fmt == "dense":
        # "dense" with quantization groups: weights were saved uncompressed (fake-quant); refuse below
        return "dense"
    return fmt or None


def _experts_group(source) -> dict | None:
    """The config group of the experts' format (the first group with weights when none names it), or None."""
    qc = quant_config_of(source)
    fmt = _ct_format(source)
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict) and g.get("weights")]
    match = [g for g in groups if g.get("format") in (fmt, None)] or groups
    return match[0] if match else None


def _ct_input_activations(source) -> ActivationRecipe:
    """The activation recipe of the config group whose format is the experts' one."""
    group = _experts_group(source)
    if group is None:
        return UNDECLARED
    ia = group.get("input_activations")
    if ia is None:
        return ActivationRecipe("bf16", False, "compressed-tensors weight-only (input_activations: null): not "
                                               "quantized (BF16)")
    if not isinstance(ia, dict):
        return unknown(f"compressed-tensors input_activations {ia!r}")
    bits, typ, gs, strat = ia.get("num_bits"), ia.get("type"), ia.get("group_size"), ia.get("strategy")
    dyn = ia.get("dynamic")
    how = {True: "dynamic", False: "static, calibrated", "local": "dynamic per group, calibrated global"}.get(
        dyn, f"dynamic={dyn!r}")
    if typ == "float" and bits == 4 and gs == 16:
        return ActivationRecipe("nvfp4", dyn in (False, "local"), f"compressed-tensors NVFP4 per 16 ({how})")
    if typ == "float" and bits == 4 and gs == 32:
        return ActivationRecipe("mxfp4", dyn is False, f"compressed-tensors MXFP4 per 32 ({how})")
    if typ == "float" and bits == 8 and gs == 32:
        return ActivationRecipe("mxfp8", dyn is False, f"compressed-tensors MXFP8 per 32 ({how})")
    if typ == "float" and bits == 8 and strat == "group" and gs == 128:
        return ActivationRecipe("fp8_128", dyn is False, f"compressed-tensors FP8 per 1x128 group ({how})")
    if typ == "float" and bits == 8 and strat in ("tensor", "token"):
        return ActivationRecipe("fp8", dyn is False, f"compressed-tensors FP8 per {strat} ({how})")
    return unknown(f"compressed-tensors input_activations num_bits={bits} type={typ} strategy={strat} "
                   f"group_size={gs}")


def _expert_weights_args(source) -> dict:
    """The ``weights`` quantization args of the config group in the experts' format."""
    group = _experts_group(source)
    w = group.get("weights") if group is not None else None
    return w if isinstance(w, dict) else {}


def _ct_fp8_block_reason(source) -> str | None:
    """None for float-quantized FP8 with 128x128 block weights (the fp8_block row), else why not."""
    w = _expert_weights_args(source)
    strat = w.get("strategy")
    if w.get("type") != "float" or w.get("num_bits") != 8 or strat != "block":
        return (f"compressed-tensors format 'float-quantized' is not supported: {_WHY_NOT['float-quantized']} "
                f"(weights num_bits={w.get('num_bits')} type={w.get('type')!r} strategy={strat!r}). Supported "
                f"compressed-tensors formats: {', '.join(_SUPPORTED)} (float-quantized: strategy 'block' "
                "[128, 128]). To convert this model: re-export it with llm-compressor scheme FP8_BLOCK, NVFP4, "
                "MXFP4 or MXFP8, or convert the unquantized model with --quantize mxfp4|mxfp8|nvfp4|fp8_block")
    from .fp8_block import block_fp8_reason

    bs = w.get("block_structure")
    return block_fp8_reason("compressed-tensors weights (strategy 'block')", list(bs) if isinstance(bs, (list, tuple))
                            else bs)


def _ct_scheme(label: str, encoding: str, *params: Param, **options) -> Scheme:
    """One projection as compressed-tensors stores it: its tensors, beside the ``weight_shape`` every export keeps."""
    return Scheme(name=f"compressed-tensors {label}", encoding=encoding, params=params, ignored=("weight_shape",),
                  **options)


class _CTReader(SchemeReader):
    direct_weight_bytes = True  # weights are the stored bytes, viewed (convert reads them in place)
    ct_format: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.synthetic_formats = (cls.format_name,)  # every CT reader's synthetic checkpoint is its own format

    def __init__(self, source) -> None:
        super().__init__(source)
        self._ignore_patterns = ignore_list(quant_config_of(source), "ignore")

    @classmethod
    def detect(cls, source) -> bool:
        return _ct_format(source) == cls.ct_format

    @classmethod
    def activation_recipe(cls, source) -> ActivationRecipe:
        return _ct_input_activations(source)

    @classmethod
    def unsupported_reason(cls, source) -> str | None:
        fmt = _ct_format(source)
        if fmt == "float-quantized":
            return _ct_fp8_block_reason(source)
        if fmt is None or fmt in _SUPPORTED:
            return None
        if fmt.startswith("mixed-precision:"):
            why = f"its config groups use several formats ({fmt.split(':', 1)[1]}) and the experts' one is ambiguous"
        elif fmt == "dense":
            why = "format 'dense' means the weights were saved uncompressed (fake-quantized)"
        else:
            why = _WHY_NOT.get(fmt, "it is not one of the formats this converter reads")
        return (
            f"compressed-tensors format {fmt!r} is not supported: {why}. "
            f"Supported compressed-tensors formats: {', '.join(_SUPPORTED)}. To convert this model: re-export it "
            "with llm-compressor scheme NVFP4, MXFP4 or MXFP8 (the weight-only NVFP4A16 / MXFP4A16 / MXFP8A16 with "
            "--accept-activation-change), or convert the unquantized model with --quantize mxfp4|mxfp8|nvfp4|fp8_block"
        )

    @classmethod
    def synthetic_quant_config(cls, variant: str, ignore: list[str]) -> tuple[dict | None, dict | None]:
        """An llm-compressor 0.14 export (compressed-tensors 0.20) of ``ct_format``
        with dynamic activations of the weights' kind."""
        if cls.row == "fp8_block":
            w = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128],
                 "symmetric": True, "dynamic": False}
            a = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "symmetric": True,
                 "dynamic": True}
        elif cls.row == "nvfp4":
            w = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
                 "dynamic": False, "scale_dtype": "float8_e4m3fn"}
            a = dict(w, dynamic="local")
        else:
            w = {"num_bits": 4 if cls.row == "mxfp4" else 8, "type": "float", "strategy": "group", "group_size": 32,
                 "symmetric": True, "dynamic": False, "scale_dtype": "uint8"}
            a = dict(w, dynamic=True)
        return {
            "quant_method": "compressed-tensors",
            "format": cls.ct_format,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": a,
                                          "format": cls.ct_format}},
            "ignore": ignore,
            "quantization_status": "compressed",
            "version": "0.20.1",
        }, None


@register_reader
class CTNVFP4Reader(_CTReader):
    format_name = "ct-nvfp4"
    row = "nvfp4"
    ct_format = "nvfp4-pack-quantized"
    aliases = ("compressed-tensors-nvfp4", "nvfp4-pack-quantized")
    description = "compressed-tensors nvfp4-pack-quantized (weight_packed, weight_scale, 1/weight_global_scale)"
    scheme = _ct_scheme("NVFP4", row, Param("weight", ("weight_packed",), ("U8", "I8")),
                        Param("scale", ("weight_scale",), ("F8_E4M3",)),
                        Param("global", ("weight_global_scale",), ("F32",)),
                        Param("input", ("input_global_scale",), ("F32",), required=False),
                        scalar_shape=(1,))  # F32 [1]


@register_reader
class CTMXFP4Reader(_CTReader):
    format_name = "ct-mxfp4"
    row = "mxfp4"
    ct_format = "mxfp4-pack-quantized"
    aliases = ("compressed-tensors-mxfp4", "mxfp4-pack-quantized")
    description = "compressed-tensors mxfp4-pack-quantized (weight_packed, weight_scale E8M0/32)"
    scheme = _ct_scheme("MXFP4", row, Param("weight", ("weight_packed",), ("U8", "I8")),
                        Param("scale", ("weight_scale",), ("U8", "F8_E8M0")))


@register_reader
class CTMXFP8Reader(_CTReader):
    format_name = "ct-mxfp8"
    row = "mxfp8"
    ct_format = "mxfp8-quantized"
    aliases = ("compressed-tensors-mxfp8", "mxfp8-quantized")
    description = "compressed-tensors mxfp8-quantized (weight E4M3, weight_scale E8M0/32)"
    scheme = _ct_scheme("MXFP8", row, Param("weight", ("weight", "weight_packed"), ("F8_E4M3",)),
                        Param("scale", ("weight_scale",), ("U8", "F8_E8M0")))


@register_reader
class CTFP8BlockReader(_CTReader):
    format_name = "ct-fp8-block"
    row = "fp8_block"
    ct_format = "float-quantized"
    aliases = ("compressed-tensors-fp8-block", "fp8-block-quantized")
    description = "compressed-tensors float-quantized FP8_BLOCK (weight E4M3, weight_scale F32 per 128x128)"
    scheme = _ct_scheme("FP8_BLOCK", row, Param("weight", ("weight",), ("F8_E4M3",)),
                        Param("scale", ("weight_scale",), ("F32", "BF16")))
