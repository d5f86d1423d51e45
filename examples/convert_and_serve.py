"""Convert a checkpoint, build every MoE layer from the converted folder, run the
forward, and compare it with an independent fp32 computation from the SOURCE.

    python examples/convert_and_serve.py                       # tiny synthetic ModelOpt NVFP4 model
    python examples/convert_and_serve.py --format modelopt-mxfp4 --shared 1
    python examples/convert_and_serve.py --src tests/fixtures/real/quark-nvfp4-qwen3moe

The comparison is the package's (``megamoe_convert.cli.against``), the one
``megamoe-convert verify OUT --against SRC`` runs on a folder you converted:
the independent computation reads the source checkpoint through the
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
from pathlib import Path

from megamoe_convert.cli.against import compare_folder_with_source, layer_lines
# the pieces of the independent computation, for a caller that wants to run them itself
from megamoe_convert.testing.selfcheck import THRESHOLDS, routing, source_forward  # noqa: F401


def run(src: Path, out: Path, *, tokens: int = 16, seed: int = 0, verbose: bool = True,
        **convert_kwargs) -> list[dict]:
    """Convert ``src`` into ``out`` (``convert_kwargs``: e.g. accept_activation_change,
    l2_activation_scale), serve every layer, compare with the source: one record per layer
    (index, prefix, row, calc_diff, threshold, shared_fused, ok)."""
    from megamoe_convert.pipeline.convert import convert

    summary = convert(src, out, **convert_kwargs)
    if verbose:
        print(f"converted {src} -> {out} ({getattr(summary, 'row', '?')})")
    layers = compare_folder_with_source(out, src, tokens=tokens, seed=seed)["layers"]
    if verbose:
        print("\n".join(layer_lines(layers)))
    return layers


def _tokens(text: str) -> int:
    n = int(text)
    if not 1 <= n <= 4096:  # the range `megamoe-convert verify --tokens` takes
        raise argparse.ArgumentTypeError(f"{n} is not in 1..4096")
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, help="source checkpoint folder (default: build a tiny synthetic one)")
    ap.add_argument("--format", default="modelopt-nvfp4", help="synthetic source format (see megamoe_convert.testing.synth)")
    ap.add_argument("--shared", type=int, default=1, help="synthetic shared experts (0 = none)")
    ap.add_argument("--out", type=Path, help="output folder (default: a temporary folder)")
    ap.add_argument("--tokens", type=_tokens, default=16, help="tokens per layer in the comparison (1..4096)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="megamoe-example-") as tmp:
        src = args.src
        if src is None:
            from megamoe_convert.testing.synth import build_synthetic_checkpoint

            src = build_synthetic_checkpoint(Path(tmp) / "src", args.format, shared=args.shared,
                                             shared_format="bf16" if args.format.endswith("nvfp4") else None)
        out = args.out or Path(tmp) / "out"
        results = run(src, out, tokens=args.tokens)
    bad = [r for r in results if not r["ok"]]
    print(f"{len(results) - len(bad)}/{len(results)} layers match the source")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
