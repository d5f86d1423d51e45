"""The manifest (`megamoe.json`): schema, version, reading, validating, writing.

The manifest is the only thing the runtime needs to rebuild a layer from a
converted folder, so it is validated strictly on read: a malformed or newer
manifest must fail here, with a message saying what is wrong, rather than as
a shape error deep inside a load. It is written last and atomically by the
converter: a folder without it is incomplete.

Tensor keys. A tensor's in-file name is `{moe_prefix}.megamoe.{role}` (or the
source name for pass-through tensors). With `ep_size > 1` every rank's files
hold a tensor of that same name (each with only that rank's experts), so the
manifest key of an expert tensor is `{name}@rank{r:03d}` when `ep_size > 1`
and the plain name otherwise; `TensorEntry.name` always holds the in-file
name. Use `Manifest.tensor_key` / `Manifest.entry` / `Manifest.tensors_of`
rather than building keys by hand.

Storage. safetensors only holds contiguous tensors. A tensor whose kernel
layout is strided (MN-major scale factors, strides `(P*N, 1, N)`) is stored in
its physical order `[..., P, N]` and `kernel_view` rebuilds the kernel view
with `transpose(-1, -2)`: one `copy_` of the file tensor into the storage the
layer allocated once then gives the kernel bytes (no transform at load).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from ..errors import LayoutError, ManifestError, MegaMoEError
from ..files.folder import inside_folder
from ..files.json_io import parse_json, read_json
from ..files.limits import check_limit
from .formats import LAYOUT_UNRECORDED_ROWS, ROWS, get_row
from .roles import (  # the role table and storage orders (re-exported: the manifest names them)
    EXPERT_ROLES,
    MN_MAJOR_ROLES,
    PASSTHROUGH_ROLE,
    SHARED_ROLES,
    STORAGE_CONTIGUOUS,
    STORAGE_MN_MAJOR,
    STORAGES,
)
from ..files.safetensors_header import DTYPE_BITS, DTYPES

_FORMAT_NAME = "megamoe"
FORMAT_VERSION = 1
MANIFEST_NAME = "megamoe.json"

#: every role a manifest tensor may have
_ROLES = EXPERT_ROLES + SHARED_ROLES + (PASSTHROUGH_ROLE,)

# DTYPES (safetensors name -> torch dtype) and DTYPE_BITS live with the header parser.
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def dtype_from_name(name: str) -> torch.dtype:
    """torch dtype of a safetensors dtype name (ManifestError if unknown)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ManifestError(
            f"unknown safetensors dtype {name!r}; known: {', '.join(sorted(DTYPES))}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    """safetensors dtype name of a torch dtype."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ManifestError(f"dtype {dtype} has no safetensors name") from None


def dtype_itemsize(name: str) -> int:
    """Bytes per element of a safetensors dtype (0.5 is not possible: F4 -> see nbytes_of)."""
    return max(DTYPE_BITS[name] // 8, 1) if name in DTYPE_BITS else dtype_from_name(name).itemsize


def nbytes_of(dtype: str, shape: Iterable[int]) -> int:
    """Data bytes of a tensor of this safetensors dtype and shape."""
    if dtype not in DTYPE_BITS:
        raise ManifestError(f"unknown safetensors dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BITS))}")
    return math.prod(int(s) for s in shape) * DTYPE_BITS[dtype] // 8


# --------------------------------------------------------------------------
# storage order <-> kernel view


def kernel_strides_of(storage: str, kernel_shape: Iterable[int]) -> tuple[int, ...]:
    """Strides of the kernel view of a tensor stored with `storage`."""
    shape = tuple(int(s) for s in kernel_shape)
    if storage == STORAGE_CONTIGUOUS:
        return _contiguous_strides(shape)
    if storage == STORAGE_MN_MAJOR:
        if len(shape) < 2:
            raise LayoutError(f"mn_major_physical needs >= 2 dims, got kernel shape {list(shape)}")
        phys = _contiguous_strides(shape[:-2] + (shape[-1], shape[-2]))
        return phys[:-2] + (phys[-1], phys[-2])
    raise LayoutError(f"unknown storage {storage!r}; valid: {', '.join(STORAGES)}")


def _stored_shape_of(storage: str, kernel_shape: Iterable[int]) -> tuple[int, ...]:
    """Shape of the contiguous file tensor for a kernel shape."""
    shape = tuple(int(s) for s in kernel_shape)
    if storage == STORAGE_MN_MAJOR:
        return shape[:-2] + (shape[-1], shape[-2])
    if storage == STORAGE_CONTIGUOUS:
        return shape
    raise LayoutError(f"unknown storage {storage!r}; valid: {', '.join(STORAGES)}")


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(strides))


def storage_of_role(role: str, row: Any = None) -> str:
    """Storage order of a role of ``row`` (a name or Row; None: a packed-scale row). Decided by role, not by
    inspecting strides: with a size-1 dim (e.g. P = 1 for H = 128) an MN-major view also counts as
    contiguous, and the on-disk order must not depend on that accident. Block scales (fp32, one per
    128x128 block) are plain contiguous tensors (docs/LAYOUT.md#sm90-block-fp8)."""
    if row is not None and get_row(row).weight.block_scaled:
        return STORAGE_CONTIGUOUS
    return STORAGE_MN_MAJOR if role in MN_MAJOR_ROLES else STORAGE_CONTIGUOUS


def to_stored(kernel: torch.Tensor, storage: str | None = None) -> tuple[torch.Tensor, str]:
    """The contiguous tensor to write for a kernel tensor, and its storage order.

    `storage` given (see `storage_of_role`): contiguous tensors are stored as
    they are; an MN-major view is stored as its physical base
    `transpose(-1, -2)`, which must be contiguous. Without `storage`, the
    order is inferred (contiguous first). Any other stride pattern is refused.
    """
    if storage is None:
        storage = STORAGE_CONTIGUOUS if kernel.is_contiguous() else STORAGE_MN_MAJOR
    if storage == STORAGE_CONTIGUOUS and kernel.is_contiguous():
        return kernel, STORAGE_CONTIGUOUS
    if storage == STORAGE_MN_MAJOR and kernel.dim() >= 2:
        phys = kernel.transpose(-1, -2)
        if phys.is_contiguous():
            return phys, STORAGE_MN_MAJOR
    raise LayoutError(
        f"tensor of shape {list(kernel.shape)} strides {list(kernel.stride())} cannot be stored as "
        f"{storage!r} (contiguous, or MN-major: transpose(-1, -2) contiguous)"
    )


def kernel_view(stored: torch.Tensor, entry: "TensorEntry") -> torch.Tensor:
    """View a tensor read from a file in its kernel shape and strides.

    No copy: for `mn_major_physical` this is `stored.transpose(-1, -2)`. The
    result is checked against the manifest's kernel shape and strides, so a
    wrong file tensor fails here with the tensor's name.
    """
    if tuple(stored.shape) != tuple(entry.stored_shape):
        raise LayoutError(
            f"{entry.name}: file tensor has shape {list(stored.shape)}, manifest says "
            f"stored_shape {list(entry.stored_shape)}"
        )
    if stored.dtype != dtype_from_name(entry.dtype):
        raise LayoutError(f"{entry.name}: file tensor has dtype {stored.dtype}, manifest says {entry.dtype}")
    if not stored.is_contiguous():
        raise LayoutError(f"{entry.name}: file tensor must be contiguous (strides {list(stored.stride())})")
    view = stored.transpose(-1, -2) if entry.storage == STORAGE_MN_MAJOR else stored
    if tuple(view.shape) != tuple(entry.kernel_shape) or tuple(view.stride()) != tuple(entry.kernel_strides):
        raise LayoutError(
            f"{entry.name}: kernel view has shape {list(view.shape)} strides {list(view.stride())}, "
            f"manifest says {list(entry.kernel_shape)} strides {list(entry.kernel_strides)}"
        )
    return view


# --------------------------------------------------------------------------
# schema


# records <-> JSON, generated from the dataclass fields
#
# A record's JSON object is its fields in declaration order, each under its name, converted by the codec of
# its annotated type (`_FIELD_CODECS`); reading checks each value's type and names the offending key. So a new
# field is one line in its dataclass (plus any semantic check in `_parse_manifest`), not four places. Field
# metadata: ``json: False`` (not stored; given by the caller when reading), ``key_from: other`` (stored under
# the value of field `other`), ``omit_none: True`` (not written when None; when present, never null). A field
# with a default may be absent when read.


def _same(v: Any) -> Any:
    return v


def _tuple_or_none(v: Any) -> Any:
    return list(v) if v is not None else None


def _read_pair_or_none(d: Any, key: str, where: str) -> tuple[int, int] | None:
    v = _need(d, key, (list, type(None)), where)
    return _int_list(v, f"{where}.{key}", 2) if v is not None else None


_NONE = type(None)

#: annotated field type -> (to JSON, from JSON (object, key, where))
_FIELD_CODECS: dict[str, tuple[Callable[[Any], Any], Callable[[Any, str, str], Any]]] = {
    "str": (_same, lambda d, k, w: _need(d, k, str, w)),
    "str | None": (_same, lambda d, k, w: _need(d, k, (str, _NONE), w)),
    "int": (_same, lambda d, k, w: _need(d, k, int, w)),
    "int | None": (_same, lambda d, k, w: _need(d, k, (int, _NONE), w)),
    "dict": (_same, lambda d, k, w: _need(d, k, dict, w)),
    "tuple": (list, lambda d, k, w: tuple(d[k])),  # free-form records (repairs), not type-checked
    "tuple[int, ...]": (list, lambda d, k, w: _int_list(_need(d, k, list, w), f"{w}.{k}")),
    "tuple[int, int] | None": (_tuple_or_none, _read_pair_or_none),
}


def _codec_type(f) -> str:
    return f.type[: -len(" | None")] if f.metadata.get("omit_none") else f.type


def record_to_json(rec: Any) -> dict:
    """A manifest record (SourceInfo, LayerEntry, TensorEntry) as its JSON object."""
    d = {}
    for f in fields(rec):
        if not f.metadata.get("json", True):
            continue
        v = getattr(rec, f.name)
        if v is None and f.metadata.get("omit_none"):
            continue
        key = getattr(rec, f.metadata["key_from"]) if "key_from" in f.metadata else f.name
        d[key] = _FIELD_CODECS[_codec_type(f)][0](v)
    return d


def record_from_json(cls: type, d: Any, where: str, **given: Any) -> Any:
    """A manifest record from its JSON object, every value type-checked (ManifestError naming `where` and the
    key); `given`: the fields not stored in it (``json: False``)."""
    kw = dict(given)
    for f in fields(cls):
        if f.name in given or not f.metadata.get("json", True):
            continue
        key = kw[f.metadata["key_from"]] if "key_from" in f.metadata else f.name
        has_default = f.default is not MISSING or f.default_factory is not MISSING
        if has_default and isinstance(d, dict) and key not in d:
            continue
        kw[f.name] = _FIELD_CODECS[_codec_type(f)][1](d, key, where)
    return cls(**kw)


@dataclass(frozen=True)
class SourceInfo:
    """Where the converted checkpoint came from (enough to reproduce it)."""

    id: str
    kind: str  # "local" | "hub"
    revision: str | None
    format: str
    content_hash: str | None
    #: the source's quantization recipe and what the kernel does instead (activations: the producer's
    #: recipe, the row's kernel recipe, finer / coarser, the opt-in if any; how a2 was derived).
    #: Informational and optional (absent in manifests written before it), so no format_version bump.
    recipe: dict | None = field(default=None, metadata={"omit_none": True})

    def to_dict(self) -> dict:
        return record_to_json(self)

    @classmethod
    def from_json(cls, d: Any, where: str) -> "SourceInfo":
        return record_from_json(cls, d, where)


# Checksum algorithms and file digest kinds: defined in digests.py (the runtime
# verifies folders too); re-exported here, where the manifest names them.
from ..files.digests import (  # noqa: E402
    ALGORITHMS,
    DIGEST_BLAKE3,
    DIGEST_BLAKE3_HEADER_AND_TENSORS,
    DIGEST_HEADER_AND_TENSORS,
    DIGEST_KINDS,
    DIGEST_SHA256,
    SHA256,
    header_and_tensor_digest,
    is_composite,
    kind_algorithm,
)


@dataclass(frozen=True)
class FileEntry:
    """A file of the output: size and digest (`digest` names the kind of
    `checksum`, see DIGEST_KINDS; a manifest without it means ``sha256``). In
    JSON the value's key is the kind's algorithm (``sha256`` or ``blake3``)."""

    size: int
    checksum: str
    digest: str = DIGEST_SHA256

    @property
    def algorithm(self) -> str:
        return kind_algorithm(self.digest)

    @property
    def sha256(self) -> str:
        """The digest value of a sha256 kind (kept for readers written before blake3)."""
        if self.algorithm != SHA256:
            raise ManifestError(f"file digest is of kind {self.digest!r}, not a sha256 kind")
        return self.checksum

    def to_dict(self) -> dict:
        return {"size": self.size, self.algorithm: self.checksum, "digest": self.digest}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the output. `name` is its name inside `file`."""

    name: str
    layer: int | None
    role: str
    ep_rank: int | None
    experts: tuple[int, int] | None  # global expert ids [lo, hi)
    file: str
    dtype: str
    stored_shape: tuple[int, ...]
    kernel_shape: tuple[int, ...]
    kernel_strides: tuple[int, ...]
    storage: str
    #: the tensor data's digest (hex) of algorithm `checksum_kind`, the manifest's ``checksum``; in JSON under
    #: the algorithm's name (``sha256`` / ``blake3``)
    checksum: str = field(metadata={"key_from": "checksum_kind"})
    #: not stored per tensor: the manifest's ``checksum`` (given when reading)
    checksum_kind: str = field(default=SHA256, metadata={"json": False})

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.stored_shape)

    @property
    def sha256(self) -> str:
        """The checksum of a sha256 manifest (kept for readers written before blake3)."""
        if self.checksum_kind != SHA256:
            raise ManifestError(f"tensor {self.name!r} has a {self.checksum_kind} checksum, not sha256")
        return self.checksum

    def to_dict(self) -> dict:
        return record_to_json(self)

    @classmethod
    def from_json(cls, d: Any, where: str, checksum_kind: str = SHA256) -> "TensorEntry":
        """Parse (types checked, ManifestError naming `where`); the manifest's semantic checks are `_check_tensor`.
        Also what the converter's journal records are read back with."""
        return record_from_json(cls, d, where, checksum_kind=checksum_kind)


@dataclass(frozen=True)
class LayerEntry:
    """One MoE layer: its spec (LayerSpec.to_dict with ep_rank 0), the scalars
    computed over all experts (e.g. `l2_activation_scale`), the shared-expert
    status and any explicit repairs the converter made (scale requantization)."""

    index: int
    prefix: str
    spec: dict
    scalars: dict
    shared: dict
    repairs: tuple = ()

    def layer_spec(self, ep_rank: int = 0, ep_size: int | None = None):
        """The LayerSpec of this layer for one EP rank."""
        from .formats import LayerSpec

        d = dict(self.spec)
        d["ep_rank"] = ep_rank
        if ep_size is not None:
            d["ep_size"] = ep_size
        return LayerSpec.from_dict(d)

    def to_dict(self) -> dict:
        return record_to_json(self)

    @classmethod
    def from_json(cls, d: Any, where: str) -> "LayerEntry":
        return record_from_json(cls, d, where)


def _check_codecs(*records: type) -> None:
    """A field whose type has no JSON codec fails at import, not when the first manifest is written."""
    for cls in records:
        for f in fields(cls):
            if f.metadata.get("json", True) and _codec_type(f) not in _FIELD_CODECS:
                raise TypeError(f"{cls.__name__}.{f.name}: no manifest JSON codec for type {f.type!r}; "
                                f"add one to _FIELD_CODECS ({', '.join(_FIELD_CODECS)})")


_check_codecs(SourceInfo, TensorEntry, LayerEntry)


@dataclass
class Manifest:
    converter_version: str
    source: SourceInfo
    row: str
    ep_size: int
    layers: list[LayerEntry]
    tensors: dict[str, TensorEntry]
    files: dict[str, FileEntry]
    model: dict = field(default_factory=dict)  # checkpoint-level facts (activation, routing...)
    format_version: int = FORMAT_VERSION
    #: the tensors' checksum algorithm (``sha256`` | ``blake3``); JSON key ``checksum``, written only when not sha256
    checksum: str = SHA256
    #: the manifest's digest of itself as read (None for one built in memory): the folder's identity
    self_digest: str | None = field(default=None, compare=False)
    #: the DeepGEMM layout flavour the folder's bytes are in (`Row.layout`) as the file says it; None in a
    #: manifest written before the key, of a row that was then only written in one (`layout_flavour`)
    layout: str | None = None

    @property
    def layout_flavour(self) -> str:
        """The folder's DeepGEMM layout flavour (docs/LAYOUT.md#layout-flavours): ``layout``, or for a manifest
        written before the key the row's layout, the one it was written in."""
        return self.layout if self.layout is not None else ROWS[self.row].layout

    # ---- lookups
    def tensor_key(self, name: str, ep_rank: int | None) -> str:
        """Manifest key of the tensor `name` of rank `ep_rank` (see module doc)."""
        return tensor_key(name, ep_rank, self.ep_size)

    def entry(self, name: str, ep_rank: int | None = None) -> TensorEntry:
        key = self.tensor_key(name, ep_rank)
        try:
            return self.tensors[key]
        except KeyError:
            raise ManifestError(f"manifest has no tensor {key!r}") from None

    def tensors_of(self, layer: int, ep_rank: int = 0) -> dict[str, TensorEntry]:
        """Expert (and shared) tensors of one layer for one rank, keyed by role.
        Shared-expert tensors are replicated: every rank's set holds them."""
        return {t.role: t for t in self.tensors.values() if t.layer == layer and t.ep_rank == ep_rank}

    def layer(self, index: int) -> LayerEntry:
        if isinstance(index, bool) or not hasattr(index, "__index__"):  # True == 1 would pick layer 1
            raise ManifestError(f"a MoE layer index is an int, got {index!r} ({type(index).__name__}); layers: "
                                f"{[le.index for le in self.layers]}")
        index = index.__index__()
        for le in self.layers:
            if le.index == index:
                return le
        raise ManifestError(f"manifest has no MoE layer {index}; layers: {[le.index for le in self.layers]}")

    def files_of_rank(self, ep_rank: int) -> list[str]:
        """Files a rank needs: its own expert shards plus every non-expert file."""
        return sorted({t.file for t in self.tensors.values() if t.ep_rank in (None, ep_rank)})

    # ---- (de)serialisation
    def to_dict(self) -> dict:
        d = {
            "format": _FORMAT_NAME,
            "format_version": self.format_version,
            "converter_version": self.converter_version,
            "source": self.source.to_dict(),
            "row": self.row,
            "ep_size": self.ep_size,
        }
        if self.layout is not None:
            d["layout"] = self.layout
        if self.checksum != SHA256:  # absent means sha256: sha256 manifests read (and hash) as before
            d["checksum"] = self.checksum
        d.update({
            "model": self.model,
            "layers": [le.to_dict() for le in sorted(self.layers, key=lambda le: le.index)],
            "tensors": {k: self.tensors[k].to_dict() for k in sorted(self.tensors)},
            "files": {k: self.files[k].to_dict() for k in sorted(self.files)},
        })
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = MANIFEST_NAME) -> "Manifest":
        return _parse_manifest(d, where)


