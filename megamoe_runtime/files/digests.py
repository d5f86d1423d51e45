"""Checksums of a converted folder: the algorithms, the file-digest kinds, and hashing.

Two checksum algorithms, named in the manifest (``checksum``; absent means
``sha256``, what every manifest before it used):

* ``sha256`` (hashlib): about 1.8 GB/s per core with SHA-NI, and sequential
  within a buffer;
* ``blake3`` (the ``blake3`` package, a small Rust extension): several GB/s
  per core, and a tree hash that can use more threads within one buffer.

Every tensor of the manifest carries a checksum of the manifest's algorithm
(the JSON key is the algorithm's name). Every file carries a digest of one of
the ``DIGEST_KINDS`` (``files[name].digest``; the JSON key of the value is the
kind's algorithm):

* ``sha256`` / ``blake3``: the hash of the whole file's bytes (``sha256``
  equals ``sha256sum`` and a hub LFS oid); used for the small JSON and
  tokenizer files the converter copies or writes;
* ``sha256-of-header-and-tensor-digests`` /
  ``blake3-of-header-and-tensor-digests``: the hash over the file's first ``8
  + N`` bytes (the little-endian header length and the N-byte JSON header,
  padding included) followed by the raw 32-byte digest of each tensor's data
  in data-offset order (ties, only possible between empty tensors, by name).
  Used for the safetensors files the converter writes: the tensor digests are
  computed anyway, so the file digest costs no second pass over the data. It
  still covers every byte: a valid safetensors file is exactly header + data,
  and the data offsets tile the data with no gap (``verify`` checks both), so
  each byte is in the header or in exactly one tensor.

This module is part of the runtime so that a serve-only install can verify a
folder. ``blake3`` is imported only when a blake3 digest is computed: a
machine without it (e.g. a GPU image with no package registry) still loads
and verifies sha256 folders, and gets a ``DigestUnavailableError`` naming the
package when asked for blake3.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable, Iterable

from ..errors import DigestUnavailableError, ManifestError, MegaMoEError

SHA256 = "sha256"
BLAKE3 = "blake3"
#: checksum algorithms, in the order the manifest schema lists them
ALGORITHMS = (SHA256, BLAKE3)
def _default_checksum() -> str:
    """blake3 (a declared dependency: about 4x sha256 a core, the difference between 0.56x and 0.73x
    of ``cp -r`` + ``sync`` for the converter on 2 cores, BENCHMARKS.md), or sha256 where the package is
    absent (an install without dependencies): a conversion never fails for want of a hash."""
    import importlib.util

    return BLAKE3 if importlib.util.find_spec("blake3") is not None else SHA256


#: what the converter writes unless told otherwise (`--checksum`)
DEFAULT_CHECKSUM = _default_checksum()

DIGEST_SHA256 = "sha256"
DIGEST_HEADER_AND_TENSORS = "sha256-of-header-and-tensor-digests"
DIGEST_BLAKE3 = "blake3"
DIGEST_BLAKE3_HEADER_AND_TENSORS = "blake3-of-header-and-tensor-digests"
#: file digest kind -> (algorithm, composed from the header and the tensor digests)
_KINDS = {
    DIGEST_SHA256: (SHA256, False),
    DIGEST_HEADER_AND_TENSORS: (SHA256, True),
    DIGEST_BLAKE3: (BLAKE3, False),
    DIGEST_BLAKE3_HEADER_AND_TENSORS: (BLAKE3, True),
}
DIGEST_KINDS = tuple(_KINDS)

_CHUNK = 16 << 20
#: buffers at least this large are hashed by blake3 on several threads (when asked for)
_BLAKE3_MT_MIN = 4 << 20


def check_algorithm(algorithm: str, what: str = "checksum") -> str:
    if algorithm not in ALGORITHMS:
        raise MegaMoEError(f"{what} {algorithm!r} is not a checksum algorithm megamoe knows; "
                           f"valid: {', '.join(ALGORITHMS)}")
    return algorithm


def kind_algorithm(kind: str) -> str:
    """The algorithm of a file digest kind (ManifestError for an unknown kind)."""
    try:
        return _KINDS[kind][0]
    except KeyError:
        raise ManifestError(f"unknown digest kind {kind!r}; this megamoe knows {', '.join(DIGEST_KINDS)} "
                            "(a newer megamoe may have written it: upgrade to verify or load this folder)") from None


def is_composite(kind: str) -> bool:
    """True for the ``*-of-header-and-tensor-digests`` kinds."""
    kind_algorithm(kind)
    return _KINDS[kind][1]


def composite_kind(algorithm: str) -> str:
    return DIGEST_HEADER_AND_TENSORS if check_algorithm(algorithm) == SHA256 else DIGEST_BLAKE3_HEADER_AND_TENSORS


def whole_kind(algorithm: str) -> str:
    return DIGEST_SHA256 if check_algorithm(algorithm) == SHA256 else DIGEST_BLAKE3


def _blake3_module():
    try:
        import blake3  # noqa: PLC0415 - optional at serve time, see the module doc
    except ImportError:
        raise DigestUnavailableError(
            "this folder's checksums are blake3, but the Python package 'blake3' is not installed here "
            "(pip install blake3); sha256 folders need nothing extra (megamoe-convert convert --checksum sha256)"
        ) from None
    return blake3


def new_hasher(algorithm: str, data: bytes | memoryview = b"", threads: int = 1) -> Any:
    """A hashlib-style object (``update``, ``digest``, ``hexdigest``) of `algorithm`.

    ``threads`` > 1 lets blake3 hash one large ``update`` on that many threads
    (its tree mode); sha256 is sequential whatever it is."""
    check_algorithm(algorithm)
    if algorithm == SHA256:
        return hashlib.sha256(data)
    b3 = _blake3_module()
    h = b3.blake3(max_threads=threads if threads > 1 else 1)
    if len(data):
        h.update(data)
    return h


def digest_bytes(algorithm: str, data: bytes | memoryview, threads: int = 1) -> bytes:
    """The raw 32-byte digest of `data` (blake3 on `threads` threads when `data` is large)."""
    return new_hasher(algorithm, data, threads if len(data) >= _BLAKE3_MT_MIN else 1).digest()


def header_and_tensor_digest(header: bytes, tensor_digests: Iterable[tuple[int, int, str, bytes]],
                             algorithm: str = SHA256) -> str:
    """The ``{algorithm}-of-header-and-tensor-digests`` file digest (hex).

    `header`: the file's first ``8 + N`` bytes; `tensor_digests`: ``(begin,
    end, name, raw 32-byte digest of the tensor's data)`` per tensor, in any
    order (sorted here by data offsets, then name)."""
    h = new_hasher(algorithm, header)
    for _, _, _, d in sorted(tensor_digests, key=lambda t: (t[0], t[1], t[2])):
        if len(d) != 32:
            raise MegaMoEError(f"tensor digest must be 32 raw bytes, got {len(d)}")
        h.update(d)
    return h.hexdigest()


def hash_file(path: Path, algorithm: str = SHA256) -> str:
    """Hex digest of the whole file (one sequential read)."""
    h = new_hasher(algorithm)
    with open(path, "rb", buffering=0) as f:
        # sized to the file: a 16 MiB buffer for a 1 KB config file costs 4096 first-touch page faults
        buf = bytearray(min(_CHUNK, max(os.fstat(f.fileno()).st_size, 1)))
        mv = memoryview(buf)
        while True:
            k = f.readinto(mv)
            if not k:
                break
            h.update(mv[:k])
    return h.hexdigest()


def _hash_spans(path: Path, spans: list, start: int = 0, whole=None,
                progress: Callable[[int], None] | None = None) -> None:
    """One sequential read of `path` from byte `start`: each ``(begin, end,
    hasher)`` span (absolute offsets, sorted by begin, not overlapping) gets
    its bytes, and `whole` (if given) every byte read."""
    pos, i = start, 0
    buf = bytearray(_CHUNK)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while True:
            k = f.readinto(mv)
            if not k:
                break
            chunk = mv[:k]
            if whole is not None:
                whole.update(chunk)
            end = pos + k
            j = i
            while j < len(spans) and spans[j][0] < end:
                b, e, h = spans[j]
                lo, hi = max(b, pos), min(e, end)
                if hi > lo:
                    h.update(chunk[lo - pos:hi - pos])
                j += 1
            while i < len(spans) and spans[i][1] <= end:
                i += 1
            pos = end
            if progress:
                progress(k)


def safetensors_digests(path: Path, fh=None, *, algorithm: str = SHA256, whole: bool = False,
                        whole_algorithm: str | None = None,
                        progress: Callable[[int], None] | None = None) -> tuple[str, dict[str, str], str | None]:
    """From one read of a safetensors file: its ``{algorithm}-of-header-and-
    tensor-digests``, every tensor's digest (hex, by name) and, with `whole`,
    the digest of the whole file (of `whole_algorithm`, default `algorithm`).
    `fh` is its validated header (read if None; CheckpointError for an invalid
    one, which guarantees header + data offsets tile the file exactly, so the
    digest covers every byte)."""
    from ..errors import CheckpointError
    from .safetensors_header import parse_safetensors_header

    path = Path(path)
    fh = fh if fh is not None else parse_safetensors_header(path)
    base = 8 + fh.header_len
    with open(path, "rb", buffering=0) as f:
        header = f.read(base)
    if len(header) != base:
        raise CheckpointError(f"{path}: changed while being read (header is {len(header)} bytes, expected {base})")
    hashers = {name: new_hasher(algorithm) for name in fh.tensors}
    spans = sorted(((base + t.begin, base + t.end, hashers[n]) for n, t in fh.tensors.items()),
                   key=lambda s: (s[0], s[1]))
    wh = new_hasher(whole_algorithm or algorithm, header) if whole else None
    if progress:
        progress(base)
    _hash_spans(path, spans, start=base, whole=wh, progress=progress)
    raw = {n: h.digest() for n, h in hashers.items()}
    composite = header_and_tensor_digest(header, [(t.begin, t.end, n, raw[n]) for n, t in fh.tensors.items()],
                                         algorithm)
    return composite, {n: d.hex() for n, d in raw.items()}, (wh.hexdigest() if wh is not None else None)


def file_digest(path: Path, kind: str) -> str:
    """The digest of `path` as the manifest's `files[name].digest` kind defines it
    (what ``--resume`` re-checks finished files with)."""
    algorithm = kind_algorithm(kind)
    if is_composite(kind):
        return safetensors_digests(path, algorithm=algorithm)[0]
    return hash_file(path, algorithm)


__all__ = [
    "SHA256", "BLAKE3", "ALGORITHMS", "DEFAULT_CHECKSUM", "DIGEST_SHA256", "DIGEST_HEADER_AND_TENSORS", "DIGEST_BLAKE3",
    "DIGEST_BLAKE3_HEADER_AND_TENSORS", "DIGEST_KINDS", "check_algorithm", "kind_algorithm", "is_composite",
    "composite_kind", "whole_kind", "new_hasher", "digest_bytes", "header_and_tensor_digest",
    "hash_file", "safetensors_digests", "file_digest",
]
