"""Whether a weight-scale tensor is known to fit the fold decode, so the kernels may skip their check.

The frag kernels' fold decode (docs/KERNELS.md, "The fold decode") is exact only while every
UE8M0 scale byte of the tile is at most a limit (E2M1 weights: 128, E4M3 weights: 134); above it
the folded scale operand is not a finite bf16. No real checkpoint comes near (a byte of 129 means
a block of 32 weights with a magnitude above 12), but the kernels must still be right on one, so
each tile checks its scale bytes after the main loop and computes itself again with the plain
decode if one is too large. That check is a second pass over the tile's scales in every tile of
every forward. This module answers the same question once per tensor contents: a reduction over
the whole scale tensor the first time a forward sees it, kept against the tensor's version
counter. Every ``copy_`` / ``fill_`` of a load or reload bumps that counter (views share it with
their base), and the page-cache DMA path, which writes through raw pointers, bumps it itself
(``file_io``), so new bytes are looked at again before the next forward trusts them.

What it never does: sync during CUDA-graph capture (an unknown tensor then keeps the in-kernel
check, which is always right), or trust a tensor whose version it cannot read (inference-mode
tensors have no counter: they keep the check).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["within_fold_limit", "FOLD_CHECK_ENV"]

#: "always": keep the in-kernel check even for tensors known to fit (benchmarks compare the two)
FOLD_CHECK_ENV = "MEGAMOE_TRITON_FOLD_CHECK"

# base tensor -> {(data_ptr, shape, stride, limit): (version, fits)}
_KNOWN: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _version(t: torch.Tensor) -> Optional[int]:
    try:
        return int(t._version)
    except RuntimeError:  # inference tensor: no version counter
        return None


def within_fold_limit(scales: Optional[torch.Tensor], limit: int) -> bool:
    """True when every byte of ``scales`` (any dtype: its bytes are read) is at most ``limit``
    and that is known for the tensor's current contents; False when it is not, or cannot be
    learned now (graph capture, no version counter, ``MEGAMOE_TRITON_FOLD_CHECK=always``).

    False is always safe: the kernels then check their tiles themselves."""
    if scales is None or scales.numel() == 0 or os.environ.get(FOLD_CHECK_ENV) == "always":
        return False
    base = scales._base if scales._base is not None else scales
    version = _version(base)
    if version is None:
        return False
    key = (scales.data_ptr(), tuple(scales.shape), tuple(scales.stride()), int(limit))
    entry = _KNOWN.get(base)
    if entry is not None and key in entry and entry[key][0] == version:
        return entry[key][1]
    if scales.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    fits = bool(_max_byte(scales) <= limit)  # one reduction and one sync per tensor contents
    _KNOWN.setdefault(base, {})[key] = (version, fits)
    return fits


def _max_byte(t: torch.Tensor) -> int:
    """Largest byte of ``t``'s elements (a strided view is read through its own strides)."""
    if t.dtype != torch.uint8:
        t = (t if t.is_contiguous() else t.contiguous()).view(torch.uint8)
    return int(t.amax())
