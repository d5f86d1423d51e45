"""The block-FP8 row's prefill L2 in Gluon (Triton's explicit-layout dialect): the same result as
``block8._l2_kernel`` byte for byte, with the weight and token tiles brought in by TMA through a ring of
shared-memory slots and two partial accumulators, so that the next K block's FP8 MMA runs while the previous
one is promoted (docs/KERNELS.md "The Gluon L2 of the block-FP8 row").

Why a second kernel for one result: Triton 3.6 waits for every promoted dot before the promotion
(``wgmma.wait_group 0``), and block8's L2 loads its tiles with per-thread copies. On an H100 this kernel takes
0.73x of block8's L2 time at 512-1024 tokens and 0.82-0.91x at 2048-8192, with equal output bytes
(docs/bench-log/kernels.md, "GPU: the Gluon block-FP8 kernels on an H100"). Used by ``block8.launch_l2`` for
the prefill tile (its ``Block8Config.l2_gluon``; env ``MEGAMOE_BLOCK8_L2`` overrides) where Gluon imports;
block8's L2 otherwise. The experiments around it (its L1, other unrolls, the negative controls) live in
``bench/gluon_block8.py``.
"""
from __future__ import annotations

import torch

try:  # Gluon is experimental: a Triton without it (or with another API) leaves block8's L2 in use
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    GLUON_ERROR = None
except Exception as _exc:  # noqa: BLE001
    GLUON_ERROR = f"{type(_exc).__name__}: {_exc}"

#: the intermediate's scale group (the L2's K block)
GA = 64
#: output rows per program (one weight scale block), warps (one warpgroup), TMA ring slots
BN, _WARPS, STAGES = 128, 4, 4
#: K blocks per trip of the loop (one promotion per trip runs with no MMA in flight); 2 was the fastest of
#: 2 / 4 / 8 / 16 at every token count measured (H100, 512-8192 tokens)
UNROLL = 2


if GLUON_ERROR is None:
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
        NW: gl.constexpr = gl.num_warps()
        gl.static_assert((NW == 4) | (NW == 8), "one or two warpgroups (64 weight rows each at 8 warps)")
        gl.static_assert(BN == 128, "one weight scale per K block")
        gl.static_assert(UNROLL % 2 == 0, "pairs of K blocks")
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        nb = gl.load(nblk_ptr)
        e = gl.load(blk_ptr + pid_m)
        if (pid_m >= nb) | (e < 0):
            return
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 32])
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
                if NW > 4:  # the other warpgroup may still read the slot: both must have retired block k
                    gl.thread_barrier()
                _issue(w_desc, x_desc, w_s, x_s, bars, k + STAGES, wrow, xrow, GA, STAGES, k + STAGES < NK)
                sw_a, sx_a = _scales(swp, as_ptr, arow, k + 2, NK, NROWS, ws_sk, GA)
                if i + 1 < UNROLL // 2:
                    p_a = _mma(w_s, x_s, bars, k + 2, p_a, STAGES)
                    p_b = warpgroup_mma_wait(num_outstanding=WAIT, deps=[p_b])  # block k + 1 done, k + 2 running
                else:
                    p_b = warpgroup_mma_wait(num_outstanding=0, deps=[p_b])  # the trip's last block: none running
                acc, p_b = _promote_now(acc, p_b, sw_b, sx_b, WAIT)
                if NW > 4:
                    gl.thread_barrier()
                _issue(w_desc, x_desc, w_s, x_s, bars, k + 1 + STAGES, wrow, xrow, GA, STAGES, k + 1 + STAGES < NK)
                sw_b, sx_b = _scales(swp, as_ptr, arow, k + 3, NK, NROWS, ws_sk, GA)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

        # bf16 (cvt.rn) slot outputs; output rows are contiguous in memory, so 8 of them per thread and store
        out: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, NW], [0, 1])
        y = gl.convert_layout(acc.to(gl.bfloat16), out)
        n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, out))
        pair = gl.load(pair_ptr + pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, out)))
        mvalid = pair >= 0
        pair = gl.where(mvalid, pair, 0)
        slot = (pair // TOPK).to(gl.int64) * NSLOT + pair % TOPK
        gl.store(slot_ptr + gl.expand_dims(slot, 0) * H + gl.expand_dims(n, 1), y, mask=gl.expand_dims(mvalid, 0))


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


def launch_l2(act, asf, w, ws, scale_strides, plan, slots, H, I, K, nslot, bm, wait: int = 1,
              stages: int = STAGES, unroll: int = UNROLL, maxnreg=None, warps: int = _WARPS):
    """``block8.launch_l2``'s arguments (prefill tile, GPU path), through the Gluon kernel; ``scale_strides``:
    the (expert, row block, K block) strides of ``ws`` as block8 reads them; ``wait``, ``stages``, ``unroll``:
    the kernel's WAIT, STAGES, UNROLL; ``maxnreg``: a register cap (None: ptxas' choice); ``warps`` 4 or 8 (two
    warpgroups of 64 weight rows each)."""
    if GLUON_ERROR is not None:
        raise RuntimeError(f"gluon unavailable: {GLUON_ERROR}")
    if (I // GA) % unroll or unroll % 2:
        raise ValueError(f"gluon L2: UNROLL {unroll} must be even and divide I / GA = {I // GA}")
    se, sn, sk = scale_strides
    x_desc, w_desc, wrows = _descs(act, w, bm, BN)
    _l2_gluon_kernel[(H // BN, plan.max_blocks)](
        x_desc, asf, w_desc, ws, plan.sorted_pairs, plan.block_expert, plan.num_blocks, slots,
        plan.max_blocks * bm, H, I, K, nslot, wrows, se, sn, sk,
        BM=bm, BN=BN, GA=GA, STAGES=stages, UNROLL=unroll, WAIT=wait, num_warps=warps, enable_fp_fusion=False,
        **({} if maxnreg is None else {"maxnreg": maxnreg}))
