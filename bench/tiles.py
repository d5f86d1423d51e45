#!/usr/bin/env python
"""Cost of the in-place weight tiling pass (`megamoe_runtime.format.weight_tiles`, issue 11 point 2) on the GPU.

    python bench/tiles.py --shape dsv3 --rows mxfp4,mxfp8 --wt 16

Per row: the routed weights of one layer of the shape (all experts, L1 and L2), tiled in place and back,
timed against a device-to-device copy of the same bytes in the same process (the pass reads and writes
every byte twice: into the scratch, then permuted back, so 0.5x the copy rate is its ideal). E2M1 weights
also move the bits of every word to the tiled order: through the triton backend's one-pass kernel, as a
layer that runs that backend does (``--bits torch``: the format layer's torch steps instead).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megamoe_runtime.format import weight_tiles  # noqa: E402

SHAPES = {"dsv3": (7168, 2048, 256), "glm": (5120, 1536, 160)}


def _time(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="dsv3", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="mxfp4,mxfp8")
    ap.add_argument("--wt", type=int, default=16)
    ap.add_argument("--bits", choices=("kernel", "torch"), default="kernel",
                    help="how E2M1 bits move: the triton backend's kernel (what a layer uses) or torch steps")
    args = ap.parse_args()
    copy_bits = None
    if args.bits == "kernel":
        from megamoe_runtime.backends.triton.bit_order import copy_e2m1_bits as copy_bits
    H, I, E = SHAPES[args.shape]
    print(f"# {torch.cuda.get_device_name()} shape {args.shape} (H {H}, I {I}, {E} experts), wt {args.wt}")
    for row in args.rows.split(","):
        e4m3 = row == "mxfp8"
        dt = torch.float8_e4m3fn if e4m3 else torch.uint8
        div = 1 if e4m3 else 2
        l1 = torch.randint(0, 256, (E, 2 * I, H // div), dtype=torch.uint8, device="cuda").view(dt)
        l2 = torch.randint(0, 256, (E, H, I // div), dtype=torch.uint8, device="cuda").view(dt)
        nbytes = l1.numel() + l2.numel()
        want = [weight_tiles.tiled_copy(t, args.wt) for t in (l1, l2)]
        ptrs = [t.data_ptr() for t in (l1, l2)]
        for t in (l1, l2):
            weight_tiles.tile_in_place(t, args.wt, copy_bits)
        assert [t.data_ptr() for t in (l1, l2)] == ptrs
        assert all(torch.equal(t.view(torch.uint8), w.view(torch.uint8)) for t, w in zip((l1, l2), want))
        del want
        for t in (l1, l2):
            weight_tiles.untile_in_place(t, args.wt, copy_bits)
        dst1, dst2 = torch.empty_like(l1), torch.empty_like(l2)

        def copy() -> None:
            dst1.copy_(l1)
            dst2.copy_(l2)

        def tile() -> None:
            for t in (l1, l2):
                weight_tiles.tile_in_place(t, args.wt, copy_bits)
            for t in (l1, l2):
                weight_tiles.untile_in_place(t, args.wt, copy_bits)

        tc = _time(copy)
        tt = _time(tile) / 2  # one tiling pass
        del dst1, dst2
        print(f"{row:6s} {nbytes / 1e9:6.2f} GB: copy {tc * 1e3:7.2f} ms ({2 * nbytes / tc / 1e9:6.0f} GB/s r+w), "
              f"tile pass {tt * 1e3:7.2f} ms = {tc / tt:.2f}x the copy rate (ideal 0.5x)", flush=True)
        del l1, l2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
