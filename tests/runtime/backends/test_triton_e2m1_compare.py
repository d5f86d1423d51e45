"""E2M1 rounding of a quotient by compares (``_jit.e2m1_magnitude``) against the IEEE quotient rounded by the codec.

The staging quantizer's NVFP4 path rounds ``y / d`` to E2M1 without dividing: ``RN(y / d) >= m`` is
``y >= m * d`` for every E2M1 midpoint m and E4M3 block scale d (docs/KERNELS.md, "Staging: the NVFP4
per-token quantizer"). The staging tests check it through whole rows; here the helper meets the definition:
``codecs.e2m1_encode`` of torch's fp32 quotient (an IEEE division), on every positive E4M3 scale with the
fp32 neighbours of every midpoint times it (where the quotient's own rounding decides), the grid values, zeros,
infinities, NaN and random values over many binades. The CPU test runs the kernel under Triton's interpreter;
the GPU test on the device, where it is compiled.
"""
from __future__ import annotations

import pytest
import torch

from interpreted import interpreted_output

MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def cases() -> tuple[torch.Tensor, torch.Tensor]:
    """(y, d) fp32 pairs: d every positive finite E4M3 value; y around each midpoint * d, on the grid, specials."""
    d_all = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    ys, ds = [], []
    for d in d_all.tolist():
        p = torch.tensor([m * d for m in MIDPOINTS], dtype=torch.float32)
        near = [p]
        up, down = p.clone(), p.clone()
        for _ in range(3):  # three fp32 steps either side of each midpoint * d
            up = torch.nextafter(up, torch.tensor(float("inf")))
            down = torch.nextafter(down, torch.tensor(0.0))
            near += [up, down]
        grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 7.0, 1e30]) * d
        y = torch.cat(near + [grid, torch.tensor([float("inf"), float("nan"), 1e-40, 0.0])])
        y = torch.cat([y, -y])
        ys.append(y)
        ds.append(torch.full_like(y, d))
    g = torch.Generator().manual_seed(0)
    r = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-30, 30, (20000,), generator=g).float())
    ys.append(r)
    ds.append(d_all[torch.randint(0, d_all.numel(), (20000,), generator=g)])
    return torch.cat(ys), torch.cat(ds)


def expected(y: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The codec's E2M1 code of the IEEE quotient, the sign taken from y (as the kernels do: a NaN's too)."""
    from megamoe_runtime.format import codecs

    code = codecs.e2m1_encode(y / d).to(torch.int32) & 7
    return code | ((y.view(torch.int32) >> 28) & 8)


triton = pytest.importorskip("triton")
tl = triton.language
from megamoe_runtime.backends.triton import _jit  # noqa: E402


@triton.jit
def _codes(y_ptr, d_ptr, out_ptr, n, STRICT_ALL: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    y = tl.load(y_ptr + o, mask=m, other=0.0)
    d = tl.load(d_ptr + o, mask=m, other=1.0)
    a = tl.abs(y)
    if STRICT_ALL:
        c = (a > d * 0.25).to(tl.int32) + (a > d * 0.75).to(tl.int32) + (a > d * 1.25).to(tl.int32) \
            + (a > d * 1.75).to(tl.int32) + (a > d * 2.5).to(tl.int32) + (a > d * 3.5).to(tl.int32) \
            + (a > d * 5.0).to(tl.int32)
    else:
        c = _jit.e2m1_magnitude(a, d)
    tl.store(out_ptr + o, c | ((y.to(tl.int32, bitcast=True) >> 28) & 8), mask=m)


def kernel_codes(y: torch.Tensor, d: torch.Tensor, strict_all: bool = False) -> torch.Tensor:
    """``_jit.e2m1_magnitude(|y|, d)`` with y's sign bit, from a one-dimensional kernel; ``strict_all``: the
    negative control, every compare strict (wrong at the midpoints that round up)."""
    out = torch.empty(y.shape, dtype=torch.int32, device=y.device)
    _codes[(triton.cdiv(y.numel(), 1024),)](y, d, out, y.numel(), STRICT_ALL=strict_all, BLOCK=1024)
    return out


def mismatches(device: str, strict_all: bool = False) -> int:
    y, d = cases()
    got = kernel_codes(y.to(device), d.to(device), strict_all).cpu()
    return int((got != expected(y, d)).sum())


def test_e2m1_by_compares_under_the_interpreter():
    """No difference; the all-strict control differs (so the cases reach the midpoints that round up)."""
    out = interpreted_output(__file__, "json.dumps([m.mismatches('cpu'), m.mismatches('cpu', True)])", timeout=300)
    exact, control = (int(v) for v in out.strip("[]").split(","))
    assert exact == 0
    assert control > 0


@pytest.mark.gpu
def test_e2m1_by_compares_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert mismatches("cuda") == 0
    assert mismatches("cuda", True) > 0
