#!/usr/bin/env python
"""Benchmark the triton backend's MoE forward and staging kernels on one GPU (issue 5).

    python bench/kernel.py                      # full table (DeepSeek-V3-like and GLM-like shapes)
    python bench/kernel.py --shapes dsv3 --rows mxfp4 --tokens 1,8 --tune

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
  index_add), also graph-captured; ratio = baseline time / triton time.
And the staging kernels (MXFP8 / NVFP4 quantization of the hidden states)
in GB/s against the copy bandwidth.

Writes a markdown table to stdout and, with --out DIR, ``bench.md`` and
``bench.json`` there.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"dsv3": dict(H=7168, I=2048, E=256, K=8), "glm": dict(H=6144, I=2048, E=256, K=8)}


def _bench(fn, graph: bool = True, rep: int = 200, warmup: int = 30) -> float:
    """Median ms. With graph=True the call is captured once and its replay timed."""
    import triton.testing as tt

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
    from megamoe_runtime.formats import get_row

    w = get_row(row).weight
    per = lambda n, k: n * (w.stored_cols(k) * (2 if w.element == "bf16" else 1) + 4 * w.scale_ints(k))
    return per(2 * I, H) + per(H, I)


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


def bench_staging(tokens, H, bw):
    from megamoe_runtime.backends.triton import staging

    rows = []
    for T in tokens:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        for name, fn, out_b in (
                ("mxfp8", lambda: staging.quantize_mxfp8(x), T * H + T * H // 32),
                ("nvfp4", lambda: staging.quantize_nvfp4_per_token(x), T * H // 2 + T * H // 16 + 4 * T),
                ("bf16 copy", lambda: staging.bf16_passthrough(x), 2 * T * H)):
            ms = _bench(fn, graph=True)
            nbytes = 2 * T * H + out_b
            rows.append(dict(kind=name, T=T, H=H, ms=ms, GBps=nbytes / ms / 1e6, frac=nbytes / ms / 1e6 / bw))
    return rows


def bench_moe(shape_name, rows, tokens, bw, args, results):
    from megamoe_runtime.backends.triton import moe, synth
    from megamoe_runtime.formats import ActivationSpec, LayerSpec

    sh = SHAPES[shape_name]
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
    for row in rows:
        spec = LayerSpec(row, H, I, E, K, ActivationSpec("swiglu", clamp=10.0), routed_scaling_factor=2.5)
        lay = synth.random_kernel_bytes(spec, "cuda", seed=1)
        from megamoe_runtime.backends.triton.backend import _NvScalars, _Roles

        kt = _Roles(lay, "")
        sc = _NvScalars(lay) if row == "nvfp4" else None
        ebytes = expert_bytes(row, H, I)
        for T in tokens:
            tw, ids = routing(T, E, K, seed=T)
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            touched = int(torch.unique(ids).numel())
            pairs = T * K
            configs = [None]
            if args.tune:
                configs = moe.candidate_configs(pairs, E)
            best = None
            for cfg in configs:
                try:
                    ms = _bench(lambda: moe.moe_forward(spec, kt, x, tw, ids, scalars=sc, config=cfg), graph=True)
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
            act_bytes = 2 * T * H * 2 + pairs * I * 2 * 2 + pairs * H * 2 * 2
            wbytes = touched * ebytes
            gbps = (wbytes + act_bytes) / ms / 1e6
            flops = 2 * pairs * (2 * I * H + H * I)
            r = dict(shape=shape_name, row=row, T=T, ms=ms, us=ms * 1e3, touched=touched,
                     weight_MB=wbytes / 1e6, GBps=gbps, frac_copy=gbps / bw, TFLOPs=flops / ms / 1e9,
                     baseline_us=base_ms.get(T, float("nan")) * 1e3,
                     speedup=base_ms.get(T, float("nan")) / ms, config=str(cfg) if cfg else "default",
                     baseline_graph=base_graph.get(T) if not args.no_baseline else None)
            results.append(r)
            print(f"{shape_name:5s} {row:6s} T={T:5d} {r['us']:9.1f} us  touched={touched:3d} "
                  f"{r['GBps']:7.0f} GB/s ({100 * r['frac_copy']:4.0f}% copy)  {r['TFLOPs']:6.1f} TFLOP/s  "
                  f"baseline {r['baseline_us']:9.1f} us  x{r['speedup']:.2f}", flush=True)
        del lay, kt
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="dsv3,glm")
    ap.add_argument("--rows", default="mxfp4,nvfp4,bf16")
    ap.add_argument("--tokens", default="1,8,64,512,4096")
    ap.add_argument("--tune", action="store_true", help="time candidate tile configs per point, keep the best")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--no-staging", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    import triton

    tokens = [int(t) for t in args.tokens.split(",")]
    dev = torch.cuda.get_device_name()
    info = dict(date=time.strftime("%Y-%m-%d"), gpu=dev, sms=torch.cuda.get_device_properties(0).multi_processor_count,
                torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda)
    print("#", json.dumps(info), flush=True)
    bw = copy_bandwidth()
    tf = matmul_tflops()
    from megamoe_runtime.backends.triton import moe as _moe

    info.update(copy_GBps=bw, bf16_matmul_TFLOPs=tf, e2m1_decode="prmt-lut" if _moe.asm_decode_ok(
        torch.device("cuda")) else "arithmetic")
    print(f"# copy bandwidth {bw:.0f} GB/s (read+write), bf16 8192^3 matmul {tf:.0f} TFLOP/s", flush=True)
    results, staging_rows = [], []
    if not args.no_staging:
        for H in sorted({SHAPES[s]["H"] for s in args.shapes.split(",")}):
            staging_rows += bench_staging(tokens, H, bw)
        for r in staging_rows:
            print(f"staging {r['kind']:9s} T={r['T']:5d} H={r['H']} {r['ms'] * 1e3:8.1f} us "
                  f"{r['GBps']:7.0f} GB/s ({100 * r['frac']:4.0f}% copy)", flush=True)
    for s in args.shapes.split(","):
        bench_moe(s, args.rows.split(","), tokens, bw, args, results)
    md = render(info, results, staging_rows)
    print(md)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench.md").write_text(md)
        (Path(args.out) / "bench.json").write_text(json.dumps(dict(info=info, moe=results, staging=staging_rows),
                                                              indent=1))


def render(info, results, staging_rows) -> str:
    L = [f"Measured {info['date']} on {info['gpu']} ({info['sms']} SMs), torch {info['torch']}, "
         f"triton {info['triton']}, CUDA {info['cuda']}. Copy bandwidth {info['copy_GBps']:.0f} GB/s "
         f"(read+write), bf16 matmul {info['bf16_matmul_TFLOPs']:.0f} TFLOP/s. E2M1 decode: "
         f"{info.get('e2m1_decode')}.", "",
         "| shape | row | tokens | time (us) | experts touched | weight MB | GB/s | % of copy BW | TFLOP/s "
         "| bf16 grouped_mm (us) | speedup |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        star = "" if r.get("baseline_graph") in (True, None) else " (eager)"
        L.append(f"| {r['shape']} | {r['row']} | {r['T']} | {r['us']:.1f} | {r['touched']} | {r['weight_MB']:.0f} | "
                 f"{r['GBps']:.0f} | {100 * r['frac_copy']:.0f}% | {r['TFLOPs']:.1f} | {r['baseline_us']:.1f}{star} | "
                 f"{r['speedup']:.2f}x |")
    if staging_rows:
        L += ["", "| staging | tokens | H | time (us) | GB/s | % of copy BW |", "|---|---|---|---|---|---|"]
        for r in staging_rows:
            L.append(f"| {r['kind']} | {r['T']} | {r['H']} | {r['ms'] * 1e3:.1f} | {r['GBps']:.0f} | "
                     f"{100 * r['frac']:.0f}% |")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    main()
