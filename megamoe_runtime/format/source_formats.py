"""What a source checkpoint's expert tensor names mean: the facts the raw loader needs.

The raw (vLLM-style) ``weight_loader`` reads an unconverted checkpoint without the
converter, so the meaning of every expert tensor name lives here, in the runtime
(docs/CHECKPOINTS.md#source-formats, #expert-naming); the converter's format
classes (``megamoe_convert.readers``) read the same tables and add what only
conversion needs (accepted dtypes, detection, the synthetic encoder).

* Projection names: ``gate_proj`` / ``w1`` is the gate, ``up_proj`` / ``w3`` the
  up and ``down_proj`` / ``w2`` the down projection, whatever the producer.
* Suffix meanings, per producer family (:class:`SourceFamily`): which stored
  tensor is the weight, the block scale, the global or the input scale, and
  whether a float scale is stored as a divisor (compressed-tensors:
  ``global = 6*448/amax``) or as a multiplier (everyone else). One suffix has
  one meaning across families; :data:`SUFFIX_KINDS` is their union, checked.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

#: the kinds of stored expert tensors the loaders know
_KINDS = ("weight", "scale", "global_scale", "input_scale")

#: projection name -> role, every spelling (HF ``*_proj``, Mixtral / DeepSeek ``w1 w3 w2``)
PROJECTION_ROLES = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}
#: role -> vLLM shard id (w1 = gate and w3 = up are the two L1 halves, w2 = down is L2)
SHARD_OF_ROLE = {"gate": "w1", "up": "w3", "down": "w2"}
#: the projection names as a regex alternative
PROJECTION_PATTERN = "gate_proj|up_proj|down_proj|w1|w2|w3"
#: the module names a layer's shared experts go by, as a regex alternative (Qwen2-MoE: ``shared_expert``)
SHARED_MODULE_PATTERN = "shared_experts|shared_expert|shared_mlp"


@dataclass(frozen=True)
class SuffixMeaning:
    """One stored tensor of a projection module: its suffix, what it is
    (:data:`_KINDS`), and whether a float scale is stored as its reciprocal."""

    suffix: str
    kind: str
    divisor: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"suffix {self.suffix!r}: kind {self.kind!r} is not one of {_KINDS}")


@dataclass(frozen=True)
class SourceFamily:
    """The suffixes one producer family writes, in the order
    ``make_expert_params_mapping(fmt=name)`` lists them."""

    name: str
    suffixes: tuple[SuffixMeaning, ...]


def _w(s: str) -> SuffixMeaning:
    return SuffixMeaning(s, "weight")


def _s(s: str) -> SuffixMeaning:
    return SuffixMeaning(s, "scale")


_MODELOPT = SourceFamily("modelopt", (
    SuffixMeaning("weight_scale_2", "global_scale"),  # a multiplier
    _s("weight_scale"),
    _w("weight"),
    SuffixMeaning("input_scale", "input_scale"),  # a multiplier
))
_COMPRESSED_TENSORS = SourceFamily("compressed-tensors", (
    SuffixMeaning("weight_global_scale", "global_scale", divisor=True),
    SuffixMeaning("input_global_scale", "input_scale", divisor=True),
    _w("weight_packed"),
    _s("weight_scale"),
    _w("weight"),
))
_QUARK = SourceFamily("quark", (
    SuffixMeaning("weight_scale_2", "global_scale"),
    _s("weight_scale"),
    _w("weight"),
    SuffixMeaning("input_scale_2", "input_scale"),  # the activation's per-tensor FP8 stage, a multiplier
))
_DEEPSEEK_V4 = SourceFamily("deepseek-v4", (_w("weight"), _s("scale")))  # E8M0 per 32
#: any MX export (ModelOpt, Quark, compressed-tensors ``mxfp8-quantized``)
MX = SourceFamily("mx", (_s("weight_scale"), _w("weight")))
BF16 = SourceFamily("bf16", (_w("weight"),))
#: block FP8 (DeepSeek-V3 / transformers FineGrainedFP8): ``weight_scale_inv`` is the multiplier despite its name
FP8_BLOCK = SourceFamily("fp8-block", (_w("weight"), _s("weight_scale_inv")))

#: fmt of ``make_expert_params_mapping`` -> family
FAMILIES: dict[str, SourceFamily] = {f.name: f for f in (_MODELOPT, _COMPRESSED_TENSORS, _QUARK, _DEEPSEEK_V4, MX, BF16,
                                                           FP8_BLOCK)}

#: suffixes recognised but not loadable into any MegaMoE row (reported, with the reason)
UNSUPPORTED_SUFFIXES = {
    "bias": "expert biases have no slot in any DeepGEMM mega entry point",
}


def _union(families) -> dict[str, SuffixMeaning]:
    """Every family's suffixes; a suffix two families give different meanings is a bug, refused at import."""
    out: dict[str, SuffixMeaning] = {}
    for fam in families:
        for m in fam.suffixes:
            if out.setdefault(m.suffix, m) != m:
                raise ImportError(f"suffix {m.suffix!r} means {out[m.suffix]} and, in {fam.name}, {m}")
    return out


#: suffix -> its meaning, over every family
SUFFIXES: dict[str, SuffixMeaning] = _union(FAMILIES.values())
#: suffix -> (kind, divisor): the raw loader's lookup
SUFFIX_KINDS: dict[str, tuple[str, bool]] = {s: (m.kind, m.divisor) for s, m in SUFFIXES.items()}

#: safetensors dtypes of a weight that is stored quantized (packed E2M1 bytes or E4M3 elements)
_QUANTIZED_WEIGHT_DTYPES = ("U8", "I8", "F8_E4M3")


def is_quantized_linear(dtypes: Mapping[str, str]) -> bool:
    """Whether a linear's stored tensors (suffix -> safetensors dtype) hold a quantized weight: what both the
    converter (which pass-through tensors it value-checks) and the engines' dense decode ask."""
    return "weight_packed" in dtypes or dtypes.get("weight") in _QUANTIZED_WEIGHT_DTYPES
