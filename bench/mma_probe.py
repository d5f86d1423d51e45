#!/usr/bin/env python
"""Where the FP8 path stops being exact: one k32 MMA on MX-block operands vs the exact sum.

    python bench/mma_probe.py [--programs 256]      # GPU; prints a table, --out DIR writes probe.json

For random MX blocks (32 E4M3 activation values x 32 weights; weights E2M1 as E4M3 bytes of
value*2^-6, or E4M3), computes ``sum(w * x)`` three ways: exactly (float64 on the GPU; the
products have at most 8 significant bits and their sum fits float64 exactly), through one
``tl.dot`` on float8e4nv operands (what ``mma8`` issues, wgmma e4m3 k32), and through one
``tl.dot`` on the same values as bf16 (what the default path issues). Reports the fraction of
blocks whose result differs from the correctly rounded float32 sum, and the largest relative difference.
Activations are drawn like the dispatch: a bf16 normal row quantized per 32 by ``codecs``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@triton.jit
def _probe(w_ptr, x_ptr, o8_ptr, o16_ptr, BM: tl.constexpr, BN: tl.constexpr):
    # one program: BN weight rows x BM activation rows, one 32-wide K block
    r = tl.arange(0, BN)
    m = tl.arange(0, BM)
    k = tl.arange(0, 32)
    base = tl.program_id(0)
    w = tl.load(w_ptr + base * BN * 32 + r[:, None] * 32 + k[None, :]).to(tl.float8e4nv, bitcast=True)
    x = tl.load(x_ptr + base * BM * 32 + m[:, None] * 32 + k[None, :]).to(tl.float8e4nv, bitcast=True)
    p8 = tl.dot(w, tl.trans(x))
    p16 = tl.dot(w.to(tl.bfloat16), tl.trans(x.to(tl.bfloat16)))
    o = base * BN * BM + r[:, None] * BM + m[None, :]
    tl.store(o8_ptr + o, p8)
    tl.store(o16_ptr + o, p16)


def main() -> None:
    from megamoe_runtime.format import codecs

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    BN, BM = 64, 16
    g = torch.Generator(device="cpu").manual_seed(0)
    res = {}
    for kind in ("e2m1", "e4m3"):
        P = args.programs
        xs = torch.randn(P * BM, 32, generator=g).to(torch.bfloat16)
        xq, _ = codecs.quantize_mxfp8(xs)  # per-32 E4M3 codes, as the dispatch
        if kind == "e2m1":
            codes = torch.randint(0, 16, (P * BN, 32), generator=g, dtype=torch.uint8)
            wv = codecs.e2m1_decode(codes) / 64  # exactly E4M3 values
        else:
            wv = torch.randn(P * BN, 32, generator=g) * 8
        wq = codecs.e4m3_encode(wv).view(torch.uint8)
        wf = wq.view(torch.float8_e4m3fn).double().cuda()
        xf = xq.view(torch.float8_e4m3fn).double().cuda()
        o8 = torch.empty(P * BN * BM, dtype=torch.float32, device="cuda")
        o16 = torch.empty_like(o8)
        _probe[(P,)](wq.cuda(), xq.view(torch.uint8).cuda(), o8, o16, BM=BM, BN=BN, num_warps=4)
        exact = torch.einsum("pnk,pmk->pnm", wf.view(P, BN, 32), xf.view(P, BM, 32)).reshape(-1)
        mag = torch.einsum("pnk,pmk->pnm", wf.view(P, BN, 32).abs(), xf.view(P, BM, 32).abs()).reshape(-1)
        ex32 = exact.float()  # the correctly rounded fp32 sum
        row = {"fp32 representable": float((ex32.double() == exact).double().mean())}
        for name, o in (("fp8 wgmma", o8), ("bf16 wgmma", o16)):
            diff = (o.double() - exact).abs()
            rel = diff / exact.abs().clamp_min(1e-30)
            rel_mag = diff / mag.clamp_min(1e-300)  # error relative to sum |w x| (the terms' scale)
            row[name] = dict(frac_inexact=float((o != ex32).double().mean()),
                             max_rel=float(rel[exact != 0].max()), blocks=int(exact.numel()),
                             max_err_over_abs_sum=float(rel_mag[mag > 0].max()),
                             median_err_over_abs_sum_inexact=float(rel_mag[o != ex32].median()) if bool((o != ex32).any())
                             else 0.0)
        res[kind] = row
    print("| weights | MMA | blocks | fraction != fp32(exact sum) | max rel. difference | max diff / sum of abs products "
          "| median of that over inexact blocks |")
    print("|---|---|---|---|---|---|---|")
    for kind, row in res.items():
        print(f"# {kind}: exact sum representable in fp32 for {100 * row['fp32 representable']:.2f}% of blocks")
        for name, r in row.items():
            if not isinstance(r, dict):
                continue
            print(f"| {kind} | {name} | {r['blocks']} | {r['frac_inexact']:.4f} | {r['max_rel']:.2e} | "
                  f"{r['max_err_over_abs_sum']:.2e} | {r['median_err_over_abs_sum_inexact']:.2e} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
