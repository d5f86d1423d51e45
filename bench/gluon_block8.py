#!/usr/bin/env python
"""An experiment: the block-FP8 row's L2 (``block8._l2_kernel``) in Gluon, with explicit asynchronous wgmma.

Why (docs/KERNELS.md "Where prefill still loses to DeepGEMM"): every 64 of K the L2 must promote the block's
fp32 partial (``acc + p * (s_w * s_x)``), and Triton places ``wgmma.wait_group 0`` right after every dot whose
result feeds anything but another dot's accumulator, so the tensor cores idle while the warpgroup promotes.
Here the kernel keeps two partial accumulators: it issues the MMA of K block k+1, waits with one group still
outstanding (``wgmma.wait_group 1``: block k's MMA is done, block k+1's still runs) and promotes block k
meanwhile. Loads: TMA into a ring of ``STAGES`` shared-memory slots (weight tile ``[BN, GA]`` and token tile
``[BM, GA]``, E4M3), one mbarrier per slot; a slot is refilled once the MMA that read it has completed. The
scales (one weight scale per K block, the intermediate's per token and GA) are read from global memory two K
blocks ahead of their promotion. The loop runs ``UNROLL`` K blocks per trip and lets the last MMA of a trip
finish before the next trip: with an MMA in flight across the back edge ptxas serializes every wgmma of the
kernel (docs/bench-log/kernels.md, the Gluon L2 entry), so one promotion in UNROLL is not overlapped.

Per output element the operations are block8's on the GPU (HW_CVT, not EXACT): per GA-wide K block one fresh
FP8 wgmma sum (the same ``m64n{BM}k32`` e4m3 instructions: two per block, the first with a zero accumulator),
then ``acc = acc + p * (s_w * s_x)`` in ascending K, each operation rounded (no fp contraction), and the bf16
slot output by ``cvt.rn``. So the slot bytes must equal block8's; ``--gpu`` checks that. Only the prefill
tile: BN = 128 weight rows (one weight scale per K block), one warpgroup (4 warps), ``BM`` tokens per row
block as ``block8.TILES["prefill"]``. It is not wired into the runtime.

    python bench/gluon_block8.py --compile-only [--json out.json]   # sm_90 cubins on a CPU: regs, spills, smem,
                                                                      # wgmma waits in the PTX and SASS K loop
    python bench/gluon_block8.py --gpu [--tokens 2048,4096] [--json out.json]   # bitwise vs block8, times

The kernel's arguments are ``block8._l2_kernel``'s except that the activation bytes and the weight bytes come
as TMA descriptors (E4M3-typed views: ``act [rows, I]`` and ``w`` as ``[E * H, I]``), ``WROWS`` (weight rows
per expert in that view) stands for the weight strides, and ``GPI``/``HW_CVT``/``EXACT`` are gone (the GPU
path, one promotion per GA).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import triton  # noqa: E402

try:  # Gluon is experimental: a Triton without it (or with another API) still gets block8's timing from --gpu
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    GLUON_ERROR = None
except Exception as _exc:  # noqa: BLE001
    GLUON_ERROR = f"{type(_exc).__name__}: {_exc}"

#: DeepSeek-V3's routed experts
H, I, E, K = 7168, 2048, 256, 8
#: the intermediate's scale group (the L2's K block) and the weight scale block
GA, WBLOCK = 64, 128
#: the prefill L2 tile (block8.TILES["prefill"]: 128 rows, 4 warps, 4 stages, 32-token row blocks)
BN, WARPS, STAGES = 128, 4, 4
#: K blocks per trip of the Gluon kernel's loop (one promotion per trip runs with no MMA in flight)
UNROLL = 8


# --------------------------------------------------------------------------- kernel

if GLUON_ERROR is None:  # the kernel and its helpers (module-level functions all the same)

    @gluon.jit
    def _issue(w_desc, x_desc, w_s, x_s, bars, k, wrow, xrow, GA: gl.constexpr, STAGES: gl.constexpr, pred):
        """TMA of K block k's weight and token tiles into slot k % STAGES, completing on its mbarrier."""
        s = k % STAGES
        bar = bars.index(s)
        mbarrier.expect(bar, w_desc.block_type.nbytes + x_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(w_desc, [wrow, k * GA], bar, w_s.index(s), pred=pred)
        tma.async_copy_global_to_shared(x_desc, [xrow, k * GA], bar, x_s.index(s), pred=pred)


    @gluon.jit
    def _mma(w_s, x_s, bars, k, p, STAGES: gl.constexpr):
        """Block k's fresh FP8 partial ``w @ x^T`` (asynchronous), once its tiles have landed; ``p`` is only the
        register set it is written into (use_acc=False: the first k32 step starts from zero)."""
        s = k % STAGES
        mbarrier.wait(bars.index(s), (k // STAGES) & 1)
        return warpgroup_mma(w_s.index(s), x_s.index(s).permute((1, 0)), p, use_acc=False, is_async=True)


    @gluon.jit
    def _scales(swp, as_ptr, arow, k, NK, NROWS, ws_sk, GA: gl.constexpr):
        """(weight scale, token scales [BM]) of K block k (clamped to the last block: a prefetch past the end
        reads in bounds and is never used)."""
        kk = gl.minimum(k, NK - 1)
        return gl.load(swp + ((kk * GA) // 128) * ws_sk), gl.load(as_ptr + kk * NROWS + arow)


    @gluon.jit
    def _promote(acc, p, sw, sx):
        """acc + p * (s_w * s_x): the product of the scales once per token, then the multiply and the add, each
        rounded (compiled without fp contraction): block8._promote with one weight scale."""
        return acc + p * gl.expand_dims(sw * sx, 0)


    @gluon.jit
    def _promote_now(acc, p, sw, sx, WAIT: gl.constexpr):
        """``_promote``, then the new accumulator and the promoted partial's registers passed through a wgmma wait
        that retires nothing new (the same number of groups stays outstanding). The wait is ordered before the
        next MMA and consumes the new accumulator, so the promotion is computed before the partial's registers
        are handed to that MMA: left free, the compiler sinks the promotion below it and copies the partial to
        new registers in the middle of the pipeline, and ptxas then serializes every wgmma (its C7515)."""
        acc = _promote(acc, p, sw, sx)
        return warpgroup_mma_wait(num_outstanding=WAIT, deps=[acc, p])


    @gluon.jit
    def _l2_gluon_kernel(x_desc, as_ptr, w_desc, ws_ptr, pair_ptr, blk_ptr, nblk_ptr, slot_ptr,
                         NROWS, H, I, TOPK, NSLOT, WROWS, ws_se, ws_sn, ws_sk,
                         BM: gl.constexpr, BN: gl.constexpr, GA: gl.constexpr, STAGES: gl.constexpr,
                         UNROLL: gl.constexpr, WAIT: gl.constexpr):
        """y = act @ W2^T for BN output rows of one row block -> bf16 slot outputs (block8._l2_kernel's result).

        WAIT: wgmma groups left outstanding while a partial is promoted (1; 0 is the serialized negative control)."""
        gl.static_assert(gl.num_warps() == 4, "one warpgroup")
        gl.static_assert(BN == 128, "one weight scale per K block")
        gl.static_assert(UNROLL % 2 == 0, "pairs of K blocks")
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        nb = gl.load(nblk_ptr)
        e = gl.load(blk_ptr + pid_m)
        if (pid_m >= nb) | (e < 0):
            return
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 32])
        col: gl.constexpr = gl.SliceLayout(0, mma)
        arow = pid_m * BM + gl.arange(0, BM, layout=col)
        swp = ws_ptr + e.to(gl.int64) * ws_se + ((pid_n * BN) // 128) * ws_sn
        wrow = e * WROWS + pid_n * BN
        xrow = pid_m * BM
        NK = I // GA

        w_s = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, GA], w_desc.layout)
        x_s = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, GA], x_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        for s in gl.static_range(STAGES):
            _issue(w_desc, x_desc, w_s, x_s, bars, s, wrow, xrow, GA, STAGES, s < NK)

        acc = gl.zeros([BN, BM], gl.float32, mma)
        p_a = gl.zeros([BN, BM], gl.float32, mma)
        p_b = gl.zeros([BN, BM], gl.float32, mma)
        sw_a, sx_a = _scales(swp, as_ptr, arow, 0, NK, NROWS, ws_sk, GA)
        sw_b, sx_b = _scales(swp, as_ptr, arow, 1, NK, NROWS, ws_sk, GA)
        # UNROLL K blocks per trip, partial A holding the even blocks and B the odd ones (no register moves between
        # them: an accumulator in flight is never copied). Inside a trip one MMA is always running while the
        # other partial is promoted; the trip's last block is promoted with none running, so that no wgmma is in
        # flight across the loop's back edge (with one, ptxas serializes every wgmma of the kernel, its C7514).
        # NK is a multiple of UNROLL (the host checks).
        for k0 in range(0, NK, UNROLL):
            p_a = _mma(w_s, x_s, bars, k0, p_a, STAGES)
            for i in gl.static_range(UNROLL // 2):
                k = k0 + 2 * i
                p_b = _mma(w_s, x_s, bars, k + 1, p_b, STAGES)
                p_a = warpgroup_mma_wait(num_outstanding=WAIT, deps=[p_a])  # block k done, k + 1 running
                acc, p_a = _promote_now(acc, p_a, sw_a, sx_a, WAIT)
                _issue(w_desc, x_desc, w_s, x_s, bars, k + STAGES, wrow, xrow, GA, STAGES, k + STAGES < NK)
                sw_a, sx_a = _scales(swp, as_ptr, arow, k + 2, NK, NROWS, ws_sk, GA)
                if i + 1 < UNROLL // 2:
                    p_a = _mma(w_s, x_s, bars, k + 2, p_a, STAGES)
                    p_b = warpgroup_mma_wait(num_outstanding=WAIT, deps=[p_b])  # block k + 1 done, k + 2 running
                else:
                    p_b = warpgroup_mma_wait(num_outstanding=0, deps=[p_b])  # the trip's last block: none running
                acc, p_b = _promote_now(acc, p_b, sw_b, sx_b, WAIT)
                _issue(w_desc, x_desc, w_s, x_s, bars, k + 1 + STAGES, wrow, xrow, GA, STAGES, k + 1 + STAGES < NK)
                sw_b, sx_b = _scales(swp, as_ptr, arow, k + 3, NK, NROWS, ws_sk, GA)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

        # bf16 (cvt.rn) slot outputs; output rows are contiguous in memory, so 8 of them per thread and store
        out: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, 4], [0, 1])
        y = gl.convert_layout(acc.to(gl.bfloat16), out)
        n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, out))
        pair = gl.load(pair_ptr + pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, out)))
        mvalid = pair >= 0
        pair = gl.where(mvalid, pair, 0)
        slot = (pair // TOPK).to(gl.int64) * NSLOT + pair % TOPK
        gl.store(slot_ptr + gl.expand_dims(slot, 0) * H + gl.expand_dims(n, 1), y, mask=gl.expand_dims(mvalid, 0))


# --------------------------------------------------------------------------- host side


def _descs(act: torch.Tensor, w: torch.Tensor, bm: int, bn: int):
    """TMA descriptors of the E4M3 activation bytes ``[rows, I]`` (tile ``[bm, GA]``) and weight bytes
    (``[E, N, I]`` as ``[E * N, I]``, tile ``[bn, GA]``), and the weight rows per expert."""
    wb = w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w
    if wb.dim() == 2:
        wb = wb.unsqueeze(0)
    if not wb.is_contiguous() or not act.is_contiguous():
        raise ValueError("gluon L2: contiguous activation and weight bytes only")
    w2 = wb.reshape(-1, wb.shape[-1]).view(torch.float8_e4m3fn)
    a2 = act.view(torch.float8_e4m3fn)
    lay_w = gl.NVMMASharedLayout.get_default_for([bn, GA], gl.float8e4nv)
    lay_x = gl.NVMMASharedLayout.get_default_for([bm, GA], gl.float8e4nv)
    return (TensorDescriptor.from_tensor(a2, [bm, GA], lay_x), TensorDescriptor.from_tensor(w2, [bn, GA], lay_w),
            wb.shape[1])


def launch_l2(act, asf, w, ws, plan, slots, H, I, K, nslot, bm, wait: int = 1, stages: int = STAGES,
              unroll: int = UNROLL, maxnreg=None):
    """``block8.launch_l2``'s arguments (prefill tile, GPU path), through the Gluon kernel; ``wait``, ``stages``,
    ``unroll``: the kernel's WAIT, STAGES, UNROLL; ``maxnreg``: a register cap (None: ptxas' choice)."""
    from megamoe_runtime.backends.triton import block8

    if GLUON_ERROR is not None:
        raise RuntimeError(f"gluon unavailable: {GLUON_ERROR}")
    if (I // GA) % unroll or unroll % 2:
        raise ValueError(f"gluon L2: UNROLL {unroll} must be even and divide I / GA = {I // GA}")
    se, sn, sk = block8._scale_strides(ws, "l2_scale")
    x_desc, w_desc, wrows = _descs(act, w, bm, BN)
    _l2_gluon_kernel[(H // BN, plan.max_blocks)](
        x_desc, asf, w_desc, ws, plan.sorted_pairs, plan.block_expert, plan.num_blocks, slots,
        plan.max_blocks * bm, H, I, K, nslot, wrows, se, sn, sk,
        BM=bm, BN=BN, GA=GA, STAGES=stages, UNROLL=unroll, WAIT=wait, num_warps=WARPS, enable_fp_fusion=False,
        **({} if maxnreg is None else {"maxnreg": maxnreg}))


# --------------------------------------------------------------------------- compile for sm_90 on a CPU


def _record(bm: int, wait: int, unroll: int = UNROLL, maxnreg=None, rows: int = 38400) -> list:
    """The Launch records (``tools/sm90_compile.recording``) of block8's prefill L2 and of the Gluon L2 at
    DeepSeek-V3's shape, on CPU tensors (nothing runs)."""
    import sm90_compile as sc
    from megamoe_runtime.backends.triton import block8
    from megamoe_runtime.backends.triton.staging import RoutingPlan

    mb = rows // bm
    plan = RoutingPlan(torch.zeros(mb * bm, dtype=torch.int32), torch.zeros(mb, dtype=torch.int32),
                       torch.zeros(1, dtype=torch.int32), bm, mb, K)
    act = torch.zeros(mb * bm, I, dtype=torch.uint8)
    asf = torch.zeros(I // GA, mb * bm)
    w = torch.zeros(E, H, I, dtype=torch.uint8)
    ws = torch.zeros(E, H // WBLOCK, I // WBLOCK)
    slots = torch.zeros(1, K, H, dtype=torch.bfloat16)
    rec: dict = {}
    fc = block8.TILES["prefill"]
    with sc.recording("block8", rec):
        block8.launch_l2(fc, act, asf, w, ws, plan, slots, H, I, K, K, bm, True)
    with sc.recording("gluon", rec):
        launch_l2(act, asf, w, ws, plan, slots, H, I, K, K, bm, wait=wait, unroll=unroll, maxnreg=maxnreg)
    return list(rec.values())


def wgmma_waits(ptx: str) -> dict:
    """``wgmma.wait_group.sync.aligned N`` counts by N (a string, as JSON keys) in the PTX: in the whole kernel, and in its main loop (the
    body of the PTX loop -- a label some later branch jumps back to -- holding the most ``wgmma.mma_async``)."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"^\s*(\$L__\w+):", ln))}
    best: tuple = (-1, [])
    for j, ln in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", ln)
        if m and m.group(1) in labels and labels[m.group(1)] < j:
            body = lines[labels[m.group(1)]:j + 1]
            n = sum("wgmma.mma_async" in x for x in body)
            if n > best[0]:
                best = (n, body)

    def count(body):
        out: dict = {}
        for x in body:
            m = re.search(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", x)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0) + 1
        return out

    return dict(kernel=count(lines), loop=count(best[1]), loop_mma=max(best[0], 0))


def _sass_waits(body: list) -> dict:
    """``WARPGROUP.DEPBAR.LE gsb0, N`` counts by N (a string) in SASS instructions: ptxas' wgmma waits."""
    out: dict = {}
    for t in body:
        m = re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)", t)
        if m:
            n = str(int(m.group(1), 16))
            out[n] = out.get(n, 0) + 1
    return out


def compile_launch(ln) -> dict:
    """Compile one recorded launch for sm_90 (``sm90_compile.compile_kernel``): resources, the PTX's and the
    SASS K loop's wgmma waits, the loop's instruction mix, and ptxas' warnings (e.g. wgmma serialization)."""
    import sm90_compile as sc

    k = sc.compile_kernel(ln.fn, ln.signature, ln.constexprs, ln.attrs, ln.options)
    res = sc._resources(k.asm["cubin"])
    body = sc.main_loop(sc.sass_instructions(sc._cuobjdump(k.asm["cubin"], "--dump-sass")))
    mix = sc.loop_mix(k.asm["cubin"], ln.options.get("num_warps", 4), None)
    cx = sc.named(ln.fn.arg_names, ln.constexprs)
    return dict(kernel=ln.kernel.rsplit(".", 1)[-1], regs=res["regs"], spill_bytes=res["local"], stack=res["stack"],
                shared=int(k.metadata.shared), warps=ln.options.get("num_warps"),
                stages=cx.get("STAGES", ln.options.get("num_stages")), maxnreg=ln.options.get("maxnreg"),
                tile={n: cx[n] for n in ("BM", "BN", "GA", "GPI", "UNROLL", "WAIT") if n in cx},
                ptx_waits=wgmma_waits(k.asm["ptx"]),
                sass_loop_waits=_sass_waits(body), sass_loop_instr=mix["loop_instr"],
                sass_loop_opcodes=dict(list(mix["opcodes"].items())[:12]),
                ptxas_warnings=ptxas_warnings(k.asm["ptx"]),
                fma_in_ptx=len(re.findall(r"\bfma\.rn\.f32\b", k.asm["ptx"])),
                wgmma_forms=sorted(set(re.findall(r"wgmma\.mma_async\.[\w.]+", k.asm["ptx"]))),
                bf16_cvt=sorted(set(re.findall(r"cvt\.\w+\.bf16(?:x2)?\.f32", k.asm["ptx"]))))


def ptxas_warnings(ptx: str) -> list:
    """ptxas' warnings for the PTX (sm_90a, Triton's flags): Triton hides them, and one says when ptxas serializes the
    wgmma pipeline ("wgmma.mma_async instructions are serialized")."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        # Triton's own ptxas flags for these kernels (no fp contraction)
        r = subprocess.run([ptxas, "-lineinfo", "--fmad=false", "-v", "--gpu-name=sm_90a", src, "-o",
                            os.path.join(d, "k.cubin")], capture_output=True, text=True)
    return [x.strip() for x in (r.stdout + r.stderr).splitlines()
            if "warning" in x.lower() or "performance loss" in x.lower()]


def compile_only(bm: int, wait: int = 1, unroll: int = UNROLL, maxnreg=None) -> list[dict]:
    """Both L2 kernels' prefill specializations compiled for sm_90 (with ``wait`` the Gluon loop's outstanding
    groups): one result each, block8 first; a kernel that does not compile gives its error."""
    out = []
    for ln in _record(bm, wait, unroll, maxnreg):
        try:
            out.append(compile_launch(ln))
        except Exception as exc:  # the compiler's message is the result
            out.append(dict(kernel=ln.kernel.rsplit(".", 1)[-1], error=f"{type(exc).__name__}: {exc}"[-3000:]))
    return out


def pipelined(r: dict) -> bool:
    """The K loop keeps one wgmma group in flight: ``wait_group 1`` in the PTX loop, and ptxas did not
    serialize it (no warning, a ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` in the SASS loop)."""
    return ("error" not in r and r["ptx_waits"]["loop"].get("1", 0) > 0 and r["sass_loop_waits"].get("1", 0) > 0
            and not any("serialized" in w for w in r["ptxas_warnings"]))


# --------------------------------------------------------------------------- GPU


def _problem(T: int, seed: int = 0, dev: str = "cuda"):
    """DeepSeek-V3's L2 at T tokens: random E4M3 weight bytes (no NaN codes) and power-of-two block scales,
    a uniform top-8 routing, and a random E4M3 intermediate with positive per-(row, 64) scales; padding rows
    zero, as the L1 writes them."""
    from megamoe_runtime.backends.triton import block8
    from megamoe_runtime.backends.triton.staging import route

    g = torch.Generator(device=dev).manual_seed(seed)

    def e4m3(*shape):
        b = torch.randint(0, 256, shape, generator=g, device=dev, dtype=torch.uint8)
        b[(b & 0x7F) == 0x7F] ^= 1
        return b

    w2 = torch.empty(E, H, I, dtype=torch.uint8, device=dev)
    for i in range(0, E, 16):
        w2[i:i + 16] = e4m3(min(16, E - i), H, I)
    s2 = torch.exp2(torch.randint(-12, -7, (E, H // WBLOCK, I // WBLOCK), generator=g, device=dev).float())
    ids = torch.argsort(torch.rand(T, E, generator=g, device=dev), dim=1)[:, :K].to(torch.int64)
    bm = block8.TILES["prefill"].block_m
    plan = route(ids, E, 0, bm)
    rows = plan.max_blocks * bm
    valid = (plan.sorted_pairs >= 0)
    act = e4m3(rows, I) * valid[:, None].to(torch.uint8)
    asf = torch.exp2(torch.randint(-10, -2, (I // GA, rows), generator=g, device=dev).float()) * valid[None, :]
    asf[:, ~valid] = torch.finfo(torch.float32).tiny  # padding rows: zero bytes, finite scales
    return dict(w=w2, ws=s2, plan=plan, act=act, asf=asf, bm=bm, T=T)


def _time(fn, reps: int) -> float:
    """Median ms of ``fn`` replayed in a CUDA graph (falls back to CUDA events if capture fails)."""
    fn()
    torch.cuda.synchronize()
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except Exception:
        run = fn
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        run()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


#: the Gluon configurations ``--gpu`` times: (name, wait, stages, unroll, maxnreg). Registers decide how many
#: programs share an SM (block8's 96 allow five; 174 allow two), so capped variants too (sm_90 compile: no
#: spills at a cap of 96 or 128, but more instructions per K block). "wait0": the negative controls (the same
#: kernels with every wgmma waited for at once: no overlap inside the warpgroup)
VARIANTS = (("u8", 1, 4, 8, None), ("u2", 1, 4, 2, None), ("u4", 1, 4, 4, None), ("u16", 1, 4, 16, None),
            ("u8_s6", 1, 6, 8, None), ("u2_r128", 1, 4, 2, 128), ("u4_r128", 1, 4, 4, 128),
            ("u8_r128", 1, 4, 8, 128), ("u2_r96", 1, 4, 2, 96), ("u4_r96", 1, 4, 4, 96),
            ("u8_wait0", 0, 4, 8, None), ("u4_r128_wait0", 0, 4, 4, 128))


def gpu(tokens: list[int], reps: int, variants=VARIANTS) -> dict:
    """block8's prefill L2 and the Gluon L2 configurations on the same inputs: differing slot bytes against
    block8's, median times, TFLOP/s, ratio to block8 (a failing configuration is reported and skipped)."""
    from megamoe_runtime.backends.triton import block8

    fc = block8.TILES["prefill"]
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                 "shape": dict(H=H, I=I, E=E, K=K), "block8_tile": fc.__dict__,
                 "variants": {v[0]: dict(wait=v[1], stages=v[2], unroll=v[3], maxnreg=v[4]) for v in variants},
                 "points": {}}
    for T in tokens:
        pr = _problem(T)
        plan, act, asf, w, ws, bm = pr["plan"], pr["act"], pr["asf"], pr["w"], pr["ws"], pr["bm"]
        pt: dict = {"block_m": bm, "rows": plan.max_blocks * bm}
        flops = 2.0 * T * K * H * I
        ref = torch.zeros(T, K, H, dtype=torch.bfloat16, device="cuda")

        def run_b8():
            block8.launch_l2(fc, act, asf, w, ws, plan, ref, H, I, K, K, bm, True)

        try:
            ms = _time(run_b8, reps)
            pt["block8"] = dict(ms=ms, tflops=flops / ms / 1e9)
            ref.zero_()
            run_b8()
            torch.cuda.synchronize()
        except Exception as exc:
            traceback.print_exc()
            pt["block8"] = dict(error=f"{type(exc).__name__}: {exc}"[-2000:])
        for name, wait, stages, unroll, maxnreg in variants:
            got = torch.zeros_like(ref)

            def run(wait=wait, stages=stages, unroll=unroll, maxnreg=maxnreg, got=got):
                launch_l2(act, asf, w, ws, plan, got, H, I, K, K, bm, wait=wait, stages=stages, unroll=unroll,
                          maxnreg=maxnreg)

            try:
                run()
                torch.cuda.synchronize()
                diff = int((got.view(torch.uint8) != ref.view(torch.uint8)).sum())
                ms = _time(run, reps)
                pt[name] = dict(ms=ms, tflops=flops / ms / 1e9, differing_bytes=diff, bytes=got.numel() * 2)
                if "ms" in pt["block8"]:
                    pt[name]["ratio_vs_block8"] = ms / pt["block8"]["ms"]
            except Exception as exc:  # a configuration that fails still leaves the others and block8's time
                traceback.print_exc()
                pt[name] = dict(error=f"{type(exc).__name__}: {exc}"[-2000:])
            del got
        res["points"][str(T)] = pt
        for k, v in pt.items():
            if isinstance(v, dict):
                print(f"T={T} {k:10s} " + (f"{v['ms']:.3f} ms {v['tflops']:.0f} TFLOP/s"
                                           + (f"  x{v['ratio_vs_block8']:.3f} of block8" if "ratio_vs_block8" in v else "")
                                           + (f"  differing bytes {v['differing_bytes']} of {v['bytes']}"
                                              if "differing_bytes" in v else "")
                                           if "ms" in v else f"FAILED {v['error'][-300:]}"), flush=True)
        del pr, act, asf, w, ref
        torch.cuda.empty_cache()
    return res


# --------------------------------------------------------------------------- CLI


def _fmt(r: dict) -> str:
    if "error" in r:
        return f"{r['kernel']:18s} FAILED {r['error'].splitlines()[-1][:200]}"
    tile = " ".join(f"{k}={v}" for k, v in r["tile"].items())
    cap = f" maxnreg {r['maxnreg']}" if r.get("maxnreg") else ""
    return (f"{r['kernel']:18s} [{tile}] w{r['warps']} s{r['stages']}{cap} regs {r['regs']:>3} spill {r['spill_bytes']} "
            f"smem {r['shared']:>6}  PTX wgmma.wait_group kernel {r['ptx_waits']['kernel']} loop {r['ptx_waits']['loop']} "
            f"({r['ptx_waits']['loop_mma']} wgmma in loop)  SASS loop DEPBAR gsb0 {r['sass_loop_waits']} "
            f"({r['sass_loop_instr']} instr)  ptxas warnings {len(r['ptxas_warnings'])}  fma {r['fma_in_ptx']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--compile-only", action="store_true", help="compile both L2 kernels for sm_90 (no GPU)")
    mode.add_argument("--gpu", action="store_true", help="bitwise check and timing on an SM90 GPU")
    ap.add_argument("--tokens", default="2048,4096")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--wait", type=int, default=1, help="--compile-only: outstanding wgmma groups in the loop")
    ap.add_argument("--unroll", type=int, default=UNROLL, help="--compile-only: K blocks per loop trip")
    ap.add_argument("--maxnreg", type=int, default=None, help="--compile-only: register cap of the Gluon kernel")
    ap.add_argument("--json", default="", help="write the results here")
    a = ap.parse_args(argv)
    if a.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)
        from megamoe_runtime.backends.triton import block8

        res = compile_only(block8.TILES["prefill"].block_m, a.wait, a.unroll, a.maxnreg)
        for r in res:
            print(_fmt(r))
        gl_res = [r for r in res if r["kernel"] == "_l2_gluon_kernel"]
        ok = bool(gl_res) and all("error" not in r and not r["spill_bytes"] for r in gl_res)
        print(f"gluon loop keeps one wgmma group in flight: {bool(gl_res) and pipelined(gl_res[0])}")
        out: object = res
    else:
        if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
            print("--gpu needs an SM90 GPU")
            return 2
        out = dict(gpu=gpu([int(t) for t in a.tokens.split(",")], a.reps))
        ok = all("ms" in v and v.get("differing_bytes", 0) == 0 for p in out["gpu"]["points"].values()
                 for v in p.values() if isinstance(v, dict))
        # the sm_90 compile figures of the same kernels, last: the recording replaces the process's driver
        try:
            out["compile"] = compile_only(32, 1)
            for r in out["compile"]:
                print(_fmt(r))
        except Exception as exc:
            out["compile_error"] = repr(exc)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
