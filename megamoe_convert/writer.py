"""Writing (and verifying) a megamoe output folder.

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

Also here: the progress journal that makes ``--resume`` possible, the
temporary-folder protocol (``.OUT.megamoe-tmp`` beside OUT, swapped into place
at the end by ``output_dir.swap_into_place``), and :func:`verify_output`,
which re-reads a finished folder and checks it against its manifest (used by
``megamoe-convert verify``).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from megamoe_runtime.tensor_bytes import byte_view

from megamoe_runtime.errors import CheckpointError, ManifestError, MegaMoEError
from megamoe_runtime.folder import inside_folder
from megamoe_runtime.json_io import parse_json
from megamoe_runtime.digests import (
    SHA256,
    is_composite,
    composite_kind,
    digest_bytes,
    file_digest,
    hash_file,
    header_and_tensor_digest,
    new_hasher,
    safetensors_digests,
)
from megamoe_runtime.load_checks import spec_tensor_problems
from megamoe_runtime.manifest import (
    DIGEST_SHA256,
    MANIFEST_NAME,
    PASSTHROUGH_ROLE,
    dtype_from_name,
    nbytes_of,
    read_manifest,
)

from .output_dir import (
    JOURNAL_NAME,
    OutputError,
    StepHook,
    STEP_COMPLETE,
    STEP_SYNCED,
    STEP_TENSOR,
    TMP_MARKER,
    _fsync_dir,
    check_old_name_free,
    check_replaceable,
    discard_temp,
    is_our_temp,
    journal_state,
    swap_into_place,
    temp_dir_for,
    write_temp_marker,
)
from .source import read_safetensors_header

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

    def result(self) -> str:
        self._write.result()
        return self._hash.result().hex()


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
        self._f = open(self.path, "wb", buffering=0)
        self._header = safetensors_header(self.plan, metadata)
        self._size = 0
        self._write_all(memoryview(self._header))

    def _write_all(self, mv: memoryview) -> None:
        """Write `mv` to the file (runs on the write thread), and start the
        kernel writing it back to disk now (`start_writeback`), so that the
        final fsync waits only for the tail instead of the whole file."""
        step = self._SLICE
        start = self._size
        for i in range(0, len(mv), step):
            piece = mv[i:i + step]
            while piece:
                n = self._f.write(piece)
                piece = piece[n:]
        self._size += len(mv)
        if len(mv) >= self._SLICE:
            start_writeback(self._f.fileno(), start, len(mv))

    def _digest(self, mv: memoryview) -> bytes:
        return digest_bytes(self.algorithm, mv, self._hash_threads)

    def _pools(self):
        if self._write_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._hash_pool = ThreadPoolExecutor(1, thread_name_prefix="megamoe-hash")
            self._write_pool = ThreadPoolExecutor(1, thread_name_prefix="megamoe-write")
        return self._hash_pool, self._write_pool

    def _submit_write(self, mv: memoryview):
        fut = self._pools()[1].submit(self._write_all, mv)
        self._pending.append(fut)
        return fut

    def flush(self) -> None:
        """Wait until every queued byte is written and hashed (re-raising errors)."""
        pending, self._pending = self._pending, []
        for fut in pending:
            fut.result()

    @property
    def pending(self) -> list[PlannedTensor]:
        return self.plan[self._next:]

    @property
    def done(self) -> bool:
        return self._next == len(self.plan)

    def _expect(self, name: str) -> PlannedTensor:
        if self._next >= len(self.plan):
            raise MegaMoEError(f"{self.path.name}: tensor {name!r} written after the planned tensors")
        p = self.plan[self._next]
        if p.name != name:
            raise MegaMoEError(f"{self.path.name}: expected tensor {p.name!r} next, got {name!r}")
        return p

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
        wfut = self._submit_write(data)
        self._digests.append((*self._spans[self._next], name, hfut))
        self._next += 1
        if self._on_step is not None:
            self._on_step(STEP_TENSOR)
        return _Digest(hfut, wfut)

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
        h = new_hasher(self.algorithm)
        n = 0
        prev = None
        for c in chunks:
            mv = memoryview(c).cast("B")
            fut = self._submit_write(mv)
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
        self._digests.append((*self._spans[self._next], name, done))
        self._next += 1
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


def copy_source_bytes(path: Path, offset: int, nbytes: int, progress: Callable[[int], None] | None = None
                      ) -> Iterator[memoryview]:
    """Yield `nbytes` raw bytes of `path` from `offset` in chunks (pass-through
    copies: the tensor is never decoded, so it is copied unchanged). Two
    buffers alternate: a yielded chunk stays valid until two more are
    requested (see `ShardWriter.write_chunks`)."""
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


# safetensors_digests, file_digest, hash_file: megamoe_runtime.digests (re-exported here)


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


# --------------------------------------------------------------------------- temp folder + journal


def check_output_target(out: Path, *, overwrite: bool, resume: bool, recovered: bool = False) -> None:
    """The checks of `prepare_temp_dir`, creating and removing nothing: run
    (under the output lock) before the source is opened, so a refusal comes
    before a hub download and the preflight, not after. `recovered`: this run
    has just finished an earlier run's swap into OUT (OUT may then exist)."""
    out = Path(out)
    tmp = temp_dir_for(out)
    if out.exists() or out.is_symlink():
        if not overwrite and not recovered:
            raise OutputError(
                f"output folder {out} already exists; pass --overwrite to replace it "
                "(only a megamoe output is replaced, and only after the new conversion has finished)"
            )
        if overwrite:
            check_replaceable(out)
            check_old_name_free(out)
    if tmp.exists() or tmp.is_symlink():
        if not is_our_temp(tmp):
            discard_temp(tmp)  # raises: not ours, left alone
        fp, complete = journal_state(tmp)
        if complete or overwrite or (resume and (tmp / JOURNAL_NAME).is_file()):
            return  # a complete one is resumed when this run's fingerprint matches (prepare_temp_dir)
        hint = ("it has no progress journal, so it cannot be resumed; " if resume else
                "pass --resume to continue that run, or ")
        raise OutputError(
            f"{tmp} exists: an earlier conversion to {out} was interrupted (no process holds its lock, so it "
            f"is not running); {hint}pass --overwrite to discard it and start over"
        )


