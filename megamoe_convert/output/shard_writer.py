"""The streaming safetensors writer: plan output files, write one shard.


Streaming safetensors writer. ``safetensors.torch.save_file`` needs every
tensor of a file in memory at once; a 5 GB shard spans several MoE layers, so
that would break the "memory bounded by about one MoE layer" promise. The
converter knows every output tensor's name, dtype and shape before it reads a
byte (kernel shapes follow from the layer sizes), so :class:`ShardWriter`
writes the header first and then each tensor's bytes in planned order as the
layer that produces it is packed. The files are ordinary safetensors files
(8-byte little-endian header length, JSON header padded with spaces to a
multiple of 8, ``__metadata__ = {"format": "pt"}``, data offsets tiling the
data with no gaps), readable by ``safe_open`` / ``load_file``. Tensors are laid
out in plan order rather than save_file's alignment-then-name order; every
tensor the converter writes has a byte size that is a multiple of its item
size, and the plan puts 4-byte dtypes first within a layer, so offsets stay
aligned. Output is deterministic: no timestamps, fixed key order.


Also here, the byte-level helpers the converter writes with: shard planning
(`plan_shards`), sizes (`parse_size`), pass-through byte copies
(`copy_source_bytes`) and small deterministic JSON files. The temp folder
and journal are ``temp_folder``; verifying a finished folder is
``megamoe_runtime.load.verify``.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from megamoe_runtime.files.digests import (
    SHA256,
    composite_kind,
    digest_bytes,
    hash_file,
    header_and_tensor_digest,
    new_hasher,
)
from megamoe_runtime.errors import CheckpointError, MegaMoEError
from megamoe_runtime.files.tensor_bytes import byte_view
from megamoe_runtime.format.manifest import dtype_from_name, nbytes_of

from .output_dir import STEP_TENSOR, StepHook

DEFAULT_MAX_SHARD_SIZE = 5_000_000_000
ST_METADATA = {"format": "pt"}
INDEX_NAME = "model.safetensors.index.json"

_CHUNK = 16 << 20


# --------------------------------------------------------------------------- sizes

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
          "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str | int) -> int:
    """'5GB' -> 5_000_000_000, '500MB', '1.5GiB', '4096' (bytes). Decimal units as
    huggingface_hub's max_shard_size; KiB/MiB/GiB binary."""
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = _SIZE_RE.match(str(text))
        unit = (m.group(2) or "").upper() if m else None
        if not m or unit not in _UNITS:
            raise MegaMoEError(
                f"size {text!r} is not understood; use a number of bytes or a unit: '5GB', '500MB', '1GiB'"
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise MegaMoEError(f"size {text!r} must be > 0")
    return n


from .units import format_bytes  # noqa: E402  (one byte format for every summary, torch-free)


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of an output file: in-file name, safetensors dtype, stored shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)


def plan_shards(tensors: list[PlannedTensor], max_bytes: int) -> list[list[PlannedTensor]]:
    """Greedy split in the given order: a shard is closed when the next tensor
    would take it past `max_bytes`. A tensor larger than the limit gets a shard
    of its own (as huggingface_hub does); it cannot be split."""
    shards: list[list[PlannedTensor]] = []
    cur: list[PlannedTensor] = []
    size = 0
    for t in tensors:
        if cur and size + t.nbytes > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    if cur:
        shards.append(cur)
    return shards


