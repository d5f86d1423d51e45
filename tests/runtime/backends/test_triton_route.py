"""Routing plans of the triton backend (``staging.route``), both kernels, against a bincount.

The single-program kernel and the two-launch form (histograms per slice of pairs, then
placement) must give the same plan up to the order inside each expert's run. The CPU test runs
the kernels under Triton's interpreter in a subprocess (the interpreter is chosen when triton is
imported); the GPU test adds the sizes a prefill routes.
"""
from __future__ import annotations


import pytest
import torch

from megamoe_runtime.testing import check_routing_plan as check_plan
from megamoe_runtime.testing import check_tail_split
from interpreted import interpreted_output


#: (tokens, local experts, offset of the first, row block, top-k, slice_pairs)
CASES = [(37, 8, 8, 16, 4, 16), (300, 16, 0, 64, 4, 64), (300, 16, 0, 64, 4, 0), (129, 256, 0, 16, 8, 256),
         (50, 5, 3, 32, 4, 32), (64, 16, 0, 16, 4, None), (300, 16, 0, 64, 4, None), (3, 4, 0, 128, 2, 16)]


#: (tokens, local experts, offset, row block, top-k, tail block, tail max): tails of one and of
#: several small blocks, experts whose only block is a tail, full last blocks (no tail)
TAIL_CASES = [(300, 16, 0, 64, 4, 16, 16), (300, 16, 0, 64, 4, 16, 40), (40, 4, 2, 32, 4, 16, 31),
              (129, 8, 0, 128, 8, 32, 64), (64, 4, 0, 16, 4, 16, 8), (5, 8, 0, 128, 2, 32, 32)]


def run_cases(device: str) -> int:
    from megamoe_runtime.backends.triton import staging

    g = torch.Generator().manual_seed(0)
    for T, E_l, off, bm, K, sl in CASES:
        ids = torch.randint(-1, 2 * E_l + off, (T, K), generator=g).to(device)
        check_plan(staging.route(ids, E_l, off, bm, slice_pairs=sl), ids, E_l, off, bm)
    for T, E_l, off, bm, K, tbm, tmax in TAIL_CASES:
        ids = torch.randint(-1, E_l + off + 1, (T, K), generator=g).to(device)
        if T == 64:  # every expert's count a multiple of the row block: no tails at all
            ids = (torch.arange(T * K, device=device) % E_l + off).reshape(T, K)
        plan = staging.route(ids, E_l, off, bm)
        check_tail_split(plan, staging.split_tails(plan, E_l, tbm, tmax), ids, E_l, off, tmax)
    return len(CASES) + len(TAIL_CASES)


def test_route_kernels_under_the_interpreter():
    assert interpreted_output(__file__, "m.run_cases('cpu')", timeout=300) == str(len(CASES) + len(TAIL_CASES))


def test_check_plan_catches_a_wrong_plan():
    """The checker is the test: a pair moved to another expert's run, a lost pair and a wrong
    block count must each fail it."""
    from types import SimpleNamespace

    ids = torch.tensor([[0, 1], [1, 2], [2, 0]])
    good = dict(sorted_pairs=torch.tensor([0, 5, 1, 2, 3, 4, -1, -1], dtype=torch.int32),
                block_expert=torch.tensor([0, 1, 2, -1], dtype=torch.int32),
                num_blocks=torch.tensor([3], dtype=torch.int32), max_blocks=4)
    check_plan(SimpleNamespace(**good), ids, 3, 0, 2)
    moved = dict(good, sorted_pairs=torch.tensor([0, 1, 5, 2, 3, 4, -1, -1], dtype=torch.int32))
    lost = dict(good, sorted_pairs=torch.tensor([0, 5, 1, -1, 3, 4, -1, -1], dtype=torch.int32))
    count = dict(good, num_blocks=torch.tensor([2], dtype=torch.int32))
    for bad in (moved, lost, count):
        with pytest.raises(AssertionError):
            check_plan(SimpleNamespace(**bad), ids, 3, 0, 2)


def test_bad_slice_is_refused():
    pytest.importorskip("triton")
    from megamoe_runtime.backends.triton import staging
    from megamoe_runtime.errors import MegaMoEError

    with pytest.raises(MegaMoEError, match="slice_pairs must be 0 or a power of two"):
        staging.route(torch.zeros(4, 2, dtype=torch.int64), 4, 0, 16, slice_pairs=48)


def _cuda():
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megamoe_runtime.backends.triton import staging, synth

    return staging, synth


