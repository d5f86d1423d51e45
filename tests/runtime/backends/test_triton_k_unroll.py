"""Two K blocks per loop trip (``KernelConfig.k_unroll=2``): the frag kernels' output must be one block per
trip's, bit for bit (the same dots in the same order; only the loop's bookkeeping is shared).

The CPU test runs the whole layer under Triton's interpreter in a subprocess (the interpreter is chosen when
triton is imported) for the three decoded rows, fold and plain decodes, scales ahead and a split-K L2 (K
slices of 256 that do not start at 0), and a layer whose K is not a multiple of 256 (one block per trip
there). Negative control: a trip that reads its first block twice must change every unrolled case's output
and leave the case that falls back to one block per trip as it was. The GPU test runs the same cases through
the compiled kernels.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from interpreted import interpreted_output

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU CI without triton: the tests skip
    triton = None

if triton is not None:
    @triton.jit
    def _first_block_twice(kk, u: tl.constexpr, BK: tl.constexpr):
        """A wrong trip (the negative control): every block of the trip is its first."""
        return kk

#: (row, decode, scale load, L2 K slices, H, I)
CASES = [("mxfp4", "fold", None, 1, 512, 256), ("nvfp4", "fold", None, 2, 512, 512),
         ("mxfp8", "plain", "ahead", 1, 512, 256), ("mxfp8", "fold", "bytes", 2, 256, 512),
         ("mxfp4", "plain", None, 1, 384, 384)]


def run_cases(device: str, negative: bool = True) -> dict:
    """{case: [bitwise equal to one block per trip, the wrong trip's output differs]} over ``CASES``."""
    from megamoe_runtime.backends.triton import configs, moe, operands, synth
    from megamoe_runtime.backends.triton.backend import _NvScalars, _Roles
    from megamoe_runtime.format.formats import ActivationSpec, LayerSpec

    out = {}
    E, K, T = 4, 2, 6
    for row, dec, sl, split, H, I in CASES:
        spec = LayerSpec(row, H, I, E, K, ActivationSpec("swiglu", clamp=10.0), routed_scaling_factor=2.5)
        lay = synth.random_kernel_bytes(spec, device, seed=3)
        kt = _Roles(lay, "")
        sc = _NvScalars(lay) if row == "nvfp4" else None
        g = torch.Generator().manual_seed(5)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32).to(device)
        tw = torch.rand(T, K, generator=g).to(device)
        base = configs.KernelConfig(block_m=16, k_order="frag", decode=dec, l1_gu=True, l2_split=split,
                                    scale_load=sl)
        run = lambda c: moe.moe_forward(spec, kt, x, tw, ids, scalars=sc, config=c).view(torch.int16)  # noqa: E731
        want = run(base)
        two = dataclasses.replace(base, k_unroll=2)
        res = [bool(torch.equal(run(two), want))]
        if negative:
            saved = operands.trip_block
            operands.trip_block = _first_block_twice  # in the K loop of the L1 and the L2 (``operands.k_loop``)
            try:
                res.append(not torch.equal(run(two), want))
            finally:
                operands.trip_block = saved
        out[f"{row} {dec} scales={sl} split={split} H={H} I={I}"] = res
    return out


def _check(res: dict, negative: bool) -> None:
    assert len(res) == len(CASES)
    for (case, r), (_, _, _, split, H, I) in zip(res.items(), CASES):
        assert r[0], f"{case}: two K blocks per trip differ from one"
        if negative and H % 256 == 0:
            assert r[1], f"{case}: a trip that reads its first block twice went unnoticed"
        elif negative:  # K % 256 != 0: one block per trip, the wrong trip cannot matter
            assert not r[1], f"{case}: unrolled a loop whose K is not a multiple of 256"


def test_k_unroll_rejects_other_values():
    from megamoe_runtime.backends.triton import configs

    assert configs.k_unroll(configs.KernelConfig(k_unroll=2), 512) == 2
    assert configs.k_unroll(configs.KernelConfig(k_unroll=2), 384) == 1
    assert configs.k_unroll(configs.KernelConfig(), 512) == 1
    with pytest.raises(ValueError, match="k_unroll must be 1 or 2, got 3"):
        configs.k_unroll(configs.KernelConfig(k_unroll=3), 768)


def test_k_unroll_same_bits_under_the_interpreter():
    _check(json.loads(interpreted_output(__file__, "json.dumps(m.run_cases('cpu'))", timeout=900)), True)


@pytest.mark.gpu
def test_k_unroll_same_bits_on_the_gpu():
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _check(run_cases("cuda", negative=False), False)