def safetensors_header(tensors: list[PlannedTensor], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length plus the JSON header for `tensors` in this order."""
    head: dict = {"__metadata__": dict(metadata if metadata is not None else ST_METADATA)}
    off = 0
    for t in tensors:
        head[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    raw = json.dumps(head, separators=(",", ":"), ensure_ascii=True).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


# --------------------------------------------------------------------------- shard writer

def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor (a view; contiguous copy if needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return byte_view(t)


class _Digest:
    """A tensor's pending checksum (hex): done when both its hash and its write
    have finished. ``result()`` re-raises a write or hash error."""

    __slots__ = ("_hash", "_write")

    def __init__(self, hash_fut, write_fut):
        self._hash, self._write = hash_fut, write_fut

    def done(self) -> bool:
        return self._hash.done() and self._write.done()

    def result(self) -> str | None:
        self._write.result()
        raw = self._hash.result()
        return None if raw is None else raw.hex()  # None: a piece (`TensorParts.put`), hashed into its tensor


_sync_file_range = None


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of `fd` back
    to disk without waiting for it (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``;
    the pages stay cached). Durability still comes from the fsync before the
    final rename; this only moves the disk writes earlier, overlapping the
    conversion. A no-op where the call is unavailable."""
    global _sync_file_range
    if _sync_file_range is None:
        try:
            import ctypes

            f = ctypes.CDLL(None, use_errno=True).sync_file_range
            f.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
            _sync_file_range = f
        except (OSError, AttributeError):  # not Linux / not glibc
            _sync_file_range = False
    if _sync_file_range:
        _sync_file_range(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE; errors only lose the head start


class ShardWriter:
    """Writes one safetensors file: header first, then tensors in plan order.

    ``write_async(name, tensor)`` checks name, dtype and shape against the
    plan, queues the bytes and returns a pending digest whose ``result()`` is
    the tensor's checksum of ``algorithm`` (``write`` waits for it).
    ``close()`` returns (size, file digest); the file digest is of kind
    ``{algorithm}-of-header-and-tensor-digests`` (see
    ``megamoe_runtime.files.digests``): the hash of the header bytes and the
    per-tensor digests, so every data byte is hashed once, not twice, and
    nothing is read back. There is no
    fsync per shard: the kernel writes finished shards back while later
    layers are converted, and `finalize_output` fsyncs every file before the
    rename. (The journal needs no fsynced shards either: ``--resume``
    re-hashes every file it lists, so a shard lost in a crash is redone.)

    Threads: tensor hashes run on ``hash_lanes`` background threads (blake3
    may also use ``hash_threads`` for one large tensor) and the file write on
    another (hashlib, blake3 and file writes release the GIL), all reading
    the caller's memory, while the caller packs the next layer. Each tensor is
    hashed on one lane, the one with the fewest planned bytes so far, so its
    pieces are hashed in order; two lanes let the routed ``l1_weight`` and
    ``l2_weight`` of a rank, which stream side by side, be hashed on two cores
    (sha256 is sequential within a tensor: one thread caps the run at about
    1.1 GB/s on this VM's cores; on the 2-core VM itself, busy with the other
    threads, two lanes measured the same as one: docs/bench-log/convert.md).
    Writes stay
    in order. The memory of a queued tensor must stay untouched until its
    digest is done (``flush()`` waits for everything; ``close()`` flushes).
    """

    _SLICE = 4 << 20

    def __init__(self, path: Path, tensors: list[PlannedTensor], metadata: dict[str, str] | None = None,
                 on_step: StepHook | None = None, algorithm: str = SHA256, hash_threads: int = 1,
                 hash_lanes: int = 1, direct: bool = False, direct_io: "DirectIO | None" = None):
        """`on_step` is called with ``"tensor"`` after each tensor is queued
        (tests plant a crash there, see ``output_dir``). `direct` (or a shared
        `direct_io`): write the page-aligned middle of every tensor with
        ``O_DIRECT`` where the file system takes it (`_Region`), else through
        the page cache."""
        self.path = Path(path)
        self.algorithm = algorithm
        self.digest_kind = composite_kind(algorithm)
        self._hash_threads = hash_threads
        self._lane_bytes = [0] * max(1, hash_lanes)  # planned bytes given to each hash lane so far
        new_hasher(algorithm)  # an unknown or unavailable algorithm fails here, before any byte is written
        self._on_step = on_step
        self.plan = list(tensors)
        self._next = 0
        self._spans = []
        off = 0
        for t in self.plan:
            self._spans.append((off, off + t.nbytes))
            off += t.nbytes
        self._digests: list[tuple[int, int, str, object]] = []  # (begin, end, name, future of raw digest)
        self._pending: list = []
        self._hash_pools: list = []
        self._write_pool = None
        self._claimed: set[int] = set()  # plan indices whose bytes are queued (or being streamed in parts)
        self._index = {t.name: i for i, t in enumerate(self.plan)}
        self._f = open(self.path, "wb", buffering=0)
        self._header = safetensors_header(self.plan, metadata)
        self._size = 0
        self._write_all(memoryview(self._header), 0)
        self._data_start = len(self._header)
        self._dfd = _open_direct(self.path) if direct or direct_io is not None else None  # O_DIRECT, same file
        self._direct_ok = self._dfd is not None  # False once the file system refused an O_DIRECT write
        self._own_io = self._dfd is not None and direct_io is None
        self._direct_io = (direct_io or DirectIO()) if self._dfd is not None else None
        self._io: list = []  # futures of the device writes (`DirectIO.submit`)
        self.stopped = False  # set by `abort`: queued writes are dropped, not done (the file is redone on resume)

    def _write_all(self, mv: memoryview, offset: int) -> None:
        """Write `mv` at file position `offset` (runs on the write thread), and
        start the kernel writing it back to disk now (`start_writeback`), so
        that the final fsync waits only for the tail instead of the whole file.
        Positional: tensors streamed in parts (`open_parts`) land at their
        planned offsets whatever order their pieces are written in."""
        step = self._SLICE
        fd = self._f.fileno()
        for i in range(0, len(mv), step):
            piece = mv[i:i + step]
            pos = offset + i
            while piece:
                with self.naming_errors():
                    n = os.pwrite(fd, piece, pos)
                piece, pos = piece[n:], pos + n
        self._size = max(self._size, offset + len(mv))
        if len(mv) >= self._SLICE:
            start_writeback(fd, offset, len(mv))

    def _region(self, begin: int, end: int) -> "_Region":
        """A data span ``[begin, end)`` (offsets in the data section) to fill
        front to back, piece by piece, on the write thread."""
        return _Region(self, self._data_start + begin, self._data_start + end)

    def _write_direct(self, parts: list[memoryview], offset: int, nbytes: int) -> None:
        """Write the concatenation of `parts` (`nbytes`, a multiple of
        `DIRECT_ALIGN`) at the aligned `offset` with ``O_DIRECT`` (write
        thread): copied into the aligned staging buffers of `DirectIO` (the
        caller's memory has any alignment) and written from there on its I/O
        thread, so that the next copy overlaps the device write. Errors
        surface in `flush` / `close`."""
        io, buf, fill, pos = self._direct_io, None, 0, offset
        for part in parts:
            while part:
                if buf is None:
                    buf = io.buffer(self)
                k = min(len(part), len(buf) - fill)
                _copy_into(buf[fill:fill + k], part[:k])
                fill, part = fill + k, part[k:]
                if fill == len(buf):
                    self._io.append(io.submit(self, buf, fill, pos))
                    buf, pos, fill = None, pos + fill, 0
        if fill:
            self._io.append(io.submit(self, buf, fill, pos))
        self._size = max(self._size, offset + nbytes)

    def _pwrite_direct(self, view: memoryview, pos: int) -> None:
        """Write `view` (aligned memory, aligned offset and length) with
        ``O_DIRECT`` (`DirectIO`'s thread). On a refusal (``EINVAL``: a file
        system or device with other alignment rules) it goes through the page
        cache instead, and so does the rest of the file."""
        done, n = 0, len(view)
        while done < n and self._direct_ok:
            try:
                k = os.pwrite(self._dfd, view[done:], pos + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise self.named(exc) from exc
                self._direct_ok = False
                break
            if k <= 0 or k % DIRECT_ALIGN:  # a short write off the alignment: finish it buffered
                done += max(k, 0)
                break
            done += k
        fd = self._f.fileno()
        while done < n:
            with self.naming_errors():
                done += os.pwrite(fd, view[done:], pos + done)

    def named(self, exc: OSError) -> OSError:
        """`exc` with this file's path as its filename (a failed ``pwrite`` names none): the user is told
        which file could not be written (a full disk, an I/O error), not only ``[Errno 28]``."""
        if exc.filename is not None:
            return exc
        return type(exc)(exc.errno, exc.strerror or str(exc), str(self.path))

    @contextlib.contextmanager
    def naming_errors(self) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            named = self.named(exc)
            if named is exc:
                raise
            raise named from exc

    def _close_direct(self) -> None:
        """After the write thread stopped: wait for every device write, then
        give back the descriptor and an own `DirectIO`, then re-raise the first
        write error. All of them are waited for first: a descriptor closed
        under a write still queued could be reused by another open, and that
        write would land in another file."""
        io_futs, self._io = self._io, []
        first: BaseException | None = None
        for fut in io_futs:
            try:
                fut.result()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, once every write is over
                first = first or exc
        if self._dfd is not None:
            os.close(self._dfd)
            self._dfd = None
        if self._own_io and self._direct_io is not None:
            self._direct_io.close()
        self._direct_io = None
        if first is not None:
            raise first

    def _digest(self, mv: memoryview) -> bytes:
        return digest_bytes(self.algorithm, mv, self._hash_threads)

    def _start_pools(self) -> None:
        if self._write_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._hash_pools = [ThreadPoolExecutor(1, thread_name_prefix="megamoe-hash")
                                for _ in self._lane_bytes]
            self._write_pool = ThreadPoolExecutor(1, thread_name_prefix="megamoe-write")

    def _hash_lane(self, nbytes: int):
        """The single-thread hash pool for a tensor of `nbytes`: the lane with
        the fewest planned bytes so far (first lane on ties). One tensor keeps
        its lane, so its pieces and its final digest run in order."""
        self._start_pools()
        k = min(range(len(self._lane_bytes)), key=self._lane_bytes.__getitem__)
        self._lane_bytes[k] += nbytes
        return self._hash_pools[k]

    def _submit_write(self, region: "_Region", mv: memoryview | None):
        """Queue the next piece of `region` (None: the region is complete) on the write thread."""
        self._start_pools()
        fut = self._write_pool.submit(region.finish if mv is None else region.put, mv)
        self._pending.append(fut)
        return fut

    def _wait_queued(self) -> None:
        """Wait until every queued byte is hashed and handed to the kernel (or,
        for direct writes, copied into a staging buffer): the caller may reuse
        its memory. Device writes may still be running (`flush` waits for them)."""
        pending, self._pending = self._pending, []
        for fut in pending:
            fut.result()

    def flush(self) -> None:
        """Wait until every queued byte is written and hashed (re-raising errors)."""
        self._wait_queued()
        for fut in list(self._io):  # the device writes those queued
            fut.result()

    @property
    def pending(self) -> list[PlannedTensor]:
        return [t for i, t in enumerate(self.plan) if i not in self._claimed]

    @property
    def done(self) -> bool:
        return len(self._claimed) == len(self.plan)

    def _expect(self, name: str) -> PlannedTensor:
        """The next planned tensor not yet claimed must be `name` (whole-tensor
        writes keep plan order; `open_parts` may claim tensors ahead of it)."""
        while self._next < len(self.plan) and self._next in self._claimed:
            self._next += 1
        if self._next >= len(self.plan):
            raise MegaMoEError(f"{self.path.name}: tensor {name!r} written after the planned tensors")
        p = self.plan[self._next]
        if p.name != name:
            raise MegaMoEError(f"{self.path.name}: expected tensor {p.name!r} next, got {name!r}")
        return p

    def _claim(self, i: int) -> tuple[int, int]:
        """Mark plan entry `i` as queued; its (begin, end) data offsets."""
        self._claimed.add(i)
        return self._spans[i]

    def write_async(self, name: str, tensor: torch.Tensor) -> _Digest:
        """Queue the tensor's bytes; the returned digest's ``result()`` is their
        checksum. The tensor's memory must stay untouched until it is done."""
        p = self._expect(name)
        want = dtype_from_name(p.dtype)
        if tensor.dtype != want or tuple(tensor.shape) != p.shape:
            raise MegaMoEError(
                f"{self.path.name}: tensor {name!r} is {tensor.dtype} {list(tensor.shape)}, planned "
                f"{p.dtype} {list(p.shape)}"
            )
        data = tensor_bytes(tensor)
        hfut = self._hash_lane(p.nbytes).submit(self._digest, data)
        self._pending.append(hfut)
        begin, end = self._claim(self._index[name])
        region = self._region(begin, end)
        self._submit_write(region, data)
        wfut = self._submit_write(region, None)
        self._digests.append((begin, end, name, hfut))
        if self._on_step is not None:
            self._on_step(STEP_TENSOR)
        return _Digest(hfut, wfut)

    def open_parts(self, name: str) -> "TensorParts":
        """Stream planned tensor `name` in consecutive pieces (`TensorParts.put`),
        in any order relative to the other tensors of the file: the converter
        packs a layer a few experts at a time into small reused buffers, and
        each piece is written at its planned offset and hashed in order."""
        i = self._index.get(name)
        if i is None or i in self._claimed:
            raise MegaMoEError(f"{self.path.name}: tensor {name!r} is not planned or was already written")
        begin, end = self._claim(i)
        return TensorParts(self, self.plan[i], begin, end)

    def write(self, name: str, tensor: torch.Tensor) -> str:
        """`write_async` and wait: the tensor's checksum."""
        return self.write_async(name, tensor).result()

    def write_chunks(self, name: str, chunks: Iterable[bytes | memoryview]) -> str:
        """Write a tensor's raw bytes from an iterable (pass-through copies).
        Chunk k is hashed here while the write thread writes it, and the next
        chunk is requested once chunk k-1 is written: the producer may reuse a
        buffer two chunks later (`copy_source_bytes` alternates two), so its
        read of chunk k+1 overlaps the write of chunk k. Returns the tensor's
        checksum."""
        p = self._expect(name)
        begin, end = self._claim(self._next)
        h = new_hasher(self.algorithm)
        region = self._region(begin, end)
        n = 0
        prev = None
        for c in chunks:
            mv = memoryview(c).cast("B")
            if n + len(mv) > p.nbytes:
                self._wait_queued()
                raise CheckpointError(f"{self.path.name}: tensor {name!r} got more than {p.nbytes} bytes")
            fut = self._submit_write(region, mv)
            h.update(mv)
            n += len(mv)
            if prev is not None:
                prev.result()
            prev = fut
        self._submit_write(region, None)
        self._wait_queued()  # the chunks' memory is the caller's again (the device writes go on)
        if n != p.nbytes:
            raise CheckpointError(f"{self.path.name}: tensor {name!r} got {n} bytes, expected {p.nbytes}")
        from concurrent.futures import Future

        done: Future = Future()
        done.set_result(h.digest())
        self._digests.append((begin, end, name, done))
        if self._on_step is not None:
            self._on_step(STEP_TENSOR)
        return h.hexdigest()

    def close(self) -> tuple[int, str]:
        """Finish the file: (size, its digest of kind ``self.digest_kind``)."""
        if not self.done:
            raise MegaMoEError(
                f"{self.path.name}: closed with {len(self.pending)} planned tensor(s) unwritten, "
                f"first {self.pending[0].name!r}"
            )
        self.flush()
        self._shutdown()
        self._close_direct()
        self._f.close()  # no fsync here: finalize_output syncs every file once, at the end
        want = self._data_start + (self._spans[-1][1] if self._spans else 0)
        if self._size != want:  # pragma: no cover - every claimed tensor checks its own byte count
            raise MegaMoEError(f"{self.path.name}: wrote {self._size} bytes, planned {want}")
        digest = header_and_tensor_digest(self._header, [(b, e, n, f.result()) for b, e, n, f in self._digests],
                                          self.algorithm)
        return self._size, digest

    def _shutdown(self) -> None:
        for pool in (*self._hash_pools, self._write_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._hash_pools, self._write_pool = [], None

    def abort(self) -> None:
        """Stop without finishing (the partial file stays for --resume to redo). Queued writes and hashes
        are dropped, not run: on a slow disk a writer may hold a whole layer's pieces in its queue, and an
        interrupted run must end in moments, not once they are all written (``stopped`` makes the ones
        already started return at their next piece)."""
        self.stopped = True
        for fut in self._pending:
            fut.cancel()
        for fut in self._io:
            fut.cancel()
        try:
            self.flush()
        except BaseException:  # noqa: BLE001 - cancelled or failed writes of a file that is redone anyway
            pass
        self._shutdown()
        try:
            self._close_direct()
        except Exception:
            pass
        if not self._f.closed:
            self._f.close()



class TensorParts:
    """One planned tensor of a `ShardWriter` arriving in consecutive pieces.

    ``put(data)`` queues the next piece (written at its offset on the write
    thread, hashed in order on the hash thread) and returns a future that is
    done when the piece's memory may be reused; ``finish()`` checks the byte
    count and returns the tensor's pending digest (`_Digest`)."""

    def __init__(self, writer: ShardWriter, planned: PlannedTensor, begin: int, end: int):
        self._w, self.planned = writer, planned
        self._begin, self._end = begin, end
        self._n = 0
        self._hasher = new_hasher(writer.algorithm)
        self._lane = writer._hash_lane(end - begin)  # every piece, and the digest, on this one thread
        self._region = writer._region(begin, end)
        self._last_write = None

    def put(self, data: memoryview) -> _Digest:
        w = self._w
        mv = memoryview(data).cast("B")
        if self._n + len(mv) > self._end - self._begin:
            raise MegaMoEError(f"{w.path.name}: tensor {self.planned.name!r} got more than its planned "
                               f"{self._end - self._begin} bytes")
        hfut = self._lane.submit(self._update, mv)
        w._pending.append(hfut)
        wfut = w._submit_write(self._region, mv)
        self._n += len(mv)
        self._last_write = wfut
        return _Digest(hfut, wfut)  # done when the piece is hashed and written; its result() is None

    def _update(self, mv: memoryview) -> None:
        self._hasher.update(mv)  # blake3's update returns the hasher: a piece's result is None

    def finish(self) -> _Digest:
        w = self._w
        if self._n != self._end - self._begin:
            raise MegaMoEError(f"{w.path.name}: tensor {self.planned.name!r} got {self._n} bytes, planned "
                               f"{self._end - self._begin}")
        hfut = self._lane.submit(self._hasher.digest)  # after every piece: the lane's one thread runs in order
        w._pending.append(hfut)
        w._digests.append((self._begin, self._end, self.planned.name, hfut))
        if w._on_step is not None:
            w._on_step(STEP_TENSOR)
        self._last_write = w._submit_write(self._region, None)  # the unaligned tail, after every piece
        return _Digest(hfut, self._last_write)


#: file offset and length alignment of ``O_DIRECT`` writes: the page size, a multiple of every
#: common logical block size (512 B, 4 KiB)
DIRECT_ALIGN = 4096


#: copies at least this large release the GIL (`_copy_into`)
_NOGIL_COPY = 64 << 10


def _copy_into(dst: memoryview, src: memoryview) -> None:
    """``dst[:len(src)] = src``. Large copies from writable memory go through
    ``ctypes.memmove``, which releases the GIL (a memoryview slice assignment
    holds it): the staging copy of every shard byte would otherwise stall the
    device-write thread and the readers for a millisecond per 8 MiB
    (docs/bench-log/convert.md)."""
    n = len(src)
    if n >= _NOGIL_COPY and not src.readonly:
        ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(dst)),
                       ctypes.addressof(ctypes.c_char.from_buffer(src)), n)
    else:
        dst[:n] = src


class WriterStopped(MegaMoEError):
    """A write of an aborted `ShardWriter` (its file is incomplete; a resume redoes it)."""


class DirectIO:
    """Page-aligned staging buffers and the one thread that writes them with
    ``O_DIRECT``, shared by the shard writers of a run (their write threads
    copy into a free buffer, this thread writes it out and frees it): the
    device write of one buffer overlaps the copy into the next, and the
    staging memory (`buffers` x `size`) does not grow with the number of
    files open at once (one per expert-parallel rank)."""

    def __init__(self, buffers: int = 3, size: int = 8 << 20):
        import queue
        import threading

        self.size, self._max = size, buffers
        self._free: "queue.SimpleQueue[memoryview]" = queue.SimpleQueue()
        self._made = 0
        self._lock = threading.Lock()
        self._pool = None

    def buffer(self, writer: ShardWriter | None = None) -> memoryview:
        """A free staging buffer (made on first use, up to `buffers`; then
        waits for the I/O thread to free one). Gives up with `WriterStopped`
        once `writer` is aborted: the I/O thread may never free one then (its
        pool refuses new work at interpreter exit), and a writer thread waiting
        here forever kept an interrupted run from exiting."""
        import queue

        with self._lock:
            if self._made < self._max:
                self._made += 1
                return memoryview(mmap.mmap(-1, self.size))  # anonymous mappings are page-aligned
        while True:
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                if writer is not None and writer.stopped:
                    raise WriterStopped(f"{writer.path.name}: writing stopped (the run was interrupted)") from None

    def submit(self, writer: ShardWriter, buf: memoryview, n: int, pos: int):
        with self._lock:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(1, thread_name_prefix="megamoe-direct")
        try:
            return self._pool.submit(self._write, writer, buf, n, pos)
        except BaseException:  # a pool shut down (interpreter exit): the buffer is free again
            self._free.put(buf)
            raise

    def _write(self, writer: ShardWriter, buf: memoryview, n: int, pos: int) -> None:
        try:
            if not writer.stopped:
                writer._pwrite_direct(buf[:n], pos)
        finally:
            self._free.put(buf)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _open_direct(path: Path) -> int | None:
    """A second, ``O_DIRECT`` write descriptor of `path` (already created), or
    None where the platform or file system has none (tmpfs refuses it)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:
        return None


class _Region:
    """One tensor's data span of a `ShardWriter`, filled front to back on the
    write thread (pieces of one region arrive in order: one write thread).

    Without a direct descriptor every piece is a positional page-cache write
    (`ShardWriter._write_all`). With one, the pages that lie wholly inside the
    span are written with ``O_DIRECT`` from an aligned staging buffer, and
    only the unaligned head and tail (under a page each; a page shared with a
    neighbouring tensor is only ever written through the page cache, by both)
    go through the page cache; `finalize_output`'s fsync still makes all of it
    durable. Why: on the 2-core VM a page-cache write of fresh pages cost
    0.25-3 CPU-s per GB (page allocation; a VM faults in fresh guest memory),
    an ``O_DIRECT`` write from a reused buffer 0.17 CPU-s per GB, copy
    included, with nothing left dirty for the final fsync
    (docs/bench-log/convert.md)."""

    __slots__ = ("_w", "_start", "_end", "_pos", "_carry")

    def __init__(self, writer: ShardWriter, start: int, end: int):
        self._w, self._start, self._end = writer, start, end
        self._pos = start  # file offset of the first byte not yet written (or carried)
        self._carry = bytearray()  # bytes from _pos on, held until a page boundary

    def put(self, mv: memoryview) -> None:
        w = self._w
        if w.stopped:  # aborted: the file is redone on resume
            return
        if not w._direct_ok:  # page-cache writes: nothing to align
            if self._carry:
                w._write_all(memoryview(self._carry), self._pos)
                self._pos += len(self._carry)
                self._carry = bytearray()
            w._write_all(mv, self._pos)
            self._pos += len(mv)
            return
        if self._pos % DIRECT_ALIGN:  # the head: up to the first page boundary, through the page cache
            head = min(-self._pos % DIRECT_ALIGN - len(self._carry), len(mv))
            self._carry += mv[:head]
            mv = mv[head:]
            if self._pos + len(self._carry) < self._end and (self._pos + len(self._carry)) % DIRECT_ALIGN:
                return  # still short of the boundary
            w._write_all(memoryview(self._carry), self._pos)
            self._pos += len(self._carry)
            self._carry = bytearray()
        have = len(self._carry) + len(mv)
        full = have - have % DIRECT_ALIGN
        if full:
            used = full - len(self._carry)
            w._write_direct([memoryview(self._carry), mv[:used]], self._pos, full)
            self._pos += full
            self._carry = bytearray(mv[used:])
        else:
            self._carry += mv

    def finish(self, _=None) -> None:
        """Write what is still carried (the tail, through the page cache)."""
        if self._carry and not self._w.stopped:
            self._w._write_all(memoryview(self._carry), self._pos)
            self._pos += len(self._carry)
            self._carry = bytearray()


class CopyBuffers:
    """The two alternating chunk buffers of `copy_source_bytes`, allocated on
    first use and reused for every tensor of a run: fresh memory costs a page
    fault per 4 KiB on first touch (1-2.5 us each on a VM), and two new 16 MiB
    buffers per pass-through tensor made that cost as large as the copy."""

    def __init__(self, size: int = _CHUNK):
        self.size = size
        self._mvs: list[memoryview] | None = None

    def get(self) -> list[memoryview]:
        if self._mvs is None:  # anonymous mappings: no zero-filling pass under the GIL (a bytearray's)
            self._mvs = [memoryview(mmap.mmap(-1, self.size)) for _ in range(2)]
        return self._mvs


def copy_source_bytes(path: Path, offset: int, nbytes: int, progress: Callable[[int], None] | None = None,
                      buffers: CopyBuffers | None = None) -> Iterator[memoryview]:
    """Yield `nbytes` raw bytes of `path` from `offset` in chunks (pass-through
    copies: the tensor is never decoded, so it is copied unchanged). Two
    buffers alternate (`buffers`, reused across calls, or a pair sized for this
    tensor): a yielded chunk stays valid until two more are requested (see
    `ShardWriter.write_chunks`)."""
    if buffers is not None:
        size, mvs = buffers.size, buffers.get()
    else:
        size = min(_CHUNK, max(nbytes, 1))
        mvs = [memoryview(bytearray(size)) for _ in range(2 if nbytes > size else 1)]
    i = 0
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        left = nbytes
        while left:
            mv = mvs[i % len(mvs)]
            i += 1
            k = f.readinto(mv[: min(size, left)])
            if not k:
                raise CheckpointError(f"{path}: unexpected end of file at byte {offset + nbytes - left}")
            left -= k
            yield mv[:k]
            if progress:
                progress(k)


def sha256_file(path: Path) -> str:
    """sha256 of the whole file (hex), what ``sha256sum`` prints."""
    return hash_file(path, SHA256)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def json_bytes(obj) -> bytes:
    """Deterministic JSON for the small files we write (index, config)."""
    return (json.dumps(obj, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode()


__all__ = [
    "DEFAULT_MAX_SHARD_SIZE", "ST_METADATA", "INDEX_NAME", "parse_size", "format_bytes", "PlannedTensor",
    "plan_shards", "safetensors_header", "ShardWriter", "DirectIO", "DIRECT_ALIGN", "tensor_bytes", "start_writeback", "copy_source_bytes", "CopyBuffers",
    "sha256_file", "write_bytes_atomic", "json_bytes",
]
