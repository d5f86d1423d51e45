"""safetensors headers: the dtype table and the one header parser/validator.

Both the runtime (``file_io.SafetensorsFile``, the reload dry run) and the
converter (``megamoe_convert.readers.source``, the writer's verify) read headers
through :func:`parse_safetensors_header`, so a file is judged by the same
rules wherever it is opened (docs/CHECKPOINTS.md#safetensors): an 8-byte length, a
header of at most 100,000,000 bytes that is a UTF-8 JSON object without
duplicate keys, known dtypes, non-negative shapes, byte ranges of exactly
``numel * bits / 8`` bytes that tile the data section with no gap or overlap,
and a file length of exactly ``8 + header + data``. Every error is a
CheckpointError naming the file (and the tensor, where one is at fault),
raised before any tensor byte is read.
"""
from __future__ import annotations

import hashlib
import math
import os
import stat as stat_mod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from ..errors import CheckpointError
from .json_io import parse_json
from .limits import MAX_HEADER_BYTES, check_limit

__all__ = [
    "MAX_HEADER_BYTES",
    "HEADER_DTYPE_BITS",
    "DTYPES",
    "DTYPE_BITS",
    "HeaderEntry",
    "SafetensorsHeader",
    "parse_safetensors_header",
    "file_kind",
]

#: safetensors dtype name -> (bits per element as a header counts them, torch dtype or None where this torch
#: lacks it). F4 counts logical 4-bit elements (its byte size is numel / 2); the 6-bit floats have no torch dtype.
_DTYPE_TABLE: dict[str, tuple[int, Optional[torch.dtype]]] = {
    "BOOL": (8, torch.bool),
    "U8": (8, torch.uint8),
    "I8": (8, torch.int8),
    "I16": (16, torch.int16),
    "U16": (16, getattr(torch, "uint16", None)),
    "F16": (16, torch.float16),
    "BF16": (16, torch.bfloat16),
    "I32": (32, torch.int32),
    "U32": (32, getattr(torch, "uint32", None)),
    "F32": (32, torch.float32),
    "F64": (64, torch.float64),
    "C64": (64, torch.complex64),
    "I64": (64, torch.int64),
    "U64": (64, getattr(torch, "uint64", None)),
    "F8_E4M3": (8, torch.float8_e4m3fn),
    "F8_E5M2": (8, torch.float8_e5m2),
    "F8_E8M0": (8, getattr(torch, "float8_e8m0fnu", None)),
    "F8_E4M3FNUZ": (8, getattr(torch, "float8_e4m3fnuz", None)),
    "F8_E5M2FNUZ": (8, getattr(torch, "float8_e5m2fnuz", None)),
    "F4": (4, getattr(torch, "float4_e2m1fn_x2", None)),
    "F6_E2M3": (6, None),
    "F6_E3M2": (6, None),
}
#: header-only dtypes: a source header may name them (their byte counts are checked), but no torch dtype holds
#: them, so megamoe never stores them
_HEADER_ONLY = ("F6_E2M3", "F6_E3M2")

