#!/usr/bin/env python
"""Run the triton backend's default forward a few times at one point, for a profiler to attach.

    ncu -k regex:_l1_kernel -c 1 --section WarpStateStats python bench/one_forward.py --row mxfp4 --tokens 8
    ncu -k regex:swiglu -c 1 --section WarpStateStats python bench/one_forward.py --peer-path .peer-tk --tokens 8

Same layer, weights and routing as ``bench/kernel.py`` (random valid kernel-layout bytes,
uniform top-k; weights in the tiled arrangement a loaded layer reads, ``--w-tile``); no timing of its own.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel import SHAPES, Peer, random_layer, routing  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="dsv3", choices=sorted(SHAPES))
    ap.add_argument("--row", default="mxfp4")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--peer-path", default=None, help="run the peer's MoE (bench/kernel.py Peer) instead")
    ap.add_argument("--w-tile", type=int, default=16,
                    help="rows per tile of the weight arrangement (what a loaded layer derives: 16); 0: as converted")
    ap.add_argument("--cfg", default=None,
                    help="KernelConfig fields over the default, e.g. block_m=128,l1_warps=4,decode=plain")
    args = ap.parse_args()
    if args.peer_path:
        sh = SHAPES[args.shape]
        peer = Peer(args.peer_path, sh["H"], sh["I"], sh["E"], sh["K"])
        tw, ids = routing(args.tokens, sh["E"], sh["K"], seed=args.tokens)
        x = torch.randn(args.tokens, sh["H"], device="cuda", dtype=torch.bfloat16)
        for _ in range(args.calls):
            peer(x, tw, ids)
        torch.cuda.synchronize()
        print(f"peer T={args.tokens}")
        return
    from megamoe_runtime.backends.triton import configs, moe

    sh = SHAPES[args.shape]
    H, I, E, K = sh["H"], sh["I"], sh["E"], sh["K"]
    spec, lay, kt, sc = random_layer(args.row, H, I, E, K, args.w_tile)  # w_tile: as a loaded layer reads
    tw, ids = routing(args.tokens, E, K, seed=args.tokens)
    x = torch.randn(args.tokens, H, device="cuda", dtype=torch.bfloat16)
    ff = moe.fold_flags(spec, kt)  # as a loaded layer passes them
    cfg = configs.default_config(args.tokens * K, E, "frag", w_kind=configs.ROW_W_KIND[args.row], H=H, I=I)
    for kv in filter(None, (args.cfg or "").split(",")):
        k, v = kv.split("=")  # numbers as ints, anything else (decode, scale_load, ...) as text
        cfg = dataclasses.replace(cfg, **{k: int(v) if v.lstrip("-").isdigit() else v})
    for _ in range(args.calls):
        moe.moe_forward(spec, kt, x, tw, ids, scalars=sc, fold_flags=ff, config=cfg, w_tile=args.w_tile)
    torch.cuda.synchronize()
    print(f"{args.row} T={args.tokens}: {cfg}")


if __name__ == "__main__":
    main()
