"""DeepGEMM's SM90 MegaMoE (`deep_gemm.fp8_mega_moe`) on one Hopper GPU: does it run, is it right, how fast.

Why: the block-FP8 row (E4M3 weights, fp32 128x128 block scales, FP8 activations per 1x128) is served
through the sgl-deep-gemm wheel's Hopper kernel. This script needs nothing of megamoe: it builds a
world-size-1 process group, makes random block-FP8 experts, lays them out through the package's own
`transform_weights_for_mega_moe_sm90`, runs the kernel, and compares with an fp32 computation written
here from the numerics in docs/KERNELS.md#sm90-fp8-mega (per-128 activation quantization, the
intermediate's per-64 requantization, top-k weight before it, bf16 per-expert outputs summed in fp32).
Negative controls (gate/up not interleaved, scales transposed, one block scale doubled) must move the
error far past the tolerance. Then it times the kernel against torch's bf16 grouped_mm on the same
weights dequantized, at several token counts.

    python bench/deepgemm_sm90.py --out $OUT            # DeepSeek-V3 expert shape
    python bench/deepgemm_sm90.py --experts 16 --hidden 1024 --intermediate 512 --tokens 64
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

E4M3_MAX = 448.0


def log(msg: str) -> None:
    print(msg, flush=True)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] fp32 -> E4M3 [E, N, K] and fp32 scales [E, N/128, K/128] (one per 128x128 block)."""
    e, n, k = w.shape
    blocks = w.view(e, n // 128, 128, k // 128, 128)
    amax = blocks.abs().amax(dim=(2, 4)).clamp_min(1e-8)
    scale = amax / E4M3_MAX
    q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).view(e, n, k)
    return q, scale.float().contiguous()


def dequant_blocks(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """One expert: E4M3 [N, K], scales [N/128, K/128] -> fp32 [N, K]."""
    return q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)