#: bits per element of every dtype a safetensors header may name
HEADER_DTYPE_BITS: dict[str, int] = {name: bits for name, (bits, _) in _DTYPE_TABLE.items()}
#: safetensors dtype names -> torch dtypes (those this torch has). A dry run
#: building meta tensors from headers needs at least these.
DTYPES: dict[str, torch.dtype] = {name: dt for name, (_, dt) in _DTYPE_TABLE.items() if dt is not None}
#: bits per element of the dtypes a megamoe file may store (F4 counts logical
#: 4-bit elements, so its byte size is numel / 2)
DTYPE_BITS: dict[str, int] = {name: bits for name, (bits, _) in _DTYPE_TABLE.items() if name not in _HEADER_ONLY}


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a (validated) safetensors header: dtype name, shape, byte range in the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> Optional[torch.dtype]:
        """The torch dtype whose elements are this header's elements, None where there is none: the 6-bit
        floats, and F4, whose torch dtype packs two header elements into one."""
        if self.dtype == "F4":
            return None
        return DTYPES.get(self.dtype)


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated safetensors header: the tensors (in header order), the ``__metadata__`` strings, the header's
    length, the file's size and the sha256 of the header bytes."""

    path: Path
    header_len: int
    file_size: int
    tensors: dict[str, HeaderEntry]
    metadata: dict[str, str]
    header_sha256: str

    @property
    def data_start(self) -> int:
        """File offset of the data section (data offsets count from here)."""
        return 8 + self.header_len


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words (errors name it: "is a FIFO (named pipe)")."""
    for test, what in ((stat_mod.S_ISFIFO, "is a FIFO (named pipe)"), (stat_mod.S_ISCHR, "is a character device"),
                       (stat_mod.S_ISBLK, "is a block device"), (stat_mod.S_ISSOCK, "is a socket"),
                       (stat_mod.S_ISDIR, "is a folder"), (stat_mod.S_ISREG, "is a regular file")):
        if test(mode):
            return what
    return "is not a regular file"


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def parse_safetensors_header(path: Union[str, os.PathLike]) -> SafetensorsHeader:
    """Read only the header bytes of ``path`` and validate them against the file (see the module docstring);
    CheckpointError naming the file, and the tensor where one is at fault, on any defect."""
    path = Path(path)
    try:
        st = path.stat()
        size = st.st_size
        if not stat_mod.S_ISREG(st.st_mode):  # never open a FIFO or a device: a read could block or never end
            raise CheckpointError(f"{path}: {file_kind(st.st_mode)}, not a regular file; a safetensors file is "
                                  "a regular file")
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"{path}: truncated safetensors file ({size} bytes; at least the 8-byte header length is needed)"
                )
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{path}: header length {n} exceeds the safetensors limit of {MAX_HEADER_BYTES} bytes "
                    "(not a safetensors file, or a corrupted one)"
                )
            if 8 + n > size:
                raise CheckpointError(
                    f"{path}: truncated safetensors file: header says {n} header bytes but the file has only "
                    f"{size - 8} after the length field"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read safetensors file: {e}") from e
    # every entry has one "data_offsets" key: a count in the raw bytes bounds the entries before the parse
    # (1.3 M entries took gigabytes to parse, and then failed later, naming no file)
    check_limit("header_tensors", raw.count(b'"data_offsets"'), str(path), CheckpointError,
                label="tensors listed in its safetensors header")
    header = parse_json(raw, str(path), error=CheckpointError, max_bytes=MAX_HEADER_BYTES,
                        what="safetensors header", key_name="tensor name")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is a {type(header).__name__}, expected a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings, found {metadata!r:.200}")
    tensors: dict[str, HeaderEntry] = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise CheckpointError(f"{path}: header entry {name!r} lacks dtype/shape/data_offsets: {entry!r:.200}")
        dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in HEADER_DTYPE_BITS:
            raise CheckpointError(
                f"{path}: tensor {name!r} has unknown dtype {dtype!r}; known: {sorted(HEADER_DTYPE_BITS)}"
            )
        if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
            raise CheckpointError(f"{path}: tensor {name!r} has invalid shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_count(o) for o in offs)):
            raise CheckpointError(f"{path}: tensor {name!r} has invalid data_offsets {offs!r}")
        begin, end = offs
        numel, bits = math.prod(shape), HEADER_DTYPE_BITS[dtype]
        if numel * bits % 8:
            raise CheckpointError(
                f"{path}: tensor {name!r} ({dtype} {shape}) holds {numel} x {bits} bits, not a whole number of bytes"
            )
        expected = numel * bits // 8
        if end < begin or end - begin != expected:
            raise CheckpointError(
                f"{path}: tensor {name!r} ({dtype} {shape}) spans {end - begin} bytes [{begin}, {end}) "
                f"but needs {expected} (expected {expected} bytes = {numel} x {bits} bits)"
            )
        tensors[name] = HeaderEntry(name, dtype, tuple(shape), begin, end)
    pos = 0
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin != pos:
            what = "gap" if t.begin > pos else "overlap"
            raise CheckpointError(
                f"{path}: data offsets do not tile the data section: {what} before tensor {t.name!r} "
                f"(starts at {t.begin}, previous data ends at {pos})"
            )
        pos = t.end
    if size != 8 + n + pos:
        raise CheckpointError(
            f"{path}: file is {size} bytes but its header describes {8 + n + pos} "
            f"(8 + {n} header + {pos} data): "
            + ("truncated (incomplete download?)" if size < 8 + n + pos else "trailing bytes after the data")
        )
    return SafetensorsHeader(path, n, size, tensors, dict(metadata), hashlib.sha256(raw).hexdigest())
