"""Scale bytes one K step ahead (``KernelConfig.scale_load="ahead"``): the frag kernels' output must be the
byte loads' output bit for bit (the same bytes, loaded one loop iteration earlier).

The CPU test runs the whole layer under Triton's interpreter in a subprocess (the interpreter is chosen when
triton is imported), for mxfp8 (where the choice takes effect) and the E2M1 rows (where it must not), the
one-dot and two-dot L1, and a split-K L2 (a K loop that does not start at 0). Negative control: a prefetch
that reads the following K block's scales instead must change the mxfp8 output, and leave the E2M1 rows'
(which never take it) as they were. The GPU test runs the same cases through the compiled kernels.
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
    from megamoe_runtime.backends.triton import operands

    _mx_scales = operands.mx_scales  # the right one, which the wrong prefetch below calls

    @triton.jit
    def _one_block_late(wsb_ptr, srows, NROWS, k0, k_last, SAHEAD: tl.constexpr):
        """A wrong prefetch (the negative control): the scales of the K block after the one asked for."""
        return _mx_scales(wsb_ptr, srows, NROWS, k0 + 128, k_last, SAHEAD)

#: (row, one-dot L1, L2 K slices)
CASES = [("mxfp8", True, 1), ("mxfp8", True, 2), ("mxfp8", False, 1), ("mxfp4", True, 2), ("nvfp4", True, 1)]


def run_cases(device: str, negative: bool = True) -> dict:
    """{case: [bitwise equal to the byte loads, the wrong prefetch's output differs]} over ``CASES``."""
    from megamoe_runtime.backends.triton import configs, moe, operands, synth
    from megamoe_runtime.backends.triton.backend import _NvScalars, _Roles
    from megamoe_runtime.format.formats import ActivationSpec, LayerSpec

    out = {}
    H, I, E, K, T = 256, 512, 4, 2, 6
    for row, gu, split in CASES:
        spec = LayerSpec(row, H, I, E, K, ActivationSpec("swiglu", clamp=10.0), routed_scaling_factor=2.5)
        lay = synth.random_kernel_bytes(spec, device, seed=3)
        kt = _Roles(lay, "")
        sc = _NvScalars(lay) if row == "nvfp4" else None
        g = torch.Generator().manual_seed(5)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32).to(device)
        tw = torch.rand(T, K, generator=g).to(device)
        base = configs.KernelConfig(block_m=16, k_order="frag", decode="plain", l1_gu=gu, l2_split=split)
        run = lambda c: moe.moe_forward(spec, kt, x, tw, ids, scalars=sc, config=c).view(torch.int16)  # noqa: E731
        want = run(dataclasses.replace(base, scale_load="bytes"))
        ahead = dataclasses.replace(base, scale_load="ahead")
        res = [bool(torch.equal(run(ahead), want))]
        if negative:
            operands.mx_scales = _one_block_late  # in the K loop of the L1 and the L2 (``operands.k_loop``)
            try:
                res.append(not torch.equal(run(ahead), want))
            finally:
                operands.mx_scales = _mx_scales
        out[f"{row} gu={int(gu)} split={split}"] = res
    return out


def _check(res: dict, negative: bool) -> None:
    assert len(res) == len(CASES)
    for case, r in res.items():
        assert r[0], f"{case}: scales ahead differ from the byte loads"
        if negative and case.startswith("mxfp8"):  # (the two-dot case through its L2)
            assert r[1], f"{case}: a prefetch of the wrong K block went unnoticed"
        elif negative:  # the E2M1 rows never load ahead: the wrong prefetch cannot matter
            assert not r[1], f"{case}: took the scales-ahead path it must not take"


def test_scales_ahead_same_bits_under_the_interpreter():
    _check(json.loads(interpreted_output(__file__, "json.dumps(m.run_cases('cpu'))", timeout=600)), True)


@pytest.mark.gpu
def test_scales_ahead_same_bits_on_the_gpu():
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _check(run_cases("cuda", negative=False), False)
