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
``bn:warps:stages[:decode[:bk[:maxnreg[:split]]]]`` lists separated by commas (decode "-" = the row's
default, bk "-" = 128; the frag kernels take 128 whatever is asked; maxnreg absent or "-" = the default
config's register cap, 0 = none; split = the L2's K slices, ``KernelConfig.l2_split``).
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
from kernel import (SHAPES, _bench, bench_peer, copy_bandwidth, expert_bytes, kernel_breakdown, random_layer,  # noqa: E402
                    parse_shapes, routing)

#: (one-dot L1, L1 pairs per tile, warps, stages, decode or None) by regime; ``sweep_point`` puts the
#: default config's own tiles first. 32-row L1 tiles and 64-row L2 tiles give a small grid more CTAs
#: (small I or H, few experts touched); 128-row / 8-warp tiles decode each weight for more pairs.
L1_VARIANTS = {
    "decode": ["1:64:4:3", "1:32:4:3", "1:32:4:4", "1:64:4:4", "1:128:8:3:-:-:0", "1:64:8:3:-:-:0"],
    "mid": ["1:64:4:3", "0:128:4:3", "1:32:4:3", "1:128:8:3", "1:64:4:4", "1:64:8:3"],
    "prefill": ["1:64:4:3", "1:64:8:4", "1:64:8:3", "1:128:8:3", "1:64:4:2", "1:32:4:3"],
}
L1_VARIANTS["prefill64"] = L1_VARIANTS["prefill"]
L1_VARIANTS["few"] = L1_VARIANTS["decode"]
#: (L2 output columns per tile, warps, stages, decode or None) by regime
L2_VARIANTS = {
    "decode": ["128:4:3", "64:4:3", "64:4:4", "32:4:3", "128:4:4", "256:8:3"],
    "mid": ["128:4:3", "64:4:3", "256:8:3", "128:8:3", "64:4:4", "128:4:2"],
    "prefill": ["128:4:3", "128:4:2", "256:8:3", "64:4:3", "128:8:3", "256:8:2"],
}
L2_VARIANTS["prefill64"] = L2_VARIANTS["prefill"]
L2_VARIANTS["few"] = L2_VARIANTS["decode"]


def default_variants(cfg) -> tuple[str, str]:
    """The L1 and L2 variant strings of a config's own tiles (its decodes; its L1 register cap)."""
    l1 = f"{int(bool(cfg.l1_gu))}:{cfg.l1_bn}:{cfg.l1_warps}:{cfg.l1_stages}:{cfg.decode}:-:{cfg.l1_maxnreg or 0}"
    l2 = f"{cfg.l2_bn}:{cfg.l2_warps}:{cfg.l2_stages}:{cfg.l2_decode or cfg.decode}"
    if cfg.l2_split > 1:
        l2 += f":-:-:{cfg.l2_split}"
    return l1, l2


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
    if len(p) > 5 and p[5] != "-":
        d["l2_maxnreg"] = int(p[5]) or None
    if len(p) > 6:
        d["l2_split"] = int(p[6])
    return d, (p[3] if len(p) > 3 and p[3] != "-" else None)


