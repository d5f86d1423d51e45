"""Unquantized checkpoints (BF16 / FP16 / FP32 experts).

Without ``quantize`` the experts map onto the ``bf16`` row: BF16 is copied,
FP16 / FP32 are cast to BF16 (round-to-nearest-even, what any BF16 serving
path does). With ``quantize="mxfp4" | "mxfp8" | "nvfp4" | "fp8_block"`` the experts are
quantized from their stored precision (FP32 is not rounded to BF16 first)
with the reference quantizers of ``megamoe_runtime.format.codecs``:

* mxfp4: ``quantize_mxfp4`` (RCEIL UE8M0 scale, E2M1 ties to even);
* mxfp8: ``quantize_mxfp8`` (DeepGEMM's UE8M0 cast, bit-exact);
* fp8_block: ``quantize_fp8_block`` (one fp32 ``amax / 448`` per 128x128
  block, E4M3 RNE, as DeepSeek-V3 and transformers' FineGrainedFP8 do);
* nvfp4: ``quantize_nvfp4_weight`` (ModelOpt's convention, global =
  amax/2688), with **gate and up quantized together** so they share one
  ``weight_scale_2`` as ModelOpt >= 0.47 exports do (the w1/w3 agreement
  rule of docs/SCALES.md#w1-w3-agreement then holds by construction). There is no
  calibration data, so ``input_scale`` is None for every projection: the
  runtime must use per-token dispatch scales, and the static L2 activation
  scale ``a2`` is not available from such a checkpoint.

Per-expert names (``gate_proj/up_proj/down_proj``, ``w1/w3/w2``) and
transformers >= 5 fused 3-D experts (``experts.gate_up_proj [E, 2I, H]``,
gate half first, ``experts.down_proj [E, H, I]``) are both read; a fused
expert is read with one slice per expert, never the whole 3-D tensor.
Shared experts stay BF16 (``SharedInfo.encoding == "bf16"``); the writer
converts them to the row's fusable shared precision.
"""

from __future__ import annotations

import torch

from megamoe_runtime.errors import CheckpointError, FormatError
from megamoe_runtime.format.canonical import ExpertTensors
from megamoe_runtime.format.formats import QUANTIZE_ROWS, get_row

from . import naming
from .base import ExpertScalars, register_reader
from .common import BF16_SCHEME, SchemeReader, all_finite, non_finite_message, quant_config_of



def _no_quant(source) -> bool:
    from .modelopt import effective_algo, modelopt_quant

    if modelopt_quant(source) is not None:
        # ModelOpt export that quantized nothing but the KV cache: weights are plain
        return effective_algo(source) in ("", "NONE")
    qc = quant_config_of(source)
    if not qc:
        return True
    # gpt-oss-like configs that only list modules_to_not_convert are still quantized
    return not (qc.get("quant_method") or qc.get("quant_algo") or qc.get("producer") or qc.get("quantization"))


