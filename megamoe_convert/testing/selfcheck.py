"""Does the converted folder compute what the SOURCE checkpoint computes?

An independent check of a conversion: every MoE layer is built from the
converted folder (``megamoe_runtime.open_checkpoint(out).build_layer(...,
backend="reference")``, i.e. the kernel-layout bytes with the kernels'
dispatch quantization, bf16 roundings and requantized intermediate) and its
forward is compared with an fp32 MoE evaluated straight from the source:
experts read through the converter's readers (checkpoint encoding, no kernel
layout), dequantized, and ``sum_k w_k * down(act(gate x, up x))`` (x rsf)
plus the shared experts. The two share no packing code, so a wrong layout
(swapped experts, gate/up halves, scales) lands orders of magnitude above the
per-row ``calc_diff`` threshold, while quantization noise stays below it.

Used by ``megamoe-convert demo`` and ``examples/convert_and_serve.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megamoe_runtime.format.formats import ROWS, ActivationSpec, LayerSpec
from megamoe_runtime.testing import calc_diff

#: calc_diff thresholds vs the unquantized-activation fp32 computation. The
#: served forward quantizes activations (MXFP8 / NVFP4) and the intermediate;
#: a wrong layout (swapped experts, gate/up, scales) lands orders of magnitude above
#: (`Row.selfcheck_tolerance`).
THRESHOLDS = {name: r.selfcheck_tolerance for name, r in ROWS.items()}


@dataclass
class LayerResult:
    index: int
    prefix: str
    row: str
    diff: float
    threshold: float
    shared_fused: bool = False

    @property
    def ok(self) -> bool:
        return self.diff < self.threshold

    def to_dict(self) -> dict:
        return {"index": self.index, "prefix": self.prefix, "row": self.row, "calc_diff": self.diff,
                "threshold": self.threshold, "shared_fused": self.shared_fused, "ok": self.ok}


def _activation(spec: ActivationSpec, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The activation straight from its definition (ARCHITECTURE.md), in fp32."""
    if spec.kind == "swiglu":
        if spec.clamp is not None:
            g = g.clamp(max=spec.clamp)
            u = u.clamp(-spec.clamp, spec.clamp)
        return g * torch.sigmoid(spec.alpha * g) * (u + spec.beta)
    b, bl = spec.situ_beta, spec.situ_linear_beta
    return torch.sigmoid(g) * b * torch.tanh(g / b) * bl * torch.tanh(u / bl)


def source_forward(reader, layer_index: int, spec: LayerSpec, x: torch.Tensor, w: torch.Tensor,
                   ids: torch.Tensor) -> torch.Tensor:
    """fp32 MoE of one layer from the source checkpoint's dequantized experts
    (`reader`: a megamoe_convert reader; slots with id -1 are skipped)."""
    info = next(i for i in reader.moe_layers() if i.index == layer_index)
    row = reader.row
    xf = x.float()
    y = torch.zeros_like(xf)
    for e in range(info.num_experts):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        g, u, d = reader.read_expert(layer_index, e).dequantize(row)
        h = _activation(spec.activation, xf[tok] @ g.t(), xf[tok] @ u.t()) @ d.t()
        y.index_add_(0, tok, h * w[tok, slot, None])
    y = y * spec.routed_scaling_factor
    if spec.shared is not None:  # fused shared experts (unfused ones the served layer does not run)
        enc = info.shared.encoding
        for ex in reader.read_shared(layer_index) or []:
            g, u, d = ex.dequantize(enc)
            y = y + _activation(spec.activation, xf @ g.t(), xf @ u.t()) @ d.t()
    return y


def routing(T: int, E: int, K: int, H: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic tokens (bf16), top-k weights (fp32, normalized) and ids,
    with one masked slot (id -1) to exercise the kernels' skip path."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * 0.5).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g)
    w, ids = torch.softmax(logits, -1).topk(K, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    ids[0, -1] = -1  # a masked slot
    return x, w.float(), ids


def compare_with_source(src: str | Path, out: str | Path, tokens: int = 16, seed: int = 0, *,
                        format: str | None = None, quantize: str | None = None,
                        revision: str | None = None) -> list[LayerResult]:
    """Serve every layer of converted folder `out` (reference backend, CPU,
    one rank holding every expert) and compare it with `source_forward` of
    checkpoint `src` on the same tokens; one result per layer, in order.
    `format` / `quantize` / `revision`: as given to the conversion."""
    import megamoe_runtime as mr
    from megamoe_runtime.errors import MegaMoEError

    from ..readers import detect_reader
    from ..readers.source import open_source

    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise MegaMoEError(f"tokens={tokens!r}: the comparison needs an int >= 1 tokens per layer")
    ckpt = mr.open_checkpoint(out)
    source = open_source(str(src), revision)
    results = []
    try:
        # the conversion already decided (and recorded) any activation change; this only reads the source
        reader = detect_reader(source, format=format, quantize=quantize, accept_activation_change=True)
        _check_same_layers(ckpt, reader, str(src), str(out))
        for li in ckpt.layers:
            spec = li.spec
            x, w, ids = routing(tokens, spec.num_experts, spec.top_k, spec.hidden, seed + li.index)
            layer = ckpt.build_layer(li.index, device="cpu", backend="reference")
            with torch.no_grad():
                y = layer(x, w, ids)
                ref = source_forward(reader, li.index, spec, x, w, ids)
            results.append(LayerResult(li.index, li.prefix, spec.row, calc_diff(y, ref),
                                       THRESHOLDS[spec.row], bool(layer.shared_fused)))
    finally:
        source.close()
    return results


def _check_same_layers(ckpt, reader, src: str, out: str) -> None:
    """MegaMoEError naming the first difference when ``src`` does not have ``out``'s MoE layers (index,
    experts, hidden, intermediate): a comparison with another model's checkpoint would fail meaninglessly."""
    from megamoe_runtime.errors import MegaMoEError

    have = {i.index: (i.num_experts, i.hidden, i.intermediate) for i in reader.moe_layers()}
    for li in ckpt.layers:
        want = (li.spec.num_experts, li.spec.hidden, li.spec.intermediate)
        got = have.get(li.index)
        if got != want:
            what = "has no such MoE layer" if got is None else \
                f"has experts/hidden/intermediate {got[0]}/{got[1]}/{got[2]}"
            raise MegaMoEError(f"{src} is not the source of {out}: MoE layer {li.index} is {want[0]} experts, hidden "
                               f"{want[1]}, intermediate {want[2]} in {out}, but {src} {what}")


__all__ = ["THRESHOLDS", "LayerResult", "source_forward", "routing", "compare_with_source"]
