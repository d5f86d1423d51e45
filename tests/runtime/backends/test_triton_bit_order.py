"""The tiled E2M1 bit order written by a kernel (``backends.triton.bit_order``): the same bits as the format
layer's definition (``format.weight_tiles.permute_e2m1_bits``), both ways, for the layer's in-place passes.

CPU: the kernel under Triton's interpreter (a subprocess) against the torch form, and the function's
refusals. GPU: the compiled kernel on words of every bit pattern, lengths that no block divides, both word
widths; the in-place tiling pass through it against ``tiled_copy``. Negative control (both): the other
direction is another permutation, so a kernel that moved the bits the wrong way would be caught.
"""
from __future__ import annotations

import json

import pytest
import torch
from interpreted import interpreted_output

from megamoe_runtime.format import weight_tiles

bit_order = pytest.importorskip("megamoe_runtime.backends.triton.bit_order")

#: (word dtype, words): lengths that no kernel block divides
CASES = [("int32", 4095), ("int64", 4096 * 3 + 17)]


def _words(n: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8).view(dtype).to(device)


def check(device: str) -> dict:
    """{case: [tiled as defined, back as defined, round trip, the other direction differs]}."""
    res = {}
    for name, n in CASES:
        src = _words(n, getattr(torch, name), device, seed=n)
        tiled, back = torch.full_like(src, -1), torch.full_like(src, -1)
        bit_order.copy_e2m1_bits(src, tiled, True)
        bit_order.copy_e2m1_bits(tiled, back, False)
        res[f"{name} {n}"] = [torch.equal(tiled, weight_tiles.permute_e2m1_bits(src, True)),
                              torch.equal(back, weight_tiles.permute_e2m1_bits(tiled, False)),
                              torch.equal(back, src),
                              not torch.equal(tiled, weight_tiles.permute_e2m1_bits(src, False))]
    return res


def _assert_all(res: dict) -> None:
    for case, (to_tiled, to_natural, round_trip, direction) in res.items():
        assert to_tiled and to_natural, f"{case}: the kernel's bits differ from the format layer's"
        assert round_trip, f"{case}: tiled and back is not the identity"
        assert direction, f"{case}: the two directions agree, so the check could not tell them apart"


def test_kernel_matches_the_torch_form_under_the_interpreter():
    _assert_all(json.loads(interpreted_output(__file__, "json.dumps(m.check('cpu'))", timeout=300)))


def test_mismatched_tensors_are_refused():
    src = _words(64, torch.int64)
    with pytest.raises(ValueError, match="one shape and dtype"):
        bit_order.copy_e2m1_bits(src, torch.empty(32, dtype=torch.int64), True)
    with pytest.raises(ValueError, match="one shape and dtype"):
        bit_order.copy_e2m1_bits(src, torch.empty(128, dtype=torch.int32), True)


@pytest.mark.gpu
def test_kernel_matches_the_torch_form():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _assert_all(check("cuda"))


@pytest.mark.gpu
def test_in_place_pass_through_the_kernel_is_tiled_copy():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    w = _words(5 * 64 * 256 // 8, torch.int64, "cuda", seed=7).view(torch.uint8).view(5, 64, 256)
    want = weight_tiles.tiled_copy(w, 16)
    orig, ptr = w.clone(), w.data_ptr()
    weight_tiles.tile_in_place(w, 16, bit_order.copy_e2m1_bits)
    assert w.data_ptr() == ptr and torch.equal(w, want)
    weight_tiles.untile_in_place(w, 16, bit_order.copy_e2m1_bits)
    assert torch.equal(w, orig)
