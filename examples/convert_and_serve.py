"""Convert a checkpoint, build every MoE layer from the converted folder, run the
forward, and compare it with an independent fp32 computation from the SOURCE.

    python examples/convert_and_serve.py                       # tiny synthetic ModelOpt NVFP4 model
    python examples/convert_and_serve.py --format modelopt-mxfp4 --shared 1
    python examples/convert_and_serve.py --src tests/fixtures/real/quark-nvfp4-qwen3moe

The independent computation reads the source checkpoint through the
converter's readers (checkpoint encoding, no kernel layout), dequantizes every
expert to fp32 and evaluates the MoE directly: for each token,
``sum_k w_k * down(act(gate x, up x))`` (x rsf) plus the shared expert. The
served layer instead runs the reference backend on the converted kernel-layout
bytes, with the kernels' dispatch quantization, bf16 roundings and
requantization of the intermediate, so the two agree to quantization noise:
``calc_diff`` (DeepGEMM's cosine-like metric) below a per-row threshold.
Exits non-zero if any layer misses its threshold.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

import megamoe_runtime as mr
from megamoe_runtime.testing import calc_diff

#: calc_diff thresholds vs the unquantized-activation fp32 computation. The
#: served forward quantizes activations (MXFP8 / NVFP4) and the intermediate;
#: a wrong layout (swapped experts, gate/up, scales) lands orders of magnitude above.
THRESHOLDS = {"bf16": 1e-4, "mxfp8": 2e-3, "mxfp4": 2e-3, "nvfp4": 2e-2}


@dataclass
class LayerResult:
    index: int
    prefix: str
    row: str
    diff: float
    threshold: float

    @property
    def ok(self) -> bool:
        return self.diff < self.threshold


def _act(spec: mr.ActivationSpec, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The activation straight from its definition (ARCHITECTURE.md), in fp32."""
    if spec.kind == "swiglu":
        if spec.clamp is not None:
            g = g.clamp(max=spec.clamp)
            u = u.clamp(-spec.clamp, spec.clamp)
        return g * torch.sigmoid(spec.alpha * g) * (u + spec.beta)
    b, bl = spec.situ_beta, spec.situ_linear_beta
    return torch.sigmoid(g) * b * torch.tanh(g / b) * bl * torch.tanh(u / bl)


def source_forward(reader, layer_index: int, spec: mr.LayerSpec, x: torch.Tensor, w: torch.Tensor,
                   ids: torch.Tensor) -> torch.Tensor:
    """fp32 MoE of one layer from the source checkpoint's dequantized experts."""
    info = next(i for i in reader.moe_layers() if i.index == layer_index)
    row = reader.row
    xf = x.float()
    y = torch.zeros_like(xf)
    for e in range(info.num_experts):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        g, u, d = reader.read_expert(layer_index, e).dequantize(row)
        h = _act(spec.activation, xf[tok] @ g.t(), xf[tok] @ u.t()) @ d.t()
        y.index_add_(0, tok, h * w[tok, slot, None])
    y = y * spec.routed_scaling_factor
    if spec.shared is not None:
        shared = reader.read_shared(layer_index) or []
        enc = info.shared.encoding
        for ex in shared:
            g, u, d = ex.dequantize(enc)
            y = y + _act(spec.activation, xf @ g.t(), xf @ u.t()) @ d.t()
    return y


def routing(T: int, E: int, K: int, H: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * 0.5).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g)
    w, ids = torch.softmax(logits, -1).topk(K, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    ids[0, -1] = -1  # a masked slot
    return x, w.float(), ids


def run(src: Path, out: Path, *, tokens: int = 16, seed: int = 0, verbose: bool = True) -> list[LayerResult]:
    """Convert ``src`` into ``out``, serve every layer, compare with the source."""
    from megamoe_convert.convert import convert
    from megamoe_convert.readers import detect_reader
    from megamoe_convert.source import open_source

    summary = convert(src, out)
    if verbose:
        print(f"converted {src} -> {out} ({getattr(summary, 'row', '?')})")
    ckpt = mr.open_checkpoint(out)
    source = open_source(str(src))
    reader = detect_reader(source)
    results = []
    try:
        for li in ckpt.layers:
            spec = li.spec
            x, w, ids = routing(tokens, spec.num_experts, spec.top_k, spec.hidden, seed + li.index)
            layer = ckpt.build_layer(li.index, device="cpu", backend="reference")
            y = layer(x, w, ids)
            ref = source_forward(reader, li.index, spec, x, w, ids)
            res = LayerResult(li.index, li.prefix, spec.row, calc_diff(y, ref), THRESHOLDS[spec.row])
            results.append(res)
            if verbose:
                print(f"layer {li.index} ({li.prefix}, {spec.row}, shared fused={layer.shared_fused}): "
                      f"calc_diff vs source fp32 = {res.diff:.2e} (threshold {res.threshold:.0e}) "
                      f"{'OK' if res.ok else 'FAIL'}")
    finally:
        source.close()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, help="source checkpoint folder (default: build a tiny synthetic one)")
    ap.add_argument("--format", default="modelopt-nvfp4", help="synthetic source format (see megamoe_convert.synth)")
    ap.add_argument("--shared", type=int, default=1, help="synthetic shared experts (0 = none)")
    ap.add_argument("--out", type=Path, help="output folder (default: a temporary folder)")
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="megamoe-example-") as tmp:
        src = args.src
        if src is None:
            from megamoe_convert.synth import build_synthetic_checkpoint

            src = build_synthetic_checkpoint(Path(tmp) / "src", args.format, shared=args.shared,
                                             shared_format="bf16" if args.format.endswith("nvfp4") else None)
        out = args.out or Path(tmp) / "out"
        results = run(src, out, tokens=args.tokens)
    bad = [r for r in results if not r.ok]
    print(f"{len(results) - len(bad)}/{len(results)} layers match the source")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
