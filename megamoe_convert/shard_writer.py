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
``megamoe_runtime.verify``.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from megamoe_runtime.digests import (
    SHA256,
    composite_kind,
    digest_bytes,
    hash_file,
    header_and_tensor_digest,
    new_hasher,
)
from megamoe_runtime.errors import CheckpointError, MegaMoEError
from megamoe_runtime.manifest import dtype_from_name, nbytes_of
from megamoe_runtime.tensor_bytes import byte_view

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


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"  # pragma: no cover


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
    ``megamoe_runtime.digests``): the hash of the header bytes and the
    per-tensor digests, so every data byte is hashed once, not twice, and
    nothing is read back. There is no
    fsync per shard: the kernel writes finished shards back while later
    layers are converted, and `finalize_output` fsyncs every file before the
    rename. (The journal needs no fsynced shards either: ``--resume``
    re-hashes every file it lists, so a shard lost in a crash is redone.)

    Threads: the tensor hash runs on one background thread (blake3 may use
    ``hash_threads`` for one large tensor) and the file write on another
    (hashlib, blake3 and file writes release the GIL), both reading
    the caller's memory, while the caller packs the next layer. Writes stay
    in order. The memory of a queued tensor must stay untouched until its
    digest is done (``flush()`` waits for everything; ``close()`` flushes).
    """

    _SLICE = 4 << 20

    def __init__(self, path: Path, tensors: list[PlannedTensor], metadata: dict[str, str] | None = None,
                 on_step: StepHook | None = None, algorithm: str = SHA256, hash_threads: int = 1):
        """`on_step` is called with ``"tensor"`` after each tensor is queued
        (tests plant a crash there, see ``output_dir``)."""
        self.path = Path(path)
        self.algorithm = algorithm
        self.digest_kind = composite_kind(algorithm)
        self._hash_threads = hash_threads
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
        self._hash_pool = self._write_pool = None
        self._claimed: set[int] = set()  # plan indices whose bytes are queued (or being streamed in parts)
        self._index = {t.name: i for i, t in enumerate(self.plan)}
        self._f = open(self.path, "wb", buffering=0)
        self._header = safetensors_header(self.plan, metadata)
        self._size = 0
        self._write_all(memoryview(self._header), 0)
        self._data_start = len(self._header)

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
                n = os.pwrite(fd, piece, pos)
                piece, pos = piece[n:], pos + n
        self._size = max(self._size, offset + len(mv))
        if len(mv) >= self._SLICE:
            start_writeback(fd, offset, len(mv))

    def _digest(self, mv: memoryview) -> bytes:
        return digest_bytes(self.algorithm, mv, self._hash_threads)

    def _pools(self):
        if self._write_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._hash_pool = ThreadPoolExecutor(1, thread_name_prefix="megamoe-hash")
            self._write_pool = ThreadPoolExecutor(1, thread_name_prefix="megamoe-write")
        return self._hash_pool, self._write_pool

    def _submit_write(self, mv: memoryview, offset: int):
        fut = self._pools()[1].submit(self._write_all, mv, offset)
        self._pending.append(fut)
        return fut

    def flush(self) -> None:
        """Wait until every queued byte is written and hashed (re-raising errors)."""
        pending, self._pending = self._pending, []
        for fut in pending:
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
        hash_pool, _ = self._pools()
        hfut = hash_pool.submit(self._digest, data)
        self._pending.append(hfut)
        begin, end = self._claim(self._index[name])
        wfut = self._submit_write(data, self._data_start + begin)
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
        n = 0
        prev = None
        for c in chunks:
            mv = memoryview(c).cast("B")
            if n + len(mv) > p.nbytes:
                self.flush()
                raise CheckpointError(f"{self.path.name}: tensor {name!r} got more than {p.nbytes} bytes")
            fut = self._submit_write(mv, self._data_start + begin + n)
            h.update(mv)
            n += len(mv)
            if prev is not None:
                prev.result()
            prev = fut
        self.flush()
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
        self._f.close()  # no fsync here: finalize_output syncs every file once, at the end
        want = self._data_start + (self._spans[-1][1] if self._spans else 0)
        if self._size != want:  # pragma: no cover - every claimed tensor checks its own byte count
            raise MegaMoEError(f"{self.path.name}: wrote {self._size} bytes, planned {want}")
        digest = header_and_tensor_digest(self._header, [(b, e, n, f.result()) for b, e, n, f in self._digests],
                                          self.algorithm)
        return self._size, digest

    def _shutdown(self) -> None:
        for pool in (self._hash_pool, self._write_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._hash_pool = self._write_pool = None

    def abort(self) -> None:
        """Stop without finishing (the partial file stays for --resume to redo)."""
        try:
            self.flush()
        except Exception:
            pass
        self._shutdown()
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
        self._last_write = None

    def put(self, data: memoryview) -> _Digest:
        w = self._w
        mv = memoryview(data).cast("B")
        if self._n + len(mv) > self._end - self._begin:
            raise MegaMoEError(f"{w.path.name}: tensor {self.planned.name!r} got more than its planned "
                               f"{self._end - self._begin} bytes")
        hash_pool, _ = w._pools()
        hfut = hash_pool.submit(self._update, mv)
        w._pending.append(hfut)
        wfut = w._submit_write(mv, w._data_start + self._begin + self._n)
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
        hash_pool, _ = w._pools()
        hfut = hash_pool.submit(self._hasher.digest)  # after every piece: the hash thread runs in order
        w._pending.append(hfut)
        w._digests.append((self._begin, self._end, self.planned.name, hfut))
        if w._on_step is not None:
            w._on_step(STEP_TENSOR)
        if self._last_write is None:  # an empty tensor
            from concurrent.futures import Future

            self._last_write = Future()
            self._last_write.set_result(None)
        return _Digest(hfut, self._last_write)


class CopyBuffers:
    """The two alternating chunk buffers of `copy_source_bytes`, allocated on
    first use and reused for every tensor of a run: fresh memory costs a page
    fault per 4 KiB on first touch (1-2.5 us each on a VM), and two new 16 MiB
    buffers per pass-through tensor made that cost as large as the copy."""

    def __init__(self, size: int = _CHUNK):
        self.size = size
        self._mvs: list[memoryview] | None = None

    def get(self) -> list[memoryview]:
        if self._mvs is None:
            self._mvs = [memoryview(bytearray(self.size)) for _ in range(2)]
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
    "plan_shards", "safetensors_header", "ShardWriter", "tensor_bytes", "start_writeback", "copy_source_bytes", "CopyBuffers",
    "sha256_file", "write_bytes_atomic", "json_bytes",
]
