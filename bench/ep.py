"""Expert-parallel forward time, EP-N against one device, in one run.

    python bench/ep.py --world 2 --device cuda --backend triton --shape dsv3 --row mxfp4
    python bench/ep.py --world 4 --device cuda --backend triton --shape glm --row nvfp4 --tokens 1,8,64,512,4096
    python bench/ep.py --world 2 --device cpu --backend reference --shape tiny      # gloo, any machine

Every rank builds the SAME full layer from random valid kernel-layout bytes
(one seed), keeps its own experts [r*E/N, (r+1)*E/N) in a
`DeepGemmMegaMoEExperts`, and runs `layer(x, w, ids)` (which dispatches pairs
to their owners over torch.distributed: NCCL on CUDA, gloo on CPU). Each point:
T tokens per rank (global batch N*T), median over iterations of the slowest
rank's time (a barrier before each iteration). In the same run, rank 0 times
the single-device forward of the full layer on the same global batch (N*T
tokens) and checks the EP output of its own tokens against it (calc_diff,
bitwise fraction). Results: a table on stdout, JSON lines with --out.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends), as the lent
multi-GPU machines require.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = {  # hidden, intermediate, experts, top-k
    "tiny": (256, 128, 16, 4),
    "dsv3": (7168, 2048, 256, 8),
    "glm": (6144, 2048, 256, 8),
}
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _layer(spec, full, device, backend):
    """This rank's layer, holding its slice of the full random layer."""
    from megamoe_runtime import DeepGemmMegaMoEExperts

    layer = DeepGemmMegaMoEExperts(spec, device=device, backend=backend)
    lo, hi = spec.local_experts.start, spec.local_experts.stop
    layer.begin_load()  # writes go through a load (docs/RELOAD.md); an unloaded layer refuses to run
    with torch.no_grad():
        for role in ("l1_weight", "l1_scale", "l2_weight", "l2_scale"):
            dst = getattr(layer, role)
            if dst is not None:
                dst.copy_(getattr(full, role)[lo:hi])
        if spec.row_spec.has_alphas:
            layer.l1_alpha.copy_(full.l1_alpha[lo:hi])
            layer.l2_global_scale.copy_(full.l2_global_scale[lo:hi])
            layer.set_l2_activation_scale(float(full.l2_activation_scale))
    layer.finish_load()
    return layer


def _time(fn, device, iters, group=None) -> float:
    """Median seconds of fn() over iters (after warm-up), slowest rank's."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if group is not None:
            dist.barrier(group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64,
                     device=device if device.type == "cuda" else "cpu")
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _worker(rank: int, world: int, port: int, args) -> None:
    from megamoe_runtime import LayerSpec, calc_diff
    from megamoe_runtime.backends.triton.synth import random_kernel_bytes, random_routing
    from megamoe_runtime.format.formats import ActivationSpec

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.device == "cuda":
        os.environ.update(NCCL_ENV)
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        H, I, E, K = SHAPES[args.shape]
        act = ActivationSpec("swiglu", clamp=10.0)
        full_spec = LayerSpec(args.row, H, I, E, K, act, routed_scaling_factor=2.5)
        full = random_kernel_bytes(full_spec, device, seed=args.seed)
        spec = LayerSpec(args.row, H, I, E, K, act, ep_rank=rank, ep_size=world, routed_scaling_factor=2.5)
        layer = _layer(spec, full, device, args.backend)
        single = _layer(full_spec, full, device, args.backend) if rank == 0 else None
        del full
        rows = []
        for T in args.tokens:
            tw, ids = random_routing(T * world, E, K, device, seed=args.seed + T)
            g = torch.Generator(device="cpu").manual_seed(args.seed + 7 * T)
            x_all = torch.randn(T * world, H, generator=g).to(torch.bfloat16).to(device)
            sl = slice(rank * T, (rank + 1) * T)
            x, w, i = x_all[sl].contiguous(), tw[sl].contiguous(), ids[sl].contiguous()
            y = layer(x, w, i)
            t_ep = _time(lambda: layer(x, w, i), device, args.iters, group=None if world == 1 else dist.group.WORLD)
            row = dict(world=world, device=args.device, backend=args.backend, shape=args.shape, row=args.row,
                       tokens_per_rank=T, global_tokens=T * world, ep_ms=t_ep * 1e3)
            if rank == 0:
                y_single_all = single(x_all, tw, ids)
                row["single_ms"] = _time(lambda: single(x_all, tw, ids), device, args.iters) * 1e3
                row["speedup"] = row["single_ms"] / row["ep_ms"]
                ref = y_single_all[sl]
                row["calc_diff_rank0"] = calc_diff(y, ref)
                row["bitwise_rank0"] = float((y.view(torch.int16) == ref.view(torch.int16)).float().mean())
            dist.barrier()
            rows.append(row)
        if rank == 0:
            for r in rows:
                print(json.dumps(r), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    for r in rows:
                        f.write(json.dumps(r) + "\n")
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default=None, help="reference | triton (default: triton on cuda, else reference)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--row", choices=["mxfp4", "mxfp8", "nvfp4", "bf16"], default="mxfp4")
    ap.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8, 64, 512])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    args.backend = args.backend or ("triton" if args.device == "cuda" else "reference")
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        print(f"--world {args.world} needs {args.world} GPUs; this machine has {torch.cuda.device_count()}",
              file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"# EP{args.world} vs single {args.device} ({args.backend}), shape {args.shape} {SHAPES[args.shape]}, "
          f"row {args.row}; torch {torch.__version__}", flush=True)
    mp.spawn(_worker, args=(args.world, port, args), nprocs=args.world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
