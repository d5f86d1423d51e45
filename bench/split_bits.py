#!/usr/bin/env python
"""How far the split-K L2 (``KernelConfig.l2_split``) moves a layer's output from the one-pass L2, at
real shapes (GPU only).

    python bench/split_bits.py --shapes mixtral,dbrx --rows mxfp8 --tokens 8,64 --splits 2,4 --out $OUT/bits

Per (shape, row, tokens, split): the share of output elements bit-equal to the one-pass output, the
largest absolute difference and calc_diff against it. Why: on E4M3 weights a K slice's fp32 partial sum
can be inexact, so adding the slices' partials can differ from the running sum in a last bit
(docs/NUMERICS.md); on E2M1 weights the partials are exact and the outputs must be equal. Same layer,
weights (tiled as a loaded layer reads them) and routing as ``bench/kernel.py``; the default config of
each point, with only ``l2_split`` changed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel import parse_shapes, random_layer, routing  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="mixtral,dbrx", help="comma list of bench/kernel.py shape names")
    ap.add_argument("--rows", default="mxfp8")
    ap.add_argument("--tokens", default="8,64")
    ap.add_argument("--splits", default="2,4", help="K slices to compare with the one-pass L2")
    ap.add_argument("--w-tile", type=int, default=16, help="weight arrangement (0: as converted)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    from megamoe_runtime.backends.triton import configs, l2, moe
    from megamoe_runtime.testing import calc_diff

    res = []
    for s, sh in parse_shapes(args.shapes):
        H, I, E, K = sh["H"], sh["I"], sh["E"], sh["K"]
        for row in args.rows.split(","):
            spec, lay, kt, sc = random_layer(row, H, I, E, K, args.w_tile)
            ff = moe.fold_flags(spec, kt)
            for T in (int(t) for t in args.tokens.split(",")):
                tw, ids = routing(T, E, K, seed=T)
                x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
                base = configs.default_config(T * K, E, "frag", w_kind=configs.ROW_W_KIND[row], H=H, I=I)
                run = lambda c: moe.moe_forward(spec, kt, x, tw, ids, scalars=sc, config=c,  # noqa: E731
                                                w_tile=args.w_tile, fold_flags=ff)
                one = run(dataclasses.replace(base, l2_split=1))
                for split in (int(v) for v in args.splits.split(",")):
                    c = dataclasses.replace(base, l2_split=split)
                    taken = l2.l2_split(c, I)
                    out = run(c)
                    same = float((out.view(torch.int16) == one.view(torch.int16)).float().mean())
                    diff = float((out.float() - one.float()).abs().max())
                    r = dict(shape=s, row=row, T=T, split=split, split_taken=taken, bitwise_equal_share=same,
                             max_abs_diff=diff, calc_diff=float(calc_diff(out, one)))
                    res.append(r)
                    print(f"{s:8s} {row:6s} T={T:4d} split {split} (taken {taken}): {100 * same:.4f}% bit-equal, "
                          f"max |diff| {diff:.3g}, calc_diff {r['calc_diff']:.3g}", flush=True)
            del lay, kt
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "split_bits.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