def expert_range_problem(role: str, entries: Iterable["TensorEntry"], lo: int, hi: int) -> str | None:
    """The one rule for the tensors of one expert role that one stored rank holds, whose experts are
    ``[lo, hi)``: their expert ranges (an entry without one covers the whole rank) tile ``[lo, hi)``
    exactly once, and each entry holds as many experts (its kernel shape's first dim) as its range says.
    None when they do; else what is wrong. `verify` and every load (`Checkpoint.plan`, strict) apply this,
    so a manifest one refuses the others refuse too (a range widened to ``[0, 9)`` on 8 experts failed
    verify while the loaders read the first 8 and served them)."""
    entries = list(entries)
    ranges = sorted((tuple(te.experts) if te.experts is not None else (lo, hi), te.name) for te in entries)
    names = ", ".join(n for _, n in ranges)
    pos = lo
    for (a, b), name in ranges:
        if b <= a or a < lo or b > hi:
            return (f"{role} {name} holds experts [{a}, {b}), which is not inside the rank's experts [{lo}, {hi}) "
                    "(each exactly once)")
        if a < pos:
            return f"{role} for experts [{a}, {min(b, pos)}) is stored more than once ({names})"
        if a > pos:
            return f"no {role} for experts [{pos}, {a}) (the rank's experts are [{lo}, {hi}))"
        pos = b
    if pos != hi:
        return f"no {role} for experts [{pos}, {hi}) (the rank's experts are [{lo}, {hi}))"
    for te in entries:
        a, b = te.experts if te.experts is not None else (lo, hi)
        if te.kernel_shape and te.kernel_shape[0] != b - a:
            return f"{role} {te.name} holds {te.kernel_shape[0]} experts but its range [{a}, {b}) says {b - a}"
    return None


