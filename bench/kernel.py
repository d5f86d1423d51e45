#!/usr/bin/env python
"""Benchmark the triton backend's MoE forward and staging kernels on one GPU (issue 5).

    python bench/kernel.py                      # full table (the shape set, SHAPE_SET)
    python bench/kernel.py --shapes qwen3-30b,4096,1536,128,8   # names and/or H,I,E,K
    python bench/kernel.py --shapes dsv3 --rows mxfp4 --tokens 1,8 --tune
    python bench/kernel.py --shapes new --rows mxfp4,nvfp4,mxfp8 --mma bf16 --korder frag --peer-path DIR
    python bench/kernel.py --peer-path DIR   # DIR holds OpenAI triton_kernels (unmodified, from triton 3.6.0): + a peer column
    python bench/kernel.py --shapes mixtral --rows mxfp4 --tokens 4096 --peer-path DIR --clocks   # + SM clock / power per timing

What it measures, per (shape, row, tokens):
* median time of the whole layer forward (staging + routing + L1 + L2 +
  combine), captured in a CUDA graph and replayed under
  ``triton.testing.do_bench`` (which zeroes a 256 MB buffer before every
  replay, so L2 is flushed); routing is uniform top-k over all experts;
* bytes of the touched experts' weights and scales (read once) plus the
  activations, over that time, in GB/s and as a fraction of the device
  copy bandwidth measured in the same run (bytes read + written);
* TFLOP/s (2 * pairs * (2I*H + H*I)) -- meaningful at 4096 tokens;
* the baseline in the same run: the same layer with bf16 weights through
  ``torch._grouped_mm`` (sort by expert, grouped GEMM, SwiGLU, grouped GEMM,
  index_add), also graph-captured; ratio = baseline time / triton time;
* with ``--peer-path``: the peer (OpenAI triton_kernels ``matmul_ogs``, MXFP4
  weights in its Hopper layout) on the same routing, same method; vs peer =
  peer time / triton time (> 1: megamoe is faster);
* the MX rows once per GEMM path (``--mma fp8,bf16``).
And the staging kernels (MXFP8 / NVFP4 quantization of the hidden states)
in GB/s against the copy bandwidth.

Writes a markdown table to stdout and, with --out DIR, ``bench.md`` and
``bench.json`` there.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: ``--decode`` variants of the frag paths: KernelConfig (decode, scale_load, l1_gu) on the
#: default tiles (``default_config(..., l1_gu=)`` flips only the L1 form)
DECODE_VARIANTS = {"plain": dict(decode="plain", scale_load="bytes", l1_gu=False),
                   "fold": dict(decode="fold", scale_load="bytes", l1_gu=False),
                   "fold+words": dict(decode="fold", scale_load="words", l1_gu=False),
                   "gu": dict(decode="plain", scale_load="bytes", l1_gu=True),
                   "new": dict(decode="fold", scale_load="bytes", l1_gu=True),
                   "new+words": dict(decode="fold", scale_load="words", l1_gu=True)}

#: MoE layer shapes of the families people serve (issue 28), each with its real hidden size H, routed-expert
#: intermediate size I, routed experts E and top-k K (from the models' published configs)
SHAPES = {
    "dsv3": dict(H=7168, I=2048, E=256, K=8),  # DeepSeek-V3 / R1
    "kimi-k2": dict(H=7168, I=2048, E=384, K=8),  # Kimi-K2
    "qwen3-235b": dict(H=4096, I=1536, E=128, K=8),  # Qwen3-235B-A22B
    "qwen3-30b": dict(H=2048, I=768, E=128, K=8),  # Qwen3-30B-A3B
    "glm45": dict(H=5120, I=1536, E=160, K=8),  # GLM-4.5 and GLM-4.6 (the same MoE dimensions)
    "mixtral": dict(H=4096, I=14336, E=8, K=2),  # Mixtral-8x7B: top-2 of 8
    "dbrx": dict(H=6144, I=10752, E=16, K=4),  # DBRX: few large experts, top-4 of 16
    "glm": dict(H=6144, I=2048, E=256, K=8),  # the "GLM-like" shape of the earlier passes
    # few large experts, top-1 (Llama-4 style)
    "llama4-scout": dict(H=5120, I=8192, E=16, K=1),  # Llama-4-Scout: top-1 of 16
    "llama4-maverick": dict(H=5120, I=8192, E=128, K=1),  # Llama-4-Maverick: top-1 of 128
    # many small experts, top-6..10
    "qwen3-next": dict(H=2048, I=512, E=512, K=10),  # Qwen3-Next-80B-A3B: top-10 of 512
    "dsv2-lite": dict(H=2048, I=1408, E=64, K=6),  # DeepSeek-V2-Lite / Moonlight: top-6 of 64
}
#: the whole set (``--shapes set``)
SHAPE_SET = ("dsv3", "kimi-k2", "qwen3-235b", "qwen3-30b", "glm45", "mixtral", "dbrx")
#: the families added after the set (``--shapes new``): few large top-1 experts, many small top-6..10 experts
NEW_SET = ("llama4-scout", "llama4-maverick", "qwen3-next", "dsv2-lite")


def parse_shapes(text: str) -> list[tuple[str, dict]]:
    """``--shapes``: a comma list of names (``SHAPES``; ``set`` = ``SHAPE_SET``, ``new`` = ``NEW_SET``) and of custom shapes written as
    four integers ``H,I,E,K`` in a row, e.g. ``dsv3,4096,1536,128,8,mixtral``. Returns [(label, dict)]."""
    toks = [t.strip() for t in text.split(",") if t.strip()]
    out, i = [], 0
    while i < len(toks):
        t = toks[i]
        if t in ("set", "new"):
            out += [(n, SHAPES[n]) for n in (SHAPE_SET if t == "set" else NEW_SET)]
            i += 1
        elif t in SHAPES:
            out.append((t, SHAPES[t]))
            i += 1
        elif t.isdigit():
            nums = toks[i:i + 4]
            if len(nums) < 4 or not all(n.isdigit() for n in nums):
                raise SystemExit(f"--shapes: a custom shape is four integers H,I,E,K; got {','.join(nums)}")
            H, I, E, K = (int(n) for n in nums)
            out.append((f"{H}x{I}x{E}x{K}", dict(H=H, I=I, E=E, K=K)))
            i += 4
        else:
            raise SystemExit(f"--shapes: unknown shape {t!r}; names: {', '.join(SHAPES)}, set, new, or H,I,E,K")
    return out


#: set by ``--compile-only`` (the ``--jobs`` build pass): each timed call runs once, untimed
_COMPILE_ONLY = []


#: with ``--clocks``: the running ``clocks.ClockSampler`` (one element) and, per labelled timing, its SM clock and
#: board power over that timing's window (a list, as ``_COMPILE_ONLY``: ``main`` sets it, ``_bench`` reads it)
_SAMPLER: list = []
CLOCKS: list = []


def _bench(fn, graph: bool = True, rep: int = 200, warmup: int = 30, label: str = "") -> float:
    """Median ms. With graph=True the call is captured once and its replay timed. ``label``: under ``--clocks``,
    the name under which this timing's clock and power are recorded (``CLOCKS``)."""
    t0 = time.time()
    ms = _bench_median(fn, graph, rep, warmup)
    if _SAMPLER and label:
        CLOCKS.append(dict(label=label, us=round(ms * 1e3, 1), **_SAMPLER[0].window(t0, time.time())))
    return ms


