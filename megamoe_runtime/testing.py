"""Numeric comparison helpers shared by tests and benchmarks.

Kept in the runtime package (not under tests/) so benches and downstream users
can report errors with the same metrics the test suite asserts on.
"""
from __future__ import annotations

import torch

__all__ = ["calc_diff", "check_routing_plan", "rel_l2", "staging_adversarial_rows", "staging_random_rows"]


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity error: ``1 - 2*sum(x*y) / sum(x^2 + y^2)`` in float64.

    Same definition as DeepGEMM ``deep_gemm/testing/numeric.py`` so our
    thresholds (e.g. DG's NVFP4 1e-3) mean what they mean there; 0.0 when both
    tensors are all zero. It equals ``|x-y|^2 / (|x|^2 + |y|^2)``: 0 iff x == y,
    and scale-sensitive (``calc_diff(x, 2x) = 0.2``).
    """
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    if float(denominator) == 0.0:
        return 0.0
    return float(1.0 - 2.0 * (x * y).sum() / denominator)


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ``|x - ref| / |ref|`` in float64 (DGv's NVFP4 metric).

    0.0 when both are all zero; ``inf`` when only ``ref`` is all zero.
    """
    x, ref = x.double(), ref.double()
    num = float((x - ref).norm())
    den = float(ref.norm())
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


# ------------------------------------------------------------------ staging inputs
# Shared by the staging tests and bench/staging.py (its bit-exactness checks).


def staging_adversarial_rows(H: int, dev) -> torch.Tensor:
    """bf16 rows that hit every rounding corner of the MXFP8 / NVFP4 quantizers."""
    g = torch.Generator(device="cpu").manual_seed(7)
    rows = []
    rows.append(torch.zeros(H))                                    # all-zero row
    rows.append(-torch.zeros(H))                                   # all -0.0
    for k in (-20, -8, 0, 5, 20):                                  # amax exactly 1.75*2^k (448 = 1.75*2^8)
        r = torch.randn(H, generator=g).clamp(-1, 1) * 1.75 * 2.0 ** k
        r[::32] = 1.75 * 2.0 ** k
        rows.append(r)
        r2 = r.clone()
        r2[::32] = torch.tensor(1.75 * 2.0 ** k).bfloat16().float() * (1 + 2 ** -7)  # just above
        rows.append(r2)
    # E4M3 ties after the UE8M0 scaling: group amax 448 -> scale 1, elements at mantissa midpoints
    t = torch.tensor([1.0625, 1.1875, 2.125, 0.0048828125, 0.013671875, 3.25, 5.5, 13.0, 240.0, 416.0])
    r = t[torch.randint(0, len(t), (H,), generator=g)] * torch.where(torch.rand(H, generator=g) < 0.5, -1.0, 1.0)
    r[::32] = 448.0
    rows.append(r)
    # NVFP4 ties: token amax 2688*2^k -> token scale 2^k; block amax 6*s, elements at E2M1 midpoints * s
    for k in (-6, 0, 3):
        s_vals = torch.tensor([448.0, 1.0, 0.5, 3.25, 0.0625, 13.0])
        mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0])
        r = torch.empty(H)
        for b in range(H // 16):
            s = s_vals[b % len(s_vals)]
            blk = mids[torch.randint(0, len(mids), (16,), generator=g)] * s
            blk[0] = 6.0 * s
            blk = blk * torch.where(torch.rand(16, generator=g) < 0.5, -1.0, 1.0)
            r[b * 16:(b + 1) * 16] = blk
        r[0] = 2688.0
        rows.append(r * 2.0 ** k)
    rows.append(torch.randint(-64, 65, (H,), generator=g).float() / 16)   # a coarse grid: many ties
    rows.append(torch.full((H,), 3.0e38))                                  # near bf16 max
    rows.append(torch.randn(H, generator=g) * 1e-38)                       # bf16 subnormals
    rows.append(torch.randn(H, generator=g) * 1e-6)                        # below the 1e-4 floor
    mixed = torch.randn(H, generator=g) * torch.logspace(-30, 30, H)
    rows.append(mixed)
    # near powers of two: +-2^k * (1 + j/128), j in -2..2 (bf16 neighbours of 2^k), k random per element
    for lo, hi in ((-12, 4), (-3, 9)):
        k = torch.randint(lo, hi, (H,), generator=g).float()
        j = torch.randint(-2, 3, (H,), generator=g).float()
        sgn = torch.where(torch.rand(H, generator=g) < 0.5, -1.0, 1.0)
        rows.append(sgn * 2.0 ** k * (1 + j / 128))
    one_hot = torch.zeros(H)
    one_hot[H // 3] = -1.0                                              # one non-zero element
    rows.append(one_hot)
    return torch.stack(rows).to(torch.bfloat16).to(dev)


def staging_random_rows(T: int, H: int, dev, seed: int) -> torch.Tensor:
    """Gaussian rows over 16 decades of scale, 1% of elements 100x larger."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    scale = torch.logspace(-8, 8, T)[:, None]
    x = torch.randn(T, H, generator=g) * scale
    heavy = torch.rand(T, H, generator=g) < 0.01
    x = torch.where(heavy, x * 100, x)
    return x.to(torch.bfloat16).to(dev)


def frag_positions(H: int, e4m3: bool = False) -> torch.Tensor:
    """Stored column of each natural column in the triton backend's frag K orders
    (docs/KERNELS.md, "The frag K order"), written independently of the kernels'
    ``_jit.frag_pos`` / ``_jit.frag8_pos`` so tests and benchmarks can check them. E2M1:
    natural ``32q + 8w + 4h + j`` of a 128 block is stored at ``16(2w + j//2) + 8(j%2) + 2q + h``;
    E4M3: ``32q + 4w + 2h + p`` at ``16w + 8p + 2q + h``."""
    c = torch.arange(H)
    m = c % 128
    if e4m3:
        q, w, h, p = m // 32, (m // 4) % 8, (m // 2) % 2, m % 2
        return c - m + 16 * w + 8 * p + 2 * q + h
    q, w, h, j = m // 32, (m // 8) % 4, (m // 4) % 2, m % 4
    return c - m + 16 * (2 * w + j // 2) + 8 * (j % 2) + 2 * q + h


def check_routing_plan(plan, ids: torch.Tensor, num_local: int, offset: int, bm: int) -> None:
    """Raise AssertionError unless ``plan`` (a triton ``RoutingPlan``) groups exactly the pairs of
    local experts of ``ids`` into padded runs of ``bm`` rows: pairs first, -1 after, experts
    ascending. A plain bincount is the reference, so tests and ``bench/route.py`` check the same."""
    flat = ids.reshape(-1).cpu().long()
    le = flat - offset
    valid = (le >= 0) & (le < num_local)
    counts = torch.bincount(le[valid], minlength=num_local)
    nblk = int(((counts + bm - 1) // bm).sum())
    assert int(plan.num_blocks) == nblk <= plan.max_blocks, (int(plan.num_blocks), nblk, plan.max_blocks)
    sp = plan.sorted_pairs.cpu()[: plan.max_blocks * bm]
    be = plan.block_expert.cpu()[: plan.max_blocks]
    assert (be[nblk:] == -1).all() and (sp[nblk * bm:] == -1).all(), "blocks or rows past the end"
    seen = []
    for b in range(nblk):
        rows = sp[b * bm:(b + 1) * bm]
        real = rows[rows >= 0]
        assert (rows[: real.numel()] >= 0).all(), f"block {b}: padding before a pair"
        assert (le[real.long()] == be[b]).all(), f"block {b}: pairs of other experts"
        seen.append(real)
    got = sorted(torch.cat(seen).tolist()) if seen else []
    assert got == valid.nonzero().squeeze(1).tolist(), "pairs lost or placed twice"
    if nblk:
        assert (torch.diff(be[:nblk]) >= 0).all(), "experts out of order"


def check_tail_split(plan, tails, ids: torch.Tensor, num_local: int, offset: int, tail_max: int) -> None:
    """Raise AssertionError unless ``plan`` and ``tails`` (after ``staging.split_tails``) compute
    every local pair of ``ids`` exactly once: each expert whose last ``plan.block_m`` block held
    1..``tail_max`` pairs has that block skipped (expert -1) and its pairs in ``tails`` blocks of
    ``tails.block_m`` rows (pairs first, -1 after); every other block unchanged. Reference: a
    bincount, as ``check_routing_plan``."""
    bm, tbm = plan.block_m, tails.block_m
    flat = ids.reshape(-1).cpu().long()
    le = flat - offset
    valid = (le >= 0) & (le < num_local)
    counts = torch.bincount(le[valid], minlength=num_local)
    last_fill = counts - (torch.clamp((counts + bm - 1) // bm, min=1) - 1) * bm
    is_tail = (counts > 0) & (last_fill <= tail_max)
    n_tail = int(((last_fill + tbm - 1) // tbm)[is_tail].sum())
    assert int(tails.num_blocks) == n_tail <= tails.max_blocks, (int(tails.num_blocks), n_tail, tails.max_blocks)
    nblk = int(plan.num_blocks)
    be = plan.block_expert.cpu()[: plan.max_blocks]
    sp = plan.sorted_pairs.cpu()
    tbe = tails.block_expert.cpu()[: tails.max_blocks]
    tsp = tails.sorted_pairs.cpu()
    assert (tbe[n_tail:] == -1).all(), "tail blocks past the end"
    assert int((be[:nblk] == -1).sum()) == int(is_tail.sum()), "skipped blocks != experts with a tail"
    seen = []
    for blocks, exp, rows_per, what in ((range(nblk), be, bm, sp), (range(n_tail), tbe, tbm, tsp)):
        for b in blocks:
            if exp[b] < 0:
                continue
            rows = what[b * rows_per:(b + 1) * rows_per]
            real = rows[rows >= 0]
            assert (rows[: real.numel()] >= 0).all(), f"block {b}: padding before a pair"
            assert (le[real.long()] == exp[b]).all(), f"block {b}: pairs of other experts"
            assert rows_per == bm or bool(is_tail[exp[b]]), f"tail block {b} of expert {int(exp[b])} without a tail"
            seen.append(real)
    got = sorted(torch.cat(seen).tolist()) if seen else []
    assert got == valid.nonzero().squeeze(1).tolist(), "pairs lost or computed twice"
