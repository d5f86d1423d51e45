#!/usr/bin/env python
"""Per-kernel tile sweep of the triton backend's L1 and L2 GEMMs (issue 11).

    python bench/sweep.py --shape dsv3 --rows mxfp4,nvfp4 --tokens 8,64,512,4096 --out $OUT/sweep

``bench/kernel.py --tune`` times whole forwards, so a config that speeds up the L1 and slows
the L2 hides both facts. Here each candidate forward runs under ``torch.profiler`` (eager, L2
flushed before every call: ``kernel.kernel_breakdown``) and the L1 and the L2 kernel are timed
apart. The L1 fields (``l1_*``) and the L2 fields (``l2_*``) of a ``KernelConfig`` are
independent once the row block (``block_m``, shared through the routing) is fixed, so the
candidates pair the i-th L1 variant with the i-th L2 variant, and the best of each is
combined. That combination and ``default_config`` are then timed the usual way (whole layer
in one CUDA graph, ``do_bench`` median), and both lines are printed.

Candidates: ``L1_VARIANTS`` / ``L2_VARIANTS`` by regime (mean pairs per expert), or
``--l1`` / ``--l2`` as ``gu:bn:warps:stages[:decode[:bk[:maxnreg]]]`` and
``bn:warps:stages[:decode[:bk[:maxnreg]]]`` lists separated by commas (decode "-" = the row's
default, bk "-" = 128; the frag kernels take 128 whatever is asked; maxnreg absent = the default
config's register cap, 0 = none).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel import SHAPES, _bench, copy_bandwidth, expert_bytes, kernel_breakdown, routing  # noqa: E402

#: (one-dot L1, L1 pairs per tile, warps, stages, decode or None) by regime
L1_VARIANTS = {
    "decode": ["1:64:4:3", "1:64:4:4", "1:128:8:3", "1:128:8:4", "0:64:4:3", "1:64:8:3", "1:32:4:4"],
    "mid": ["0:128:4:3", "1:64:4:3", "1:128:8:3", "1:128:8:4", "0:64:4:3", "1:64:8:3", "0:128:8:3"],
    "prefill": ["0:64:4:3", "1:64:8:3", "1:128:8:3", "0:128:8:3", "1:64:4:3", "1:128:8:2", "0:64:4:4"],
}
L1_VARIANTS["prefill64"] = L1_VARIANTS["prefill"]
L1_VARIANTS["few"] = L1_VARIANTS["decode"]
#: (L2 output columns per tile, warps, stages, decode or None) by regime
L2_VARIANTS = {
    "decode": ["64:4:3", "64:4:4", "128:4:3", "128:8:3", "256:8:3", "128:4:4", "32:4:4"],
    "mid": ["128:4:3", "64:4:3", "128:8:3", "256:8:3", "128:4:4", "256:4:3", "64:4:4"],
    "prefill": ["64:4:3", "128:8:3", "256:8:3", "128:4:3", "256:8:2", "128:8:4", "64:8:3"],
}
L2_VARIANTS["prefill64"] = L2_VARIANTS["prefill"]
L2_VARIANTS["few"] = L2_VARIANTS["decode"]


def block_ms(mean: float) -> list[int]:
    if mean <= 8:
        return [16]
    if mean <= 16:
        return [16, 32]
    if mean <= 32:
        return [32]
    return [64, 128] if mean <= 64 else [128]


def _l1(v: str) -> tuple[dict, str | None]:
    p = v.split(":")
    d = dict(l1_gu=p[0] == "1", l1_bn=int(p[1]), l1_warps=int(p[2]), l1_stages=int(p[3]))
    if len(p) > 5 and p[5] != "-":
        d["l1_bk"] = int(p[5])
    if len(p) > 6:
        d["l1_maxnreg"] = int(p[6]) or None
    return d, (p[4] if len(p) > 4 and p[4] != "-" else None)


def _l2(v: str) -> tuple[dict, str | None]:
    p = v.split(":")
    d = dict(l2_bn=int(p[0]), l2_warps=int(p[1]), l2_stages=int(p[2]))
    if len(p) > 4 and p[4] != "-":
        d["l2_bk"] = int(p[4])
    if len(p) > 5:
        d["l2_maxnreg"] = int(p[5]) or None
    return d, (p[3] if len(p) > 3 and p[3] != "-" else None)


def sweep_point(spec, kt, sc, T, E, K, l1s, l2s, log, bms=None, w_tile: int = 0) -> dict:
    from megamoe_runtime.backends.triton import moe

    pairs = T * K
    mean = pairs / E
    tw, ids = routing(T, E, K, seed=T)
    x = torch.randn(T, spec.hidden, device="cuda", dtype=torch.bfloat16)
    ff = moe.fold_flags(spec, kt)  # the per-expert fold flags a loaded layer passes
    w_kind = moe._W_KIND[spec.row]
    dflt = moe.default_config(pairs, E, "frag", w_kind=w_kind)
    # a variant without a decode runs the default's for this regime and row; each kernel keeps its
    # own (KernelConfig.decode for the L1, l2_decode for the L2), so the best L1 and the best L2
    # combine as measured
    row_decode = dflt.decode
    rows = []
    bms = bms or block_ms(mean)
    for bm in bms:
        n = max(len(l1s), len(l2s))
        for i in range(n):
            (a, da), (b, db) = _l1(l1s[i % len(l1s)]), _l2(l2s[i % len(l2s)])
            cfg = dataclasses.replace(dflt, block_m=bm, **a, **b, decode=da or row_decode,
                                      l2_decode=db or row_decode)
            try:
                ks = kernel_breakdown(lambda: moe.moe_forward(spec, kt, x, tw, ids, scalars=sc, config=cfg,
                                                              w_tile=w_tile, fold_flags=ff), iters=10)
            except Exception as e:  # a tile that does not compile / fit: skip it
                log(f"#   skip bm={bm} {l1s[i % len(l1s)]} / {l2s[i % len(l2s)]}: {type(e).__name__}: {str(e)[:160]}")
                continue
            t1 = sum(us for name, _, us in ks if name.startswith("_l1"))
            t2 = sum(us for name, _, us in ks if name.startswith("_l2"))
            rest = sum(us for name, _, us in ks) - t1 - t2
            rows.append(dict(bm=bm, l1=l1s[i % len(l1s)], l2=l2s[i % len(l2s)], l1_us=t1, l2_us=t2, rest_us=rest,
                             cfg=cfg))
            log(f"#   bm={bm:3d} L1 {l1s[i % len(l1s)]:12s} {t1:9.1f} us   L2 {l2s[i % len(l2s)]:10s} {t2:9.1f} us"
                f"   rest {rest:6.1f} us")
    best = None
    for bm in bms:
        r = [x for x in rows if x["bm"] == bm]
        if not r:
            continue
        b1 = min(r, key=lambda x: x["l1_us"])
        b2 = min(r, key=lambda x: x["l2_us"])
        tot = b1["l1_us"] + b2["l2_us"] + b1["rest_us"]
        if best is None or tot < best[0]:
            best = (tot, b1, b2)
    if best is None:
        return {}
    _, b1, b2 = best
    l1f = {k: getattr(b1["cfg"], k) for k in ("l1_gu", "l1_bn", "l1_bk", "l1_warps", "l1_stages", "l1_maxnreg",
                                               "decode")}
    l2_dec = b2["cfg"].l2_decode  # the decode the best L2 ran with
    combo = dataclasses.replace(b2["cfg"], **l1f)
    combo = dataclasses.replace(combo, l2_decode=None if l2_dec == combo.decode else l2_dec)
    res = dict(T=T, mean=mean, default=str(dflt), best=str(combo), best_l1=b1["l1"], best_l1_us=b1["l1_us"],
               best_l2=b2["l2"], best_l2_us=b2["l2_us"], block_m=b1["bm"],
               rows=[{k: v for k, v in r.items() if k != "cfg"} for r in rows])
    for label, cfg in (("default", dflt), ("best", combo)):
        try:
            res[f"{label}_us"] = _bench(lambda: moe.moe_forward(spec, kt, x, tw, ids, scalars=sc, config=cfg,
                                                             w_tile=w_tile, fold_flags=ff)) * 1e3
        except Exception as e:
            log(f"# {label} failed: {type(e).__name__}: {str(e)[:200]}")
            res[f"{label}_us"] = float("nan")
    log(f"{spec.row:6s} T={T:5d} default {res['default_us']:9.1f} us   best {res['best_us']:9.1f} us "
        f"(x{res['default_us'] / res['best_us']:.3f}; bm={b1['bm']} L1 {b1['l1']} {b1['l1_us']:.1f} us, "
        f"L2 {b2['l2']} {b2['l2_us']:.1f} us)")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="dsv3", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="mxfp4,nvfp4,mxfp8")
    ap.add_argument("--tokens", default="8,64,512,4096")
    ap.add_argument("--l1", default=None,
                    help="L1 variants gu:bn:warps:stages[:decode[:bk[:maxnreg]]], comma-separated")
    ap.add_argument("--l2", default=None,
                    help="L2 variants bn:warps:stages[:decode[:bk[:maxnreg]]], comma-separated")
    ap.add_argument("--block-m", default=None, help="row blocks to try, comma-separated (default: by regime)")
    ap.add_argument("--w-tile", type=int, default=0,
                    help="weights in the tiled arrangement of WT rows (megamoe_runtime.weight_tiles); 0: as converted")
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    from megamoe_runtime import weight_tiles
    from megamoe_runtime.backends.triton import moe, synth
    from megamoe_runtime.backends.triton.backend import _NvScalars, _Roles
    from megamoe_runtime.formats import ActivationSpec, LayerSpec, get_row

    sh = SHAPES[args.shape]
    H, I, E, K = sh["H"], sh["I"], sh["E"], sh["K"]
    lines = []

    def log(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    bw = copy_bandwidth()
    log(f"# {time.strftime('%Y-%m-%d')} {torch.cuda.get_device_name()} copy {bw:.0f} GB/s; shape {args.shape}")
    out = []
    for row in args.rows.split(","):
        spec = LayerSpec(row, H, I, E, K, ActivationSpec("swiglu", clamp=10.0), routed_scaling_factor=2.5)
        lay = synth.random_kernel_bytes(spec, "cuda", seed=1)
        kt = _Roles(lay, "")
        if args.w_tile:
            kt.l1_weight = weight_tiles.tiled_copy(kt.l1_weight, args.w_tile)
            kt.l2_weight = weight_tiles.tiled_copy(kt.l2_weight, args.w_tile)
        sc = _NvScalars(lay) if get_row(row).has_alphas else None
        for T in (int(t) for t in args.tokens.split(",")):
            reg = moe.frag_regime(T * K / E, T * K)
            l1s = args.l1.split(",") if args.l1 else L1_VARIANTS[reg]
            l2s = args.l2.split(",") if args.l2 else L2_VARIANTS[reg]
            log(f"# {row} T={T} ({reg})")
            r = sweep_point(spec, kt, sc, T, E, K, l1s, l2s, log,
                            [int(b) for b in args.block_m.split(",")] if args.block_m else None, args.w_tile)
            if r:
                touched = int(torch.unique(routing(T, E, K, seed=T)[1]).numel())
                r.update(row=row, shape=args.shape, frac_copy_best=touched * expert_bytes(row, H, I) / (
                    r["best_us"] * 1e-6) / 1e9 / bw)
                out.append(r)
        del lay, kt
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"sweep{args.tag}.json").write_text(json.dumps(dict(copy_GBps=bw, points=out), indent=1))
        (Path(args.out) / f"sweep{args.tag}.log").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