@register_reader
class UnquantizedReader(SchemeReader):
    format_name = "unquantized"
    row = "bf16"
    description = ("BF16/FP16/FP32 experts -> bf16 row, or quantize= mxfp4|mxfp8|nvfp4|fp8_block with the reference "
                   "quantizers")
    scheme = BF16_SCHEME
    aliases = ("bf16", "fp16", "fp32")
    #: synthetic variants: stored dtype (``bf16-fused``: transformers >= 5 fused 3-D experts)
    synthetic_formats = ("bf16", "fp16", "fp32", "bf16-fused")
    _SYNTHETIC_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                         "bf16-fused": torch.bfloat16}

    @classmethod
    def encode_expert(cls, variant, gate, up, down, *, input_scales=None, shared_global=True):
        """The float weights in the variant's dtype (round to nearest even), under ``weight``."""
        dt = cls._SYNTHETIC_DTYPES[variant]
        return {r: {"weight": t.to(dt)} for r, t in zip(naming.ROLES, (gate, up, down))}

    @classmethod
    def activation_recipe(cls, source):
        from .recipe import ActivationRecipe

        # quantize= (choosing a quantized row for an unquantized model) is itself the opt-in
        return ActivationRecipe("bf16", False, "unquantized model: BF16 activations")
    shared_schemes = (BF16_SCHEME,)
    reads_fused = True

    def __init__(self, source, quantize: str | None = None) -> None:
        super().__init__(source)
        if quantize is not None and quantize not in QUANTIZE_ROWS and quantize != "bf16":
            raise FormatError(f"quantize={quantize!r}; valid: {', '.join(QUANTIZE_ROWS)} (or None for the bf16 row)")
        self.quantize = None if quantize in (None, "bf16") else quantize
        self.row = self.quantize or "bf16"

    @classmethod
    def detect(cls, source) -> bool:
        return _no_quant(source)

    # -- reading -------------------------------------------------------------
    def _raw(self, layer_index: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        info, ln, res = self._entry(layer_index)
        if "_fused" in res:
            gname, dname = res["_fused"]
            gu = self.source.get_slice(gname)[expert : expert + 1][0]
            dn = self.source.get_slice(dname)[expert : expert + 1][0]
            I = info.intermediate
            return gu[:I], gu[I:], dn
        return tuple(self.source.get_tensor(res[(expert, r)].names["weight"]) for r in naming.ROLES)  # type: ignore[return-value]

    def read_expert(self, layer_index: int, expert: int, *, weights: bool = True) -> ExpertTensors:
        # no weight_byte_ranges (the weights are converted or quantized), so weights=False never comes
        info = self.layer(layer_index)
        if not 0 <= expert < info.num_experts:
            return super().read_expert(layer_index, expert)  # raises the range error
        gate, up, down = self._raw(layer_index, expert)
        where = f"{self.source.id}: layer {layer_index} expert {expert}"
        if self.quantize:
            self._check_finite(layer_index, expert, where, (gate, up, down))
        et = self._encode(gate, up, down)
        if not self.quantize:  # the bf16 row: what is written is the BF16 (cast) weight, checked as such
            self._check_finite(layer_index, expert, where, (gate, up, down),
                               [p.weight for _, p in et.projections()])
        et.validate(self.row, info.hidden, info.intermediate, where)
        return et

    def _fix_hint(self) -> str:
        return (f"--quantize {self.quantize} needs finite weights: fix the source" if self.quantize else
                "the bf16 row would serve it as is (every token routed to this expert would come out NaN): "
                "fix the source")

    def _check_finite(self, layer_index: int, expert: int, where: str, weights, written=None) -> None:
        """No NaN or inf in an expert's weights.

        With --quantize (``written`` None) the source weights are checked: a NaN or inf must not reach a
        quantizer, where it would come out as a scale or element that hides it (an inf block's scale is inf and
        every element NaN or 0), or as a NaN code blamed on the quantized bytes. For the bf16 row, ``written``
        (the BF16 weights the output gets, a cast of ``weights`` or the same tensors) is checked and a bad
        value reported from the source: a NaN or inf there is copied into the output and served. A finite
        FP32 weight beyond BF16's range (it rounds to inf) is refused the same way.

        One sum per tensor (`all_finite`): memory speed, so the check costs little beside the read."""
        for k, (role, w) in enumerate(zip(naming.ROLES, weights)):
            out = w if written is None else written[k]
            if all_finite(out):
                continue
            _, _, res = self._entry(layer_index)
            if "_fused" in res:
                gname, dname = res["_fused"]
                name = f"{dname if role == 'down' else gname}[{expert}]"
            else:
                name = res[(expert, role)].names["weight"]
            raise CheckpointError(non_finite_message(f"{where} {role}: {name}", w, self._fix_hint(), out))

    def _encode(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> ExpertTensors:
        # --quantize nvfp4: gate and up share one global scale (ExpertTensors.quantize)
        return ExpertTensors.quantize(self.row, gate, up, down)

    def read_expert_scalars(self, layer_index: int, expert: int) -> ExpertScalars:
        if not get_row(self.row).has_alphas:
            return ExpertScalars()
        et = self.read_expert(layer_index, expert)
        return ExpertScalars(
            gate_global=et.gate.global_scale, up_global=et.up.global_scale, down_global=et.down.global_scale
        )

    def __repr__(self) -> str:
        q = f" quantize={self.quantize}" if self.quantize else ""
        return f"<UnquantizedReader row={self.row}{q} source={self.source.id}>"
