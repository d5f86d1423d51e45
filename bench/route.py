#!/usr/bin/env python
"""Time the triton backend's routing (``staging.route``): the single-program kernel against the
two-launch form (histograms per slice of pairs, then placement) for several slice sizes.

    python bench/route.py --tokens 1,8,64,512,4096,16384 --slices 0,256,512,1024,2048

Uniform top-8 over 256 local experts, the row block the default tiles pick per regime; each
variant captured in a CUDA graph and timed with ``do_bench`` (median, L2 flushed), as
``bench/kernel.py`` times a whole layer. Every plan is checked before it is timed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel import _bench, routing  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,8,64,512,4096,16384")
    ap.add_argument("--slices", default="0,256,512,1024,2048", help="slice_pairs values (0: one program)")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    args = ap.parse_args()
    from megamoe_runtime.backends.triton import configs, staging

    from megamoe_runtime.testing import check_routing_plan as check_plan

    E, K = args.experts, args.top_k
    slices = [int(s) for s in args.slices.split(",")]
    print(f"# {torch.cuda.get_device_name()}; {E} experts, top-{K}; us per call (graph replay, median)")
    print("| tokens | pairs | row block | default (slice) | " + " | ".join(f"slice {s}" for s in slices) + " |")
    print("|---|---|---|---|" + "---|" * len(slices))
    for T in (int(t) for t in args.tokens.split(",")):
        _, ids = routing(T, E, K, seed=T)
        bm = configs.default_config(T * K, E, "frag").block_m
        times = []
        for sl in slices:
            check_plan(staging.route(ids, E, 0, bm, slice_pairs=sl), ids, E, 0, bm)
            times.append(_bench(lambda: staging.route(ids, E, 0, bm, slice_pairs=sl)) * 1e3)
        dflt = staging.route_slice(T * K)
        print(f"| {T} | {T * K} | {bm} | {dflt} | " + " | ".join(f"{t:.1f}" for t in times) + " |", flush=True)


if __name__ == "__main__":
    main()
