"""The tiled E2M1 bit order written on the GPU (``backends.triton.bit_order``): the same bits as the format
layer's definition (``format.weight_tiles.permute_e2m1_bits``), both ways, for the layer's in-place passes.

CPU: the function's fallback (the torch form) and its refusals. GPU: the kernel against the torch form on
words of every bit pattern, lengths that no block divides, both word widths; the in-place tiling pass through
it against ``tiled_copy``; negative control: the other direction gives other words.
"""
from __future__ import annotations

import pytest
import torch

from megamoe_runtime.format import weight_tiles

bit_order = pytest.importorskip("megamoe_runtime.backends.triton.bit_order")


def _words(n: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8)
    return w.view(dtype).to(device)


@pytest.mark.parametrize("to_tiled", [True, False])
def test_cpu_tensors_take_the_torch_form(to_tiled):
    src = _words(1000, torch.int64)
    dst = torch.empty_like(src)
    bit_order.copy_e2m1_bits(src, dst, to_tiled)
    assert torch.equal(dst, weight_tiles.permute_e2m1_bits(src, to_tiled))


def test_mismatched_tensors_are_refused():
    src = _words(64, torch.int64)
    with pytest.raises(ValueError, match="one shape and dtype"):
        bit_order.copy_e2m1_bits(src, torch.empty(32, dtype=torch.int64), True)
    with pytest.raises(ValueError, match="one shape and dtype"):
        bit_order.copy_e2m1_bits(src, torch.empty(128, dtype=torch.int32), True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [1, 4095, 4096 * 3 + 17])
def test_kernel_matches_the_torch_form(dtype, n):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    src = _words(n, dtype, "cuda", seed=n)
    for to_tiled in (True, False):
        dst = torch.full_like(src, -1)
        bit_order.copy_e2m1_bits(src, dst, to_tiled)
        assert torch.equal(dst, weight_tiles.permute_e2m1_bits(src, to_tiled)), (dtype, n, to_tiled)
    back = torch.empty_like(src)
    tiled = torch.empty_like(src)
    bit_order.copy_e2m1_bits(src, tiled, True)
    bit_order.copy_e2m1_bits(tiled, back, False)
    assert torch.equal(back, src)
    # negative control: the other direction is another permutation
    assert n < 4 or not torch.equal(tiled, weight_tiles.permute_e2m1_bits(src, False))


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