def _bench_median(fn, graph: bool, rep: int, warmup: int) -> float:
    import triton.testing as tt

    if _COMPILE_ONLY:
        fn()
        torch.cuda.synchronize()
        return float("nan")

    if graph:
        fn()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        run = fn
    return float(tt.do_bench(run, warmup=warmup, rep=rep, return_mode="median"))


def kernel_breakdown(fn, iters: int = 20) -> list[tuple[str, float, float]]:
    """Per-kernel device time of ``fn`` run eagerly: [(kernel name, launches per call, us per
    call)], largest first. L2 is flushed before every call (a 256 MB ``bitwise_not_``, left out
    of the sums), as ``do_bench`` does. These are the kernels a graph replay runs; the sum leaves
    out the launch gaps of eager execution."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.bitwise_not_()
            fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = getattr(ev, "cuda_time_total", 0.0)
        if t <= 0 or "bitwise_not" in ev.key or ev.key.startswith("cuda") or ev.key.startswith("Memcpy"):
            continue
        rows.append((ev.key, ev.count / iters, t / iters))
    # one row per kernel (the CPU-side op rows carry the same device time): keep kernel names only
    seen = {}
    for name, n, us in rows:
        if name.startswith("aten::"):
            continue
        seen[name] = max(seen.get(name, (0, 0.0)), (n, us), key=lambda v: v[1])
    out = sorted(((k, v[0], v[1]) for k, v in seen.items()), key=lambda r: -r[2])
    del flush
    return out


def print_breakdown(label: str, rows: list[tuple[str, float, float]], sink: list) -> None:
    total = sum(r[2] for r in rows)
    print(f"# profile {label}: {total:.1f} us of kernels per call", flush=True)
    for name, n, us in rows:
        print(f"#   {us:9.1f} us {100 * us / max(total, 1e-9):5.1f}%  x{n:.0f}  {name[:110]}", flush=True)
    sink.append(dict(label=label, total_us=total, kernels=[dict(name=a, launches=b, us=c) for a, b, c in rows]))


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy, counting bytes read + written."""
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    ms = _bench(lambda: b.copy_(a), graph=False)
    del a, b
    return 2 * n / ms / 1e6


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = _bench(lambda: a @ b, graph=False, rep=100)
    return 2 * 8192 ** 3 / ms / 1e9


