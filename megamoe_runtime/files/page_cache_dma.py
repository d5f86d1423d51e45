"""GPU loads that DMA straight from the file's page cache (no CPU copy).

Why: a copying loader moves every byte page cache -> pinned buffer on a CPU
(read + write of host memory) and then the DMA reads it again, so on the H200
host it tops out near 18 GB/s, a third of the 55 GB/s a pinned host-to-device
copy reaches (BENCHMARKS.md, "Load"). Mapping the file read-only
(``PROT_READ``, ``MAP_SHARED``) and page-locking that mapping with
``cudaHostRegister(..., cudaHostRegisterReadOnly)`` lets the copy engine read
the cached file pages themselves: measured there, the DMA from a registered
page-cache mapping runs at the full pinned rate (54.7 GB/s).

How the cost is kept down (one ``mmap(MAP_POPULATE)`` + register +
unregister + ``munmap`` per 64 MiB piece of each tensor reaches only 12.4
GB/s: ``mmap``/``munmap`` take the process's address-space lock for
writing, so the reader threads' page pinning would wait on each other):

* a load's reads are gathered first (`dma_reads` takes them all) and each
  file is mapped once, over the span its reads cover, without populating:
  the registration faults the pages in itself;
* the mapping is registered piece by piece (page-aligned pieces of
  `piece_bytes()`) by several threads, which only take that lock for
  reading, and each piece's copies are queued as soon as it is pinned, so
  pinning overlaps the copies of earlier pieces;
* a piece is unregistered once its copies are done; the mappings go when
  every piece has.

Still opt-in (``MEGAMOE_LOAD_DMA=1``): measured on the H200 host in a whole
load (docs/bench-log/load.md, "page-cache DMA, whole-layer batches"), the kernel pins
page-cache pages at 25-35 GB/s whatever the number of threads, plus about
8 ms/GB to unpin, and pinning slows the copying readers running beside it, so
every mix of DMA and copying measured (14-17 GB/s) stayed below the copying
path alone (17-19 GB/s). It is kept for hosts that pin faster.

Nothing is written through the mapping (it is ``PROT_READ``) and the copies
only read it. Where any step is unavailable (no CUDA runtime symbols, the
device does not support read-only registration, the kernel refuses to pin),
the caller copies through pinned buffers instead: `available()` says why.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .. import knobs
from .work_queue import SharedQueue

__all__ = ["available", "disable", "dma_reads", "DmaRead", "piece_bytes", "dma_threads", "dma_share"]

_READ_ONLY = 8  # cudaHostRegisterReadOnly
_MAPPED = 2  # cudaHostRegisterMapped
_ATTR_READ_ONLY_SUPPORTED = 113  # cudaDevAttrHostRegisterReadOnlySupported
_H2D = 1  # cudaMemcpyHostToDevice
_PROT_READ, _MAP_SHARED = 1, 1
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_lock = threading.Lock()
_state: dict[Any, Any] = {}


def piece_bytes() -> int:
    """Bytes pinned at a time (``MEGAMOE_LOAD_DMA_PIECE_MB``, default 64), rounded to pages."""
    mb = knobs.value("MEGAMOE_LOAD_DMA_PIECE_MB")
    return max(_PAGE, int(mb * (1 << 20)) // _PAGE * _PAGE)


def dma_share() -> float:
    """Fraction of each large read done by DMA (``MEGAMOE_LOAD_DMA_SHARE``, default 0.5); the
    copying readers do the rest at the same time."""
    return min(1.0, max(0.0, knobs.value("MEGAMOE_LOAD_DMA_SHARE")))


def dma_threads() -> int:
    """Threads pinning pieces (``MEGAMOE_LOAD_DMA_THREADS``, default 2: the pinning rate does not grow
    past two on the H200 host)."""
    return max(1, min(8, knobs.value("MEGAMOE_LOAD_DMA_THREADS")))


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
        if knobs.value("MEGAMOE_LOAD_DMA") != "1":
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


@dataclass(frozen=True)
class DmaRead:
    """``nbytes`` of open file ``fd`` at ``offset`` into the contiguous CUDA bytes ``flat``."""

    fd: int
    offset: int
    nbytes: int
    flat: torch.Tensor


class _Mapping:
    """One read-only shared mapping of a file span (page-aligned start)."""

    def __init__(self, fd: int, lo: int, hi: int):
        libc = _state["libc"]
        self.lo = lo - lo % _PAGE
        self.length = hi - self.lo
        base = libc.mmap(None, self.length, _PROT_READ, _MAP_SHARED, fd, self.lo)
        if base in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap of the file refused")
        self.base = base

    def close(self) -> None:
        _state["libc"].munmap(ctypes.c_void_p(self.base), self.length)


class _Piece:
    """A page-aligned run of one mapping and the copies that read from it."""

    __slots__ = ("base", "length", "copies", "registered", "event")

    def __init__(self, base: int, length: int, copies: list[tuple[int, int, int]]):
        self.base, self.length, self.copies = base, length, copies  # copies: (dst ptr, src ptr, bytes)
        self.registered, self.event = False, None


def _plan(reads: Sequence[DmaRead], maps: list[_Mapping], piece: int) -> list[_Piece]:
    """Map each file once over the span its reads cover; cut the mapping into
    pieces and give each piece the parts of the reads that lie in it."""
    by_fd: dict[int, list[DmaRead]] = {}
    for r in reads:
        by_fd.setdefault(r.fd, []).append(r)
    pieces: list[_Piece] = []
    for fd, rs in by_fd.items():
        m = _Mapping(fd, min(r.offset for r in rs), max(r.offset + r.nbytes for r in rs))
        maps.append(m)
        spans = sorted(((r.offset - m.lo, r.offset - m.lo + r.nbytes, r.flat.data_ptr()) for r in rs))
        for k in range(0, m.length, piece):
            end = min(k + piece, m.length)
            copies = []
            for a, b, dst in spans:
                lo, hi = max(a, k), min(b, end)
                if lo < hi:
                    copies.append((dst + (lo - a), m.base + lo, hi - lo))
            if copies:  # gaps between the reads (other ranks' experts) are never pinned
                pieces.append(_Piece(m.base + k, end - k, copies))
    return pieces


def _release(p: _Piece) -> None:
    if p.event is not None:
        p.event.synchronize()
    if p.registered:
        _state["rt"].cudaHostUnregister(ctypes.c_void_p(p.base))
        p.registered = False


def _worker(pieces: "SharedQueue[_Piece]", stream: "torch.cuda.Stream") -> None:
    """Pin the next free piece, queue its copies on `stream`; keep two pieces
    in flight, so pinning the next overlaps the copies of the last."""
    rt = _state["rt"]
    inflight: list[_Piece] = []
    try:
        for p in pieces:
            inflight.append(p)
            if rt.cudaHostRegister(ctypes.c_void_p(p.base), p.length, _READ_ONLY | _MAPPED) != 0:
                rt.cudaGetLastError()  # not sticky, but clear it so no later CUDA call reports it
                raise OSError(0, "cudaHostRegister(ReadOnly) refused the page-cache mapping")
            p.registered = True
            for dst, src, n in p.copies:
                if rt.cudaMemcpyAsync(ctypes.c_void_p(dst), ctypes.c_void_p(src), n, _H2D,
                                      ctypes.c_void_p(stream.cuda_stream)) != 0:
                    rt.cudaGetLastError()
                    raise OSError(0, "cudaMemcpyAsync from the registered mapping failed")
            p.event = torch.cuda.Event()
            p.event.record(stream)
            while len(inflight) > 2:
                _release(inflight.pop(0))
    finally:
        for p in inflight:
            _release(p)


_streams: dict[tuple, Any] = {}


def dma_reads(reads: Sequence[DmaRead], submit: Callable[..., Any]) -> None:
    """Copy every read by DMA from the page cache; all copies are complete on return.

    ``submit(fn, *args)`` runs ``fn`` on a reader thread and returns a future
    (the loader's thread pool). Raises OSError when a mapping or registration
    is refused (the caller then reads everything the copying way); every
    piece is unregistered and every mapping unmapped either way.
    """
    if not reads:
        return
    device = reads[0].flat.device
    maps: list[_Mapping] = []
    try:
        pieces = _plan(reads, maps, piece_bytes())
        workers = max(1, min(dma_threads(), len(pieces)))
        streams = []
        for w in range(workers):
            key = (device, w)
            if key not in _streams:
                _streams[key] = torch.cuda.Stream(device=device)
            streams.append(_streams[key])
        queue = SharedQueue(pieces)
        if workers == 1:
            _worker(queue, streams[0])
            return
        futs = [submit(_worker, queue, streams[w]) for w in range(workers)]
        errors = []
        for f in futs:  # every worker finishes (and releases its pieces) before anything is reported or unmapped
            try:
                f.result()
            except OSError as e:
                errors.append(e)
        if errors:
            raise errors[0]
    finally:
        for m in maps:
            m.close()
