"""File I/O of the runtime: safetensors files opened, mapped and read.

One place for the ways bytes leave a file: the validated header
(`read_safetensors_header`, `SafetensorsFile`), zero-copy mmap views
(`SafetensorsFile.tensor`), positional reads straight into a destination's
memory, split over reader threads for large tensors, and pinned double
buffering to the GPU (`read_file_into`, `FileSlice.read_into`), and the
staged host-to-GPU copy of a large pageable source (`copy_into`). The loaders
(`megamoe_runtime.layer.loaders`) and the checkpoint (`megamoe_runtime.load.checkpoint`)
both use it; it imports neither, which is what keeps the import graph of
checkpoint -> layer -> loaders one-directional.
"""
from __future__ import annotations

import mmap
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

import torch

from .. import knobs
from ..errors import CheckpointError, LayoutError
from . import page_cache_dma
from .safetensors_header import DTYPES, HeaderEntry, SafetensorsHeader, parse_safetensors_header
from .tensor_bytes import byte_view
from .work_queue import SharedQueue

__all__ = ["SAFETENSORS_DTYPES", "SafetensorsFile", "FileSlice", "read_safetensors_header", "read_file_into",
           "read_workers", "copy_into", "deferred_gpu_reads"]

#: safetensors dtype name -> torch dtype. The dry run needs at least BF16, F16,
#: F32, F8_E4M3, F8_E5M2, F8_E8M0, U8, I8, I32 and I64 (docs/RELOAD.md#dry-run).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = dict(DTYPES)


def read_safetensors_header(path: Union[str, os.PathLike]) -> tuple[dict[str, HeaderEntry], dict[str, str], int]:
    """Parse and validate a safetensors header: ``(entries, metadata, data_start)``.

    Reads only the header bytes. CheckpointError, naming the file, for any
    defect :func:`megamoe_runtime.files.safetensors_header.parse_safetensors_header`
    refuses (truncation, a header over 100 MB, invalid JSON, duplicate keys,
    malformed entries or unknown dtypes, byte ranges that do not tile the data
    section, a file length that disagrees with the header).
    """
    h = parse_safetensors_header(path)
    return h.tensors, h.metadata, h.data_start


class SafetensorsFile:
    """A safetensors file: header parsed up front, data mapped lazily.

    ``tensor(name)`` is a zero-copy CPU view of the (private, copy-on-write)
    mmap: copying it into a parameter is the only copy a load makes.
    ``meta(name)`` is a meta tensor of the same shape and dtype, from the
    header only (a dry-run stand-in).
    """

    def __init__(self, path: Union[str, os.PathLike], header: Optional[SafetensorsHeader] = None):
        self.path = Path(path)
        if header is None:
            header = parse_safetensors_header(self.path)
        self.entries, self.metadata, self.data_start = header.tensors, header.metadata, header.data_start
        self._file = None
        self._mm: Optional[mmap.mmap] = None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def keys(self) -> list[str]:
        return list(self.entries)

    def entry(self, name: str) -> HeaderEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in this file") from None

    def _dtype(self, name: str) -> torch.dtype:
        en = self.entry(name)
        dt = en.torch_dtype
        if dt is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} has dtype {en.dtype!r}, which megamoe cannot map "
                                  f"(known: {', '.join(sorted(SAFETENSORS_DTYPES))})")
        return dt

    def meta(self, name: str) -> torch.Tensor:
        """Meta stand-in (shape and dtype from the header, no data)."""
        return torch.empty(self.entry(name).shape, dtype=self._dtype(name), device="meta")

    def tensor(self, name: str) -> torch.Tensor:
        """Zero-copy CPU view of the tensor's bytes."""
        dt = self._dtype(name)
        en = self.entry(name)
        nbytes = en.end - en.begin
        if nbytes == 0:
            return torch.empty(en.shape, dtype=dt)
        if self._mm is None:
            self._file = open(self.path, "rb")
            self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
            try:
                self._mm.madvise(mmap.MADV_SEQUENTIAL)
            except (AttributeError, OSError, ValueError):  # pragma: no cover - platform dependent
                pass
        raw = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=self.data_start + en.begin)
        return raw.view(dt).view(en.shape)

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a tensor view is still alive; the mapping goes with it
            self._mm = None
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass(frozen=True)
class FileSlice:
    """Contiguous bytes of a stored tensor (or of a run of its leading rows) in a file.

    The real pre-laid-out load reads these bytes straight into the parameter's
    storage (`read_into`): one read per stored tensor on CPU (no mmap, no
    temporary), pinned double-buffered chunks on CUDA. It carries dtype and
    shape so the loader validates it exactly like a tensor source.
    """

    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    is_meta = False

    def read_into(self, dst: torch.Tensor) -> None:
        read_file_into(self.path, self.offset, self.nbytes, dst)