@pytest.mark.gpu
@pytest.mark.parametrize("slice_pairs", [None, 0, 64, 1024])
@pytest.mark.parametrize("T,E_l,offset,bm,K", [(1, 8, 0, 16, 4), (37, 8, 8, 16, 4), (300, 16, 0, 64, 4),
                                                (0, 4, 0, 16, 4), (64, 256, 0, 16, 8), (4096, 256, 0, 128, 8),
                                                (5000, 256, 512, 64, 8)])
def test_route(T, E_l, offset, bm, K, slice_pairs):
    staging, synth = _cuda()
    E = max(E_l * 2, offset + E_l)
    tw, ids = synth.random_routing(T, E, K, "cuda", seed=T, mask_frac=0.2, zero_tokens=min(T, 2))
    check_plan(staging.route(ids, E_l, offset, bm, slice_pairs=slice_pairs), ids, E_l, offset, bm)


@pytest.mark.gpu
def test_route_interpreter_cases_on_the_gpu():
    _cuda()
    assert run_cases("cuda") == len(CASES) + len(TAIL_CASES)


def test_route_slice_grows_with_the_pairs():
    pytest.importorskip("triton")
    from megamoe_runtime.backends.triton import staging

    one = staging.ROUTE_ONE_PROGRAM_MAX
    assert staging.route_slice(1) == staging.route_slice(one) == 0
    sizes = [staging.route_slice(n) for n in (one + 1, 8192, 8193, 1 << 20)]
    assert sizes == sorted(sizes) and all(s >= 16 and s & (s - 1) == 0 for s in sizes)


def test_check_tail_split_catches_a_wrong_split():
    """The tail checker is the test: a tail block left in the main plan as well (its pairs twice),
    a tail that lost a pair, and a tail taken from an expert whose last block is over the limit
    must each fail it."""
    from types import SimpleNamespace

    ids = torch.tensor([[0, 1], [0, 1], [0, 2]])  # expert 0: 3 pairs, 1: 2, 2: 1; row block 2, tail <= 1
    plan = SimpleNamespace(sorted_pairs=torch.tensor([0, 2, 4, -1, 1, 3, 5, -1], dtype=torch.int32),
                           block_expert=torch.tensor([0, -1, 1, -1], dtype=torch.int32),
                           num_blocks=torch.tensor([4], dtype=torch.int32), max_blocks=4, block_m=2)
    tails = SimpleNamespace(sorted_pairs=torch.tensor([4, 5], dtype=torch.int32),
                            block_expert=torch.tensor([0, 2], dtype=torch.int32),
                            num_blocks=torch.tensor([2], dtype=torch.int32), max_blocks=2, block_m=1)
    check_tail_split(plan, tails, ids, 3, 0, 1)
    twice = SimpleNamespace(**dict(vars(plan), block_expert=torch.tensor([0, 0, 1, -1], dtype=torch.int32)))
    lost = SimpleNamespace(**dict(vars(tails), sorted_pairs=torch.tensor([4, -1], dtype=torch.int32)))
    over = SimpleNamespace(**dict(vars(plan), block_expert=torch.tensor([0, -1, -1, -1], dtype=torch.int32)))
    over_t = SimpleNamespace(sorted_pairs=torch.tensor([4, 1, 3, 5], dtype=torch.int32),
                             block_expert=torch.tensor([0, 1, 1, 2], dtype=torch.int32),
                             num_blocks=torch.tensor([4], dtype=torch.int32), max_blocks=4, block_m=1)
    for p, t in ((twice, tails), (plan, lost), (over, over_t)):
        with pytest.raises(AssertionError):
            check_tail_split(p, t, ids, 3, 0, 1)


def test_bad_tail_split_is_refused():
    pytest.importorskip("triton")
    from megamoe_runtime.backends.triton import staging
    from megamoe_runtime.errors import MegaMoEError

    plan = staging.RoutingPlan(torch.full((64,), -1, dtype=torch.int32), torch.full((2,), -1, dtype=torch.int32),
                               torch.zeros(1, dtype=torch.int32), 32, 2, 2)
    with pytest.raises(MegaMoEError, match="tail_block_m"):
        staging.split_tails(plan, 2, 24, 8)
    with pytest.raises(MegaMoEError, match="tail_max"):
        staging.split_tails(plan, 2, 16, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("T,bm,tbm,tmax", [(4096, 128, 32, 32), (4096, 128, 32, 64), (4096, 64, 32, 32),
                                           (40000, 128, 16, 48), (2, 128, 32, 32)])
def test_split_tails_at_prefill_sizes(T, bm, tbm, tmax):
    staging, synth = _cuda()
    tw, ids = synth.random_routing(T, 256, 8, "cuda", seed=T, mask_frac=0.1, zero_tokens=min(T, 2))
    plan = staging.route(ids, 256, 0, bm)
    check_tail_split(plan, staging.split_tails(plan, 256, tbm, tmax), ids, 256, 0, tmax)
