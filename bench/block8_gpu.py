#!/usr/bin/env python
"""The triton block-FP8 row (``backends/triton/block8.py``) on one Hopper GPU: where its error comes from,
and its tiles at prefill.

    python bench/block8_gpu.py probe --out DIR      # the FP8 MMA's sum of one 128-block, raw data for the CPU fit
    python bench/block8_gpu.py diag --out DIR       # DeepSeek-V3-width layer: FP8 vs exact-sum MMA, tiles, controls
    python bench/block8_gpu.py sweep --out DIR      # L1 / L2 tiles at 4096 tokens, DeepSeek-V3's shape
    python bench/block8_gpu.py sweep --tokens 2048,4096 --jobs 12 --out DIR
    python bench/block8_gpu.py sweep --grid split --tokens 2048,4096 --bm 32,64,128 --baseline MODULE --out DIR

Why each part:

* ``probe``: one ``tl.dot`` of a 64x128 E4M3 weight tile and 16 dispatch-quantized token rows (what
  ``block8._dot8`` issues per block of K: four chained k32 FP8 wgmmas), with the inputs and fp32 outputs
  saved (``probe.pt``) so the rounding rule of the tensor core's sum can be fitted on the CPU
  (``bench/fp8_block_mma_model.py --fit DIR/probe.pt``).
* ``diag``: the GPU test's DeepSeek-V3-width layer (H 7168, I 2048, 8 experts, top-8, 64 tokens) through
  the forward with several tile configurations, bitwise against each other, and with ``exact=True``
  (the same kernels with the MMA on bf16 operands, which sums the exact E4M3 products to fp32): if the
  exact variant lands on the reference to the interpreter's 1e-7 with the same tiles, everything in the
  kernel but the FP8 MMA's own sum is the reference's, at those tiles. Also the GPU reference against
  the CPU reference, and negative controls measured on the tokens and columns they touch.
* ``sweep``: every L1 and L2 tile configuration of a grid, timed alone (CUDA events, median) on DeepSeek-V3's
  routed experts (256 x H 7168 x I 2048, top-8, uniform routing, random E4M3 bytes) at prefill token counts;
  each configuration's output bytes compared with the current default's of the same row block (the
  reduction order per element is the same, so they must be equal). Kernels are compiled first in
  ``--jobs`` worker processes on a 4-expert copy of the shape (the triton cache is on disk, so the timed
  process finds them compiled). ``--baseline MODULE``: an importable copy of an earlier ``block8`` (same
  package, e.g. saved as ``megamoe_runtime/backends/triton/_block8_base.py`` on the machine), timed with its
  prefill tiles in the same process, its outputs compared with the new default's (rows matched by pair).
Results go to ``DIR/<part>.json``; a short table is printed last.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H, I, E, K = 7168, 2048, 256, 8
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run under TRITON_INTERPRET=1
GRID = "full"


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def log(msg: str) -> None:
    print(msg, flush=True)


def dump(out: str, name: str, obj) -> None:
    with open(os.path.join(out, name), "w") as f:
        json.dump(obj, f, indent=1, default=str)


# --------------------------------------------------------------------------- probe


def probe(out: str, programs: int) -> None:
    import triton
    import triton.language as tl

    from megamoe_runtime.format import codecs

    @triton.jit
    def _k128(w_ptr, x_ptr, o_ptr, BN: tl.constexpr, BM: tl.constexpr):
        r = tl.arange(0, BN)
        m = tl.arange(0, BM)
        k = tl.arange(0, 128)
        b = tl.program_id(0)
        w = tl.load(w_ptr + b * BN * 128 + r[:, None] * 128 + k[None, :]).to(tl.float8e4nv, bitcast=True)
        x = tl.load(x_ptr + b * BM * 128 + m[:, None] * 128 + k[None, :]).to(tl.float8e4nv, bitcast=True)
        tl.store(o_ptr + b * BN * BM + r[:, None] * BM + m[None, :], tl.dot(w, tl.trans(x)))

    BN, BM = 64, 16
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(programs * BM, 128, generator=g).to(torch.bfloat16)
    xq, _ = codecs.quantize_fp8_act(xs, 128, reciprocal_scale=False)
    wf = torch.randn(programs * BN, 128, generator=g)
    wq = (wf / (wf.abs().amax() / 448)).to(torch.float8_e4m3fn)  # one 128x128-like block scale per tile
    wb, xb = wq.view(torch.uint8).to(DEV), xq.view(torch.uint8).to(DEV)
    o = torch.empty(programs * BN * BM, dtype=torch.float32, device=DEV)
    _k128[(programs,)](wb, xb, o, BN=BN, BM=BM, num_warps=4)
    sync()
    exact = torch.einsum("prk,pmk->prm", wq.double().view(programs, BN, 128), xq.double().view(programs, BM, 128))
    got = o.cpu().double().view(programs, BN, BM)
    f32 = exact.float().double()
    torch.save({"w": wq.view(torch.uint8).view(programs, BN, 128), "x": xq.view(torch.uint8).view(programs, BM, 128),
                "out": o.cpu().view(programs, BN, BM)}, os.path.join(out, "probe.pt"))
    err = got - exact
    res = {"programs": programs, "blocks": got.numel(), "ne_fp32_of_exact": float((got != f32).double().mean()),
           "mean_err_over_mean_abs_sum": float(err.mean() / exact.abs().mean()),
           "frac_below_exact": float((got < f32).double().mean()), "frac_above_exact": float((got > f32).double().mean()),
           "frac_below_when_sum_pos": float((got[exact > 0] < f32[exact > 0]).double().mean()),
           "frac_below_when_sum_neg": float((got[exact < 0] < f32[exact < 0]).double().mean())}
    dump(out, "probe.json", res)
    log(f"probe: {res}")


# --------------------------------------------------------------------------- diag


def diag(out: str) -> None:
    import copy

    from megamoe_runtime.backends.reference import ReferenceBackend
    from megamoe_runtime.backends.triton import block8, configs, synth
    from megamoe_runtime.backends.triton.backend import _Roles
    from megamoe_runtime.backends.triton.moe import moe_forward
    from megamoe_runtime.format.formats import ActivationSpec, LayerSpec
    from megamoe_runtime.testing import calc_diff

    res: dict = {"device": torch.cuda.get_device_name() if DEV == "cuda" else DEV}
    T = 64
    spec = LayerSpec("fp8_block", H, I, 8, 8, ActivationSpec("swiglu"), routed_scaling_factor=2.5)
    lay = synth.random_layer(spec, device=DEV, seed=0)
    tw, ids = synth.random_routing(T, 8, 8, DEV, seed=1, mask_frac=0.15, zero_tokens=2)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEV)
    ref = ReferenceBackend().forward(lay, x, tw, ids)
    lay_cpu = copy.copy(lay)
    for t in ("l1_weight", "l1_scale", "l2_weight", "l2_scale"):
        setattr(lay_cpu, t, getattr(lay, t).cpu())
    t0 = time.time()
    ref_cpu = ReferenceBackend().forward(lay_cpu, x.cpu(), tw.cpu(), ids.cpu())
    res["ref_gpu_vs_cpu"] = {"calc_diff": calc_diff(ref.cpu(), ref_cpu),
                             "bitwise": float((ref.cpu().view(torch.int16) == ref_cpu.view(torch.int16)).float().mean()),
                             "cpu_s": round(time.time() - t0, 1)}
    log(f"diag: reference GPU vs CPU {res['ref_gpu_vs_cpu']}")

    def run(fc, layer=lay, bm=None):
        return moe_forward(layer.spec, _Roles(layer, ""), x, tw, ids, config=configs.KernelConfig(block_m=bm, fp8=fc))

    variants = {
        "default": (None, None),
        "decode_tiles_bm16": (block8.TILES["decode"], 16),
        "prefill_bm16": (block8.TILES["prefill"], 16),
        "decode_tiles_bm64": (block8.TILES["decode"], 64),
        "gpi2": (dataclasses.replace(block8.TILES["prefill"], gpi=2), None),
        "exact_default": (dataclasses.replace(block8.TILES["prefill"], exact=True), None),
        "exact_bm16_4w": (dataclasses.replace(block8.TILES["decode"], exact=True), 16),
    }
    outs = {}
    for name, (fc, bm) in variants.items():
        y = run(fc, bm=bm)
        sync()
        outs[name] = y
        res[name] = {"calc_diff": calc_diff(y, ref), "calc_diff_cpu_ref": calc_diff(y.cpu(), ref_cpu),
                     "bitwise": float((y.view(torch.int16) == ref.view(torch.int16)).float().mean()),
                     "max_abs": float((y.float() - ref.float()).abs().max()),
                     "equal_default": bool(torch.equal(y, outs.get("default", y)))}
        log(f"diag {name}: {res[name]}")
    res["ref_absmax"] = float(ref.float().abs().max())
    # negative controls: the whole-output calc_diff, and the one on the outputs they can change
    e = int(torch.mode(ids[ids >= 0].flatten()).values)
    rows_e = (ids == e).any(1)
    ctl = {}
    bad = copy.copy(lay)
    bad.l1_scale = lay.l1_scale.clone()
    bad.l1_scale[e, 0, 0] *= 2.0
    y = run(None, bad)
    ctl["one L1 block scale doubled"] = {"calc_diff": calc_diff(y, ref),
                                         "on_expert_tokens": calc_diff(y[rows_e], ref[rows_e])}
    bad = copy.copy(lay)
    bad.l2_scale = lay.l2_scale.clone()
    bad.l2_scale[e, 0, 0] *= 2.0
    y = run(None, bad)
    ctl["one L2 block scale doubled"] = {"calc_diff": calc_diff(y, ref),
                                         "on_block": calc_diff(y[rows_e, :128], ref[rows_e, :128])}
    res["controls"] = ctl
    log(f"diag controls: {ctl}")
    dump(out, "diag.json", res)


# --------------------------------------------------------------------------- sweep


#: the tile grids: "full" (the first sweep), "fine" (around its winners: deeper pipelines, 32-token blocks);
#: the L1's last axis is ``paired`` (gate and up dots issued together, or one after the other)
GRIDS = {"full": (((64, 128), (4, 8), (2, 3, 4), (1, 0)), ((64, 128, 256), (4, 8), (2, 3, 4), (1, 2))),
         "fine": (((64, 128), (4, 8), (3, 4, 5), (1,)), ((128, 256), (4, 8), (3, 4, 5), (1,))),
         "split": (((64, 128), (4, 8), (2, 3, 4), (1, 0)), ((64, 128, 256), (4, 8), (3, 4, 5), (1, 2)))}


def l1_grid() -> list[dict]:
    g = [dict(l1_bn=bn, warps=w, stages=st, paired=p) for bn, w, st, p in
         itertools.product(*GRIDS.get(GRID, GRIDS["full"])[0])]
    return g if GRID in GRIDS else g[:2]


def l2_grid() -> list[dict]:
    g = [dict(l2_bn=bn, warps=w, stages=st, gpi=g) for bn, w, st, g in itertools.product(*GRIDS.get(GRID, GRIDS["full"])[1])]
    return g if GRID in GRIDS else g[:2]


def _fc(kind: str, c: dict):
    from megamoe_runtime.backends.triton import block8

    if kind == "l1":
        return block8.Block8Config(l1_bn=c["l1_bn"], paired=bool(c["paired"]), warps=c["warps"], stages=c["stages"])
    return block8.Block8Config(l2_bn=c["l2_bn"], gpi=c["gpi"], warps=c["warps"], stages=c["stages"])


class Problem:
    """DeepSeek-V3's routed experts (``experts`` of them) with random E4M3 bytes and fp32 block scales."""

    def __init__(self, experts: int, seed: int = 0, module=None):
        from megamoe_runtime.backends.triton import block8

        block8 = module or block8

        g = torch.Generator(device=DEV).manual_seed(seed)
        self.E = experts

        def e4m3(*shape):
            b = torch.empty(*shape, dtype=torch.uint8, device=DEV)
            for i in range(0, shape[0], 16):
                v = torch.randint(0, 256, (min(16, shape[0] - i),) + shape[1:], generator=g, device=DEV,
                                  dtype=torch.uint8)
                v[(v & 0x7F) == 0x7F] ^= 1  # no NaN codes
                b[i:i + 16] = v
            return b

        def scales(*shape):
            return torch.exp2(torch.randint(-12, -7, shape, generator=g, device=DEV).float())

        self.w1, self.s1 = e4m3(experts, 2 * I, H), scales(experts, 2 * I // 128, H // 128)
        self.w2, self.s2 = e4m3(experts, H, I), scales(experts, H // 128, I // 128)
        self.block8 = block8

    def tokens(self, T: int, seed: int = 1):
        g = torch.Generator(device=DEV).manual_seed(seed)
        x = torch.randn(T, H, generator=g, device=DEV).to(torch.bfloat16)
        ids = torch.argsort(torch.rand(T, self.E, generator=g, device=DEV), dim=1)[:, :K].to(torch.int64)
        tw = torch.softmax(torch.randn(T, K, generator=g, device=DEV), 1)
        xq, xs = self.block8.quantize_b128(x, DEV == "cuda")
        return xq, xs, tw, ids

    def plan(self, ids, bm):
        from megamoe_runtime.backends.triton.staging import route

        p = route(ids, self.E, 0, bm)
        self._rows_key = None  # the row-ordered scales of ``l1`` belong to one plan
        act = torch.zeros(p.max_blocks * bm, I, dtype=torch.uint8, device=DEV)
        asf = torch.zeros(p.max_blocks * bm, I // 64, dtype=torch.float32, device=DEV)
        return p, act, asf

    def l1(self, fc, xq, xs, tw, p, act, asf, bm):
        if hasattr(self.block8, "row_scales"):  # the L1 reads the dispatch scales in row order
            key = (id(p), id(xs))
            if getattr(self, "_rows_key", None) != key:
                self._rows, self._rows_key = self.block8.row_scales(xs, p, K, DEV == "cuda"), key
            xs = self._rows
        self.block8.launch_l1(fc, xq, xs, self.w1, self.s1, p, tw, act, asf, H, I, K, None, 2.5, bm, DEV == "cuda")

    def l2(self, fc, act, asf, p, slots, bm):
        self.block8.launch_l2(fc, act, asf, self.w2, self.s2, p, slots, H, I, K, K, bm, DEV == "cuda")


def _warm(job: list) -> list:
    """Compile (by running once on an 8-expert problem) each (kind, bm, config) of ``job``."""
    if DEV == "cuda":
        torch.cuda.set_device(0)
    pr = Problem(8)
    xq, xs, tw, ids = pr.tokens(64)
    done = []
    for kind, bm, c in job:
        t0 = time.time()
        try:
            p, act, asf = pr.plan(ids, bm)
            fc = _fc(kind, c)
            if kind == "l1":
                pr.l1(fc, xq, xs, tw, p, act, asf, bm)
            else:
                slots = torch.empty(64, K, H, dtype=torch.bfloat16, device=DEV)
                pr.l2(fc, act, asf, p, slots, bm)
            sync()
            done.append((kind, bm, c, round(time.time() - t0, 1), None))
        except Exception as exc:  # out of shared memory etc.: reported, skipped when timing
            done.append((kind, bm, c, round(time.time() - t0, 1), repr(exc)[:200]))
    return done


def _time(fn, reps: int) -> float:
    if DEV == "cpu":
        t0 = time.time()
        fn()
        return (time.time() - t0) * 1e3
    fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def sweep(out: str, tokens: list[int], bms: list[int], jobs: int, reps: int, compile_only: bool = False,
          baseline: str | None = None) -> None:
    from megamoe_runtime.backends.triton import block8

    if baseline:  # an importable copy of an earlier block8 (same package), timed and compared in this process
        import importlib

        baseline = importlib.import_module(baseline)

    work = [("l1", bm, c) for bm in bms for c in l1_grid()] + [("l2", bm, c) for bm in bms for c in l2_grid()]
    t0 = time.time()
    failed = {}
    if jobs > 1:
        import multiprocessing as mp

        chunks = [work[i::jobs] for i in range(jobs)]
        with mp.get_context("spawn").Pool(jobs) as pool:
            for part in pool.map(_warm, chunks):
                for kind, bm, c, s, err in part:
                    if err:
                        failed[(kind, bm, json.dumps(c, sort_keys=True))] = err
    log(f"sweep: compiled {len(work)} kernels in {time.time() - t0:.0f}s ({len(failed)} failed)")
    if failed:
        dump(out, "sweep_failed.json", [list(k) + [v] for k, v in failed.items()])
    if compile_only:
        return
    if not failed and os.path.isfile(os.path.join(out, "sweep_failed.json")):  # from the compile-only run
        with open(os.path.join(out, "sweep_failed.json")) as f:
            failed = {(k, b, c): e for k, b, c, e in json.load(f)}
    pr = Problem(E)
    res: dict = {"device": torch.cuda.get_device_name() if DEV == "cuda" else DEV, "shape": dict(H=H, I=I, E=E, K=K), "points": {},
                 "failed": [list(k) + [v] for k, v in failed.items()], "defaults": {k: v.__dict__ for k, v in block8.TILES.items()}}
    base = block8.TILES["prefill"]
    for T in tokens:
        xq, xs, tw, ids = pr.tokens(T)
        pt = res["points"][str(T)] = {}
        for bm in bms:
            p, act, asf = pr.plan(ids, bm)
            slots = torch.zeros(T, K, H, dtype=torch.bfloat16, device=DEV)
            pr.l1(base, xq, xs, tw, p, act, asf, bm)
            ref_act, ref_asf = act.clone(), asf.clone()
            pr.l2(base, act, asf, p, slots, bm)
            ref_slots = slots.clone()
            if baseline is not None and bm == baseline.TILES["prefill"].block_m:
                try:
                    res.setdefault("baseline", {})[str(T)] = bl = baseline_point(
                        pr, baseline, T, xq, xs, tw, ids, reps, dict(block_m=bm, act=ref_act, asf=ref_asf, slots=ref_slots, pairs=p.sorted_pairs))
                    log(f"T={T} baseline {baseline.__name__}: {bl}")
                except Exception as exc:
                    res.setdefault("baseline", {})[str(T)] = {"error": repr(exc)[:300]}
                    log(f"T={T} baseline failed: {exc!r}")
            rows = []
            for kind, grid in (("l1", l1_grid()), ("l2", l2_grid())):
                for c in grid:
                    if (kind, bm, json.dumps(c, sort_keys=True)) in failed:
                        continue
                    fc = _fc(kind, c)
                    try:
                        if kind == "l1":
                            act.zero_()
                            ms = _time(lambda: pr.l1(fc, xq, xs, tw, p, act, asf, bm), reps)
                            eq = bool(torch.equal(act, ref_act) and torch.equal(asf, ref_asf))
                            act.copy_(ref_act)
                            asf.copy_(ref_asf)
                        else:
                            slots.zero_()
                            ms = _time(lambda: pr.l2(fc, act, asf, p, slots, bm), reps)
                            eq = bool(torch.equal(slots, ref_slots))
                    except Exception as exc:
                        rows.append(dict(kind=kind, **c, error=repr(exc)[:200]))
                        continue
                    rows.append(dict(kind=kind, **c, ms=ms, equal_default=eq))
            l1 = sorted((r for r in rows if r["kind"] == "l1" and "ms" in r), key=lambda r: r["ms"])
            l2 = sorted((r for r in rows if r["kind"] == "l2" and "ms" in r), key=lambda r: r["ms"])
            flops = 2 * T * K * 3 * H * I
            pt[str(bm)] = {"l1": l1, "l2": l2, "best_ms": l1[0]["ms"] + l2[0]["ms"],
                           "best_tflops": flops / (l1[0]["ms"] + l2[0]["ms"]) / 1e9}
            log(f"T={T} bm={bm}: best L1 {l1[0]} | best L2 {l2[0]} | "
                f"{pt[str(bm)]['best_tflops']:.0f} TFLOP/s of L1+L2")
            for r in l1[:5] + l2[:5]:
                log(f"   {r}")
            dump(out, "sweep.json", res)
            del act, asf, slots, ref_act, ref_asf, ref_slots
        if DEV == "cuda":
            torch.cuda.empty_cache()
    # the tiles to adopt: per row block the L1 and the L2 configuration fastest over all token counts (sum of
    # their times), bitwise equal to the default at every point; then the row block whose pair is fastest
    def total(kind: str, bm: str, c: dict):
        ms = []
        for T in tokens:
            r = [r for r in res["points"][str(T)][bm][kind] if all(r.get(k) == v for k, v in c.items())]
            if not r or not r[0].get("equal_default"):
                return None
            ms.append(r[0]["ms"])
        return sum(ms)

    best = {}
    for bm in (str(b) for b in bms):
        pick = {}
        for kind, grid in (("l1", l1_grid()), ("l2", l2_grid())):
            tots = [(total(kind, bm, c), c) for c in grid]
            tots = [t for t in tots if t[0] is not None]
            if tots:
                pick[kind] = min(tots, key=lambda t: t[0])
        if len(pick) == 2:
            best[bm] = (pick["l1"][0] + pick["l2"][0], pick["l1"][1], pick["l2"][1])
    if not best:
        log("adopt: nothing bitwise equal at every point")
        dump(out, "sweep.json", res)
        return
    bm = min(best, key=lambda b: best[b][0])
    _, l1, l2 = best[bm]
    pin = dict(l1_bn=l1["l1_bn"], paired=bool(l1["paired"]), warps=l1["warps"], stages=l1["stages"],
               l2_bn=l2["l2_bn"], l2_gpi=l2["gpi"], l2_warps=l2["warps"], l2_stages=l2["stages"],
               block_m=None if int(bm) == 128 else int(bm))  # 128: what pick_block_m takes above 64 pairs
    per_t = {T: {k: [r["ms"] for r in res["points"][str(T)][bm][k] if all(r.get(x) == v for x, v in c.items())][0]
                 for k, c in (("l1", l1), ("l2", l2))} for T in tokens}
    res["pin"] = {"tiles": pin, "ms_per_tokens": per_t, "totals_by_block_m": {b: v[0] for b, v in best.items()},
                  "baseline": res.get("baseline")}
    log(f"adopt: {res['pin']}")
    with open(os.path.join(out, "pin.json"), "w") as f:
        json.dump(pin, f)
    dump(out, "sweep.json", res)


def baseline_point(pr: "Problem", mod, T: int, xq, xs, tw, ids, reps: int, new: dict) -> dict:
    """The kernels of ``mod`` (the previous block8) with its prefill tiles at T tokens: L1 and L2 times, and
    whether their outputs equal the new default's (``new``: act, asf, slots and the plan's pairs, same row
    block), row by pair (the previous L1 leaves padding rows unwritten; its act scales are row-major)."""
    fc = mod.TILES["prefill"]
    bm = fc.block_m
    bp = Problem.__new__(Problem)
    bp.__dict__.update(pr.__dict__)
    bp.block8 = mod
    p, act, asf = bp.plan(ids, bm)
    slots = torch.zeros(T, K, H, dtype=torch.bfloat16, device=DEV)
    ms1 = _time(lambda: bp.l1(fc, xq, xs, tw, p, act, asf, bm), reps)
    ms2 = _time(lambda: bp.l2(fc, act, asf, p, slots, bm), reps)
    out = {"block_m": bm, "tiles": fc.__dict__, "l1_ms": ms1, "l2_ms": ms2}
    if new.get("block_m") == bm:
        # rows matched by pair: the order of pairs within an expert's run differs between two routings
        def by_pair(pairs, a, s_rows):
            v = (pairs >= 0).nonzero().flatten()
            o = v[torch.argsort(pairs[v])]
            return a[o], s_rows[o]

        rows = act.shape[0]
        a0, s0 = by_pair(p.sorted_pairs, act, asf.view(rows, -1))
        a1, s1 = by_pair(new["pairs"], new["act"], new["asf"].view(-1, rows).t())
        out["act_equal"] = bool(torch.equal(a0, a1))
        out["asf_equal"] = bool(torch.equal(s0, s1))
        out["slots_equal"] = bool(torch.equal(slots, new["slots"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=("probe", "diag", "sweep"))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--programs", type=int, default=512)
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--bm", default="64,128")
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--grid", choices=tuple(GRIDS), default="full")
    ap.add_argument("--compile-only", action="store_true", help="sweep: only compile (in --jobs workers)")
    ap.add_argument("--baseline", help="sweep: module path of an earlier block8 to time and compare with")
    ap.add_argument("--dry", action="store_true", help="small shape and grid (a CPU run under TRITON_INTERPRET=1)")
    args = ap.parse_args()
    global H, I, E, GRID
    GRID = args.grid
    if args.dry:
        H, I, E, GRID = 256, 128, 8, "small"
    log(f"{args.part} on {DEV} {torch.cuda.get_device_name() if DEV == 'cuda' else ''} (torch {torch.__version__})")
    if args.part == "probe":
        probe(args.out, args.programs)
    elif args.part == "diag":
        diag(args.out)
    else:
        sweep(args.out, [int(t) for t in args.tokens.split(",")], [int(b) for b in args.bm.split(",")], args.jobs,
              args.reps, args.compile_only, args.baseline)


if __name__ == "__main__":
    main()