def prepare_temp_dir(out: Path, *, overwrite: bool, resume: bool,
                     fingerprint: str | None = None) -> tuple[Path, bool]:
    """Check OUT (`check_output_target`) and create or reuse its temp folder.
    Returns (tmp, resuming). A complete temp folder (killed just before its
    swap) whose journal has this run's `fingerprint` is resumed without
    --resume: only the swap is left to do."""
    out = Path(out)
    check_output_target(out, overwrite=overwrite, resume=resume)
    tmp = temp_dir_for(out)
    if tmp.exists():
        fp, complete = journal_state(tmp)
        if resume and (tmp / JOURNAL_NAME).is_file():
            return tmp, True
        if complete and fingerprint is not None and fp == fingerprint:
            return tmp, True
        if not overwrite:
            raise OutputError(
                f"{tmp} holds a finished conversion to {out} of different inputs or options (run fingerprint "
                f"{str(fp)[:12]}..., this run {str(fingerprint)[:12]}...); pass --overwrite to discard it")
        discard_temp(tmp)  # only reachable with --overwrite; only our own
    tmp.mkdir()
    write_temp_marker(tmp, out)
    return tmp, False


def finalize_output(tmp: Path, out: Path, mark_complete: Callable[[], None] | None = None,
                    on_step: StepHook | None = None) -> None:
    """fsync every file, mark the journal complete, then swap the temp folder
    into place (``output_dir.swap_into_place``: an old OUT is replaced only
    now), so OUT never names unwritten data.

    `mark_complete` runs after the sync: the converter appends the journal's
    ``complete`` record there. A kill before it leaves a temp folder that
    ``--resume`` finishes; a kill after it, one the next run swaps in itself."""
    out = Path(out)
    for p in sorted(tmp.iterdir()):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(tmp)
    if on_step is not None:
        on_step(STEP_SYNCED)
    if mark_complete is not None:
        mark_complete()
        if on_step is not None:
            on_step(STEP_COMPLETE)
    swap_into_place(tmp, out, on_step)