def tensor_key(name: str, ep_rank: int | None, ep_size: int) -> str:
    if ep_rank is None or ep_size == 1:
        return name
    return f"{name}@rank{ep_rank:03d}"


#: key of the manifest's digest of itself (sha256 of its canonical JSON without this key)
SELF_DIGEST_KEY = "manifest_sha256"


def _self_digest(d: dict) -> str:
    body = {k: v for k, v in d.items() if k != SELF_DIGEST_KEY}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(canon.encode()).hexdigest()


def manifest_bytes(m: Manifest) -> bytes:
    """Deterministic JSON (sorted tensor and file keys, no timestamps), so the
    same conversion gives the same bytes. It ends with a digest of itself:
    the shards are checked against the manifest, and this checks the
    manifest (a flipped digit in a scale or a checksum is caught)."""
    d = m.to_dict()
    d[SELF_DIGEST_KEY] = _self_digest(d)
    return (json.dumps(d, indent=1, ensure_ascii=True, allow_nan=False) + "\n").encode()


def with_self_digest(d: dict) -> dict:
    """``d`` (a manifest as JSON data) with its self-digest set to match its content."""
    return {**{k: v for k, v in d.items() if k != SELF_DIGEST_KEY}, SELF_DIGEST_KEY: _self_digest(d)}


