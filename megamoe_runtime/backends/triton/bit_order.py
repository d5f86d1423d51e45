"""The tiled E2M1 bit order (``format.weight_tiles.E2M1_WORD_BITS``) written on the GPU in one pass.

Why a kernel: the format layer's torch form of the permutation is five shift / mask / or steps over the
words, which made the in-place tiling pass of a DeepSeek-V3 layer ten times slower than the copy it is
(80 ms against 8 on an H100; a load pays it once per layer, docs/KERNELS.md "The tiled bit order").
Here the permutation rides on the pass's copy into its scratch: each word is read once, moved, and
written once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _jit
from .launch import opts

_BLOCK = 4096


@triton.jit
def _copy_moved_kernel(src_ptr, dst_ptr, n, TO_TILED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst_ptr + offs, _jit.e2m1_bits_moved(tl.load(src_ptr + offs, mask=m), TO_TILED), mask=m)


def copy_e2m1_bits(src: torch.Tensor, dst: torch.Tensor, to_tiled: bool) -> None:
    """Write ``src`` (contiguous words of packed E2M1 weights, any integer dtype of 4 or 8 bytes) into
    ``dst`` (same shape and dtype) with the bits of every 32-bit word moved to the tiled order or back: the
    format layer's ``permute_e2m1_bits``, bit for bit, in one kernel (a GPU, or Triton's interpreter)."""
    if src.shape != dst.shape or src.dtype != dst.dtype or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"copy_e2m1_bits: contiguous tensors of one shape and dtype expected, got "
                         f"{src.dtype} {tuple(src.shape)} and {dst.dtype} {tuple(dst.shape)}")
    s32, d32 = src.view(-1).view(torch.int32), dst.view(-1).view(torch.int32)
    n = s32.numel()
    if n:
        _copy_moved_kernel[(triton.cdiv(n, _BLOCK),)](s32, d32, n, TO_TILED=to_tiled, BLOCK=_BLOCK, num_warps=8,
                                                      **opts())