class Journal:
    """Append-only progress log in the temp folder (JSON lines, fsynced).

    Records: the run fingerprint (first line), each finished file (name, size,
    sha256, its tensors' manifest entries) and each finished layer (scalars,
    repairs), and last ``complete`` once everything is synced. A torn last
    line from a kill is ignored. On resume, finished files are re-hashed and
    kept only if they still match, and their tensors are re-derived from the
    source and compared (``convert._Run.check``).
    """

    def __init__(self, tmp: Path):
        self.path = Path(tmp) / JOURNAL_NAME
        self.run_record: dict | None = None  # the first record, once `load` has run

    def start(self, fingerprint: str, sources: dict | None = None) -> None:
        """First record: the run fingerprint and (``sources``) each source file's [size, mtime_ns]."""
        self.path.write_text("")
        self._append({"kind": "run", "fingerprint": fingerprint, **({"sources": sources} if sources else {})})

    def load(self) -> tuple[str | None, dict[str, dict], dict[int, dict]]:
        fingerprint, files, layers = None, {}, {}
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = parse_json(line, str(self.path), error=CheckpointError)
            except CheckpointError:
                continue  # torn write of the last record
            kind = rec.get("kind")
            if kind == "run":
                fingerprint = rec.get("fingerprint")
                self.run_record = rec
            elif kind == "file":
                files[rec["name"]] = rec
            elif kind == "layer":
                layers[int(rec["index"])] = rec
        return fingerprint, files, layers

    def record_file(self, name: str, size: int, sha256: str, tensors: dict[str, dict],
                    digest: str = DIGEST_SHA256) -> None:
        """A finished file; `digest` is the kind of `sha256` (manifest DIGEST_KINDS)."""
        self._append({"kind": "file", "name": name, "size": size, "sha256": sha256, "digest": digest,
                      "tensors": tensors})

    def record_layer(self, index: int, record: dict) -> None:
        self._append({"kind": "layer", "index": index, **record})

    def mark_complete(self) -> None:
        """Every file and the manifest are written and synced: only the swap is left."""
        self._append({"kind": "complete"})

    def _append(self, rec: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- verify


@dataclass
class VerifyReport:
    """What `verify_output` found. `ok` is False when any problem was found."""

    path: str
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    files_checked: int = 0
    tensors_checked: int = 0
    bytes_checked: int = 0
    format_version: int | None = None
    row: str | None = None
    ep_size: int | None = None
    layers: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {
            "path": self.path, "ok": self.ok, "problems": self.problems, "warnings": self.warnings,
            "files_checked": self.files_checked, "tensors_checked": self.tensors_checked,
            "bytes_checked": self.bytes_checked, "format_version": self.format_version,
            "row": self.row, "ep_size": self.ep_size, "layers": self.layers,
        }


def verify_output(out: str | os.PathLike, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Check a converted folder against its manifest.

    Schema and version (read_manifest), every listed file present with the
    listed size and digest (of the entry's kind, see
    ``megamoe_runtime.manifest.DIGEST_KINDS``), every safetensors header valid
    (data offsets tiling the file exactly) and consistent with the manifest
    (names, dtypes, stored shapes; no unlisted tensors), and every tensor's
    checksum (sha256 or blake3, the manifest's ``checksum``; a blake3 folder
    needs the ``blake3`` package: DigestUnavailableError without it). One sequential
    read per file computes all its tensor hashes and, from them, the file
    digest. Raises nothing for a damaged folder: all
    findings go into the report (a missing folder raises OutputError).
    """
    out = Path(out)
    if not out.is_dir():
        raise OutputError(f"{out} is not a folder")
    rep = VerifyReport(str(out))
    try:
        m = read_manifest(out)
    except ManifestError as e:
        rep.problems.append(str(e))
        return rep
    rep.format_version, rep.row, rep.ep_size, rep.layers = m.format_version, m.row, m.ep_size, len(m.layers)
    rep.files_checked = 1  # the manifest itself (schema, version, self-digest): files count as convert counts them
    for alg in sorted({m.checksum} | {fe.algorithm for fe in m.files.values()}):
        new_hasher(alg)  # DigestUnavailableError (blake3 not installed) before reading anything: not a mismatch
    rep.problems += spec_tensor_problems(m, str(out / MANIFEST_NAME))

    by_file: dict[str, dict[str, tuple[str, object]]] = {}
    for key, t in m.tensors.items():
        by_file.setdefault(t.file, {})[t.name] = (key, t)

    total = sum(fe.size for fe in m.files.values())
    user_progress = progress

    def progress(n: int) -> None:
        rep.bytes_checked += n
        if user_progress:
            user_progress(min(rep.bytes_checked, total), total)

    on_disk = {p.name for p in out.iterdir() if p.is_file()} - {MANIFEST_NAME}
    for extra in sorted(on_disk - set(m.files)):
        rep.warnings.append(f"{out / extra}: file not listed in the manifest (ignored)")

    for fname in sorted(m.files):
        fe = m.files[fname]
        tensors = by_file.pop(fname, {})  # even when the file is missing: one problem per missing file
        try:
            path = inside_folder(out, fname)
        except CheckpointError as e:
            rep.problems.append(str(e))
            continue
        if not path.is_file():
            rep.problems.append(f"{path}: missing (manifest lists it with {fe.size} bytes"
                                + (f" and {len(tensors)} tensor(s)" if tensors else "") + ")")
            continue
        size = path.stat().st_size
        if size != fe.size:
            rep.problems.append(f"{path}: size {size} bytes, manifest says {fe.size}")
        if fname.endswith(".safetensors"):
            _verify_safetensors(path, fe, tensors, rep, progress, m.checksum)
        else:  # read_manifest allows the header-and-tensors kinds for safetensors files only
            digest = hash_file(path, fe.algorithm)
            progress(size)
            if digest != fe.checksum:
                rep.problems.append(f"{path}: {fe.algorithm} {digest} does not match the manifest's {fe.checksum}")
        rep.files_checked += 1
    for fname, tensors in by_file.items():  # pragma: no cover - read_manifest refuses this
        rep.problems.append(f"tensors {sorted(tensors)[:3]} name file {fname!r}, which the manifest does not list")
    return rep


def _verify_safetensors(path: Path, fe, tensors: dict, rep: VerifyReport,
                        progress: Callable[[int], None], checksum: str = SHA256) -> None:
    """One read of the file checks every tensor's checksum and the file digest
    (of the entry's kind). The header must be valid (header + data offsets
    tiling the file exactly, which is what lets the header-and-tensors digest
    cover every byte); an invalid header is itself a failure."""
    try:
        fh = read_safetensors_header(path)
    except CheckpointError as e:
        rep.problems.append(f"{e} (cannot check its {fe.digest} digest)")
        progress(path.stat().st_size)
        return
    names = set(fh.tensors)
    for name in sorted(names - set(tensors)):
        rep.problems.append(f"{path}: tensor {name!r} is in the file but not in the manifest")
    checks = []
    for name, (key, t) in sorted(tensors.items()):
        th = fh.tensors.get(name)
        if th is None:
            rep.problems.append(f"{path}: manifest tensor {key!r} is missing from the file")
            continue
        if th.dtype != t.dtype or tuple(th.shape) != tuple(t.stored_shape):
            rep.problems.append(
                f"{path}: tensor {name!r} is {th.dtype} {list(th.shape)} in the header, manifest says "
                f"{t.dtype} {list(t.stored_shape)}")
            continue
        checks.append((name, key, t.checksum))
    whole = not is_composite(fe.digest)
    try:
        composite, got, whole_sha = safetensors_digests(path, fh, algorithm=checksum, whole=whole,
                                                        whole_algorithm=fe.algorithm, progress=progress)
    except (OSError, CheckpointError) as e:
        rep.problems.append(f"{path}: cannot read it to check its digests: {e}")
        return
    digest = whole_sha if whole else composite
    if digest != fe.checksum:
        rep.problems.append(f"{path}: {fe.digest} digest {digest} does not match the manifest's {fe.checksum}")
    for name, key, want in checks:
        rep.tensors_checked += 1
        if got[name] != want:
            rep.problems.append(f"{path}: tensor {key!r} {checksum} {got[name]} does not match the manifest's {want}")


__all__ = [
    "DEFAULT_MAX_SHARD_SIZE", "OutputError", "parse_size", "format_bytes", "PlannedTensor", "plan_shards",
    "safetensors_header", "ShardWriter", "tensor_bytes", "copy_source_bytes", "sha256_file", "file_digest",
    "safetensors_digests",
    "write_bytes_atomic", "json_bytes", "temp_dir_for", "check_output_target", "prepare_temp_dir", "finalize_output", "Journal",
    "VerifyReport", "verify_output", "PASSTHROUGH_ROLE", "INDEX_NAME", "JOURNAL_NAME", "TMP_MARKER", "OutputError",
]