def sweep_point(spec, kt, sc, T, E, K, l1s, l2s, log, bms=None, w_tile: int = 0, compile_only: bool = False,
                iters: int = 10, rep: int = 200) -> dict:
    from megamoe_runtime.backends.triton import configs, moe

    pairs = T * K
    mean = pairs / E
    tw, ids = routing(T, E, K, seed=T)
    x = torch.randn(T, spec.hidden, device="cuda", dtype=torch.bfloat16)
    ff = moe.fold_flags(spec, kt)  # the per-expert fold flags a loaded layer passes
    w_kind = configs.ROW_W_KIND[spec.row]
    dflt = configs.default_config(pairs, E, "frag", w_kind=w_kind, H=spec.hidden, I=spec.intermediate)
    # a variant without a decode runs the default's for this regime and row; each kernel keeps its
    # own (KernelConfig.decode for the L1, l2_decode for the L2), so the best L1 and the best L2
    # combine as measured
    row_decode = dflt.decode
    d1, d2 = default_variants(dflt)
    l1s = list(dict.fromkeys([d1, *l1s]))
    l2s = list(dict.fromkeys([d2, *l2s]))
    l2_row_decode = dflt.l2_decode or dflt.decode
    rows = []
    bms = bms or block_ms(mean)
    if compile_only:
        for cfg in (dflt,):
            moe.moe_forward(spec, kt, x, tw, ids, scalars=sc, config=cfg, w_tile=w_tile, fold_flags=ff)
    def uniq(vs, parse, dec, cap_key):  # one entry per distinct tile (the same tile written two ways once)
        seen, keep = set(), []
        for v in vs:
            d, dv = parse(v)
            d.setdefault(cap_key, getattr(dflt, cap_key))
            k = (tuple(sorted(d.items())), dv or dec)
            if k not in seen:
                seen.add(k)
                keep.append(v)
        return keep

    l1s = uniq(l1s, _l1, row_decode, "l1_maxnreg")
    l2s = uniq(l2s, _l2, l2_row_decode, "l2_maxnreg")
    for bm in bms:
        n = max(len(l1s), len(l2s))
        for i in range(n):
            (a, da), (b, db) = _l1(l1s[i % len(l1s)]), _l2(l2s[i % len(l2s)])
            cfg = dataclasses.replace(dflt, block_m=bm, **a, **b, decode=da or row_decode,
                                      l2_decode=db or l2_row_decode)
            if compile_only:  # build the kernels of this candidate (the timing pass then finds them cached)
                try:
                    moe.moe_forward(spec, kt, x, tw, ids, scalars=sc, config=cfg, w_tile=w_tile, fold_flags=ff)
                    torch.cuda.synchronize()
                except Exception as e:
                    log(f"#   skip bm={bm} {l1s[i % len(l1s)]} / {l2s[i % len(l2s)]}: {type(e).__name__}")
                continue
            try:
                ks = kernel_breakdown(lambda: moe.moe_forward(spec, kt, x, tw, ids, scalars=sc, config=cfg,
                                                              w_tile=w_tile, fold_flags=ff), iters=iters)
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
    if compile_only:
        torch.cuda.synchronize()
        return {}
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
                                                             w_tile=w_tile, fold_flags=ff), rep=rep) * 1e3
        except Exception as e:
            log(f"# {label} failed: {type(e).__name__}: {str(e)[:200]}")
            res[f"{label}_us"] = float("nan")
    log(f"{spec.row:6s} T={T:5d} default {res['default_us']:9.1f} us   best {res['best_us']:9.1f} us "
        f"(x{res['default_us'] / res['best_us']:.3f}; bm={b1['bm']} L1 {b1['l1']} {b1['l1_us']:.1f} us, "
        f"L2 {b2['l2']} {b2['l2_us']:.1f} us)")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", "--shapes", dest="shapes", default="dsv3",
                    help="comma list of shape names (" + ", ".join(SHAPES) + ", set) and custom H,I,E,K")
    ap.add_argument("--rows", default="mxfp4,nvfp4,mxfp8")
    ap.add_argument("--tokens", default="8,64,512,4096",
                    help="token counts; the points run token count by token count over all shapes, in this order")
    ap.add_argument("--l1", default=None,
                    help="L1 variants gu:bn:warps:stages[:decode[:bk[:maxnreg]]], comma-separated")
    ap.add_argument("--l2", default=None,
                    help="L2 variants bn:warps:stages[:decode[:bk[:maxnreg]]], comma-separated")
    ap.add_argument("--block-m", default=None, help="row blocks to try, comma-separated (default: by regime)")
    ap.add_argument("--w-tile", type=int, default=0,
                    help="weights in the tiled arrangement of WT rows (megamoe_runtime.format.weight_tiles); 0: as converted")
    ap.add_argument("--iters", type=int, default=10, help="profiled forwards per candidate")
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep (ms) of the whole-layer timings")
    ap.add_argument("--jobs", type=int, default=0,
                    help="first build every candidate's kernels in this many processes at once (each takes a "
                         "share of the (shape, row) pairs; triton's disk cache hands them to the timing pass)")
    ap.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--job", default="0/1", help=argparse.SUPPRESS)
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting points after this many seconds")
    ap.add_argument("--peer-path", default=None, help="also time the peer (MXFP4 weights) per shape and token count")
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    t_start = time.time()
    if args.jobs and not args.compile_only:
        import subprocess

        argv = [a for a in sys.argv[1:]]
        procs = [subprocess.Popen([sys.executable, __file__, *argv, "--jobs", "0", "--compile-only",
                                   "--job", f"{j}/{args.jobs}", "--out", ""],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for j in range(args.jobs)]
        for p in procs:
            _, err = p.communicate()
            if p.returncode:
                print(f"# compile job rc={p.returncode}: {err[-800:]}", flush=True)
        print(f"# compile pass: {time.time() - t_start:.0f} s in {args.jobs} processes", flush=True)
    from megamoe_runtime.backends.triton import configs

    shapes = parse_shapes(args.shapes)
    rows_ = args.rows.split(",")
    jobs = [(s, sh, row) for s, sh in shapes for row in rows_]
    if args.compile_only:
        j, n = (int(v) for v in args.job.split("/"))
        jobs = jobs[j::n]
    lines = []

    def log(s: str) -> None:
        if not args.compile_only:
            print(s, flush=True)
        lines.append(s)

    bw = 0.0 if args.compile_only else copy_bandwidth()
    log(f"# {time.strftime('%Y-%m-%d')} {torch.cuda.get_device_name()} copy {bw:.0f} GB/s; shapes {args.shapes}")
    layers = {}
    for s, sh, row in jobs:
        H, I, E, K = sh["H"], sh["I"], sh["E"], sh["K"]
        layers[(s, row)] = random_layer(row, H, I, E, K, args.w_tile)
    out, peers = [], {}
    if args.peer_path and not args.compile_only:
        for s, sh in shapes:
            res = bench_peer(args.peer_path, sh["H"], sh["I"], sh["E"], sh["K"],
                             [int(t) for t in args.tokens.split(",")])
            peers[s] = {T: v[0] * 1e3 for T, v in res.items()}

    def dump():
        if args.out and not args.compile_only:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"sweep{args.tag}.json").write_text(json.dumps(dict(copy_GBps=bw, points=out, peer_us={
                s: {str(T): v for T, v in p.items()} for s, p in peers.items()}), indent=1))
            (Path(args.out) / f"sweep{args.tag}.log").write_text("\n".join(lines) + "\n")

    for T in (int(t) for t in args.tokens.split(",")):
        for s, sh, row in jobs:
            if args.budget_s and time.time() - t_start > args.budget_s:
                log(f"# budget: skipped {s} {row} T={T}")
                continue
            spec, lay, kt, sc = layers[(s, row)]
            H, I, E, K = sh["H"], sh["I"], sh["E"], sh["K"]
            reg = configs.frag_regime(T * K / E, T * K)
            l1s = args.l1.split(",") if args.l1 else L1_VARIANTS[reg]
            l2s = args.l2.split(",") if args.l2 else L2_VARIANTS[reg]
            log(f"# {s} {row} T={T} ({reg})")
            r = sweep_point(spec, kt, sc, T, E, K, l1s, l2s, log,
                            [int(b) for b in args.block_m.split(",")] if args.block_m else None, args.w_tile,
                            compile_only=args.compile_only, iters=args.iters, rep=args.rep)
            if r:
                touched = int(torch.unique(routing(T, E, K, seed=T)[1]).numel())
                r.update(row=row, shape=s, H=H, I=I, E=E, K=K, touched=touched,
                         frac_copy_best=touched * expert_bytes(row, H, I) / (r["best_us"] * 1e-6) / 1e9 / bw)
                p = peers.get(s, {}).get(T)
                if p:
                    r.update(peer_us=p, vs_peer_default=p / r["default_us"], vs_peer_best=p / r["best_us"])
                    log(f"#   peer {p:.1f} us: default x{p / r['default_us']:.2f}, best x{p / r['best_us']:.2f}")
                out.append(r)
                dump()
    dump()


if __name__ == "__main__":
    main()