# Pinned staging for host -> GPU copies of large mmap-backed sources: pageable
# H2D copies go through the driver's small bounce buffers at a fraction of the
# link bandwidth, so large tensors are pushed through two pinned chunks instead
# (still a plain copy of contiguous bytes; no transform).
_STAGE_CHUNK = 64 << 20
_STAGE_MIN = 8 << 20
_stager: dict[Any, Any] = {}


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; large pageable host sources go to the GPU through two pinned chunks."""
    if (dst.is_cuda and src.device.type == "cpu" and not src.is_pinned()
            and dst.is_contiguous() and src.is_contiguous()
            and src.numel() * src.element_size() >= _STAGE_MIN):
        _staged_h2d(dst, src)
    else:
        dst.copy_(src)


def _pinned(device: torch.device) -> tuple[list[torch.Tensor], list[Any]]:
    st = _stager.get(device)
    if st is None:
        bufs = [torch.empty(_STAGE_CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        events = [torch.cuda.Event(), torch.cuda.Event()]
        st = _stager[device] = (bufs, events)
    return st


#: parallel file reads: page-cache -> memory copies run on one core per read() call, so a
#: single reader tops out far below the memory / PCIe bandwidth; large tensors are split
#: into chunks read concurrently (positional reads release the GIL).
_READ_CHUNK = 16 << 20


def _gpu_chunk() -> int:
    """Bytes per pinned chunk of a GPU reader (``MEGAMOE_LOAD_GPU_CHUNK_MB``, default 16)."""
    env = knobs.get("MEGAMOE_LOAD_GPU_CHUNK_MB")
    return max(4096, int(float(env) * (1 << 20)) // 4096 * 4096) if env else _READ_CHUNK

_READ_MIN_PARALLEL = 32 << 20
_read_pool: Any = None
_worker_staging: dict[tuple, tuple] = {}


def read_workers() -> int:
    """Reader threads for large tensors (``MEGAMOE_LOAD_THREADS`` overrides)."""
    import os

    env = knobs.get("MEGAMOE_LOAD_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(8, os.cpu_count() or 1))


_dma_pool_: Any = None


def _dma_pool() -> Any:
    """Threads that pin and queue page-cache DMA pieces, apart from the copying readers (which run at the
    same time)."""
    global _dma_pool_
    if _dma_pool_ is None:
        from concurrent.futures import ThreadPoolExecutor

        _dma_pool_ = ThreadPoolExecutor(max_workers=8, thread_name_prefix="megamoe-dma")
    return _dma_pool_


def _pool() -> Any:
    global _read_pool
    if _read_pool is None:
        from concurrent.futures import ThreadPoolExecutor

        # threads start only as tasks need them: the callers decide how many run (read_workers())
        _read_pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="megamoe-load")
    return _read_pool


def _pread_exact(fd: int, mv: memoryview, offset: int, path: Any) -> None:
    import os

    got, n = 0, len(mv)
    while got < n:
        k = os.preadv(fd, [mv[got:]], offset + got)
        if k <= 0:
            raise CheckpointError(f"{path}: truncated: {n - got} bytes missing at offset {offset + got}")
        got += k


def _cpu_chunks(fd: int, flat: torch.Tensor, offset: int, nbytes: int, path: Any) -> None:
    mv = byte_view(flat)
    workers = read_workers()
    if nbytes < _READ_MIN_PARALLEL or workers == 1:
        _pread_exact(fd, mv, offset, path)
        return
    step = max(_READ_CHUNK, -(-nbytes // (4 * workers)) // 4096 * 4096)
    futs = [_pool().submit(_pread_exact, fd, mv[a:min(a + step, nbytes)], offset + a, path)
            for a in range(0, nbytes, step)]
    for f in futs:
        f.result()


def _gpu_worker(fd: int, flat: torch.Tensor, offset: int, spans: Iterable[tuple[int, int]], slot: int,
                path: Any) -> None:
    """One reader: its own two pinned chunks and stream; reads overlap its H2D copies.
    `spans` may be shared with the other readers (each takes the next chunk when free)."""
    chunk = _gpu_chunk()
    key = (flat.device, slot, chunk)
    st = _worker_staging.get(key)
    if st is None:
        bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        st = _worker_staging[key] = (bufs, [torch.cuda.Event(), torch.cuda.Event()],
                                     torch.cuda.Stream(device=flat.device))
    bufs, events, stream = st
    used = [False, False]
    i = 0
    for a, b in spans:
        for c in range(a, b, chunk):
            m = min(chunk, b - c)
            j = i % 2
            if used[j]:
                events[j].synchronize()  # the GPU finished reading this pinned chunk
            _pread_exact(fd, byte_view(bufs[j])[:m], offset + c, path)
            with torch.cuda.stream(stream):
                flat[c:c + m].copy_(bufs[j][:m], non_blocking=True)
                events[j].record(stream)
            used[j] = True
            i += 1
    for j in range(2):
        if used[j]:
            events[j].synchronize()


def read_file_into(path: Any, offset: int, nbytes: int, dst: torch.Tensor) -> None:
    """Read ``nbytes`` at ``offset`` of ``path`` into the contiguous ``dst``.

    CPU: positional reads straight into the tensor's own memory (the bytes
    land in the parameter; nothing in between), split over reader threads for
    large tensors. CUDA: each reader thread alternates two pinned 16 MiB chunks
    and issues ``non_blocking`` copies on its own stream, so page-cache / disk
    reads overlap the transfers; all copies are complete when this returns.
    Inside `deferred_gpu_reads` a CUDA read is only queued: the block's exit
    does every queued read, DMA'd straight from the file's page cache where the
    device allows it (`page_cache_dma`: no CPU copy).
    """
    if not dst.is_contiguous() or dst.numel() * dst.element_size() != nbytes:
        raise LayoutError(f"{path}: cannot read {nbytes} bytes into a destination of {list(dst.shape)} "
                          f"{dst.dtype} (contiguous={dst.is_contiguous()})")
    if nbytes == 0:
        return
    flat = dst.detach().reshape(-1).view(torch.uint8)
    queued = getattr(_deferred, "reads", None)
    if flat.device.type != "cpu" and queued is not None:
        queued.append((path, offset, nbytes, flat))
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        if flat.device.type == "cpu":
            _cpu_chunks(fd, flat, offset, nbytes, path)
            return
        # the destination may still be in use by work queued on the current stream
        torch.cuda.current_stream(flat.device).synchronize()
        _gpu_copy(fd, flat, offset, nbytes, path)
    finally:
        os.close(fd)


def _gpu_copy(fd: int, flat: torch.Tensor, offset: int, nbytes: int, path: Any) -> None:
    """The copying way to the GPU: page cache -> pinned chunks -> device, on reader threads."""
    step = _gpu_chunk()
    chunks = [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)]
    workers = 1 if nbytes < _READ_MIN_PARALLEL else min(read_workers(), len(chunks))
    if workers == 1:
        _gpu_worker(fd, flat, offset, chunks, 0, path)
        return
    # one shared queue of 16 MiB chunks: a reader takes the next one as soon as its
    # pinned buffer is free, so no reader idles while another still has two spans to do
    shared = SharedQueue(chunks)
    futs = [_pool().submit(_gpu_worker, fd, flat, offset, shared, w, path) for w in range(workers)]
    for f in futs:
        f.result()


#: reads of this size and more are DMA'd from the page cache (`page_cache_dma`) where the device allows it
_DMA_MIN = 8 << 20
_deferred = threading.local()


@contextmanager
def deferred_gpu_reads() -> Iterator[None]:
    """Queue the CUDA reads made inside the block and do them all at its exit.

    Why: DMA from the page cache pays for mapping and pinning; done for a whole
    layer at once, each file is mapped once and the pinning of one tensor's
    pieces overlaps the copies of the last, instead of every tensor paying a
    pipeline start and drain. All queued reads are complete (or an error
    raised) when the block exits normally; if the block raises, queued reads
    are dropped unread. Nested blocks are done by the outermost one.
    """
    if getattr(_deferred, "reads", None) is not None:
        yield
        return
    _deferred.reads = []
    try:
        yield
        reads, _deferred.reads = _deferred.reads, None
        _do_reads(reads)
    finally:
        _deferred.reads = None


def _do_reads(reads: list[tuple[Any, int, int, torch.Tensor]]) -> None:
    fds: dict[Any, int] = {}
    try:
        for path, *_ in reads:
            if path not in fds:
                fds[path] = os.open(path, os.O_RDONLY)
        for dev in {r[3].device for r in reads}:
            # the destinations may still be in use by work queued on the current stream
            torch.cuda.current_stream(dev).synchronize()
        dma, copy = [], []
        share = page_cache_dma.dma_share()
        for r in reads:
            path, offset, nbytes, flat = r
            fits = nbytes >= _DMA_MIN and os.fstat(fds[path]).st_size >= offset + nbytes
            if not (fits and page_cache_dma.available(flat.device) is True):
                copy.append(r)
                continue
            # the first `share` of the bytes by DMA, the rest copied at the same time: the kernel pins
            # pages at about 25-35 GB/s on the H200 host whatever the threads, below the link, so the
            # copying readers carry the other part in parallel (docs/bench-log/load.md)
            cut = min(nbytes, -(-int(nbytes * share) // 4096) * 4096)
            if cut:
                dma.append((path, offset, cut, flat[:cut]))
            if cut < nbytes:
                copy.append((path, offset + cut, nbytes - cut, flat[cut:]))
        failed: list[BaseException] = []
        side = None
        if dma:
            def run_dma() -> None:
                try:
                    page_cache_dma.dma_reads([page_cache_dma.DmaRead(fds[p], o, n, f) for p, o, n, f in dma],
                                             _dma_pool().submit)
                except BaseException as e:  # noqa: BLE001 - reported on the calling thread below
                    failed.append(e)

            side = threading.Thread(target=run_dma, name="megamoe-dma", daemon=True)
            side.start()
        try:
            for path, offset, nbytes, flat in copy:
                _gpu_copy(fds[path], flat, offset, nbytes, path)
        finally:
            if side is not None:
                side.join()
        if failed:
            if not isinstance(failed[0], OSError):
                raise failed[0]
            # refused somewhere: copy every DMA'd byte again the pinned way, and copy from now on
            for dev in {r[3].device for r in dma}:
                page_cache_dma.disable(dev, f"page-cache DMA refused: {failed[0]}")
            for path, offset, nbytes, flat in dma:
                _gpu_copy(fds[path], flat, offset, nbytes, path)
    finally:
        for fd in fds.values():
            os.close(fd)


def _staged_h2d(dst: torch.Tensor, src: torch.Tensor) -> None:
    bufs, events = _pinned(dst.device)
    s = src.reshape(-1).view(torch.uint8)
    d = dst.reshape(-1).view(torch.uint8)
    n = s.numel()
    stream = torch.cuda.current_stream(dst.device)
    used = [False, False]
    for i, off in enumerate(range(0, n, _STAGE_CHUNK)):
        j = i % 2
        m = min(_STAGE_CHUNK, n - off)
        if used[j]:
            events[j].synchronize()  # the GPU finished reading this pinned chunk
        bufs[j][:m].copy_(s[off:off + m])
        d[off:off + m].copy_(bufs[j][:m], non_blocking=True)
        events[j].record(stream)
        used[j] = True
    for j in range(2):
        if used[j]:
            events[j].synchronize()
