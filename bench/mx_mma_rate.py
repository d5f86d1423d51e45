#!/usr/bin/env python
"""How fast an MX GEMM can run on Hopper's tensor cores, by where its block scales are applied.

    python bench/mx_mma_rate.py [--m 4096 --n 4096 --k 7168] [--out DIR]   # GPU; prints a table

Why: issue 28 asks for 1.3x the peer at prefill, and on the few-large-expert shapes that is
the bf16 MMA's own ceiling. The lever it names is FP8 wgmma on E4M3 operands with the UE8M0
block scales applied to the fp32 accumulators per 32-wide K group. Hopper has no block-scaled
MMA (SM100's tcgen05 has one), so every 32 of K the partial product must leave the tensor
core and be scaled and added on the FP32 pipe. This probe measures what that costs, with no
decode, no routing and no epilogue in the way: one dense GEMM ``C[M, N] = A[M, K] B[N, K]^T``
per variant, same tiles, L2 flushed, ``do_bench`` median:

* ``bf16``         bf16 operands, one chained accumulator (the exact path's MMA, no decode);
* ``fp8``          E4M3 operands, chained accumulator, no scales (the FP8 MMA's ceiling);
* ``fp8-mx``       E4M3 operands, a fresh k32 MMA per MX block, ``acc += p * (sa[m] * sb[n])``
                   (both operands' UE8M0 scales: the issue's formulation);
* ``fp8-mx-one``   as ``fp8-mx`` with one operand's scale already folded into its bytes
                   (``acc += p * sb[n]``): the cheapest promotion an MX layout allows;
* ``fp8-k128``     a fresh MMA per 128 of K, ``acc += p * s`` (DeepGEMM's SM90 FP8 GEMM
                   promotion interval; MX scales change every 32, so this is not MX: shown only
                   to place the others).

Each variant's output is checked against a float64-free fp32 torch product of the dequantized
operands (calc_diff < 1e-4: the FP8 MMA's in-instruction rounding is not the question here), so
the rates are those of kernels that compute the right thing.
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

VARIANTS = ("bf16", "fp8", "fp8-mx", "fp8-mx-one", "fp8-k128")


@triton.jit
def _gemm(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, M, N, K,
          MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """MODE 0: chained (bf16 or fp8 by the pointers' dtype); 1: fresh MMA per BK, both scales;
    2: fresh MMA per BK, the B scale only. Scales: fp32 [rows, K // BK]."""
    pid = tl.program_id(0)
    npm = tl.cdiv(M, BM)
    pm = pid % npm
    pn = pid // npm
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_p = a_ptr + rm[:, None].to(tl.int64) * K + rk[None, :]
    b_p = b_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
    acc = tl.zeros((BM, BN), tl.float32)
    nk = K // BK
    for kb in range(0, nk):
        a = tl.load(a_p)
        b = tl.load(b_p)
        if MODE == 0:
            acc = tl.dot(a, tl.trans(b), acc)
        else:
            p = tl.dot(a, tl.trans(b))
            sb = tl.load(sb_ptr + rn * nk + kb)
            if MODE == 1:
                sa = tl.load(sa_ptr + rm * nk + kb)
                acc += p * (sa[:, None] * sb[None, :])
            else:
                acc += p * sb[None, :]
        a_p += BK
        b_p += BK
    tl.store(c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc)


def _ref(a, b, sa, sb, bk):
    """fp32 product of the dequantized operands (the scales per BK block of K)."""
    af = a.float() * (sa.repeat_interleave(bk, dim=1) if sa is not None else 1.0)
    bf = b.float() * (sb.repeat_interleave(bk, dim=1) if sb is not None else 1.0)
    return af @ bf.t()


def run(M: int, N: int, K: int, tiles: list[tuple[int, int, int, int]], rep: int) -> list[dict]:
    from megamoe_runtime.testing import calc_diff

    g = torch.Generator(device="cuda").manual_seed(0)
    a16 = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    b16 = torch.randn(N, K, device="cuda", generator=g).to(torch.bfloat16)
    a8 = (a16.float() * 16).to(torch.float8_e4m3fn)
    b8 = (b16.float() * 16).to(torch.float8_e4m3fn)
    out = []
    flops = 2.0 * M * N * K
    cache = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    for name in VARIANTS:
        bk = 32 if name.startswith("fp8-mx") else (128 if name.startswith("fp8") else 64)
        nk = K // bk
        # powers of two as UE8M0 decodes to (2^-3 .. 2^3); for "one", A's scale is taken as folded (1.0)
        sa = torch.exp2(torch.randint(-3, 4, (M, nk), device="cuda", generator=g).float())
        sb = torch.exp2(torch.randint(-3, 4, (N, nk), device="cuda", generator=g).float())
        mode = {"bf16": 0, "fp8": 0, "fp8-mx": 1, "fp8-mx-one": 2, "fp8-k128": 2}[name]
        a, b = (a16, b16) if name == "bf16" else (a8, b8)
        ref = _ref(a, b, sa if mode == 1 else None, sb if mode else None, bk)
        for bm, bn, warps, stages in tiles:
            c = torch.empty(M, N, device="cuda", dtype=torch.float32)
            grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)

            def call():
                _gemm[grid](a, b, sa, sb, c, M, N, K, MODE=mode, BM=bm, BN=bn, BK=bk,
                            num_warps=warps, num_stages=stages)
            try:
                call()
                torch.cuda.synchronize()
            except Exception as e:  # a tile that does not fit (shared memory, registers)
                out.append(dict(variant=name, tile=f"{bm}x{bn}x{bk} w{warps} s{stages}",
                                error=f"{type(e).__name__}: {str(e)[:120]}"))
                print(f"{name:11s} {bm}x{bn}x{bk} w{warps} s{stages}: {type(e).__name__}", flush=True)
                continue
            d = calc_diff(c, ref)
            ms = triton.testing.do_bench(lambda: (cache.zero_(), call()), rep=rep) - \
                triton.testing.do_bench(lambda: cache.zero_(), rep=rep)
            r = dict(variant=name, tile=f"{bm}x{bn}x{bk} w{warps} s{stages}", us=ms * 1e3,
                     tflops=flops / (ms * 1e-3) / 1e12, calc_diff=d, ok=d < 1e-4)
            out.append(r)
            print(f"{name:11s} {r['tile']:22s} {r['us']:9.1f} us {r['tflops']:7.1f} TFLOP/s  calc_diff {d:.1e}"
                  f"{'' if r['ok'] else '  WRONG'}", flush=True)
    t = torch.matmul
    ms = triton.testing.do_bench(lambda: t(a16, b16.t()), rep=rep)
    out.append(dict(variant="torch bf16 matmul", us=ms * 1e3, tflops=flops / (ms * 1e-3) / 1e12))
    print(f"torch bf16 matmul {ms * 1e3:9.1f} us {flops / (ms * 1e-3) / 1e12:7.1f} TFLOP/s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=4096, help="rows of A (the weights' output rows)")
    ap.add_argument("--n", type=int, default=4096, help="rows of B (tokens)")
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--tiles", default="128:128:4:3,128:128:8:3,128:256:8:3,128:128:8:4,64:256:4:3",
                    help="BM:BN:warps:stages, comma-separated")
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tiles = [tuple(int(v) for v in t.split(":")) for t in args.tiles.split(",")]
    res = run(args.m, args.n, args.k, tiles, args.rep)
    best = {}
    for r in res:
        if r.get("ok") and r["tflops"] > best.get(r["variant"], {}).get("tflops", 0):
            best[r["variant"]] = r
    print("\n| variant | best tile | us | TFLOP/s | vs bf16 |")
    print("|---|---|---|---|---|")
    base = best.get("bf16", {}).get("tflops")
    for v in VARIANTS:
        if v in best:
            b = best[v]
            print(f"| {v} | {b['tile']} | {b['us']:.1f} | {b['tflops']:.1f} | "
                  f"{b['tflops'] / base:.2f}x |" if base else "")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "mx_mma_rate.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