def quant_groups(v: torch.Tensor, group: int) -> torch.Tensor:
    """Per-row groups of `group`: scale = max(amax, 1e-10) / 448 in fp32 (a true division for the dispatch's
    128-groups, a multiply by fp32(1/448) for the intermediate's 64-groups: docs/NUMERICS.md#fp8-block), E4M3
    round-to-nearest with saturation; returns the dequantized fp32 values (what the next GEMM multiplies)."""
    t, n = v.shape
    g = v.view(t, n // group, group)
    amax = g.abs().amax(dim=2, keepdim=True).clamp_min(1e-10)
    # a tensor divisor: on CUDA torch turns a division by a Python number into a multiply by its reciprocal
    sf = amax / torch.tensor(E4M3_MAX, device=v.device) if group == 128 else amax * (1.0 / E4M3_MAX)
    q = (g * (1.0 / sf)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (q * sf).view(t, n)


def reference(x, topk_idx, topk_w, rsf, w1, s1, w2, s2, clamp=None) -> torch.Tensor:
    """fp32 forward of the SM90 kernel's numerics, expert by expert (weights dequantized one at a time)."""
    t, h = x.shape
    xa = quant_groups(x.float(), 128)
    out = torch.zeros(t, topk_idx.shape[1], h, dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for e in topk_idx.unique().tolist():
        if e < 0:
            continue
        tok, slot = (topk_idx == e).nonzero(as_tuple=True)
        a = xa[tok]
        gu = a @ dequant_blocks(w1[e], s1[e]).T
        g, u = gu[:, :inter], gu[:, inter:]
        if clamp is not None:
            g = g.clamp(max=clamp)
            u = u.clamp(-clamp, clamp)
        act = g * torch.sigmoid(g) * u
        act = act * (topk_w[tok, slot].float() * rsf)[:, None]
        a2 = quant_groups(act, 64)
        y = a2 @ dequant_blocks(w2[e], s2[e]).T
        out[tok, slot] = y.to(torch.bfloat16).float()
    return out.sum(dim=1).to(torch.bfloat16)


def calc_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    denom = (a * a + b * b).sum()
    return float(1 - 2 * (a * b).sum() / denom) if denom > 0 else 0.0


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128, help="tokens for the correctness check")
    p.add_argument("--bench-tokens", default="1,8,64,512,4096")
    p.add_argument("--rsf", type=float, default=2.5)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--skip-checks", action="store_true",
                   help="time only: no correctness runs, negative controls or graph-reload check before the table")
    p.add_argument("--triton-budget-s", type=float, default=150.0,
                   help="stop timing the triton layer (it compiles per configuration) after this many seconds")
    p.add_argument("--layer", action="store_true", help="also time megamoe's layer (deepgemm backend) on the same bytes")
    p.add_argument("--vs-reference", default="",
                   help="token counts (comma-separated) at which the triton and the deepgemm outputs are each compared "
                        "with megamoe's reference backend on the same layer (--layer)")
    p.add_argument("--skip-bf16", action="store_true", help="no bf16 grouped_mm timing (saves 22 GB and time)")
    p.add_argument("--gluon-l2", action="store_true",
                   help="time the triton layer twice, MEGAMOE_BLOCK8_L2=triton (block8's L2) then =gluon (each "
                        "captured in its own graph), their bytes compared")
    args = p.parse_args()
    results: dict = {"args": vars(args)}

    def save() -> None:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "deepgemm_sm90.json"), "w") as f:
            json.dump(results, f, indent=1)

    log(f"torch {torch.__version__} cuda {torch.version.cuda} device {torch.cuda.get_device_name()}")
    results["device"] = torch.cuda.get_device_name()
    results["torch"] = torch.__version__
    t0 = time.time()
    try:
        import deep_gemm
    except Exception as exc:  # the exact failure is the finding
        results["import_error"] = "".join(traceback.format_exception(exc))
        log("IMPORT FAILED:\n" + results["import_error"])
        save()
        return 1
    log(f"deep_gemm {getattr(deep_gemm, '__version__', '?')} imported in {time.time() - t0:.1f}s "
        f"from {os.path.dirname(deep_gemm.__file__)}")
    results["deep_gemm"] = getattr(deep_gemm, "__version__", "?")

    import torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    group = dist.group.WORLD
    try:  # older torch needs symmetric memory enabled per group; newer ones warn or lack it
        import torch.distributed._symmetric_memory as symm_mem
        symm_mem.enable_symm_mem_for_group(group.group_name)
    except Exception as exc:
        log(f"enable_symm_mem_for_group: {exc!r}")
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    E, H, I, K = args.experts, args.hidden, args.intermediate, args.topk
    dev = "cuda"

    # Random block-FP8 experts; the canonical gate|up order, then the package's SM90 transform.
    log("making weights")
    w1 = torch.empty(E, 2 * I, H, dtype=torch.float8_e4m3fn, device=dev)
    s1 = torch.empty(E, 2 * I // 128, H // 128, dtype=torch.float32, device=dev)
    w2 = torch.empty(E, H, I, dtype=torch.float8_e4m3fn, device=dev)
    s2 = torch.empty(E, H // 128, I // 128, dtype=torch.float32, device=dev)
    for e0 in range(0, E, 16):
        e1 = min(E, e0 + 16)
        # block scales spread over ~2 decades, so a wrong scale index shows
        spread1 = torch.exp2(torch.randint(-3, 4, (e1 - e0, 2 * I // 128, H // 128), device=dev).float())
        a = torch.randn(e1 - e0, 2 * I, H, device=dev) * 0.02
        a = a * spread1.repeat_interleave(128, 1).repeat_interleave(128, 2)
        w1[e0:e1], s1[e0:e1] = quantize_blocks(a)
        spread2 = torch.exp2(torch.randint(-3, 4, (e1 - e0, H // 128, I // 128), device=dev).float())
        b = torch.randn(e1 - e0, H, I, device=dev) * 0.02
        b = b * spread2.repeat_interleave(128, 1).repeat_interleave(128, 2)
        w2[e0:e1], s2[e0:e1] = quantize_blocks(b)
        del a, b
    (l1w, l1s), (l2w, l2s) = deep_gemm.transform_weights_for_mega_moe_sm90((w1, s1), (w2, s2))
    results["transform"] = {
        "l1_weight": [list(l1w.shape), str(l1w.dtype), list(l1w.stride())],
        "l1_sf": [list(l1s.shape), str(l1s.dtype), list(l1s.stride()), l1s.data_ptr() == s1.data_ptr()],
        "l2_weight": [list(l2w.shape), str(l2w.dtype), l2w.data_ptr() == w2.data_ptr()],
        "l2_sf": [list(l2s.shape), str(l2s.dtype), l2s.data_ptr() == s2.data_ptr()],
    }
    # The layout as docs/KERNELS.md states it: rows of gate/up interleaved in groups of 8.
    mine = torch.stack([w1[:, :I].view(E, I // 8, 8, H), w1[:, I:].view(E, I // 8, 8, H)], 2).view(E, 2 * I, H)
    results["transform"]["interleave8_equal"] = bool(torch.equal(mine.view(torch.uint8), l1w.view(torch.uint8)))
    del mine
    log(f"transform: {results['transform']}")
    save()

    max_tokens = max([args.tokens] + [int(t) for t in args.bench_tokens.split(",")])
    t0 = time.time()
    buf = deep_gemm.get_symm_buffer_for_sm90_mega_moe(group, E, max_tokens, K, H, I)
    log(f"symm buffer: {buf.buffer.numel() / 2**30:.2f} GiB for {max_tokens} tokens "
        f"({time.time() - t0:.1f}s); x {tuple(buf.x.shape)} {buf.x.dtype} x_sf {tuple(buf.x_sf.shape)} "
        f"topk_idx {tuple(buf.topk_idx.shape)} {buf.topk_idx.dtype} topk_w {tuple(buf.topk_weights.shape)}")
    results["symm_buffer_gib"] = buf.buffer.numel() / 2**30

    def route(t: int):
        x = torch.randn(t, H, device=dev, dtype=torch.bfloat16)
        x = x * torch.exp2(torch.randint(-2, 3, (t, H // 128), device=dev).float()).repeat_interleave(128, 1).bfloat16()
        logits = torch.randn(t, E, device=dev)
        w, idx = logits.softmax(-1).topk(K, dim=-1)
        return x, idx.int(), (w / w.sum(-1, keepdim=True)).float()

    def forward(x, idx, w, l1=(l1w, l1s), l2=(l2w, l2s), y=None):
        t = x.shape[0]
        if y is None:
            y = torch.empty(t, H, dtype=torch.bfloat16, device=dev)
        deep_gemm.mega_moe_pre_dispatch_sm90(x, idx, w, buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights,
                                             t, 128, args.rsf)
        deep_gemm.fp8_mega_moe(y, l1, l2, buf)
        return y

    if args.skip_checks:
        return bench_part(args, results, save, deep_gemm, buf, route, forward, w1, s1, w2, s2, l1w, l1s, l2w, l2s,
                          max_tokens)

    # ---- correctness ----
    x, idx, w = route(args.tokens)
    t0 = time.time()
    try:
        y = forward(x, idx, w)
        torch.cuda.synchronize()
    except Exception as exc:
        results["run_error"] = "".join(traceback.format_exception(exc))
        log("RUN FAILED:\n" + results["run_error"])
        save()
        return 1
    log(f"first fp8_mega_moe (JIT compile + run) {time.time() - t0:.1f}s")
    # pre-dispatch check: its FP8 bytes and scales against the rule written here
    t = args.tokens
    xs = x.float().view(t, H // 128, 128)
    sf = xs.abs().amax(-1).clamp_min(1e-10) / torch.tensor(E4M3_MAX, device=xs.device)
    q = (xs / sf[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    pd = {
        "x_sf_equal": bool(torch.equal(buf.x_sf[:t].view(-1).float(), sf.view(-1))),
        "x_sf_maxrel": float(((buf.x_sf[:t].view(-1).float() - sf.view(-1)).abs() / sf.view(-1)).max()),
        "x_bytes_mismatch": int((buf.x[:t].view(torch.uint8).view(t, H) != q.view(torch.uint8).view(t, H)).sum()),
        "topk_w_equal": bool(torch.equal(buf.topk_weights[:t].float(), w * args.rsf)),
    }
    results["pre_dispatch"] = pd
    log(f"pre-dispatch vs rule: {pd}")

    ref = reference(x, idx, w, args.rsf, w1, s1, w2, s2)
    diffs = {}
    for run in range(3):
        x, idx, w = route(args.tokens)
        ref = reference(x, idx, w, args.rsf, w1, s1, w2, s2)
        y = torch.full((t, H), float("nan"), dtype=torch.bfloat16, device=dev)
        forward(x, idx, w, y=y)
        torch.cuda.synchronize()
        diffs[f"run{run}"] = {"calc_diff": calc_diff(y, ref), "rel": rel_err(y, ref),
                              "nan": int(y.isnan().sum()),
                              "maxabs_ref": float(ref.float().abs().max())}
        log(f"run {run}: {diffs[f'run{run}']}")
    # same input twice: is the kernel deterministic?
    y2 = forward(x, idx, w)
    diffs["repeat_equal"] = bool(torch.equal(y, y2))
    results["correctness"] = diffs
    save()

    # ---- negative controls: each must be far past the tolerance ----
    neg = {}
    ref = reference(x, idx, w, args.rsf, w1, s1, w2, s2)
    bad_scale = s1.clone()
    used = idx[0, 0].item()
    bad_scale[used, 0, 0] *= 2
    bad_scale[used, I // 128, 0] *= 2
    controls = {
        "gate_up_not_interleaved": ((w1, l1s), (l2w, l2s)),
        "l1_scales_transposed": ((l1w, s1.transpose(1, 2).contiguous().view_as(s1)), (l2w, l2s)),
        "l2_scales_transposed": ((l1w, l1s), (l2w, s2.transpose(1, 2).contiguous().view_as(s2))),
        "one_l1_block_scale_doubled": ((l1w, bad_scale), (l2w, l2s)),
    }
    for name, (l1, l2) in controls.items():
        try:
            yb = forward(x, idx, w, l1=l1, l2=l2)
            torch.cuda.synchronize()
            neg[name] = {"calc_diff": calc_diff(yb, ref), "rel": rel_err(yb, ref)}
        except Exception as exc:
            neg[name] = {"refused": str(exc).splitlines()[0][:300]}
        log(f"negative control {name}: {neg[name]}")
    results["negative_controls"] = neg
    save()

    # ---- CUDA graph: capture pre-dispatch + kernel, replay, change weights in place ----
    try:
        xg, idxg, wg = route(64)
        yg = torch.empty(64, H, dtype=torch.bfloat16, device=dev)
        forward(xg, idxg, wg, y=yg)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            forward(xg, idxg, wg, y=yg)
        g.replay()
        torch.cuda.synchronize()
        ref_g = reference(xg, idxg, wg, args.rsf, w1, s1, w2, s2)
        before = rel_err(yg, ref_g)
        keep = l2s.clone()
        l2s.mul_(0.5)  # a "reload": new bytes into the same storage
        g.replay()
        torch.cuda.synchronize()
        after = rel_err(yg.float() * 2, ref_g.float())
        l2s.copy_(keep)
        results["cuda_graph"] = {"rel_before": before, "rel_after_halving_l2_scales_x2": after}
        log(f"cuda graph: {results['cuda_graph']}")
    except Exception as exc:
        results["cuda_graph"] = {"error": "".join(traceback.format_exception(exc))[-2000:]}
        log(f"cuda graph failed: {results['cuda_graph']}")
    save()
    if args.skip_bench:
        return 0
    del controls, bad_scale
    return bench_part(args, results, save, deep_gemm, buf, route, forward, w1, s1, w2, s2, l1w, l1s, l2w, l2s,
                      max_tokens)


def bench_part(args, results, save, deep_gemm, buf, route, forward, w1, s1, w2, s2, l1w, l1s, l2w, l2s,
               max_tokens) -> int:
    """The timing table: fp8_mega_moe direct, megamoe's layer on it and on the triton row (--layer), and
    torch's bf16 grouped_mm, at each of --bench-tokens, in this process on this card."""
    from triton.testing import do_bench
    E, H, I, K = args.experts, args.hidden, args.intermediate, args.topk
    dev = "cuda"
    torch.cuda.empty_cache()
    if not args.skip_bf16:
        w1b = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=dev)
        w2b = torch.empty(E, H, I, dtype=torch.bfloat16, device=dev)
        for e in range(E):
            w1b[e] = dequant_blocks(w1[e], s1[e]).bfloat16()
            w2b[e] = dequant_blocks(w2[e], s2[e]).bfloat16()

    def grouped_bf16(x, idx, w):
        t = x.shape[0]
        flat = idx.view(-1).long()
        order = flat.argsort()
        counts = torch.bincount(flat, minlength=E)
        offs = counts.cumsum(0).int()
        xs = x[order // K]
        gu = torch._grouped_mm(xs, w1b.transpose(1, 2), offs=offs)
        g_, u_ = gu[:, :I], gu[:, I:]
        a = torch.nn.functional.silu(g_) * u_
        o = torch._grouped_mm(a, w2b.transpose(1, 2), offs=offs)
        o = o * (w.view(-1)[order] * args.rsf)[:, None].bfloat16()
        y = torch.zeros(t, H, dtype=torch.float32, device=dev)
        y.index_add_(0, order // K, o.float())
        return y.bfloat16()

    layer = tri_layer = None
    if args.layer:
        # the same bytes through megamoe's layer and deepgemm backend (what a server runs)
        from megamoe_runtime.format.formats import LayerSpec
        from megamoe_runtime.format.layout import block_fp8_kernel_layout
        from megamoe_runtime.layer.experts import DeepGemmMegaMoEExperts

        spec = LayerSpec(row="fp8_block", hidden=H, intermediate=I, num_experts=E, top_k=K,
                         routed_scaling_factor=args.rsf)
        kt = block_fp8_kernel_layout((w1, s1), (w2, s2))

        def make_layer(backend, kwargs):
            lay = DeepGemmMegaMoEExperts(spec, device=dev, backend=backend, backend_kwargs=kwargs)
            lay.begin_load("stored")
            for role in ("l1_weight", "l1_scale", "l2_weight", "l2_scale"):
                lay.load_stored(role, getattr(kt, role), experts=(0, E))
            lay.finish_load()
            return lay

        layer = make_layer("auto", {"max_num_tokens": max_tokens})
        results["layer_backend"] = layer.backend.name
        log(f"layer backend (auto): {layer.backend.name}")
        try:
            tri_layer = make_layer("triton", None)
        except Exception as exc:  # the comparison is optional; its failure is reported
            tri_layer = None
            results["triton_error"] = str(exc)[:500]
            log(f"triton layer failed: {exc!r}"[:500])
        del kt
        torch.cuda.empty_cache()

    deadline = time.time() + args.triton_budget_s
    bench = []
    for t in [int(s) for s in args.bench_tokens.split(",")]:
        x, idx, w = route(t)
        y = torch.empty(t, H, dtype=torch.bfloat16, device=dev)
        t0 = time.time()
        forward(x, idx, w, y=y)
        torch.cuda.synchronize()
        compile_s = time.time() - t0
        row = {"tokens": t, "first_call_s": round(compile_s, 1)}
        row["deepgemm_ms"] = do_bench(lambda: forward(x, idx, w, y=y), warmup=25, rep=200, return_mode="median")
        row["pre_dispatch_ms"] = do_bench(lambda: deep_gemm.mega_moe_pre_dispatch_sm90(
            x, idx, w, buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights, t, 128, args.rsf),
            warmup=25, rep=100, return_mode="median")
        try:
            gg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gg):
                forward(x, idx, w, y=y)
            row["deepgemm_graph_ms"] = do_bench(gg.replay, warmup=25, rep=200, return_mode="median")
        except Exception as exc:
            row["deepgemm_graph_ms"] = f"error: {str(exc)[:200]}"
        if layer is not None:
            yl = layer(x, w, idx)
            row["layer_equal_direct"] = bool(torch.equal(yl, y))
            row["layer_ms"] = do_bench(lambda: layer(x, w, idx), warmup=25, rep=200, return_mode="median")
            gl = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gl):
                layer(x, w, idx)
            row["layer_graph_ms"] = do_bench(gl.replay, warmup=25, rep=200, return_mode="median")
        if tri_layer is not None and time.time() < deadline:
            try:
                if args.gluon_l2:  # the knob is read at launch: the choice is fixed when the graph is captured
                    os.environ["MEGAMOE_BLOCK8_L2"] = "triton"
                t0 = time.time()
                yt = tri_layer(x, w, idx)
                torch.cuda.synchronize()
                row["triton_first_call_s"] = round(time.time() - t0, 1)
                gt = torch.cuda.CUDAGraph()
                with torch.cuda.graph(gt):
                    tri_layer(x, w, idx)
                os.environ.pop("MEGAMOE_BLOCK8_L2", None)
                row["triton_graph_ms"] = do_bench(gt.replay, warmup=25, rep=200, return_mode="median")
                row["triton_vs_deepgemm_rel"] = rel_err(yt, y)
                row["triton_vs_deepgemm_calc_diff"] = calc_diff(yt, y)
                if isinstance(row.get("layer_graph_ms"), float):
                    row["triton_over_deepgemm_layer"] = row["triton_graph_ms"] / row["layer_graph_ms"]
                if args.gluon_l2:
                    os.environ["MEGAMOE_BLOCK8_L2"] = "gluon"
                    try:
                        yg = tri_layer(x, w, idx)
                        gq = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(gq):
                            tri_layer(x, w, idx)
                    finally:
                        del os.environ["MEGAMOE_BLOCK8_L2"]
                    row["gluon_l2_equal_triton"] = bool(torch.equal(yg, yt))
                    row["gluon_graph_ms"] = do_bench(gq.replay, warmup=25, rep=200, return_mode="median")
                    row["gluon_over_triton"] = row["gluon_graph_ms"] / row["triton_graph_ms"]
                    if isinstance(row.get("layer_graph_ms"), float):
                        row["gluon_over_deepgemm_layer"] = row["gluon_graph_ms"] / row["layer_graph_ms"]
            except Exception as exc:
                os.environ.pop("MEGAMOE_BLOCK8_L2", None)
                row["triton_error"] = str(exc)[:300]
        if tri_layer is not None and str(t) in args.vs_reference.split(","):
            row["vs_reference"] = vs_reference(tri_layer, x, w, idx, y)
            log(f"{t} tokens against the reference backend: {row['vs_reference']}")
        if not args.skip_bf16:
            yb = grouped_bf16(x, idx, w)
            row["bf16_grouped_mm_ms"] = do_bench(lambda: grouped_bf16(x, idx, w), warmup=25, rep=200,
                                                 return_mode="median")
        ref = reference(x[:64], idx[:64], w[:64], args.rsf, w1, s1, w2, s2) if t <= 512 else None
        row["rel_vs_ref"] = rel_err(y[:64], ref) if ref is not None else None
        row["bf16_rel_vs_ref"] = rel_err(yb[:64], ref) if ref is not None and not args.skip_bf16 else None
        # fewest bytes: weights of the experts the batch touches, once
        touched = int(idx.unique().numel())
        row["experts_touched"] = touched
        row["weight_gb"] = touched * 3 * H * I / 1e9
        row["deepgemm_TBps"] = row["weight_gb"] / row["deepgemm_ms"]
        row["tflops"] = t * K * 6 * H * I / row["deepgemm_ms"] / 1e9
        bench.append(row)
        log(json.dumps(row))
        results["bench"] = bench
        save()
    def ms(v):
        return f"{v:.3f}" if isinstance(v, float) else "-"

    log("\n| tokens | fp8_mega_moe ms | graph ms | layer ms | layer graph ms | triton layer graph ms | "
        "triton / deepgemm layer | bf16 grouped_mm ms | TFLOP/s | rel err |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    for r in bench:
        log(f"| {r['tokens']} | {r['deepgemm_ms']:.3f} | {ms(r['deepgemm_graph_ms'])} | {ms(r.get('layer_ms'))} | "
            f"{ms(r.get('layer_graph_ms'))} | {ms(r.get('triton_graph_ms'))} | "
            f"{ms(r.get('triton_over_deepgemm_layer'))} | {ms(r.get('bf16_grouped_mm_ms'))} | "
            f"{r['tflops']:.0f} | {r['rel_vs_ref']} |")
    if args.gluon_l2:
        log("\n| tokens | triton layer, block8 L2, graph ms | with the Gluon L2 ms | gluon / triton | gluon / deepgemm layer | "
            "bytes equal |")
        log("|---|---|---|---|---|---|")
        for r in bench:
            log(f"| {r['tokens']} | {ms(r.get('triton_graph_ms'))} | {ms(r.get('gluon_graph_ms'))} | "
                f"{ms(r.get('gluon_over_triton'))} | {ms(r.get('gluon_over_deepgemm_layer'))} | "
                f"{r.get('gluon_l2_equal_triton', '-')} |")
    return 0


def vs_reference(tri_layer, x, w, idx, y_deepgemm) -> dict:
    """The triton layer's output and DeepGEMM's (``y_deepgemm``, same inputs) each against megamoe's reference
    backend on the triton layer's bytes (fp32 promotions per 128-block, docs/NUMERICS.md#fp8-block): which of
    the two kernels sits where."""
    try:
        from megamoe_runtime.backends.reference import ReferenceBackend

        yt = tri_layer(x, w, idx)
        yr = ReferenceBackend().forward(tri_layer, x, w, idx)
        torch.cuda.synchronize()

        def same(a, b):
            return float((a.view(torch.int16) == b.view(torch.int16)).float().mean())

        per_tok_t = ((yt.double() - yr.double()).norm(dim=1) / yr.double().norm(dim=1).clamp_min(1e-30))
        per_tok_d = ((y_deepgemm.double() - yr.double()).norm(dim=1) / yr.double().norm(dim=1).clamp_min(1e-30))
        return {"triton_calc_diff": calc_diff(yt, yr), "deepgemm_calc_diff": calc_diff(y_deepgemm, yr),
                "triton_vs_deepgemm_calc_diff": calc_diff(yt, y_deepgemm),
                "triton_rel": rel_err(yt, yr), "deepgemm_rel": rel_err(y_deepgemm, yr),
                "triton_bitwise": same(yt, yr), "deepgemm_bitwise": same(y_deepgemm, yr),
                "triton_tok_rel_max": float(per_tok_t.max()), "deepgemm_tok_rel_max": float(per_tok_d.max()),
                "deepgemm_tok_rel_max_at": int(per_tok_d.argmax()),
                "deepgemm_tokens_rel_over_1e-2": int((per_tok_d > 1e-2).sum()),
                "triton_tokens_rel_over_1e-2": int((per_tok_t > 1e-2).sum())}
    except Exception as exc:
        return {"error": "".join(traceback.format_exception(exc))[-1500:]}


if __name__ == "__main__":
    sys.exit(main())