def expert_bytes(row: str, H: int, I: int) -> int:
    from megamoe_runtime.format.formats import get_row

    w = get_row(row).weight
    if w.scale_encoding == "fp32":  # block-FP8: one byte per element, one fp32 per 128x128 block
        per = lambda n, k: n * k + 4 * (n // 128) * (k // 128)
    else:
        per = lambda n, k: n * (w.stored_cols(k) * (2 if w.element == "bf16" else 1) + 4 * w.scale_ints(k))
    return per(2 * I, H) + per(H, I)


def random_layer(row: str, H: int, I: int, E: int, K: int, w_tile: int = 0):
    """(spec, layer, kernel tensors, nvfp4 scalars or None) of a benchmark-sized layer on the GPU: random valid
    kernel-layout bytes (no quantization: fast at any size), SwiGLU clamped at 10, routed scaling 2.5; its
    routed weights arranged in ``w_tile``-row tiles where asked (what a layer loaded for the frag path reads,
    ``configs.resolve_w_tile``)."""
    from megamoe_runtime.backends.triton import synth
    from megamoe_runtime.backends.triton.backend import _NvScalars, _Roles
    from megamoe_runtime.format import weight_tiles
    from megamoe_runtime.format.formats import ActivationSpec, LayerSpec, get_row

    spec = LayerSpec(row, H, I, E, K, ActivationSpec("swiglu", clamp=10.0), routed_scaling_factor=2.5)
    lay = synth.random_kernel_bytes(spec, "cuda", seed=1)
    kt = _Roles(lay, "")
    if w_tile:
        weight_tiles.tile_in_place(kt.l1_weight, w_tile)
        weight_tiles.tile_in_place(kt.l2_weight, w_tile)
    return spec, lay, kt, (_NvScalars(lay) if get_row(row).has_alphas else None)


def routing(T, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K].to(torch.int64).cuda()
    tw = torch.softmax(torch.randn(T, K, generator=g), dim=1).float().cuda()
    return tw, ids


class Baseline:
    """bf16 weights, torch grouped GEMM (the strongest plain-torch MoE on Hopper)."""

    def __init__(self, H, I, E, K):
        self.H, self.I, self.E, self.K = H, I, E, K
        self.w1 = torch.randn(E, H, 2 * I, device="cuda", dtype=torch.bfloat16) * H ** -0.5
        self.w2 = torch.randn(E, I, H, device="cuda", dtype=torch.bfloat16) * I ** -0.5
        self.kind = "torch._grouped_mm"
        try:
            x = torch.randn(4, H, device="cuda", dtype=torch.bfloat16)
            tw, ids = routing(4, E, K, 0)
            self(x, tw, ids)
            torch.cuda.synchronize()
        except Exception as e:  # older torch: a loop of mm over the touched experts
            print(f"# torch._grouped_mm unavailable ({type(e).__name__}: {e}); baseline = per-expert loop")
            self.kind = "loop"

    def __call__(self, x, tw, ids):
        T, K = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // K
        counts = torch.zeros(self.E, dtype=torch.int64, device=flat.device).index_add_(
            0, flat, torch.ones_like(flat))  # bincount would sync with the host
        offs = torch.cumsum(counts, 0).to(torch.int32)
        xs = x[tok]
        if getattr(self, "kind", "torch._grouped_mm") == "loop":
            raise RuntimeError("loop baseline is not graph-capturable")
        h = torch._grouped_mm(xs, self.w1, offs=offs)
        g, u = h.float().chunk(2, dim=-1)
        a = (torch.nn.functional.silu(g) * u * tw.reshape(-1)[order, None]).to(torch.bfloat16)
        y = torch._grouped_mm(a, self.w2, offs=offs)
        return torch.zeros(T, self.H, device="cuda", dtype=torch.float32).index_add_(0, tok, y.float()).to(
            torch.bfloat16)


class Peer:
    """OpenAI triton_kernels' MoE (what vLLM runs for MXFP4 MoE models on Hopper), measured
    side by side only: imported from ``--peer-path`` at run time, never by the project.

    Weights: random bf16 -> its ``downcast_to_mxfp`` (MXFP4 along K) -> its Hopper value and
    scale layouts (``convert_layout``). Per call: routing metadata from the same top-k ids
    (sort by expert, histogram, its ragged-tensor metadata), ``matmul_ogs`` gate/up with the
    fused SwiGLU (gather), ``matmul_ogs`` down with the top-k weights and the scatter combine.
    bf16 activations, as the peer runs them. ``weights="mxfp8"``: E4M3 weights with UE8M0 scales
    per 32 along K instead (its ``downcast_to_mxfp`` to ``float8_e4m3fn``, column-major values as
    its Hopper FP8 path requires, scales in its plain strided layout, upcast in its ``dot_scaled``):
    the like-for-like peer of the mxfp8 row, which moves twice the MXFP4 weight bytes."""

    def __init__(self, path, H, I, E, K, weights="mxfp4"):
        if path not in sys.path:
            sys.path.insert(0, path)
        import triton_kernels.matmul_ogs as mo
        from triton_kernels.numerics_details.mxfp import downcast_to_mxfp
        from triton_kernels.specialize import FnSpecs
        from triton_kernels.swiglu import swiglu_fn
        from triton_kernels.tensor import FP4, convert_layout, make_ragged_tensor_metadata, wrap_torch_tensor
        from triton_kernels.tensor_details import layout

        self.mo, self.meta = mo, make_ragged_tensor_metadata
        self.H, self.I, self.E, self.K = H, I, E, K

        def quant(kdim, n):
            w = torch.randn(E, n, kdim, device="cuda", dtype=torch.bfloat16).mul_(kdim ** -0.5).transpose(1, 2)
            if weights == "mxfp8":
                wq, ws = downcast_to_mxfp(w, torch.float8_e4m3fn, axis=1)
                del w
                if wq.stride(-2) != 1:  # column-major (K contiguous), as its Hopper FP8 path asserts
                    wq = wq.transpose(1, 2).contiguous().transpose(1, 2)
                return wrap_torch_tensor(wq), wrap_torch_tensor(ws)
            wq, ws = downcast_to_mxfp(w, torch.uint8, axis=1)
            del w
            vl, vk = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
            sl, sk = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
            return (convert_layout(wrap_torch_tensor(wq, dtype=FP4), vl, **vk),
                    convert_layout(wrap_torch_tensor(ws), sl, **sk))

        self.w1, s1 = quant(H, 2 * I)
        self.w2, s2 = quant(I, H)
        torch.cuda.empty_cache()
        self.pc1 = mo.PrecisionConfig(weight_scale=s1)
        self.pc2 = mo.PrecisionConfig(weight_scale=s2)
        self.act = mo.FusedActivation(FnSpecs("swiglu", swiglu_fn, ("alpha", "limit"), reduction_n=2), (1.702, 7.0))

    def __call__(self, x, tw, ids):
        mo = self.mo
        T, K = ids.shape
        flat = ids.reshape(-1).to(torch.int32)
        topk_indx = torch.argsort(flat, stable=True).to(torch.int32)
        gate_indx = torch.argsort(topk_indx, stable=True).to(torch.int32)
        gate_scal = tw.reshape(-1)[topk_indx.long()].to(torch.bfloat16)
        hist = torch.zeros(self.E, dtype=torch.int32, device=x.device).index_add_(
            0, flat.long(), torch.ones_like(flat))
        rdata = mo.RoutingData(gate_scal, hist, self.E, K, self.meta(hist, T * K))
        h = mo.matmul_ogs(x, self.w1, None, rdata, gather_indx=mo.GatherIndx(topk_indx, gate_indx),
                          precision_config=self.pc1, fused_activation=self.act)
        return mo.matmul_ogs(h, self.w2, None, rdata, scatter_indx=mo.ScatterIndx(gate_indx, topk_indx),
                             precision_config=self.pc2, gammas=rdata.gate_scal)


def bench_peer(path, H, I, E, K, tokens, weights="mxfp4", profiles=None):
    """{T: (ms, graph captured?)} of the peer's MoE on the same routing as bench_moe."""
    res = {}
    try:
        peer = Peer(path, H, I, E, K, weights)
    except Exception as e:
        print(f"# peer ({weights}) unavailable: {type(e).__name__}: {str(e)[:400]}")
        return res
    for T in tokens:
        tw, ids = routing(T, E, K, seed=T)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        for graph in (True, False):
            try:
                res[T] = (_bench(lambda: peer(x, tw, ids), graph=graph, label=f"peer {weights} {H}x{I}x{E}x{K} T={T}"),
                          graph)
                break
            except Exception as e:
                print(f"# peer ({weights}) T={T} graph={graph}: {type(e).__name__}: {str(e)[:300]}")
                torch.cuda.synchronize()
        if T in res and profiles is not None:
            print_breakdown(f"peer {weights} T={T}", kernel_breakdown(lambda: peer(x, tw, ids)), profiles)
        if T in res:
            print(f"peer {weights} T={T:5d} {res[T][0] * 1e3:9.1f} us{'' if res[T][1] else ' (eager)'}", flush=True)
    del peer
    torch.cuda.empty_cache()
    return res


def bench_staging(tokens, H, bw):
    from megamoe_runtime.backends.triton import block8, staging

    rows = []
    for T in tokens:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        for name, fn, out_b in (
                ("mxfp8", lambda: staging.quantize_mxfp8(x), T * H + T * H // 32),
                ("fp8 per 1x128", lambda: block8.quantize_b128(x), T * H + T * H // 128 * 4),
                ("nvfp4", lambda: staging.quantize_nvfp4_per_token(x), T * H // 2 + T * H // 16 + 4 * T),
                ("bf16 copy", lambda: staging.bf16_passthrough(x), 2 * T * H)):
            ms = _bench(fn, graph=True)
            nbytes = 2 * T * H + out_b
            rows.append(dict(kind=name, T=T, H=H, ms=ms, GBps=nbytes / ms / 1e6, frac=nbytes / ms / 1e6 / bw))
    return rows


def bench_moe(shape_name, rows, tokens, bw, args, results, sh=None):
    from megamoe_runtime.backends.triton import configs, moe, synth
    from megamoe_runtime.format import weight_tiles
    from megamoe_runtime.format.formats import ActivationSpec, LayerSpec, get_row

    sh = sh or SHAPES[shape_name]
    H, I, E, K = sh["H"], sh["I"], sh["E"], sh["K"]
    base = None
    base_ms = {}
    if not args.no_baseline:
        base = Baseline(H, I, E, K)
        base_graph = {}
        for T in tokens:
            tw, ids = routing(T, E, K, seed=T)
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            try:
                base_ms[T] = _bench(lambda: base(x, tw, ids), graph=True)
                base_graph[T] = True
            except Exception as e:
                base_graph[T] = False
                print(f"# baseline T={T} failed: {type(e).__name__}: {e}")
                try:
                    base_ms[T] = _bench(lambda: base(x, tw, ids), graph=False)
                except Exception:
                    base_ms[T] = float("nan")
        del base
        torch.cuda.empty_cache()
    profiles = args.profiles if args.profile else None
    peer_ms = bench_peer(args.peer_path, H, I, E, K, tokens, profiles=profiles) if args.peer_path else {}
    # the mxfp8 row also against the peer on E4M3 weights (the same weight bytes per element)
    peer8_ms = (bench_peer(args.peer_path, H, I, E, K, tokens, "mxfp8")
                if args.peer_path and "mxfp8" in rows and not args.no_peer8 else {})
    variants = []  # (row, label, mma, k order, frag decode variant)
    decodes = args.decode.split(",") if args.decode else [None]
    for row in rows:
        if configs.ROW_W_KIND[row] == configs.W_E4M3_B128:  # block-FP8: its one path, FP8 wgmma (block8)
            variants.append((row, "fp8", "fp8", None, None))
            continue
        for mma in (args.mma.split(",") if get_row(row).dispatch == "mxfp8" else ["bf16"]):
            if mma == "bf16" and get_row(row).weight.element in ("e2m1", "e4m3"):
                for ko in args.korder.split(","):  # K order of the E2M1 bf16 GEMMs
                    if ko == "split":
                        variants.append((row, mma, mma, ko, None))
                    else:
                        for dv in decodes:
                            variants.append((row, f"bf16-{ko}" + (f"/{dv}" if dv else ""), mma, ko, dv))
            else:
                variants.append((row, mma, mma, "split" if mma == "bf16" else None, None))
    variants = [(row, label + ("" if ff == "layer" else f"/{ff}"), mma, korder, dv, ff)
                for row, label, mma, korder, dv in variants for ff in args.fold_flags.split(",")]
    # tail launches (KernelConfig.tail_max) of the frag path: each value a variant, "d" = the default's
    tails = args.tail.split(",") if args.tail else ["d"]
    variants = [(row, label + ("" if tl_ == "d" or korder != "frag" else f"/tail{tl_}"), mma, korder, dv, ff,
                 None if tl_ == "d" or korder != "frag" else int(tl_))
                for row, label, mma, korder, dv, ff in variants for tl_ in tails]
    variants = list(dict.fromkeys(variants))
    for row, label, mma, korder, dv, ff_mode, tail_max in variants:
        spec = LayerSpec(row, H, I, E, K, ActivationSpec("swiglu", clamp=10.0), routed_scaling_factor=2.5)
        lay = synth.random_kernel_bytes(spec, "cuda", seed=1)
        from megamoe_runtime.backends.triton.backend import _NvScalars, _Roles

        kt = _Roles(lay, "")
        sc = _NvScalars(lay) if get_row(row).has_alphas else None
        # the weight arrangement a layer derives after its load for this path (megamoe_runtime.format.weight_tiles)
        wt = args.w_tile if args.w_tile is not None else configs.resolve_w_tile(
            spec, "cuda", configs.KernelConfig(mma=mma, k_order=korder))
        if wt and korder == "frag" and mma == "bf16":
            weight_tiles.tile_in_place(kt.l1_weight, wt)
            weight_tiles.tile_in_place(kt.l2_weight, wt)
        else:
            wt = 0
        label = label + (f"/t{wt}" if wt and args.w_tile is not None else "")
        # the per-expert fold flags a layer computes after its load ("layer"); "scan": none, each tile
        # scans its scale words after its main loop (what moe_forward does without flags)
        ff = moe.fold_flags(spec, kt) if ff_mode == "layer" else None
        ebytes = expert_bytes(row, H, I)
        for T in tokens:
            tw, ids = routing(T, E, K, seed=T)
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            touched = int(torch.unique(ids).numel())
            pairs = T * K
            # what a caller without a config gets (default_config), on the chosen path
            dvk = DECODE_VARIANTS.get(dv, {})
            cfgs = [dataclasses.replace(configs.default_config(pairs, E, korder, l1_gu=dvk.get("l1_gu"),
                                                           w_kind=configs.ROW_W_KIND[row], H=H, I=I), mma=mma,
                                        k_order=korder, **dvk)]
            if tail_max is not None:
                cfgs = [dataclasses.replace(cfgs[0], tail_max=tail_max)]
            if configs.ROW_W_KIND[row] == configs.W_E4M3_B128:
                from megamoe_runtime.backends.triton import block8

                cfgs = ([configs.KernelConfig(fp8=f) for f in block8.candidate_configs(pairs, E)] if args.tune
                        else [configs.KernelConfig()])
            elif args.tune and mma == "fp8":
                from megamoe_runtime.backends.triton import mma8

                cfgs = [configs.KernelConfig(mma=mma, fp8=f) for f in mma8.candidate_fp8_configs(pairs, E)]
            elif args.tune:
                cfgs = [dataclasses.replace(c, mma=mma, k_order=korder, **dvk)
                           for c in configs.candidate_configs(pairs, E, korder)
                           if dvk.get("l1_gu") is None or bool(c.l1_gu) == dvk["l1_gu"]]
            best = None
            for cfg in cfgs:
                try:
                    ms = _bench(lambda: moe.moe_forward(spec, kt, x, tw, ids, scalars=sc, config=cfg, w_tile=wt,
                                                        fold_flags=ff), graph=True, label=f"{shape_name} {row} {label} T={T}")
                except Exception as e:
                    print(f"# {shape_name} {row} T={T} cfg={cfg}: {type(e).__name__}: {str(e)[:300]}")
                    continue
                if args.tune:
                    print(f"#   tune {shape_name} {row} T={T} {cfg} {ms * 1e3:.1f} us", flush=True)
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            if best is None:
                continue
            ms, cfg = best
            if profiles is not None:
                print_breakdown(f"{shape_name} {row} {label} T={T}", kernel_breakdown(
                    lambda: moe.moe_forward(spec, kt, x, tw, ids, scalars=sc, config=cfg, w_tile=wt,
                                            fold_flags=ff)), profiles)
            act_bytes = 2 * T * H * 2 + pairs * I * 2 * 2 + pairs * H * 2 * 2
            wbytes = touched * ebytes
            gbps = (wbytes + act_bytes) / ms / 1e6
            flops = 2 * pairs * (2 * I * H + H * I)
            pms, pgraph = peer_ms.get(T, (float("nan"), None))
            r = dict(shape=shape_name, row=row, mma=label, T=T, peer_us=pms * 1e3, peer_graph=pgraph,
                     vs_peer=pms / ms, ms=ms, us=ms * 1e3, touched=touched,
                     weight_MB=wbytes / 1e6, GBps=gbps, frac_copy=gbps / bw, TFLOPs=flops / ms / 1e9,
                     baseline_us=base_ms.get(T, float("nan")) * 1e3,
                     speedup=base_ms.get(T, float("nan")) / ms, config=str(cfg) if cfg else "default",
                     baseline_graph=base_graph.get(T) if not args.no_baseline else None)
            p8ms, _ = peer8_ms.get(T, (float("nan"), None)) if row == "mxfp8" else (float("nan"), None)
            r.update(peer8_us=p8ms * 1e3, vs_peer8=p8ms / ms)
            results.append(r)
            print(f"{shape_name:5s} {row:6s} {label:9s} T={T:5d} {r['us']:9.1f} us  peer {r['peer_us']:8.1f} us "
                  f"x{r['vs_peer']:.2f}" + (f"  peer-mxfp8 {r['peer8_us']:8.1f} us x{r['vs_peer8']:.2f}"
                                           if row == "mxfp8" else "") + f"  touched={touched:3d} "
                  f"{r['GBps']:7.0f} GB/s ({100 * r['frac_copy']:4.0f}% copy)  {r['TFLOPs']:6.1f} TFLOP/s  "
                  f"baseline {r['baseline_us']:9.1f} us  x{r['speedup']:.2f}", flush=True)
        del lay, kt
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="set",
                    help="comma list of shape names (" + ", ".join(SHAPES) + "; set = " + ",".join(SHAPE_SET)
                         + "; new = " + ",".join(NEW_SET) + ") and custom shapes as H,I,E,K")
    ap.add_argument("--rows", default="mxfp4,mxfp8,nvfp4,bf16")
    ap.add_argument("--tokens", default="1,8,64,512,4096")
    ap.add_argument("--tune", action="store_true", help="time candidate tile configs per point, keep the best")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--mma", default="fp8,bf16", help="GEMM paths of the MX rows to time (fp8, bf16)")
    ap.add_argument("--korder", default="split,frag",
                    help="K orders of the E2M1 rows' bf16 GEMMs to time (split, frag; frag is labelled bf16-frag)")
    ap.add_argument("--decode", default=None,
                    help="frag-path decode variants to time, comma-separated: " + ", ".join(DECODE_VARIANTS)
                         + " (default: the backend's defaults only; labelled bf16-frag/VARIANT)")
    ap.add_argument("--no-peer8", action="store_true",
                    help="with --peer-path: skip the peer on E4M3 weights (the mxfp8 row's like-for-like column)")
    ap.add_argument("--peer-path", default=None,
                    help="folder holding OpenAI's triton_kernels: time its MoE on the same routing (peer column)")
    ap.add_argument("--w-tile", type=int, default=None,
                    help="rows per tile of the frag paths' weight arrangement (megamoe_runtime.format.weight_tiles); "
                         "default: what a layer derives (configs.resolve_w_tile), 0: the converted layout")
    ap.add_argument("--tail", default=None,
                    help="comma list of KernelConfig.tail_max values to time on the frag path (0 = no tail "
                         "launches, d = the default's; labelled /tailN)")
    ap.add_argument("--no-staging", action="store_true")
    ap.add_argument("--fold-flags", default="layer",
                    help="comma list: layer (the per-expert fold flags a loaded layer passes, default), scan "
                         "(none: each fold tile scans its scales)")
    ap.add_argument("--profile", action="store_true",
                    help="also print each point's per-kernel device time (torch.profiler, eager, L2 flushed)")
    ap.add_argument("--clocks", action="store_true",
                    help="sample the SM clock, board power and throttle reasons (nvidia-smi) during each timing of "
                         "the layer and the peer; printed as '# clocks' lines and written to OUT/clocks.json")
    ap.add_argument("--jobs", type=int, default=0,
                    help="first build the kernels of every (shape, row) in this many processes at once (untimed; "
                         "triton's disk cache hands them to the timed pass)")
    ap.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--job", default="0/1", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    args.profiles = []
    import triton

    if args.jobs and not args.compile_only:
        import subprocess

        t0 = time.time()
        procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--jobs", "0", "--compile-only",
                                   "--job", f"{j}/{args.jobs}", "--out", ""],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for j in range(args.jobs)]
        for p in procs:
            _, err = p.communicate()
            if p.returncode:
                print(f"# build job rc={p.returncode}: {err[-600:]}", flush=True)
        print(f"# build pass: {time.time() - t0:.0f} s in {args.jobs} processes", flush=True)
    if args.compile_only:
        _COMPILE_ONLY.append(True)
        jobs = [(s, sh, r) for s, sh in parse_shapes(args.shapes) for r in args.rows.split(",")]
        # the peer's kernels too, one job per (shape, weights), so the timed pass finds them compiled
        peer = args.peer_path
        if peer:
            jobs += [(s, sh, "peer:mxfp4") for s, sh in parse_shapes(args.shapes)]
            if "mxfp8" in args.rows.split(",") and not args.no_peer8:
                jobs += [(s, sh, "peer:mxfp8") for s, sh in parse_shapes(args.shapes)]
        j, n = (int(v) for v in args.job.split("/"))
        args.no_baseline, args.peer_path, args.profile = True, None, False
        toks = [int(t) for t in args.tokens.split(",")]
        for s, sh, r in jobs[j::n]:
            if r.startswith("peer:"):
                bench_peer(peer, sh["H"], sh["I"], sh["E"], sh["K"], toks, r.split(":")[1])
            else:
                bench_moe(s, [r], toks, 1.0, args, [], sh)
        return

    tokens = [int(t) for t in args.tokens.split(",")]
    dev = torch.cuda.get_device_name()
    info = dict(date=time.strftime("%Y-%m-%d"), gpu=dev, sms=torch.cuda.get_device_properties(0).multi_processor_count,
                torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda)
    print("#", json.dumps(info), flush=True)
    bw = copy_bandwidth()
    tf = matmul_tflops()
    from megamoe_runtime.backends.triton import decode_check

    info.update(copy_GBps=bw, bf16_matmul_TFLOPs=tf, e2m1_decode="prmt-lut" if decode_check.asm_decode_ok(
        torch.device("cuda")) else "arithmetic")
    print(f"# copy bandwidth {bw:.0f} GB/s (read+write), bf16 8192^3 matmul {tf:.0f} TFLOP/s", flush=True)
    results, staging_rows = [], []
    if not args.no_staging:
        for H in sorted({sh["H"] for _, sh in parse_shapes(args.shapes)}):
            staging_rows += bench_staging(tokens, H, bw)
        for r in staging_rows:
            print(f"staging {r['kind']:9s} T={r['T']:5d} H={r['H']} {r['ms'] * 1e3:8.1f} us "
                  f"{r['GBps']:7.0f} GB/s ({100 * r['frac']:4.0f}% copy)", flush=True)
    if args.clocks:
        from clocks import ClockSampler

        _SAMPLER.append(ClockSampler().start())
    for s, sh in parse_shapes(args.shapes):
        bench_moe(s, args.rows.split(","), tokens, bw, args, results, sh)
        if args.out:  # what is done so far, should the run be cut short
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "bench.json").write_text(json.dumps(dict(info=info, moe=results), indent=1))
    if _SAMPLER:
        _SAMPLER.pop().stop()
        for c in CLOCKS:
            print(f"# clocks {c['label']}: {c['us']} us, {c['n']} samples, SM {c.get('sm_mhz_mean')} MHz mean "
                  f"(min {c.get('sm_mhz_min')}), {c.get('power_w_mean')} W mean (max {c.get('power_w_max')}), "
                  f"throttle {c.get('throttle')}", flush=True)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "clocks.json").write_text(json.dumps(CLOCKS, indent=1))
    md = render(info, results, staging_rows)
    print(md)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench.md").write_text(md)
        (Path(args.out) / "bench.json").write_text(json.dumps(dict(info=info, moe=results, staging=staging_rows,
                                                                   profiles=args.profiles), indent=1))


