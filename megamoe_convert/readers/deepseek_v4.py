"""DeepSeek-V4-style native checkpoints (docs/CHECKPOINTS.md#deepseek-v4;
third-party descriptions, checked against the headers at open).

Names carry no ``model.`` prefix: routed experts
``layers.N.ffn.experts.E.w{1,2,3}.{weight,scale}`` (w1 gate, w3 up, w2 down),
shared ``layers.N.ffn.shared_experts.w{1,2,3}.{weight,scale}``; ``mtp.N.*``
blocks are passed through untouched.

* ``expert_dtype == "fp4"`` (the released models): routed ``weight`` **I8**
  ``[out, in/2]`` (packed E2M1, low nibble first) and ``scale`` **F8_E8M0**
  ``[out, in/32]`` -> the ``mxfp4`` row; the I8 and E8M0 tensors are viewed as
  uint8 bytes, never converted by value.
* ``expert_dtype == "fp8"`` (reportedly Flash-Base): routed ``weight`` F8_E4M3
  ``[out, in]`` with E8M0 scales per 128x128 block -> the ``mxfp8`` row; each
  block byte is repeated over its 128 rows and 4 groups of 32 (exact).
* Shared experts are FP8 E4M3 with 128x128 E8M0 block scales: read in the
  ``mxfp8`` encoding by the same exact expansion (``SharedInfo.encoding``).

Detected from ``quantization_config.quant_method == "fp8"`` with
``scale_fmt == "ue8m0"`` plus a top-level ``expert_dtype``, or, when the
config is silent, from ``layers.N.ffn.experts`` names with I8 weights and
F8_E8M0 scales. DeepSeek-V3/R1 FP8 (float ``weight_scale_inv`` 128x128
scales, not powers of two) is refused: no MegaMoE row holds it exactly.
"""

from __future__ import annotations

import re

import torch

from megamoe_runtime.format import codecs

from . import naming
from .base import register_reader
from .common import Param, Scheme, SchemeReader, quant_config_of

_V4_NAME = re.compile(r"^(?:[\w.]*?\.)?layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")

_FP4_SCHEME = Scheme(
    name="DeepSeek-V4 FP4 experts",
    encoding="mxfp4",
    params=(
        Param("weight", ("weight",), ("I8", "U8")),
        Param("scale", ("scale",), ("F8_E8M0", "U8")),
    ),
)
_FP8_SCHEME = Scheme(
    name="DeepSeek-V4 FP8 (128x128 E8M0 blocks)",
    encoding="mxfp8",
    params=(
        Param("weight", ("weight",), ("F8_E4M3",)),
        Param("scale", ("scale", "weight_scale_inv"), ("F8_E8M0", "U8")),
    ),
    blocked_scales=True,
)


def _encode_fp8_block128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 weight + UE8M0 scale byte per 128x128 block, the inverse of reading `_FP8_SCHEME`
    (DeepSeek-V4 shared experts): x [out, in] float32 -> (e4m3 [out, in], uint8 [ceil(out/128), ceil(in/128)])."""
    out, k = x.shape
    ro, rk = -(-out // 128), -(-k // 128)
    pad = torch.zeros(ro * 128, rk * 128)
    pad[:out, :k] = x
    blocks = pad.reshape(ro, 128, rk, 128)
    amax = blocks.abs().amax(dim=(1, 3))
    e = codecs.ue8m0_ceil_exponent(amax, codecs.E4M3_MAX)
    inv = torch.pow(2.0, 127.0 - e.to(torch.float32))
    q = codecs.e4m3_encode(blocks * inv[:, None, :, None]).reshape(ro * 128, rk * 128)[:out, :k].contiguous()
    return q, e


def _expert_dtype(source) -> str | None:
    d = source.config.get("expert_dtype")
    if d is None:
        d = quant_config_of(source).get("expert_dtype")
    return None if d is None else str(d).lower()


def looks_v4(source) -> str | None:
    """'fp4' / 'fp8' when the checkpoint is DeepSeek-V4 style, else None."""
    qc = quant_config_of(source)
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("fp8", ""):
        return None
    ed = _expert_dtype(source)
    v4_names = [n for n in source.tensor_names() if _V4_NAME.match(n)]
    if method == "fp8" and str(qc.get("scale_fmt", "")).lower() == "ue8m0" and ed in ("fp4", "fp8") and v4_names:
        return ed
    if v4_names:
        dt = source.header(v4_names[0])[0]
        if dt == "I8":
            return "fp4"
        if dt == "F8_E4M3" and str(qc.get("scale_fmt", "")).lower() == "ue8m0":
            return "fp8"
    return None


@register_reader
class DeepSeekV4Reader(SchemeReader):
    format_name = "deepseek-v4"
    row = ""  # set per instance from expert_dtype
    description = "DeepSeek-V4 native experts (w1/w2/w3 I8 packed E2M1 + F8_E8M0 scale/32 -> mxfp4; fp8 -> mxfp8)"
    scheme = _FP4_SCHEME
    shared_schemes = (_FP8_SCHEME, _FP4_SCHEME)
    aliases = ("deepseek-v4-fp4", "dsv4")
    synthetic_formats = ("deepseek-v4",)  # the released FP4 experts (_FP4_SCHEME)

    def __init__(self, source) -> None:
        kind = looks_v4(source) or ("fp8" if _expert_dtype(source) == "fp8" else "fp4")
        self.scheme = _FP8_SCHEME if kind == "fp8" else _FP4_SCHEME  # type: ignore[misc]
        super().__init__(source)
        self.row = self.scheme.encoding
        from .common import BF16_SCHEME

        self.shared_schemes = (_FP8_SCHEME, _FP4_SCHEME, BF16_SCHEME)  # type: ignore[misc]

    @classmethod
    def detect(cls, source) -> bool:
        return looks_v4(source) is not None

    @classmethod
    def unsupported_reason(cls, source) -> str | None:
        qc = quant_config_of(source)
        if str(qc.get("quant_method", "")).lower() != "fp8" or looks_v4(source) is not None:
            return None
        if qc.get("weight_block_size") is not None:
            return None  # block FP8 (DeepSeek-V3/R1, FineGrainedFP8): the fp8-block reader's, reasons included
        sf = qc.get("scale_fmt")
        return (
            f"quant_method 'fp8' without weight_block_size "
            f"{'(scale_fmt ' + repr(sf) + ') ' if sf else ''}is per-tensor or per-channel FP8, which no MegaMoE "
            "row holds; supported FP8: 128x128 block FP8 (weight_block_size [128, 128], the fp8_block row) and "
            "DeepSeek-V4 native experts. To convert this model: re-export it with 128x128 blocks, or convert the "
            "unquantized model with --quantize mxfp4|mxfp8|nvfp4|fp8_block"
        )

    @classmethod
    def encode_shared(cls, variant, gate, up, down, *, input_scales=None):
        """Block FP8 with E8M0 scales per 128x128, as the released models store shared experts."""
        out = {}
        for r, t in zip(naming.ROLES, (gate, up, down)):
            q, e8 = _encode_fp8_block128(t)
            out[r] = {"weight": q, "scale": e8.view(torch.float8_e8m0fnu)}
        return out

    @classmethod
    def synthetic_quant_config(cls, variant: str, ignore: list[str]) -> tuple[dict | None, dict | None]:
        """The released models' block-FP8 config with UE8M0 scales (``expert_dtype``
        is a top-level config key, which the synthetic builder writes)."""
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }, None