def _check_self_digest(d: dict, where: str) -> str:
    """The manifest's own digest; ManifestError if it is absent or does not match. Mandatory for every
    format_version this code reads (1): every converter that writes version 1 writes it, so a manifest without
    it was edited by hand (e.g. to change a scale) and is refused rather than served unchecked."""
    want = d.get(SELF_DIGEST_KEY)
    if want is None:
        raise ManifestError(
            f"{where}: no {SELF_DIGEST_KEY}: every megamoe.json of format_version {FORMAT_VERSION} carries a digest "
            "of itself, so this one was edited or written by hand; re-run the conversion (an edited manifest "
            "cannot be trusted to describe the files)")
    got = _self_digest(d)
    if want != got:
        raise ManifestError(
            f"{where}: {SELF_DIGEST_KEY} is {want!r} but the manifest's content hashes to {got!r}: "
            f"{MANIFEST_NAME} was modified or corrupted after it was written; re-run the conversion "
            "(or `megamoe-convert verify` to see what else changed)")
    return got


def write_manifest(directory: str | os.PathLike, m: Manifest) -> Path:
    """Validate `m` and write `directory/megamoe.json` atomically (temp file,
    fsync, rename), so a reader never sees half a manifest."""
    data = manifest_bytes(m)
    _parse_manifest(parse_json(data, "manifest to write", error=ManifestError), "manifest to write")  # refuse to write what we cannot read
    directory = Path(directory)
    tmp = directory / f".{MANIFEST_NAME}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # mode honours the umask
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / MANIFEST_NAME)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return directory / MANIFEST_NAME


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """Read and validate `directory/megamoe.json`.

    ManifestError if it is missing (the folder is not a finished megamoe
    output), not JSON, of a newer format version, or malformed.
    """
    path = Path(directory) / MANIFEST_NAME
    if not Path(directory).is_dir():
        what = "does not exist" if not os.path.lexists(directory) else "is not a folder"
        raise ManifestError(f"{directory} {what}: a megamoe output is the folder `megamoe-convert convert SRC "
                            f"OUT` writes (OUT)")
    if not path.is_file():
        raise ManifestError(
            f"{path}: no {MANIFEST_NAME}; {directory} is not a finished megamoe output "
            "(the manifest is written last: an interrupted conversion has none)"
        )
    inside_folder(directory, MANIFEST_NAME, ManifestError)
    d = read_json(path, error=ManifestError, expect=None)
    m = _parse_manifest(d, str(path))
    m.self_digest = _check_self_digest(d, str(path))
    return m


