"""Raw byte views of CPU tensors without numpy.

torch's CPU wheel does not depend on numpy, and neither does megamoe:
``tensor.numpy()`` would fail on a fresh machine. File I/O (pread/readinto
into a parameter, hashing and writing a packed tensor) only needs a writable
buffer over the tensor's memory, which ctypes gives with no copy.
"""

from __future__ import annotations

import ctypes

import torch

from ..errors import MegaMoEError


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable ``memoryview`` (format "B") over a contiguous CPU tensor's bytes.

    No copy: writes through the view change the tensor. The view keeps the
    tensor alive for as long as it exists.
    """
    if t.device.type != "cpu":
        raise MegaMoEError(f"byte_view needs a CPU tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise MegaMoEError(f"byte_view needs a contiguous tensor, got strides {tuple(t.stride())}")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    buf = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    buf._megamoe_owner = t  # the memory belongs to the tensor: keep it alive with the view
    return memoryview(buf).cast("B")
