"""Block-FP8 checkpoints -> the ``fp8_block`` row (docs/FORMATS.md#fp8-block,
docs/CHECKPOINTS.md#block-fp8).

One scheme, the names DeepSeek-V3 / V3.1 / R1 and Kimi-K2 ship natively and
transformers' ``FineGrainedFP8Config`` writes (Qwen3-*-FP8, GLM-4.5-FP8 exports):
``config.json`` ``quantization_config: {quant_method: "fp8", weight_block_size:
[128, 128], activation_scheme: "dynamic", fmt: "e4m3" (DeepSeek)}``, per projection
``weight`` F8_E4M3 ``[out, in]`` and ``weight_scale_inv`` F32 ``[out/128, in/128]``.
Despite its name, ``weight_scale_inv`` is the multiplier (``weight = e4m3 *
weight_scale_inv``: the dequantizers of DeepSeek's inference code and of
transformers multiply by it), which is what the SM90 kernel reads: bytes are
copied unchanged. Detection leaves DeepSeek-V4's UE8M0 layout to its reader.

``modules_to_not_convert`` (FineGrainedFP8Config's list of modules left unquantized; ``ignored_layers`` in
MiniMax's exports) is read to word a refusal of routed experts stored unquantized: an entry names a module
when it is the module's name, a module above it (up to a dot) or its trailing names, read as a regular
expression matched from the start, as transformers applies the list.

Refused, with the values: block sizes other than [128, 128], ``fmt`` other than
E4M3, UE8M0 scale storage (``scale_fmt: "ue8m0"`` with F8_E8M0 tensors: the dtype
check names them), and the value checks every row has (`checks.check_expert`:
scales finite and > 0, no E4M3 NaN byte in a weight; for these fp32 scales also
none that makes its block overflow fp32, and no fp32 subnormal over a block with a nonzero
element, docs/FORMATS.md#subnormal-scales).
"""

from __future__ import annotations

import json
import re

from .base import register_reader
from .common import Param, Scheme, SchemeReader, ignore_list, quant_config_of
from .deepseek_v4 import looks_v4
from .recipe import ActivationRecipe, unknown

#: the only block size the SM90 kernel's recipe (128, 128, 128) takes
_BLOCK = [128, 128]

_SCHEME = Scheme(
    name="block FP8 (weight_scale_inv per 128x128)",
    encoding="fp8_block",
    params=(
        Param("weight", ("weight",), ("F8_E4M3",)),
        Param("scale", ("weight_scale_inv",), ("F32", "BF16")),
    ),
)


def _block_size(qc: dict):
    v = qc.get("weight_block_size")
    return list(v) if isinstance(v, (list, tuple)) else v


def _is_block_fp8(source) -> bool:
    """``quant_method: "fp8"`` with a ``weight_block_size`` and not DeepSeek-V4's layout."""
    qc = quant_config_of(source)
    return (str(qc.get("quant_method", "")).lower() == "fp8" and qc.get("weight_block_size") is not None
            and looks_v4(source) is None)


def block_fp8_reason(what: str, block, fmt=None) -> str | None:
    """Why a block-FP8 declaration cannot be the fp8_block row, or None."""
    if block != _BLOCK:
        if not isinstance(block, list):  # '"[128, 128]"' (a string) printed bare would read as the right value
            block = f"{json.dumps(block)} (not a list [rows, cols])"
        return (f"{what} declares weight blocks of {block}; the fp8_block row (DeepGEMM's SM90 fp8_mega_moe, recipe "
                f"(128, 128, 128)) takes exactly {_BLOCK}. Re-export with 128x128 blocks (transformers "
                "FineGrainedFP8Config(weight_block_size=(128, 128)), llm-compressor scheme FP8_BLOCK)")
    if fmt is not None and str(fmt).lower() not in ("e4m3", "float8_e4m3fn"):
        return f"{what} declares fmt {fmt!r}; the fp8_block row holds E4M3 weights only"
    return None


@register_reader
class FP8BlockReader(SchemeReader):
    format_name = "fp8-block"
    row = "fp8_block"
    aliases = ("deepseek-fp8", "finegrained-fp8", "block-fp8")
    synthetic_formats = ("fp8-block",)
    description = "block FP8: weight E4M3 + weight_scale_inv F32 per 128x128 (DeepSeek-V3/R1, FineGrainedFP8)"
    scheme = _SCHEME
    direct_weight_bytes = True  # weights are the stored bytes (convert reads them in place)

    def __init__(self, source) -> None:
        super().__init__(source)
        self._ignore_patterns = ignore_list(quant_config_of(source), "modules_to_not_convert", "ignored_layers")

    @staticmethod
    def _ignore_names(pat: str, module: str) -> bool:
        """transformers' rule for ``modules_to_not_convert``: the module itself, a module above it, or its
        trailing names (``"lm_head"``, ``"model.layers.1.mlp.experts"``, ``"gate"``), a regex from the start;
        an entry ends at a dot, so ``model.layers.1`` does not name ``model.layers.10``."""
        if pat == module or module.startswith(pat + ".") or module.endswith("." + pat):
            return True
        try:
            return re.match(rf"(?:{pat})(?:\.|$)", module) is not None
        except re.error:
            return False

    @classmethod
    def detect(cls, source) -> bool:
        return _is_block_fp8(source)

    @classmethod
    def unsupported_reason(cls, source) -> str | None:
        if not _is_block_fp8(source):
            return None
        qc = quant_config_of(source)
        return block_fp8_reason("quantization_config (quant_method 'fp8')", _block_size(qc), qc.get("fmt"))

    @classmethod
    def activation_recipe(cls, source) -> ActivationRecipe:
        scheme = str(quant_config_of(source).get("activation_scheme", "dynamic")).lower()
        if scheme == "dynamic":
            return ActivationRecipe("fp8_128", False, "quant_method fp8, activation_scheme dynamic: FP8 per 1x128 "
                                                      "group of a token")
        if scheme == "static":
            return ActivationRecipe("fp8", True, "quant_method fp8, activation_scheme static: FP8 with one "
                                                 "calibrated scale per tensor")
        return unknown(f"quant_method fp8 activation_scheme {scheme!r}")

    @classmethod
    def synthetic_quant_config(cls, variant: str, ignore: list[str]) -> tuple[dict | None, dict | None]:
        """DeepSeek-V3's own ``quantization_config``, which has no list of unquantized modules (DeepSeek
        quantizes every expert); where ``ignore`` names expert modules (a layer's routed experts or the
        shared experts stored unquantized), what transformers' FineGrainedFP8Config writes instead (the
        keys of tests/fixtures/real/finegrained-fp8-*/config.json), with ``modules_to_not_convert`` holding
        every module the synthetic checkpoint leaves unquantized, as module names (a glob's ``*`` dropped:
        transformers reads an entry as a prefix)."""
        if not any(".experts" in p or ".shared_experts" in p for p in ignore):
            return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(_BLOCK)}, None
        names = list(dict.fromkeys(p.rstrip("*").rstrip(".") for p in ignore))
        return {"activation_scheme": "dynamic", "dequantize": False, "modules_to_convert": None,
                "modules_to_not_convert": names, "quant_method": "fp8", "scale_fmt": "float",
                "weight_block_size": list(_BLOCK)}, None