# --------------------------------------------------------------------------
# validation


def _need(d: Any, key: str, types, where: str):
    if not isinstance(d, dict) or key not in d:
        raise ManifestError(f"{where}: missing key {key!r}")
    v = d[key]
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in _as_tuple(types)):
        raise ManifestError(f"{where}.{key}: expected {_type_names(types)}, got {type(v).__name__} {v!r:.80}")
    return v


def _as_tuple(types) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def _type_names(types) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in _as_tuple(types))


def _int_list(v: Any, where: str, n: int | None = None) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise ManifestError(f"{where}: expected a list of non-negative ints, got {v!r:.80}")
    if n is not None and len(v) != n:
        raise ManifestError(f"{where}: expected {n} ints, got {len(v)}")
    return tuple(v)


def _check_layout(d: dict, row: str, where: str) -> str | None:
    """The manifest's ``layout``: exactly the row's layout flavour (`Row.layout`). Absent, it reads as that
    flavour for the rows written before the key (`LAYOUT_UNRECORDED_ROWS`); a flavour this megamoe does not
    read for the row (another DeepGEMM layout, or a newer version of megamoe's) is refused naming both."""
    layout = _need(d, "layout", str, where) if "layout" in d else None
    want = ROWS[row].layout if row in ROWS else layout
    if layout is None and row in LAYOUT_UNRECORDED_ROWS:
        return None
    if layout != want:
        raise ManifestError(
            f"{where}.layout: the folder holds row {row!r} in layout {layout!r}, but this megamoe reads that row "
            f"only in layout {want!r}; convert the source again with this megamoe (or install the megamoe that "
            f"wrote it)")
    return layout


