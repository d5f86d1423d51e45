"""GPU loads that DMA straight from the file's page cache (no CPU copy).

Why: a copying loader moves every byte page cache -> pinned buffer on a CPU
(read + write of host memory) and then the DMA reads it again, so on the H200
host it tops out near 18 GB/s, a third of the 55 GB/s a pinned host-to-device
copy reaches (BENCHMARKS.md, issue 13). Mapping the file read-only
(``MAP_SHARED | MAP_POPULATE``) and page-locking that mapping with
``cudaHostRegister(..., cudaHostRegisterReadOnly)`` lets the copy engine read
the cached file pages themselves: measured there, the DMA from a registered
page-cache mapping runs at the full pinned rate (54.7 GB/s), and registering
costs about 30 ms per GiB, which is overlapped with the copies of earlier
pieces and spread over reader threads.

Measured on the H200 in a whole load (`bench/load.py --gb 2`, 2026-12-02), 64 MiB
pieces on 4 threads gave 12.4 GB/s, below the copying path's 17-18 GB/s: the
per-piece ``mmap(MAP_POPULATE)`` + register + unregister + ``munmap`` costs more
than the CPU copy it saves. So the path is opt-in (``MEGAMOE_LOAD_DMA=1``)
until registering larger spans once per load is measured (BENCHMARKS.md).

Nothing is written through the mapping (it is ``PROT_READ``) and the copy only
reads it. Each piece is unregistered and unmapped as soon as its copy is done.
Where any step is unavailable (no CUDA runtime symbols, the device does not
support read-only registration, the kernel refuses to pin, a short file), the
caller falls back to the pinned-buffer path: `available()` says why.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import threading
from typing import Any, Iterable, Optional

import torch

__all__ = ["available", "disable", "dma_worker", "PIECE"]

#: bytes mapped, registered and copied at a time (a multiple of the page size)
PIECE = 64 << 20
_READ_ONLY = 8  # cudaHostRegisterReadOnly
_MAPPED = 2  # cudaHostRegisterMapped
_ATTR_READ_ONLY_SUPPORTED = 113  # cudaDevAttrHostRegisterReadOnlySupported
_H2D = 1  # cudaMemcpyHostToDevice
_PROT_READ, _MAP_SHARED, _MAP_POPULATE = 1, 1, 0x8000
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_lock = threading.Lock()
_state: dict[Any, Any] = {}


def _cudart() -> Optional[ctypes.CDLL]:
    """The CUDA runtime torch already loaded (matched by soname), else one on disk."""
    major = (torch.version.cuda or "").split(".")[0]
    names = [f"libcudart.so.{major}"] if major else []
    names += sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so*"))
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            lib.cudaHostRegister.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)
            lib.cudaHostUnregister.argtypes = (ctypes.c_void_p,)
            lib.cudaMemcpyAsync.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                            ctypes.c_void_p)
            lib.cudaDeviceGetAttribute.argtypes = (ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int)
            return lib
        except (OSError, AttributeError):
            continue
    return None


def _libc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long)
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        return libc
    except (OSError, AttributeError):
        return None


def available(device: torch.device) -> "bool | str":
    """True, or why page-cache DMA cannot be used on `device` (decided once per device)."""
    with _lock:
        if device in _state:
            return _state[device]
        why: "bool | str" = True
        if os.environ.get("MEGAMOE_LOAD_DMA", "0") != "1":
            why = "off (opt-in: MEGAMOE_LOAD_DMA=1)"
        elif not sys.platform.startswith("linux"):
            why = "not Linux"
        else:
            rt, libc = _cudart(), _libc()
            if rt is None or libc is None:
                why = "no CUDA runtime / libc symbols"
            else:
                v = ctypes.c_int(0)
                index = device.index if device.index is not None else torch.cuda.current_device()
                if rt.cudaDeviceGetAttribute(ctypes.byref(v), _ATTR_READ_ONLY_SUPPORTED, index) != 0 or not v.value:
                    why = "read-only host registration unsupported"
                    rt.cudaGetLastError()
                else:
                    _state["rt"], _state["libc"] = rt, libc
        _state[device] = why
        return why


def disable(device: torch.device, why: str) -> None:
    """Stop using page-cache DMA on `device` (a registration was refused): later loads copy."""
    with _lock:
        _state[device] = why


class _Piece:
    __slots__ = ("base", "length", "registered", "event")

    def __init__(self, base: int, length: int):
        self.base, self.length, self.registered, self.event = base, length, False, None


def _release(p: _Piece) -> None:
    if p.event is not None:
        p.event.synchronize()
    if p.registered:
        _state["rt"].cudaHostUnregister(ctypes.c_void_p(p.base))
    _state["libc"].munmap(ctypes.c_void_p(p.base), p.length)


def dma_worker(fd: int, flat: torch.Tensor, offset: int, spans: Iterable[tuple[int, int]],
               stream: "torch.cuda.Stream") -> None:
    """Copy each ``(begin, end)`` span of the file (bytes ``offset + begin ..``)
    into ``flat[begin:end]`` by DMA from the page cache, on `stream`; up to two
    pieces in flight, so registering the next overlaps the copy of the last.
    Raises OSError when a mapping or registration is refused (the caller then
    reads those spans the copying way); every piece is released either way."""
    rt, libc = _state["rt"], _state["libc"]
    inflight: list[_Piece] = []
    try:
        for a, b in spans:
            for c in range(a, b, PIECE):
                m = min(PIECE, b - c)
                pos = offset + c
                lead = pos % _PAGE
                length = lead + m
                base = libc.mmap(None, length, _PROT_READ, _MAP_SHARED | _MAP_POPULATE, fd, pos - lead)
                if base in (None, ctypes.c_void_p(-1).value):
                    raise OSError(ctypes.get_errno(), "mmap of the file refused")
                p = _Piece(base, length)
                inflight.append(p)
                if rt.cudaHostRegister(ctypes.c_void_p(base), length, _READ_ONLY | _MAPPED) != 0:
                    rt.cudaGetLastError()  # not sticky, but clear it so no later CUDA call reports it
                    raise OSError(0, "cudaHostRegister(ReadOnly) refused the page-cache mapping")
                p.registered = True
                if rt.cudaMemcpyAsync(ctypes.c_void_p(flat[c:c + m].data_ptr()), ctypes.c_void_p(base + lead), m,
                                      _H2D, ctypes.c_void_p(stream.cuda_stream)) != 0:
                    rt.cudaGetLastError()
                    raise OSError(0, "cudaMemcpyAsync from the registered mapping failed")
                p.event = torch.cuda.Event()
                p.event.record(stream)
                while len(inflight) > 2:
                    _release(inflight.pop(0))
    finally:
        for p in inflight:
            _release(p)
