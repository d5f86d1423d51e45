#!/usr/bin/env python
"""An experiment: the block-FP8 row's prefill L2 and L1 (``block8._l2_kernel``, ``_l1_kernel``) in Gluon, with
explicit asynchronous wgmma.

Why (docs/KERNELS.md "Where prefill still loses to DeepGEMM"): every K block the kernels must promote the
block's fp32 partial (``acc + p * (s_w * s_x)``), and Triton places ``wgmma.wait_group 0`` right after every dot
whose result feeds anything but another dot's accumulator, so the tensor cores idle while the warpgroup
promotes. Here each kernel keeps two sets of partial accumulators: it issues the MMA of K block k+1, waits with
its groups still outstanding (``wgmma.wait_group 1``, the L1 ``2``: block k's MMAs are done, block k+1's still
run) and promotes block k meanwhile. The scales are read from global memory two K blocks ahead. The loops run
``UNROLL`` K blocks per trip and let the trip's last MMA finish before the next trip: with an MMA in flight
across the back edge ptxas serializes every wgmma of the kernel (docs/bench-log/kernels.md, the Gluon entry),
so one promotion in UNROLL is not overlapped.

* L2: TMA loads into a ring of ``STAGES`` shared-memory slots (weight tile ``[BN, GA]``, token tile ``[BM, GA]``,
  E4M3), one mbarrier per slot, a slot refilled once the MMAs that read it have completed; one warpgroup
  (block8's prefill tile) or two (8 warps, 64 weight rows each).
* L1: gate and up dots of 128 rows each (block8's interleaved kernel rows), K blocks of 128, two warpgroups;
  cp.async loads (the token rows are gathered) with one CTA barrier per block; block8's epilogue.
* L1 with TMA weights (``--kernels l1t``): the 256 interleaved gate / up rows of 128 intermediate columns as one
  ``[256, 128]`` TMA box and one wgmma group per K block, split into gate and up in registers for the epilogue;
  token rows by cp.async; pipelined (two partials) or ``serial`` (one, small enough for two programs per SM).

Per output element the operations are block8's on the GPU (HW_CVT, not EXACT): per K block one fresh FP8 wgmma
sum per dot (the same ``m64n32k32`` e4m3 instructions, the first k32 step from zero), then the promotions in
ascending K, each operation rounded (no fp contraction), and the same epilogue roundings. So the output bytes
must equal block8's; ``--gpu`` checks that. Only the prefill tiles (``block8.TILES["prefill"]``: 32-token row
blocks, 128 rows per dot). The L2 is the runtime's (``megamoe_runtime/backends/triton/block8_gluon.py``, the
prefill default); the L1s are not wired into the runtime (measured slower than or level with block8's:
docs/bench-log/kernels.md).

    python bench/gluon_block8.py --compile-only [--kernels l2,l1,l1t] [--control] [--json out.json]
        # sm_90 cubins on a CPU, beside block8's: registers, spills, shared memory, wgmma waits in the PTX and
        # SASS K loops, ptxas' notes
    python bench/gluon_block8.py --gpu [--tokens 2048,4096] [--json out.json]
        # SM90 GPU: bytes differing from block8's, median times, TFLOP/s, ratios, for each configuration

The L2 kernel's arguments are ``block8._l2_kernel``'s except that the activation bytes and the weight bytes
come as TMA descriptors (E4M3-typed views: ``act [rows, I]`` and ``w`` as ``[E * H, I]``), ``WROWS`` (weight
rows per expert in that view) stands for the weight strides, and ``GPI``/``HW_CVT``/``EXACT`` are gone; the L1
kernel's are ``block8._l1_kernel``'s without ``PAIRED``/``HW_CVT``/``EXACT``. Both add ``STAGES``, ``UNROLL``
and ``WAIT`` (outstanding groups while promoting; 0 is the negative control).
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

from megamoe_runtime.backends.triton import block8_gluon as _g2  # noqa: E402

try:  # Gluon is experimental: a Triton without it (or with another API) still gets block8's timing from --gpu
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.extra import libdevice
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
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
#: where ``--gpu`` builds its problems; "cpu" only for the CPU test of its flow (interpreter, Gluon launches
#: stood in for by block8's)
DEV = "cuda"


# --------------------------------------------------------------------------- kernel

if GLUON_ERROR is None:  # the kernels and their helpers (module-level functions all the same)
    from megamoe_runtime.backends.triton import block8 as _b8

    #: the intermediate's requant constants, block8's (fp32 values)
    _AMAX_FLOOR_C = gl.constexpr(_b8._AMAX_FLOOR.value)
    _INV_E4M3_MAX_C = gl.constexpr(_b8._INV_E4M3_MAX.value)

    # the L2 and its helpers are the runtime's (megamoe_runtime/backends/triton/block8_gluon.py)
    from megamoe_runtime.backends.triton.block8_gluon import (_issue, _l2_gluon_kernel, _mma,  # noqa: F401
                                                              _promote, _promote_now, _scales)



    # ----------------------------------------------------------------------- L1 (paired gate / up dots)

    @gluon.jit
    def _l1_token_rows(x_ptr, pair_ptr, pid_m, H, TOPK, BM: gl.constexpr, KB: gl.constexpr, ld: gl.constexpr):
        """Pointers [BM, KB] to the first K block of the row block's token rows, gathered by pair (a padding row
        reads token 0; its scale is 0)."""
        f8p: gl.constexpr = gl.pointer_type(gl.float8e4nv)
        pair_l = gl.load(pair_ptr + pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, ld)))
        tok_l = (gl.where(pair_l >= 0, pair_l, 0) // TOPK).to(gl.int64)
        i = gl.arange(0, KB, layout=gl.SliceLayout(0, ld))
        return x_ptr.to(f8p) + gl.expand_dims(tok_l * H, 1) + gl.expand_dims(i, 0)

    @gluon.jit
    def _l1_load(x_s, wg_s, wu_s, xp, wg, wu, k, NK, KB: gl.constexpr, STAGES: gl.constexpr):
        """cp.async of K block k's token rows and gate / up weight rows into slot k % STAGES, one commit group
        (empty past the last block, so that the groups stay counted one per block)."""
        s = k % STAGES
        ok = k < NK
        off = k * KB
        async_copy.async_copy_global_to_shared(x_s.index(s), xp + off, mask=ok)
        async_copy.async_copy_global_to_shared(wg_s.index(s), wg + off, mask=ok)
        async_copy.async_copy_global_to_shared(wu_s.index(s), wu + off, mask=ok)
        async_copy.commit_group()

    @gluon.jit
    def _l1_mma(x_s, wg_s, wu_s, k, p_g, p_u, STAGES: gl.constexpr):
        """Block k's fresh gate and up partials (two asynchronous wgmma groups)."""
        s = k % STAGES
        xt = x_s.index(s).permute((1, 0))
        p_g = warpgroup_mma(wg_s.index(s), xt, p_g, use_acc=False, is_async=True)
        p_u = warpgroup_mma(wu_s.index(s), xt, p_u, use_acc=False, is_async=True)
        return p_g, p_u

    @gluon.jit
    def _l1_scales(sgp, sup, xs_ptr, orow, k, NK, NROWS, ws_sk):
        """(gate weight scale, up weight scale, token scales [BM]) of K block k (clamped to the last block)."""
        kk = gl.minimum(k, NK - 1)
        kb = kk * ws_sk
        return gl.load(sgp + kb), gl.load(sup + kb), gl.load(xs_ptr + kk * NROWS + orow)

    @gluon.jit
    def _l1_promote_now(acc_g, acc_u, p_g, p_u, sg, su, sx, WAIT: gl.constexpr):
        """Both promotions (block8's PAIRED order: gate, then up), then through a wait that retires nothing
        new (``_promote_now``)."""
        acc_g = _promote(acc_g, p_g, sg, sx)
        acc_u = _promote(acc_u, p_u, su, sx)
        return warpgroup_mma_wait(num_outstanding=WAIT, deps=[acc_g, acc_u, p_g, p_u])

    @gluon.jit
    def _l1_gluon_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, pair_ptr, blk_ptr, nblk_ptr, tw_ptr, act_ptr, as_ptr,
                         NROWS, H, I, TOPK, stride_we, stride_wn, ws_se, ws_sn, ws_sk, rsf, clamp_c,
                         HAS_CLAMP: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, GA: gl.constexpr,
                         STAGES: gl.constexpr, UNROLL: gl.constexpr, WAIT: gl.constexpr):
        """h = x @ W13^T for BN intermediate columns of one row block, then block8's L1 epilogue (clamp,
        silu(g) * u, top-k weight * rsf, E4M3 requant per GA) -> act bytes + scales: block8._l1_kernel (PAIRED,
        GPU path) with the gate and up MMAs of block k+1 running while block k is promoted.

        Loads: cp.async (the token rows are gathered) into a ring of STAGES slots; one CTA barrier per block,
        after which the slot of block k-2 (retired by both warpgroups) is refilled with block k+STAGES-2.
        WAIT: wgmma groups left outstanding while promoting, in pairs (2: block k's gate and up; 0: the
        serialized negative control)."""
        gl.static_assert(gl.num_warps() == 8, "two warpgroups")
        gl.static_assert(BN == 128, "one weight scale block per dot")
        gl.static_assert(UNROLL % 2 == 0, "pairs of K blocks")
        gl.static_assert(STAGES >= 3, "blocks k-1, k and k+1 resident")
        KB: gl.constexpr = 128
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        nb = gl.load(nblk_ptr)
        e = gl.load(blk_ptr + pid_m)
        if (pid_m >= nb) | (e < 0):
            return
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BM, 32])
        col: gl.constexpr = gl.SliceLayout(0, mma)
        row: gl.constexpr = gl.SliceLayout(1, mma)
        ld: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [8, 1], [1, 0])
        f8p: gl.constexpr = gl.pointer_type(gl.float8e4nv)
        e64 = e.to(gl.int64)
        # token rows and gate / up weight rows
        xp = _l1_token_rows(x_ptr, pair_ptr, pid_m, H, TOPK, BM, KB, ld)
        i = gl.arange(0, KB, layout=gl.SliceLayout(0, ld))
        j = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ld))
        wg = (w_ptr.to(f8p) + e64 * stride_we + gl.expand_dims((16 * (j // 8) + j % 8) * stride_wn, 1)
              + gl.expand_dims(i, 0))
        wu = wg + 8 * stride_wn
        orow = pid_m * BM + gl.arange(0, BM, layout=col)
        sgp = ws_ptr + e64 * ws_se + ((pid_n * BN) // KB) * ws_sn
        sup = sgp + (I // KB) * ws_sn
        NK = H // KB

        lay_w: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, KB], gl.float8e4nv)
        lay_x: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, KB], gl.float8e4nv)
        wg_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, KB], lay_w)
        wu_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, KB], lay_w)
        x_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, KB], lay_x)
        for s in gl.static_range(STAGES - 2):
            _l1_load(x_s, wg_s, wu_s, xp, wg, wu, s, NK, KB, STAGES)

        acc_g = gl.zeros([BN, BM], gl.float32, mma)
        acc_u = gl.zeros([BN, BM], gl.float32, mma)
        pga = gl.zeros([BN, BM], gl.float32, mma)
        pua = gl.zeros([BN, BM], gl.float32, mma)
        pgb = gl.zeros([BN, BM], gl.float32, mma)
        pub = gl.zeros([BN, BM], gl.float32, mma)
        sga, sua, sxa = _l1_scales(sgp, sup, xs_ptr, orow, 0, NK, NROWS, ws_sk)
        sgb, sub, sxb = _l1_scales(sgp, sup, xs_ptr, orow, 1, NK, NROWS, ws_sk)
        # UNROLL K blocks per trip as the L2 (partials A: even blocks, B: odd ones; nothing in flight across
        # the back edge). Block k: its copies landed (this thread's, then the barrier: everyone's, and both
        # warpgroups are past block k-2's MMAs), refill block k-2's slot, issue block k's MMAs, retire block
        # k-1's, promote block k-1.
        for k0 in range(0, NK, UNROLL):
            async_copy.wait_group(STAGES - 3)
            fence_async_shared()
            gl.thread_barrier()
            _l1_load(x_s, wg_s, wu_s, xp, wg, wu, k0 + STAGES - 2, NK, KB, STAGES)
            pga, pua = _l1_mma(x_s, wg_s, wu_s, k0, pga, pua, STAGES)
            for t in gl.static_range(UNROLL // 2):
                k = k0 + 2 * t
                async_copy.wait_group(STAGES - 3)
                fence_async_shared()
                gl.thread_barrier()
                _l1_load(x_s, wg_s, wu_s, xp, wg, wu, k + 1 + STAGES - 2, NK, KB, STAGES)
                pgb, pub = _l1_mma(x_s, wg_s, wu_s, k + 1, pgb, pub, STAGES)
                pga, pua = warpgroup_mma_wait(num_outstanding=WAIT, deps=[pga, pua])  # block k done
                acc_g, acc_u, pga, pua = _l1_promote_now(acc_g, acc_u, pga, pua, sga, sua, sxa, WAIT)
                sga, sua, sxa = _l1_scales(sgp, sup, xs_ptr, orow, k + 2, NK, NROWS, ws_sk)
                if t + 1 < UNROLL // 2:
                    async_copy.wait_group(STAGES - 3)
                    fence_async_shared()
                    gl.thread_barrier()
                    _l1_load(x_s, wg_s, wu_s, xp, wg, wu, k + 2 + STAGES - 2, NK, KB, STAGES)
                    pga, pua = _l1_mma(x_s, wg_s, wu_s, k + 2, pga, pua, STAGES)
                    pgb, pub = warpgroup_mma_wait(num_outstanding=WAIT, deps=[pgb, pub])  # block k + 1 done
                else:
                    pgb, pub = warpgroup_mma_wait(num_outstanding=0, deps=[pgb, pub])  # none running
                acc_g, acc_u, pgb, pub = _l1_promote_now(acc_g, acc_u, pgb, pub, sgb, sub, sxb, WAIT)
                sgb, sub, sxb = _l1_scales(sgp, sup, xs_ptr, orow, k + 3, NK, NROWS, ws_sk)
        async_copy.wait_group(0)

        _l1_epilogue(acc_g, acc_u, pair_ptr, tw_ptr, act_ptr, as_ptr, pid_m, pid_n, NROWS, I, rsf, clamp_c,
                     HAS_CLAMP, BM, BN, GA)


    @gluon.jit
    def _l1_epilogue(acc_g, acc_u, pair_ptr, tw_ptr, act_ptr, as_ptr, pid_m, pid_n, NROWS, I, rsf, clamp_c,
                     HAS_CLAMP: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, GA: gl.constexpr):
        """block8's L1 epilogue (block8._silu_mul, the top-k weight, block8._requant) on the gate and up
        accumulators [BN, BM] in the two-warpgroup wgmma layout -> act bytes + scales of the row block."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BM, 32])
        col: gl.constexpr = gl.SliceLayout(0, mma)
        row: gl.constexpr = gl.SliceLayout(1, mma)
        orow = pid_m * BM + gl.arange(0, BM, layout=col)
        if HAS_CLAMP:
            acc_g = gl.minimum(acc_g, clamp_c)
            acc_u = gl.maximum(gl.minimum(acc_u, clamp_c), -clamp_c)
        one = gl.full([BN, BM], 1.0, gl.float32, mma)
        a = (acc_g * gl.div_rn(one, one + libdevice.exp(-acc_g))) * acc_u
        pair = gl.load(pair_ptr + pid_m * BM + gl.arange(0, BM, layout=col))
        mvalid = pair >= 0
        w = gl.load(tw_ptr + gl.where(mvalid, pair, 0), mask=mvalid, other=0.0) * rsf
        a = a * gl.expand_dims(w, 0)
        grp = gl.expand_dims(gl.arange(0, BN, layout=row) // GA, 1)
        inv_rows = gl.zeros([BN, BM], gl.float32, mma)
        for g in gl.static_range(BN // GA):
            amax = gl.max(gl.where(grp == g, gl.abs(a), 0.0), axis=0)
            sc = gl.maximum(amax, _AMAX_FLOOR_C) * _INV_E4M3_MAX_C
            inv = gl.div_rn(gl.full([BM], 1.0, gl.float32, col), sc)
            inv_rows = gl.where(grp == g, gl.expand_dims(inv, 0), inv_rows)
            gl.store(as_ptr + (pid_n * (BN // GA) + g) * NROWS + orow, sc)
        v = gl.minimum(gl.maximum(a * inv_rows, -448.0), 448.0)
        q = v.to(gl.float8e4nv).to(gl.uint8, bitcast=True)
        st: gl.constexpr = gl.BlockedLayout([16, 1], [8, 4], [1, 8], [0, 1])
        q = gl.convert_layout(q, st)
        jo = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, st))
        ro = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, st))
        # padding rows too (zeros, finite scales): the L2 reads whole row blocks
        gl.store(act_ptr + gl.expand_dims(ro.to(gl.int64) * I, 0) + gl.expand_dims(jo, 1), q)

    # ----------------------------------------------------------------------- L1, weights by TMA

    @gluon.jit
    def _l1t_load(w_desc, x_s, w_s, bars, xp, k, NK, wrow, KB: gl.constexpr, STAGES: gl.constexpr):
        """K block k into slot k % STAGES: the 2 x 128 interleaved gate / up weight rows by one TMA (completing on
        the slot's mbarrier), the gathered token rows by cp.async (one commit group, empty past the last block)."""
        s = k % STAGES
        ok = k < NK
        bar = bars.index(s)
        mbarrier.expect(bar, w_desc.block_type.nbytes, pred=ok)
        tma.async_copy_global_to_shared(w_desc, [wrow, k * KB], bar, w_s.index(s), pred=ok)
        async_copy.async_copy_global_to_shared(x_s.index(s), xp + k * KB, mask=ok)
        async_copy.commit_group()

    @gluon.jit
    def _l1t_mma(w_s, x_s, bars, k, p, STAGES: gl.constexpr):
        """Block k's fresh interleaved gate / up partial (one asynchronous wgmma group), once its weight tile
        has landed (the token rows: the caller's wait and barrier)."""
        s = k % STAGES
        mbarrier.wait(bars.index(s), (k // STAGES) & 1)
        return warpgroup_mma(w_s.index(s), x_s.index(s).permute((1, 0)), p, use_acc=False, is_async=True)

    @gluon.jit
    def _l1t_scales(sgp, sup, xs_ptr, orow, k, NK, NROWS, ws_sk):
        """(s_gate * s_x, s_up * s_x) of K block k, [BM] each (each product rounded once per token, as block8's);
        clamped to the last block."""
        kk = gl.minimum(k, NK - 1)
        kb = kk * ws_sk
        sx = gl.load(xs_ptr + kk * NROWS + orow)
        return gl.load(sgp + kb) * sx, gl.load(sup + kb) * sx

    @gluon.jit
    def _l1t_promote_now(acc, p, fg, fu, gate_rows, WAIT: gl.constexpr):
        """``_promote_now`` on interleaved rows: gate rows take ``fg``, up rows ``fu`` (which row is which is
        fixed per register by the accumulator layout)."""
        acc = acc + p * gl.where(gate_rows, gl.expand_dims(fg, 0), gl.expand_dims(fu, 0))
        return warpgroup_mma_wait(num_outstanding=WAIT, deps=[acc, p])

    @gluon.jit
    def _l1t_gluon_kernel(x_ptr, xs_ptr, w_desc, ws_ptr, pair_ptr, blk_ptr, nblk_ptr, tw_ptr, act_ptr, as_ptr,
                          NROWS, H, I, TOPK, ws_se, ws_sn, ws_sk, rsf, clamp_c,
                          HAS_CLAMP: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, GA: gl.constexpr,
                          STAGES: gl.constexpr, UNROLL: gl.constexpr, WAIT: gl.constexpr, SERIAL: gl.constexpr):
        """``_l1_gluon_kernel``'s result with the weights brought in by TMA. The kernel layout interleaves gate
        and up in groups of 8 rows, so the 2 BN rows of BN intermediate columns are contiguous and one
        [2 BN, 128] TMA box holds both halves; one wgmma group per K block computes them together. The wgmma
        accumulator gives each thread rows r and r + 8 of every 16-row slab -- a gate row and its up row -- so
        splitting them for silu(g) * u needs no data movement. Token rows stay gathered by cp.async.
        WAIT: 2 (one group left running while the other partial is promoted) or 0 (the serialized control),
        as ``_l1_gluon_kernel``'s (which counts gate and up as two groups). SERIAL: one partial per program,
        every MMA waited for (UNROLL and WAIT unused), small enough for two programs per SM."""
        gl.static_assert(gl.num_warps() == 8, "two warpgroups")
        gl.static_assert(BN == 128, "one weight scale block per gate / up half")
        gl.static_assert(UNROLL % 2 == 0, "pairs of K blocks")
        gl.static_assert(STAGES >= 3, "blocks k-1, k and k+1 resident")
        KB: gl.constexpr = 128
        W1: gl.constexpr = WAIT // 2
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        nb = gl.load(nblk_ptr)
        e = gl.load(blk_ptr + pid_m)
        if (pid_m >= nb) | (e < 0):
            return
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BM, 32])
        col: gl.constexpr = gl.SliceLayout(0, mma)
        row: gl.constexpr = gl.SliceLayout(1, mma)
        ld: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [8, 1], [1, 0])
        e64 = e.to(gl.int64)
        xp = _l1_token_rows(x_ptr, pair_ptr, pid_m, H, TOPK, BM, KB, ld)
        wrow = e * (2 * I) + pid_n * (2 * BN)
        orow = pid_m * BM + gl.arange(0, BM, layout=col)
        sgp = ws_ptr + e64 * ws_se + ((pid_n * BN) // KB) * ws_sn
        sup = sgp + (I // KB) * ws_sn
        gate_rows = gl.expand_dims((gl.arange(0, 2 * BN, layout=row) // 8) % 2 == 0, 1)
        NK = H // KB

        lay_x: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, KB], gl.float8e4nv)
        w_s = gl.allocate_shared_memory(w_desc.dtype, [STAGES, 2 * BN, KB], w_desc.layout)
        x_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, KB], lay_x)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        acc = gl.zeros([2 * BN, BM], gl.float32, mma)
        if SERIAL:
            # one partial, waited for before its promotion (the overlap comes from a second program on the SM:
            # 128 registers and 3 slots fit two). Iteration k: block k's copies landed (this thread's, then the
            # barrier: everyone's, and everyone is past block k-1's wait), refill block k-1's slot with block
            # k + STAGES - 1, MMA, wait, promote.
            for s in gl.static_range(STAGES - 1):
                _l1t_load(w_desc, x_s, w_s, bars, xp, s, NK, wrow, KB, STAGES)
            p = gl.zeros([2 * BN, BM], gl.float32, mma)
            fg, fu = _l1t_scales(sgp, sup, xs_ptr, orow, 0, NK, NROWS, ws_sk)
            for k in range(NK):
                async_copy.wait_group(STAGES - 2)
                fence_async_shared()
                gl.thread_barrier()
                _l1t_load(w_desc, x_s, w_s, bars, xp, k + STAGES - 1, NK, wrow, KB, STAGES)
                p = _l1t_mma(w_s, x_s, bars, k, p, STAGES)
                p = warpgroup_mma_wait(num_outstanding=0, deps=[p])
                acc, p = _l1t_promote_now(acc, p, fg, fu, gate_rows, 0)
                fg, fu = _l1t_scales(sgp, sup, xs_ptr, orow, k + 1, NK, NROWS, ws_sk)
        else:
            for s in gl.static_range(STAGES - 2):
                _l1t_load(w_desc, x_s, w_s, bars, xp, s, NK, wrow, KB, STAGES)

                pa = gl.zeros([2 * BN, BM], gl.float32, mma)
            pb = gl.zeros([2 * BN, BM], gl.float32, mma)
            fga, fua = _l1t_scales(sgp, sup, xs_ptr, orow, 0, NK, NROWS, ws_sk)
            fgb, fub = _l1t_scales(sgp, sup, xs_ptr, orow, 1, NK, NROWS, ws_sk)
            # _l1_gluon_kernel's loop with one wgmma group per block
            for k0 in range(0, NK, UNROLL):
                async_copy.wait_group(STAGES - 3)
                fence_async_shared()
                gl.thread_barrier()
                _l1t_load(w_desc, x_s, w_s, bars, xp, k0 + STAGES - 2, NK, wrow, KB, STAGES)
                pa = _l1t_mma(w_s, x_s, bars, k0, pa, STAGES)
                for t in gl.static_range(UNROLL // 2):
                    k = k0 + 2 * t
                    async_copy.wait_group(STAGES - 3)
                    fence_async_shared()
                    gl.thread_barrier()
                    _l1t_load(w_desc, x_s, w_s, bars, xp, k + 1 + STAGES - 2, NK, wrow, KB, STAGES)
                    pb = _l1t_mma(w_s, x_s, bars, k + 1, pb, STAGES)
                    pa = warpgroup_mma_wait(num_outstanding=W1, deps=[pa])  # block k done
                    acc, pa = _l1t_promote_now(acc, pa, fga, fua, gate_rows, W1)
                    fga, fua = _l1t_scales(sgp, sup, xs_ptr, orow, k + 2, NK, NROWS, ws_sk)
                    if t + 1 < UNROLL // 2:
                        async_copy.wait_group(STAGES - 3)
                        fence_async_shared()
                        gl.thread_barrier()
                        _l1t_load(w_desc, x_s, w_s, bars, xp, k + 2 + STAGES - 2, NK, wrow, KB, STAGES)
                        pa = _l1t_mma(w_s, x_s, bars, k + 2, pa, STAGES)
                        pb = warpgroup_mma_wait(num_outstanding=W1, deps=[pb])  # block k + 1 done
                    else:
                        pb = warpgroup_mma_wait(num_outstanding=0, deps=[pb])  # none running
                    acc, pb = _l1t_promote_now(acc, pb, fgb, fub, gate_rows, W1)
                    fgb, fub = _l1t_scales(sgp, sup, xs_ptr, orow, k + 3, NK, NROWS, ws_sk)
        async_copy.wait_group(0)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

        # [16-row groups, gate | up, 8, BM] -> gate and up [BN, BM], then the two-dot kernel's epilogue
        acc_g, acc_u = gl.split(gl.permute(gl.reshape(acc, [2 * BN // 16, 2, 8, BM]), (0, 2, 3, 1)))
        acc_g = gl.convert_layout(gl.reshape(acc_g, [BN, BM]), mma)
        acc_u = gl.convert_layout(gl.reshape(acc_u, [BN, BM]), mma)
        _l1_epilogue(acc_g, acc_u, pair_ptr, tw_ptr, act_ptr, as_ptr, pid_m, pid_n, NROWS, I, rsf, clamp_c,
                     HAS_CLAMP, BM, BN, GA)


# --------------------------------------------------------------------------- host side


def launch_l2(act, asf, w, ws, plan, slots, H, I, K, nslot, bm, wait: int = 1, stages: int = STAGES,
              unroll: int = UNROLL, maxnreg=None, warps: int = WARPS):
    """The runtime's Gluon L2 launch (``block8_gluon.launch_l2``) with this experiment's default UNROLL."""
    from megamoe_runtime.backends.triton import block8

    return _g2.launch_l2(act, asf, w, ws, block8._scale_strides(ws, "l2_scale"), plan, slots, H, I, K, nslot, bm, wait=wait, stages=stages, unroll=unroll,
                         maxnreg=maxnreg, warps=warps)



#: the Gluon L1's defaults (block8's prefill L1: 128 intermediate columns = two 128-row dots, 8 warps, 3 stages):
#: 4 slots of 36 KiB (two blocks of look-ahead), 4 K blocks per trip, no register cap. sm_90 compile: 255
#: registers, no spills (one program per SM, block8's take two); capped at 128 (two per SM, as block8's) it
#: spills, as UNROLL 8 does uncapped
L1_STAGES, L1_UNROLL, L1_MAXNREG = 4, 4, None


def launch_l1(xq, xs, w, ws, plan, tw, act, asf, H, I, K, clamp, rsf, bm, wait: int = 2, stages: int = L1_STAGES,
              unroll: int = L1_UNROLL, maxnreg=L1_MAXNREG):
    """``block8.launch_l1``'s arguments (prefill tile, GPU path; ``xs`` in row order, ``block8.row_scales``)
    through the Gluon L1; ``wait`` 2 (the pipelined kernel) or 0 (the negative control)."""
    from megamoe_runtime.backends.triton import block8

    if GLUON_ERROR is not None:
        raise RuntimeError(f"gluon unavailable: {GLUON_ERROR}")
    if (H // 128) % unroll or unroll % 2:
        raise ValueError(f"gluon L1: UNROLL {unroll} must be even and divide H / 128 = {H // 128}")
    wb, swe, swn = block8._weight_bytes(w)
    se, sn, sk = block8._scale_strides(ws, "l1_scale")
    c = 0.0 if clamp is None else float(torch.tensor(float(clamp), dtype=torch.float32))
    _l1_gluon_kernel[(I // 128, plan.max_blocks)](
        xq, xs, wb, ws, plan.sorted_pairs, plan.block_expert, plan.num_blocks, tw, act, asf,
        plan.max_blocks * bm, H, I, K, swe, swn, se, sn, sk, rsf, c,
        HAS_CLAMP=clamp is not None, BM=bm, BN=128, GA=GA, STAGES=stages, UNROLL=unroll, WAIT=wait, num_warps=8,
        enable_fp_fusion=False, **({} if maxnreg is None else {"maxnreg": maxnreg}))


def launch_l1t(xq, xs, w, ws, plan, tw, act, asf, H, I, K, clamp, rsf, bm, wait: int = 2, stages: int = L1_STAGES,
               unroll: int = L1_UNROLL, maxnreg=L1_MAXNREG, serial: bool = False):
    """``launch_l1``'s arguments through the L1 whose weights come by TMA (``_l1t_gluon_kernel``)."""
    from megamoe_runtime.backends.triton import block8

    if GLUON_ERROR is not None:
        raise RuntimeError(f"gluon unavailable: {GLUON_ERROR}")
    if (H // 128) % unroll or unroll % 2:
        raise ValueError(f"gluon L1: UNROLL {unroll} must be even and divide H / 128 = {H // 128}")
    wb = w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w
    if wb.dim() != 3 or not wb.is_contiguous():
        raise ValueError("gluon L1 (TMA): contiguous [E, 2I, H] weight bytes only")
    se, sn, sk = block8._scale_strides(ws, "l1_scale")
    lay_w = gl.NVMMASharedLayout.get_default_for([256, 128], gl.float8e4nv)
    w_desc = TensorDescriptor.from_tensor(wb.reshape(-1, H).view(torch.float8_e4m3fn), [256, 128], lay_w)
    c = 0.0 if clamp is None else float(torch.tensor(float(clamp), dtype=torch.float32))
    _l1t_gluon_kernel[(I // 128, plan.max_blocks)](
        xq, xs, w_desc, ws, plan.sorted_pairs, plan.block_expert, plan.num_blocks, tw, act, asf,
        plan.max_blocks * bm, H, I, K, se, sn, sk, rsf, c,
        HAS_CLAMP=clamp is not None, BM=bm, BN=128, GA=GA, STAGES=stages, UNROLL=unroll, WAIT=wait,
        SERIAL=serial, num_warps=8, enable_fp_fusion=False, **({} if maxnreg is None else {"maxnreg": maxnreg}))


# --------------------------------------------------------------------------- compile for sm_90 on a CPU


def _plan_cpu(bm: int, rows: int):
    from megamoe_runtime.backends.triton.staging import RoutingPlan

    mb = rows // bm
    return RoutingPlan(torch.zeros(mb * bm, dtype=torch.int32), torch.zeros(mb, dtype=torch.int32),
                       torch.zeros(1, dtype=torch.int32), bm, mb, K)


def _record(bm: int, control: bool = False, unroll: int = UNROLL, maxnreg=None, rows: int = 38400,
            baseline: bool = True, warps: int = WARPS) -> list:
    """The Launch records (``tools/sm90_compile.recording``) of block8's prefill L2 and of the Gluon L2 at
    DeepSeek-V3's shape, on CPU tensors (nothing runs); ``control``: the Gluon kernel with WAIT 0."""
    import sm90_compile as sc
    from megamoe_runtime.backends.triton import block8

    plan = _plan_cpu(bm, rows)
    act = torch.zeros(rows, I, dtype=torch.uint8)
    asf = torch.zeros(I // GA, rows)
    w = torch.zeros(E, H, I, dtype=torch.uint8)
    ws = torch.zeros(E, H // WBLOCK, I // WBLOCK)
    slots = torch.zeros(1, K, H, dtype=torch.bfloat16)
    rec: dict = {}
    if baseline:
        with sc.recording("block8", rec):
            block8.launch_l2(block8.TILES["prefill"], act, asf, w, ws, plan, slots, H, I, K, K, bm, True)
    with sc.recording("gluon", rec):
        launch_l2(act, asf, w, ws, plan, slots, H, I, K, K, bm, wait=0 if control else 1, unroll=unroll,
                  maxnreg=maxnreg, warps=warps)
    return list(rec.values())


def _record_l1(bm: int, control: bool = False, unroll: int = L1_UNROLL, maxnreg=L1_MAXNREG, stages=L1_STAGES,
               rows: int = 38400, T: int = 4096, baseline: bool = True, tma: bool = False,
               serial: bool = False) -> list:
    """The same for the L1: block8's prefill L1 and the Gluon L1 (``control``: WAIT 0)."""
    import sm90_compile as sc
    from megamoe_runtime.backends.triton import block8

    plan = _plan_cpu(bm, rows)
    xq = torch.zeros(T, H, dtype=torch.uint8)
    xs = torch.zeros(H // WBLOCK, rows)
    w = torch.zeros(E, 2 * I, H, dtype=torch.uint8)
    ws = torch.zeros(E, 2 * I // WBLOCK, H // WBLOCK)
    tw = torch.zeros(T, K)
    act = torch.zeros(rows, I, dtype=torch.uint8)
    asf = torch.zeros(I // GA, rows)
    rec: dict = {}
    if baseline:
        with sc.recording("block8", rec):
            block8.launch_l1(block8.TILES["prefill"], xq, xs, w, ws, plan, tw, act, asf, H, I, K, None, 2.5, bm, True)
    with sc.recording("gluon", rec):
        kw = dict(serial=serial) if tma else {}
        (launch_l1t if tma else launch_l1)(xq, xs, w, ws, plan, tw, act, asf, H, I, K, None, 2.5, bm,
                                           wait=0 if control else 2, stages=stages, unroll=unroll, maxnreg=maxnreg,
                                           **kw)
    return list(rec.values())


def wgmma_waits(ptx: str) -> dict:
    """``wgmma.wait_group.sync.aligned N`` counts by N (a string, as JSON keys) in the PTX: in the whole kernel,
    and in its main loop (the body of the PTX loop -- a label some later branch jumps back to -- holding the most
    ``wgmma.mma_async``)."""
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
    """Compile one recorded launch for sm_90 (``sm90_compile.compile_kernel``): resources (``spill_bytes``: ptxas'
    spill stores + loads), the PTX's and the SASS K loop's wgmma waits, the loop's instruction mix, and ptxas'
    notes (``sm90_compile.ptxas_report``)."""
    import sm90_compile as sc

    k = sc.compile_kernel(ln.fn, ln.signature, ln.constexprs, ln.attrs, ln.options)
    res = sc._resources(k.asm["cubin"])
    rep = sc.ptxas_report(k.asm["ptx"])
    body = sc.main_loop(sc.sass_instructions(sc._cuobjdump(k.asm["cubin"], "--dump-sass")))
    mix = sc.loop_mix(k.asm["cubin"], ln.options.get("num_warps", 4), None)
    cx = sc.named(ln.fn.arg_names, ln.constexprs)
    return dict(kernel=ln.kernel.rsplit(".", 1)[-1], regs=res["regs"],
                spill_bytes=(rep["spill_stores"] or 0) + (rep["spill_loads"] or 0) + (res["local"] or 0),
                stack=res["stack"],
                shared=int(k.metadata.shared), warps=ln.options.get("num_warps"),
                stages=cx.get("STAGES", ln.options.get("num_stages")), maxnreg=ln.options.get("maxnreg"),
                tile={n: cx[n] for n in ("BM", "BN", "GA", "GPI", "UNROLL", "WAIT") if n in cx},
                ptx_waits=wgmma_waits(k.asm["ptx"]),
                sass_loop_waits=_sass_waits(body), sass_loop_instr=mix["loop_instr"],
                sass_loop_opcodes=dict(list(mix["opcodes"].items())[:12]),
                ptxas=rep, ptxas_warnings=rep["notes"],
                fma_in_ptx=len(re.findall(r"\bfma\.rn\.f32\b", k.asm["ptx"])),
                wgmma_forms=sorted(set(re.findall(r"wgmma\.mma_async\.[\w.]+", k.asm["ptx"]))),
                bf16_cvt=sorted(set(re.findall(r"cvt\.\w+\.bf16(?:x2)?\.f32", k.asm["ptx"]))))


def compile_only(bm: int, control: bool = False, unroll=None, maxnreg=None, kernels=("l2", "l1"),
                 baseline: bool = True, warps: int = WARPS) -> list[dict]:
    """block8's (``baseline``) and the Gluon kernels' prefill specializations compiled for sm_90, L2 then L1
    (``control``: the Gluon kernels with WAIT 0; ``unroll``, ``maxnreg``: theirs, None for the defaults;
    ``warps``: the Gluon L2's): one result each, a kernel that does not compile gives its error."""
    lns = []
    if "l2" in kernels:
        lns += _record(bm, control, UNROLL if unroll is None else unroll, maxnreg, baseline=baseline, warps=warps)
    if "l1" in kernels:
        lns += _record_l1(bm, control, L1_UNROLL if unroll is None else unroll,
                          L1_MAXNREG if maxnreg is None else maxnreg, baseline=baseline)
    if "l1t" in kernels:
        lns += _record_l1(bm, control, L1_UNROLL if unroll is None else unroll,
                          L1_MAXNREG if maxnreg is None else maxnreg, baseline=baseline and "l1" not in kernels,
                          tma=True)
    out = []
    for ln in lns:
        try:
            out.append(compile_launch(ln))
        except Exception as exc:  # the compiler's message is the result
            out.append(dict(kernel=ln.kernel.rsplit(".", 1)[-1], error=f"{type(exc).__name__}: {exc}"[-3000:]))
    return out


def pipelined(r: dict) -> bool:
    """The K loop keeps wgmma groups in flight while it promotes: a ``wgmma.wait_group N`` with N >= 1 in the PTX
    loop, ptxas kept it (a ``WARPGROUP.DEPBAR.LE gsb0, N`` with N >= 1 in the SASS loop) and did not serialize
    the kernel's wgmmas (no C7514 / C7515 note)."""
    return ("error" not in r and any(int(n) >= 1 for n in r["ptx_waits"]["loop"])
            and any(int(n) >= 1 for n in r["sass_loop_waits"])
            and not any("serialized" in w for w in r["ptxas_warnings"]))


# --------------------------------------------------------------------------- GPU


def _problem(T: int, seed: int = 0, dev: str = ""):
    """DeepSeek-V3's L2 at T tokens: random E4M3 weight bytes (no NaN codes) and power-of-two block scales,
    a uniform top-8 routing, and a random E4M3 intermediate with positive per-(row, 64) scales; padding rows
    zero, as the L1 writes them."""
    from megamoe_runtime.backends.triton import block8
    from megamoe_runtime.backends.triton.staging import route

    dev = dev or DEV
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
    return dict(w=w2, ws=s2, plan=plan, act=act, asf=asf, bm=bm, T=T, ids=ids)


def _rows_for(pr: dict, bm: int):
    """(plan, act, asf) of ``pr``'s intermediate in the row order of ``bm``-token row blocks: each (token, slot)
    pair's row moved to its row in the new plan (padding rows zero bytes and tiny scales), so that the slot
    outputs, indexed by pair, compare with those of ``pr``'s own row blocks."""
    from megamoe_runtime.backends.triton.staging import route

    if bm == pr["bm"]:
        return pr["plan"], pr["act"], pr["asf"]
    old, act, asf = pr["plan"].sorted_pairs, pr["act"], pr["asf"]
    plan = route(pr["ids"], E, 0, bm)
    new = plan.sorted_pairs
    row_of = torch.full((pr["T"] * K,), -1, dtype=torch.int64, device=act.device)
    ok = old >= 0
    row_of[old[ok].long()] = torch.nonzero(ok).flatten()
    rows = plan.max_blocks * bm
    valid = new[:rows] >= 0
    src = row_of[new[:rows][valid].long()]
    act2 = torch.zeros(rows, I, dtype=act.dtype, device=act.device)
    asf2 = torch.full((I // GA, rows), torch.finfo(torch.float32).tiny, dtype=asf.dtype, device=asf.device)
    act2[valid] = act[src]
    asf2[:, valid] = asf[:, src]
    return plan, act2, asf2


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _device_name() -> str:
    return torch.cuda.get_device_name() if DEV == "cuda" else DEV


def _time(fn, reps: int) -> float:
    """Median ms of ``fn`` replayed in a CUDA graph (falls back to CUDA events if capture fails); on the CPU
    one wall-clock run."""
    if DEV != "cuda":
        import time

        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
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


#: the Gluon configurations ``--gpu`` times: (name, wait, stages, unroll, maxnreg, warps, bm). Registers decide
#: how many programs share an SM (block8's 96 allow five; 174 allow two, 128 four; at 8 warps 128 allow two),
#: so capped variants too (sm_90 compile: at 128 and 4 warps, UNROLL 2 spills 16 bytes, UNROLL 4 148; at 8
#: warps and BM 32 none). 8 warps: two warpgroups of 64 weight rows. BM 64: half the weight reads per token
#: (its inputs are the same pairs in 64-token row blocks; 182 registers, one program per SM). "wait0": the
#: negative control (the same kernel with every wgmma waited for at once: no overlap inside the warpgroup)
VARIANTS = (("u8", 1, 4, 8, None, 4, 32), ("u2", 1, 4, 2, None, 4, 32), ("u4", 1, 4, 4, None, 4, 32),
            ("u16", 1, 4, 16, None, 4, 32), ("u8_s6", 1, 6, 8, None, 4, 32), ("u2_r128", 1, 4, 2, 128, 4, 32),
            ("u4_r128", 1, 4, 4, 128, 4, 32), ("w8_u8_r128", 1, 4, 8, 128, 8, 32),
            ("w8_u4_r128", 1, 4, 4, 128, 8, 32), ("w8_bm64_u8", 1, 4, 8, None, 8, 64),
            ("w8_bm64_u4_s6", 1, 6, 4, None, 8, 64), ("u8_wait0", 0, 4, 8, None, 4, 32),
            ("w8_u8_r128_wait0", 0, 4, 8, 128, 8, 32))


def gpu(tokens: list[int], reps: int, variants=VARIANTS, save=None) -> dict:
    """block8's prefill L2 and the Gluon L2 configurations on the same inputs: differing slot bytes against
    block8's, median times, TFLOP/s, ratio to block8 (a failing configuration is reported and skipped); ``save``
    is called with the results after each token count."""
    from megamoe_runtime.backends.triton import block8

    fc = block8.TILES["prefill"]
    res: dict = {"device": _device_name(), "torch": torch.__version__, "triton": triton.__version__,
                 "shape": dict(H=H, I=I, E=E, K=K), "block8_tile": fc.__dict__,
                 "variants": {v[0]: dict(wait=v[1], stages=v[2], unroll=v[3], maxnreg=v[4], warps=v[5], bm=v[6])
                              for v in variants},
                 "points": {}}
    for T in tokens:
        pr = _problem(T)
        plan, act, asf, w, ws, bm = pr["plan"], pr["act"], pr["asf"], pr["w"], pr["ws"], pr["bm"]
        pt: dict = {"block_m": bm, "rows": plan.max_blocks * bm}
        flops = 2.0 * T * K * H * I
        ref = torch.zeros(T, K, H, dtype=torch.bfloat16, device=DEV)

        def run_b8():
            block8.launch_l2(fc, act, asf, w, ws, plan, ref, H, I, K, K, bm, DEV == "cuda")

        try:
            ms = _time(run_b8, reps)
            pt["block8"] = dict(ms=ms, tflops=flops / ms / 1e9)
            ref.zero_()
            run_b8()
            _sync()
        except Exception as exc:
            traceback.print_exc()
            pt["block8"] = dict(error=f"{type(exc).__name__}: {exc}"[-2000:])
        for name, wait, stages, unroll, maxnreg, warps, vbm in variants:
            got = torch.zeros_like(ref)
            try:
                vplan, vact, vasf = _rows_for(pr, vbm)
            except Exception as exc:
                traceback.print_exc()
                pt[name] = dict(error=f"{type(exc).__name__}: {exc}"[-2000:])
                continue

            def run(wait=wait, stages=stages, unroll=unroll, maxnreg=maxnreg, warps=warps, vbm=vbm, got=got,
                    vplan=vplan, vact=vact, vasf=vasf):
                launch_l2(vact, vasf, w, ws, vplan, got, H, I, K, K, vbm, wait=wait, stages=stages, unroll=unroll,
                          maxnreg=maxnreg, warps=warps)

            try:
                run()
                _sync()
                diff = int((got.view(torch.uint8) != ref.view(torch.uint8)).sum())
                ms = _time(run, reps)
                pt[name] = dict(ms=ms, tflops=flops / ms / 1e9, differing_bytes=diff, bytes=got.numel() * 2)
                if "ms" in pt["block8"]:
                    pt[name]["ratio_vs_block8"] = ms / pt["block8"]["ms"]
            except Exception as exc:  # a configuration that fails still leaves the others and block8's time
                traceback.print_exc()
                pt[name] = dict(error=f"{type(exc).__name__}: {exc}"[-2000:])
            del got, vplan, vact, vasf
        res["points"][str(T)] = pt
        _print_point("L2", T, pt)
        if save:
            save(res)
        del pr, act, asf, w, ref
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return res


#: the Gluon L1 configurations ``--gpu`` times: (name, wait, stages, unroll, maxnreg); the default first. With
#: S stages the slot of block k-2 is refilled with block k+S-2 (S-2 blocks of look-ahead). "r128": two programs
#: per SM as block8's, but it spills (sm_90 compile)
L1_VARIANTS = (("s4_u4", 2, 4, 4, None), ("s4_u2", 2, 4, 2, None), ("s3_u4", 2, 3, 4, None),
               ("s5_u4", 2, 5, 4, None), ("s3_u2_r128", 2, 3, 2, 128), ("s4_u4_wait0", 0, 4, 4, None))
#: the L1 whose weights come by TMA (``_l1t_gluon_kernel``): (name, wait, stages, unroll, maxnreg, serial).
#: sm_90 compile (BM 32): serial, 3 slots: 122 registers, 110616 B shared (two programs per SM, as block8's L1),
#: 214 SASS instructions per K block (block8's: 206); pipelined, 4 slots, UNROLL 2: 166 registers, one per SM
L1T_VARIANTS = (("t_serial_s3", 0, 3, 2, None, True), ("t_serial_s4", 0, 4, 2, None, True),
                ("t_s4_u2", 2, 4, 2, None, False), ("t_s4_u4", 2, 4, 4, None, False),
                ("t_s3_u2", 2, 3, 2, None, False), ("t_s4_u2_wait0", 0, 4, 2, None, False))


def _problem_l1(T: int, seed: int = 1, dev: str = ""):
    """DeepSeek-V3's L1 at T tokens: bf16 tokens through block8's dispatch quantizer and row-ordered scales,
    random E4M3 gate / up weight bytes (kernel layout is just bytes here) with power-of-two block scales, a
    uniform top-8 routing with softmax weights."""
    from megamoe_runtime.backends.triton import block8
    from megamoe_runtime.backends.triton.staging import route

    dev = dev or DEV
    g = torch.Generator(device=dev).manual_seed(seed)
    hw = dev == "cuda"
    w1 = torch.empty(E, 2 * I, H, dtype=torch.uint8, device=dev)
    for i in range(0, E, 8):
        b = torch.randint(0, 256, (min(8, E - i), 2 * I, H), generator=g, device=dev, dtype=torch.uint8)
        b[(b & 0x7F) == 0x7F] ^= 1
        w1[i:i + 8] = b
    s1 = torch.exp2(torch.randint(-12, -7, (E, 2 * I // WBLOCK, H // WBLOCK), generator=g, device=dev).float())
    x = torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16)
    ids = torch.argsort(torch.rand(T, E, generator=g, device=dev), dim=1)[:, :K].to(torch.int64)
    tw = torch.softmax(torch.randn(T, K, generator=g, device=dev), 1)
    bm = block8.TILES["prefill"].block_m
    plan = route(ids, E, 0, bm)
    xq, xs = block8.quantize_b128(x, hw)
    return dict(w=w1, ws=s1, xq=xq, xs=block8.row_scales(xs, plan, K, hw), tw=tw, plan=plan, bm=bm, T=T)


def gpu_l1(tokens: list[int], reps: int, variants=L1_VARIANTS, rsf: float = 2.5, save=None) -> dict:
    """block8's prefill L1 and the Gluon L1 configurations on the same inputs: differing act bytes and scale
    words against block8's (every row, padding included), median times, TFLOP/s, ratio to block8; ``save`` as
    ``gpu``'s."""
    from megamoe_runtime.backends.triton import block8

    fc = block8.TILES["prefill"]
    res: dict = {"device": _device_name(), "block8_tile": fc.__dict__, "rsf": rsf,
                 "variants": {v[0]: dict(wait=v[1], stages=v[2], unroll=v[3], maxnreg=v[4],
                                         tma_serial=v[5] if len(v) > 5 else None) for v in variants},
                 "points": {}}
    for T in tokens:
        pr = _problem_l1(T)
        plan, bm = pr["plan"], pr["bm"]
        rows = plan.max_blocks * bm
        pt: dict = {"block_m": bm, "rows": rows}
        flops = 2.0 * T * K * 2 * I * H
        act = torch.zeros(rows, I, dtype=torch.uint8, device=DEV)
        asf = torch.zeros(I // GA, rows, dtype=torch.float32, device=DEV)
        args = (pr["xq"], pr["xs"], pr["w"], pr["ws"], plan, pr["tw"])

        def run_b8():
            block8.launch_l1(fc, *args, act, asf, H, I, K, None, rsf, bm, DEV == "cuda")

        try:
            ms = _time(run_b8, reps)
            pt["block8"] = dict(ms=ms, tflops=flops / ms / 1e9)
            act.zero_()
            asf.zero_()
            run_b8()
            _sync()
        except Exception as exc:
            traceback.print_exc()
            pt["block8"] = dict(error=f"{type(exc).__name__}: {exc}"[-2000:])
        for name, wait, stages, unroll, maxnreg, *serial in variants:
            a2, s2 = torch.zeros_like(act), torch.zeros_like(asf)
            kw = dict(serial=serial[0]) if serial else {}

            def run(wait=wait, stages=stages, unroll=unroll, maxnreg=maxnreg, a2=a2, s2=s2, kw=kw):
                (launch_l1t if kw else launch_l1)(*args, a2, s2, H, I, K, None, rsf, bm, wait=wait, stages=stages,
                                                  unroll=unroll, maxnreg=maxnreg, **kw)

            try:
                run()
                _sync()
                da = int((a2 != act).sum())
                ds = int((s2.view(torch.int32) != asf.view(torch.int32)).sum())
                ms = _time(run, reps)
                pt[name] = dict(ms=ms, tflops=flops / ms / 1e9, differing_bytes=da + 4 * ds, act_bytes_differing=da,
                                scales_differing=ds, bytes=act.numel() + 4 * asf.numel())
                if "ms" in pt["block8"]:
                    pt[name]["ratio_vs_block8"] = ms / pt["block8"]["ms"]
            except Exception as exc:  # a configuration that fails still leaves the others and block8's time
                traceback.print_exc()
                pt[name] = dict(error=f"{type(exc).__name__}: {exc}"[-2000:])
            del a2, s2
        res["points"][str(T)] = pt
        _print_point("L1", T, pt)
        if save:
            save(res)
        del pr, act, asf, args
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return res


def _print_point(what: str, T: int, pt: dict) -> None:
    for k, v in pt.items():
        if isinstance(v, dict):
            print(f"{what} T={T} {k:18s} " + (f"{v['ms']:.3f} ms {v['tflops']:.0f} TFLOP/s"
                                              + (f"  x{v['ratio_vs_block8']:.3f} of block8"
                                                 if "ratio_vs_block8" in v else "")
                                              + (f"  differing bytes {v['differing_bytes']} of {v['bytes']}"
                                                 if "differing_bytes" in v else "")
                                              if "ms" in v else f"FAILED {v['error'][-300:]}"), flush=True)


# --------------------------------------------------------------------------- CLI


def _fmt(r: dict) -> str:
    if "error" in r:
        return f"{r['kernel']:18s} FAILED {r['error'].splitlines()[-1][:200]}"
    tile = " ".join(f"{k}={v}" for k, v in r["tile"].items())
    cap = f" maxnreg {r['maxnreg']}" if r.get("maxnreg") else ""
    return (f"{r['kernel']:18s} [{tile}] w{r['warps']} s{r['stages']}{cap} regs {r['regs']:>3} "
            f"spill {r['spill_bytes']} stack {r['stack']} smem {r['shared']:>6}  "
            f"PTX wgmma.wait_group kernel {r['ptx_waits']['kernel']} loop {r['ptx_waits']['loop']} "
            f"({r['ptx_waits']['loop_mma']} wgmma in loop)  SASS loop DEPBAR gsb0 {r['sass_loop_waits']} "
            f"({r['sass_loop_instr']} instr)  fma {r['fma_in_ptx']}  ptxas notes {len(r['ptxas_warnings'])}"
            + "".join(f"\n    {n[:200]}" for n in r["ptxas_warnings"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--compile-only", action="store_true", help="compile block8's and the Gluon kernels for sm_90")
    mode.add_argument("--gpu", action="store_true", help="bitwise check and timing on an SM90 GPU")
    ap.add_argument("--kernels", default="l2,l1", help="which kernels (l2, l1; l1t: the L1 with TMA weights)")
    ap.add_argument("--tokens", default="2048,4096")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--control", action="store_true", help="--compile-only: the Gluon kernels with WAIT 0")
    ap.add_argument("--unroll", type=int, default=None, help="--compile-only: K blocks per loop trip")
    ap.add_argument("--maxnreg", type=int, default=None, help="--compile-only: register cap of the Gluon kernels")
    ap.add_argument("--warps", type=int, default=WARPS, help="--compile-only: warps of the Gluon L2 (4 or 8)")
    ap.add_argument("--bm", type=int, default=None, help="--compile-only: tokens per row block (default: block8's)")
    ap.add_argument("--variants", default="",
                    help="--gpu: only these configurations (names, comma-separated; one no configuration has, e.g. "
                         "'none': block8 alone)")
    ap.add_argument("--skip-compile", action="store_true", help="--gpu: not the sm_90 compile figures at the end")
    ap.add_argument("--json", default="", help="write the results here")
    a = ap.parse_args(argv)
    kernels = tuple(a.kernels.split(","))
    if a.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)
        from megamoe_runtime.backends.triton import block8

        res = compile_only(a.bm or block8.TILES["prefill"].block_m, a.control, a.unroll, a.maxnreg, kernels,
                           warps=a.warps)
        for r in res:
            print(_fmt(r))
        gl_res = [r for r in res if r["kernel"].endswith("_gluon_kernel")]
        ok = bool(gl_res) and all("error" not in r and not r["spill_bytes"] for r in gl_res)
        for r in gl_res:
            print(f"{r['kernel']}: loop keeps wgmma groups in flight while promoting: {pipelined(r)}")
        out: object = res
    else:
        if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
            print("--gpu needs an SM90 GPU")
            return 2
        tokens = [int(t) for t in a.tokens.split(",")]
        out = {}

        def save(part):
            def put(res):
                out[part] = res
                if a.json:  # after every token count: a later fault leaves what was measured
                    with open(a.json, "w") as f:
                        json.dump(out, f, indent=1, default=str)
            return put

        names = set(filter(None, a.variants.split(",")))
        if "l2" in kernels:
            out["gpu"] = gpu(tokens, a.reps, [v for v in VARIANTS if not names or v[0] in names], save("gpu"))
        if "l1" in kernels or "l1t" in kernels:
            pool = (L1_VARIANTS if "l1" in kernels else ()) + (L1T_VARIANTS if "l1t" in kernels else ())
            out["gpu_l1"] = gpu_l1(tokens, a.reps, [v for v in pool if not names or v[0] in names],
                                   save=save("gpu_l1"))
        ok = all("ms" in v and v.get("differing_bytes", 0) == 0 for part in ("gpu", "gpu_l1") if part in out
                 for p in out[part]["points"].values() for v in p.values() if isinstance(v, dict))
        # the sm_90 compile figures of the same kernels, last: the recording replaces the process's driver
        try:
            if a.skip_compile:
                raise RuntimeError("skipped (--skip-compile)")
            out["compile"] = compile_only(32, kernels=kernels)
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