def _parse_manifest(d: Any, where: str) -> Manifest:
    if not isinstance(d, dict):
        raise ManifestError(f"{where}: expected a JSON object, got {type(d).__name__}")
    fmt = d.get("format")
    if fmt != _FORMAT_NAME:
        raise ManifestError(f"{where}: 'format' is {fmt!r}, expected {_FORMAT_NAME!r}")
    version = _need(d, "format_version", int, where)
    if version > FORMAT_VERSION:
        raise ManifestError(
            f"{where}: format_version {version} was written by a newer megamoe; this version reads "
            f"format_version <= {FORMAT_VERSION}. Upgrade megamoe (pip install -U megamoe) to load it."
        )
    if version < 1:
        raise ManifestError(f"{where}: format_version {version} is not valid (versions start at 1)")
    converter_version = _need(d, "converter_version", str, where)
    src = _need(d, "source", dict, where)
    source = SourceInfo.from_json(src, f"{where}.source")
    if source.kind not in ("local", "hub"):
        raise ManifestError(f"{where}.source.kind: {source.kind!r}, expected 'local' or 'hub'")
    row = _need(d, "row", str, where)
    layout = _check_layout(d, row, where)
    ep_size = _need(d, "ep_size", int, where)
    if ep_size < 1:
        raise ManifestError(f"{where}.ep_size: {ep_size}, must be >= 1")
    check_limit("num_experts", ep_size, f"{where}.ep_size", ManifestError)
    model = d.get("model", {})
    if not isinstance(model, dict):
        raise ManifestError(f"{where}.model: expected an object")
    checksum = d.get("checksum", SHA256)
    if checksum not in ALGORITHMS:
        raise ManifestError(
            f"{where}.checksum: unknown checksum algorithm {checksum!r}; this megamoe knows {', '.join(ALGORITHMS)} "
            "(a newer megamoe may have written it: upgrade to verify or load this folder)")

    files: dict[str, FileEntry] = {}
    for name, fe in _need(d, "files", dict, where).items():
        w = f"{where}.files[{name!r}]"
        if "/" in name or "\\" in name or name.startswith(".") or name == MANIFEST_NAME:
            raise ManifestError(f"{w}: file names must be plain names inside the folder")
        size = _need(fe, "size", int, w)
        kind = fe.get("digest", DIGEST_SHA256)
        if kind not in DIGEST_KINDS:
            raise ManifestError(
                f"{w}.digest: unknown digest kind {kind!r}; this megamoe knows {', '.join(DIGEST_KINDS)} "
                "(a newer megamoe may have written it: upgrade to verify or load this folder)")
        alg = kind_algorithm(kind)
        sha = _need(fe, alg, str, w)
        if size < 0 or not _HEX64.match(sha):
            raise ManifestError(f"{w}: size must be >= 0 and {alg} 64 lowercase hex digits, got {size}, {sha!r}")
        if is_composite(kind) and not name.endswith(".safetensors"):
            raise ManifestError(f"{w}.digest: {kind!r} applies to safetensors files only")
        if is_composite(kind) and alg != checksum:  # it is composed from the tensor checksums
            raise ManifestError(f"{w}.digest: {kind!r} is composed from {alg} tensor digests, but the manifest's "
                                f"checksum is {checksum!r}")
        files[name] = FileEntry(size, sha, kind)

    layers: list[LayerEntry] = []
    seen_layers = set()
    layer_list = _need(d, "layers", list, where)
    check_limit("num_layers", len(layer_list), f"{where}.layers", ManifestError)
    for i, le in enumerate(layer_list):
        w = f"{where}.layers[{i}]"
        index = _need(le, "index", int, w)
        if index in seen_layers:
            raise ManifestError(f"{w}: duplicate layer index {index}")
        seen_layers.add(index)
        _need(le, "spec", dict, w)  # checked before the other keys, as it always was
        entry = LayerEntry.from_json(le, w)
        for k, v in entry.scalars.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ManifestError(f"{w}.scalars.{k}: expected a finite number, got {v!r}")
        try:
            ls = entry.layer_spec(0, ep_size)
        except MegaMoEError as e:
            raise ManifestError(f"{w}.spec: {e}") from None
        if ls.row != row:
            raise ManifestError(f"{w}.spec.row is {ls.row!r} but the manifest row is {row!r}")
        layers.append(entry)

    tensors: dict[str, TensorEntry] = {}
    for key, te in _need(d, "tensors", dict, where).items():
        w = f"{where}.tensors[{key!r}]"
        _need(te, "experts", (list, type(None)), w)  # checked before the other keys, as it always was
        t = TensorEntry.from_json(te, w, checksum_kind=checksum)
        _check_tensor(t, key, w, ep_size, files, seen_layers)
        tensors[key] = t

    return Manifest(converter_version=converter_version, source=source, row=row, ep_size=ep_size,
                    layers=layers, tensors=tensors, files=files, model=model, format_version=version, layout=layout,
                    checksum=checksum)