def render(info, results, staging_rows) -> str:
    L = [f"Measured {info['date']} on {info['gpu']} ({info['sms']} SMs), torch {info['torch']}, "
         f"triton {info['triton']}, CUDA {info['cuda']}. Copy bandwidth {info['copy_GBps']:.0f} GB/s "
         f"(read+write), bf16 matmul {info['bf16_matmul_TFLOPs']:.0f} TFLOP/s. E2M1 decode: "
         f"{info.get('e2m1_decode')}.", "",
         "| shape | row | GEMM | tokens | time (us) | experts touched | weight MB | GB/s | % of copy BW | TFLOP/s "
         "| bf16 grouped_mm (us) | speedup | peer triton_kernels (us) | vs peer | peer, E4M3 weights (us) "
         "| vs that |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        star = "" if r.get("baseline_graph") in (True, None) else " (eager)"
        pstar = "" if r.get("peer_graph") in (True, None) else " (eager)"
        L.append(f"| {r['shape']} | {r['row']} | {r['mma']} | {r['T']} | {r['us']:.1f} | {r['touched']} | "
                 f"{r['weight_MB']:.0f} | {r['GBps']:.0f} | {100 * r['frac_copy']:.0f}% | {r['TFLOPs']:.1f} | "
                 f"{r['baseline_us']:.1f}{star} | {r['speedup']:.2f}x | {r['peer_us']:.1f}{pstar} | "
                 f"{r['vs_peer']:.2f}x | {r.get('peer8_us', float('nan')):.1f} | "
                 f"{r.get('vs_peer8', float('nan')):.2f}x |")
    if staging_rows:
        L += ["", "| staging | tokens | H | time (us) | GB/s | % of copy BW |", "|---|---|---|---|---|---|"]
        for r in staging_rows:
            L.append(f"| {r['kind']} | {r['T']} | {r['H']} | {r['ms'] * 1e3:.1f} | {r['GBps']:.0f} | "
                     f"{100 * r['frac']:.0f}% |")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    main()