def _check_tensor(t: TensorEntry, key: str, w: str, ep_size: int, files: dict, layers: set) -> None:
    if t.role not in _ROLES:
        raise ManifestError(f"{w}.role: {t.role!r}, valid: {', '.join(_ROLES)}")
    if t.dtype not in DTYPE_BITS:
        raise ManifestError(f"{w}.dtype: {t.dtype!r}, valid: {', '.join(sorted(DTYPE_BITS))}")
    if t.storage not in STORAGES:
        raise ManifestError(f"{w}.storage: {t.storage!r}, valid: {', '.join(STORAGES)}")
    if t.file not in files:
        raise ManifestError(f"{w}.file: {t.file!r} is not listed in 'files'")
    if not _HEX64.match(t.checksum):
        raise ManifestError(f"{w}.{t.checksum_kind}: expected 64 lowercase hex digits, got {t.checksum!r}")
    if key != tensor_key(t.name, t.ep_rank, ep_size):
        raise ManifestError(f"{w}: key does not match name {t.name!r} and ep_rank {t.ep_rank}")
    if t.role == PASSTHROUGH_ROLE:
        if t.layer is not None or t.ep_rank is not None or t.experts is not None:
            raise ManifestError(f"{w}: pass-through tensors have no layer, ep_rank or experts")
    else:
        if t.layer not in layers:
            raise ManifestError(f"{w}.layer: {t.layer} is not one of the manifest's layers {sorted(layers)}")
        if t.ep_rank is None or not 0 <= t.ep_rank < ep_size:
            raise ManifestError(f"{w}.ep_rank: {t.ep_rank}, must be in [0, {ep_size})")
        if t.experts is not None and not t.experts[0] <= t.experts[1]:
            raise ManifestError(f"{w}.experts: {list(t.experts)} is not a range [lo, hi)")
        if t.experts is not None:
            check_limit("num_experts", t.experts[1], f"{w}.experts", ManifestError)
    if len(t.kernel_shape) != len(t.kernel_strides):
        raise ManifestError(f"{w}: kernel_shape and kernel_strides differ in length")
    try:
        want_stored = _stored_shape_of(t.storage, t.kernel_shape)
        want_strides = kernel_strides_of(t.storage, t.kernel_shape)
    except LayoutError as e:
        raise ManifestError(f"{w}: {e}") from None
    if want_stored != t.stored_shape:
        raise ManifestError(
            f"{w}: stored_shape {list(t.stored_shape)} does not match kernel_shape {list(t.kernel_shape)} "
            f"under storage {t.storage!r} (expected {list(want_stored)})")
    if want_strides != t.kernel_strides:
        raise ManifestError(
            f"{w}: kernel_strides {list(t.kernel_strides)} do not match storage {t.storage!r} "
            f"(expected {list(want_strides)})")
