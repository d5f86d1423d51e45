"""Checkpoint sources: a local folder or a Hugging Face hub repo, read lazily.

``open_source(src, revision)`` resolves ``src`` to a folder (a hub id goes
through ``huggingface_hub.snapshot_download``, which honours the cache and
``HF_HUB_OFFLINE``), validates every safetensors header *before* any tensor is
read (docs/CHECKPOINTS.md#safetensors), and returns a :class:`CheckpointSource` that
hands out tensors one at a time through ``safe_open`` handles kept open for
the life of the source. Nothing is loaded eagerly, so memory stays bounded by
what the caller holds (about one MoE layer's experts for the converter).

Why validate headers ourselves: a truncated download or a garbage file makes
``safe_open`` fail with a message that does not name the file, or (worse)
only when the damaged tensor is finally read, after output has been written.
Checking the header tiling and the file length up front catches both at open
time with an error naming the file.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import struct
from pathlib import Path
from typing import Any

import torch

from megamoe_runtime.errors import CheckpointError
from megamoe_runtime.files.json_io import read_json
from megamoe_runtime.files.safetensors_header import (
    HEADER_DTYPE_BITS,
    HeaderEntry,
    SafetensorsHeader,
    parse_safetensors_header,
)
from megamoe_runtime.files.tensor_bytes import byte_view

_INDEX_NAME = "model.safetensors.index.json"


def _check_regular(path: Path, why: str) -> None:
    """Refuse a weight file that is not a regular file (a FIFO, a device, a socket, a folder), saying what
    it is, without opening it: opening a FIFO for reading blocks until a writer comes. Without this a FIFO
    named ``model.safetensors`` read as "no *.safetensors files", and one an index names as "missing"."""
    import stat as stat_mod

    from megamoe_runtime.files.safetensors_header import file_kind

    mode = path.stat().st_mode
    if not stat_mod.S_ISREG(mode):
        raise CheckpointError(f"{path} {file_kind(mode)}, not a regular file ({why}); replace it with the "
                              "safetensors file itself")

#: what a hub snapshot needs for conversion besides the weights: configs, tokenizer files
_HUB_META_PATTERNS = [
    "*.json",
    "tokenizer*",
    "*.model",
    "*.txt",
    "*.tiktoken",
    "*.jinja",
    "*.py",
]
#: everything a hub snapshot needs (the weights are narrowed to the index's shards when there is one)
HUB_ALLOW_PATTERNS = ["*.safetensors", *_HUB_META_PATTERNS]
#: sub-folders of some repos holding a second copy of the weights
_HUB_IGNORE_PATTERNS = ["original/*", "metal/*", "*/original/*"]

#: files never copied as "extra" files (weights, indexes, our own outputs)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx")
_NOT_EXTRA = {_INDEX_NAME, "megamoe.json", "pytorch_model.bin.index.json"}

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_TRUTHY = {"1", "ON", "YES", "TRUE"}


def read_safetensors_header(path: str | Path) -> SafetensorsHeader:
    """Read and validate one safetensors header; CheckpointError naming the file
    on any defect (truncation, oversize or non-JSON header, duplicate keys, bad
    dtype or shape, gaps or overlaps in the data offsets, size mismatch). The
    rules are the runtime's (:mod:`megamoe_runtime.files.safetensors_header`)."""
    return parse_safetensors_header(path)


class CheckpointSource:
    """A validated checkpoint folder with lazy, per-tensor access.

    Attributes: ``root`` (folder), ``id`` (hub repo id or the folder path),
    ``kind`` (``"local" | "hub"``), ``revision`` (requested revision for hub
    sources; None for local), ``commit`` (resolved snapshot hash for hub
    sources when known), ``config`` (config.json, ``{}`` when absent),
    ``quant_config`` (hf_quant_config.json, else config.json's
    ``quantization_config``, else None).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        id: str | None = None,
        kind: str = "local",
        revision: str | None = None,
        commit: str | None = None,
    ) -> None:
        self.root = Path(root)
        self.id = id or str(self.root)
        self.kind = kind
        self.revision = revision
        self.commit = commit
        if not self.root.is_dir():
            raise CheckpointError(f"{self.id}: {self.root} is not a folder")
        #: every file the source reads must resolve inside this folder (see `containment_base`)
        self.base = containment_base(self.root)
        #: things the caller should tell the user (e.g. an extra file skipped for lying outside the source)
        self.warnings: list[str] = []
        self.config: dict[str, Any] = self._read_json("config.json") or {}
        hf_quant = self._read_json("hf_quant_config.json")
        self.hf_quant_config: dict[str, Any] | None = hf_quant
        cfg_quant = self.config.get("quantization_config")
        self.config_quant_config: dict[str, Any] | None = cfg_quant if isinstance(cfg_quant, dict) else None
        self.quant_config: dict[str, Any] | None = hf_quant if hf_quant is not None else self.config_quant_config
        self._handles: dict[Path, int] = {}
        self._headers: dict[Path, SafetensorsHeader] = {}
        self._weight_map: dict[str, Path] = {}
        self._index_files()
        #: name -> its header entry, filled on first use: the conversion asks for a few headers per expert
        #: read, and each two-level lookup compared `Path` keys (36 000 ``PurePath.__eq__`` calls on a
        #: 1 GiB source; the headers do not change after `_index_files`)
        self._tensor_headers: dict[str, HeaderEntry] = {}

    # -- opening / validation ---------------------------------------------------
    def _read_json(self, name: str) -> dict[str, Any] | None:
        p = self.root / name
        if not p.is_file():
            return None
        return read_json(p, error=CheckpointError)

    def _index_files(self) -> None:
        index = self._read_json(_INDEX_NAME)
        if index is not None:
            wm = index.get("weight_map")
            if not isinstance(wm, dict) or not wm:
                raise CheckpointError(f"{self.root / _INDEX_NAME}: no 'weight_map' (tensor -> file) in the index")
            check_shard_names(list(wm.values()), str(self.root / _INDEX_NAME))
            files = sorted(set(wm.values()))
            missing = [f for f in files if not (self.root / f).exists()]
            if missing:
                raise CheckpointError(
                    f"{self.root / _INDEX_NAME} names shard(s) missing from {self.root}: {missing}"
                    + (" (incomplete download?)" if self.kind == "hub" else "")
                )
            paths = {f: self.root / f for f in files}  # one Path per shard, not one per tensor (thousands)
            for path in paths.values():
                _check_regular(path, f"{self.root / _INDEX_NAME} names it")
            for f, path in paths.items():
                self._check_inside(path)
                self._headers[path] = read_safetensors_header(path)
            tensors_of = {f: self._headers[path].tensors for f, path in paths.items()}
            for name, f in wm.items():
                path = paths[f]
                if name not in tensors_of[f]:
                    raise CheckpointError(
                        f"{self.root / _INDEX_NAME} maps tensor {name!r} to {path.name}, but {path} has no such tensor"
                    )
                self._weight_map[name] = path
            for path, fh in self._headers.items():
                extra = sorted(set(fh.tensors) - set(wm))
                if extra:
                    raise CheckpointError(
                        f"{path} holds tensor(s) the index {_INDEX_NAME} does not list: {extra[:5]}"
                        + (f" ... ({len(extra) - 5} more)" if len(extra) > 5 else "")
                    )
            return
        found = sorted(self.root.glob("*.safetensors"))
        for p in found:
            if p.exists():  # a dangling link is no file: skipped, as before
                _check_regular(p, "the source's weights are its *.safetensors files")
        files = [p for p in found if p.is_file()]
        if not files:
            raise CheckpointError(
                f"{self.id}: no *.safetensors files and no {_INDEX_NAME} in {self.root}"
                + (" (the snapshot may be incomplete)" if self.kind == "hub" else "")
            )
        for path in files:
            self._check_inside(path)
            fh = read_safetensors_header(path)
            self._headers[path] = fh
            for name in fh.tensors:
                if name in self._weight_map:
                    raise CheckpointError(
                        f"tensor {name!r} is in both {self._weight_map[name].name} and {path.name} and there is no "
                        f"{_INDEX_NAME} saying which to use"
                    )
                self._weight_map[name] = path

    def _inside(self, path: Path) -> bool:
        real = Path(os.path.realpath(path))
        return real == self.base or self.base in real.parents

    def _check_inside(self, path: Path) -> None:
        """A weight file must resolve inside the source (`containment_base`): a
        symlink to a file elsewhere is refused, for local sources as for hub ones."""
        if not self._inside(path):
            raise CheckpointError(
                f"{path} resolves to {os.path.realpath(path)}, outside the source folder {self.base}; weight files "
                "must lie inside the checkpoint folder (copy the file in instead of linking to it)")

    def roots(self) -> list[Path]:
        """The folders this source reads from (resolved): its root and, for a
        hub-cache snapshot, the repo's cache folder (its blobs)."""
        root = Path(os.path.realpath(self.root))
        return [root] if self.base == root else [root, self.base]

    # -- lookups ------------------------------------------------------------------
    def files(self) -> list[Path]:
        """The weight files, sorted."""
        return sorted(self._headers)

    def file_header(self, path: str | Path) -> SafetensorsHeader:
        return self._headers[Path(path)]

    def tensor_names(self) -> list[str]:
        return sorted(self._weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self._weight_map

    def file_of(self, name: str) -> Path:
        try:
            return self._weight_map[name]
        except KeyError:
            raise CheckpointError(f"{self.id}: no tensor {name!r} in the checkpoint") from None

    def tensor_header(self, name: str) -> HeaderEntry:
        th = self._tensor_headers.get(name)
        if th is None:
            th = self._tensor_headers[name] = self._headers[self.file_of(name)].tensors[name]
        return th

    def header(self, name: str) -> tuple[str, tuple[int, ...]]:
        """``(safetensors dtype string, shape)`` from the header, no data read."""
        t = self.tensor_header(name)
        return t.dtype, t.shape

    def nbytes(self, name: str) -> int:
        return self.tensor_header(name).nbytes

    def _fd(self, path: Path) -> int:
        fd = self._handles.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            except OSError as e:
                raise CheckpointError(f"{path}: cannot open: {e}") from e
            # reader threads (stream.read_threads) may race here: keep the first descriptor, close ours
            kept = self._handles.setdefault(path, fd)
            if kept != fd:
                os.close(fd)
            fd = kept
        return fd

    def _read_bytes(self, path: Path, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` at data offset ``offset`` of ``path`` with positional reads
        (no mmap: pages read once are not kept mapped, so RSS stays bounded by
        what the caller holds), into a fresh uint8 tensor (``torch.empty``: not
        zero-filled first, unlike a bytearray; every byte is read into)."""
        fh = self._headers[path]
        buf = torch.empty(nbytes, dtype=torch.uint8)
        view = byte_view(buf)
        fd = self._fd(path)
        pos = 8 + fh.header_len + offset
        got = 0
        while got < nbytes:
            n = os.preadv(fd, [view[got:]], pos + got) if hasattr(os, "preadv") else _pread_into(fd, view[got:], pos + got)
            if n <= 0:
                raise CheckpointError(
                    f"{path}: unexpected end of file reading {nbytes} bytes at {pos} (file changed since it was opened?)"
                )
            got += n
        return buf

    def tensor_data_range(self, name: str) -> tuple[Path, int, int]:
        """``(file, absolute byte offset, nbytes)`` of a tensor's data: where
        `read_into` reads it from."""
        th = self.tensor_header(name)
        path = self.file_of(name)
        return path, 8 + self._headers[path].header_len + th.begin, th.nbytes

    def read_into(self, path: Path, pos: int, views: list[memoryview]) -> None:
        """Scatter-read consecutive bytes at absolute offset ``pos`` of ``path``
        straight into ``views`` (in order; e.g. row groups of a kernel buffer):
        ``os.preadv`` with one iovec per view, at most IOV_MAX per call, short
        reads resumed. No temporary buffer and no copy after the read."""
        fd = self._fd(path)
        total = sum(map(len, views))
        i, got = 0, 0
        while got < total:
            batch = views[i:i + _IOV_MAX]
            n = os.preadv(fd, batch, pos + got) if hasattr(os, "preadv") else _pread_into(fd, batch[0], pos + got)
            if n <= 0:
                raise CheckpointError(
                    f"{path}: unexpected end of file reading {total} bytes at {pos} (file changed since it was opened?)"
                )
            got += n
            if got == total:  # the usual case: one call filled every view (no per-view bookkeeping)
                return
            while i < len(views) and n >= len(views[i]):  # drop the views filled by this read
                n -= len(views[i])
                i += 1
            if n:  # a short read ended inside views[i]
                views = views[:i] + [views[i][n:]] + views[i + 1:]

    def meta_tensor(self, name: str) -> torch.Tensor:
        """A meta tensor with the dtype and shape `get_tensor` would return (no data read)."""
        t = self.tensor_header(name)
        return torch.empty(t.shape, dtype=self._torch_dtype(name), device="meta")

    def _torch_dtype(self, name: str) -> torch.dtype:
        t = self.tensor_header(name)
        dt = t.torch_dtype
        if dt is None:
            raise CheckpointError(
                f"{self.file_of(name)}: tensor {name!r} has dtype {t.dtype}, which this reader cannot represent"
            )
        return dt

    def get_slice(self, name: str) -> "LazySlice":
        """Lazy view: ``get_shape()``, ``get_dtype()`` and ``[...]``, which reads
        only the rows of the first dimension it selects."""
        return LazySlice(self, name)

    #: stored dtype -> (bytes of one element, struct format after `_first_value_bytes`): the dtypes whose
    #: first element `first_value` decodes without torch, bit for bit as ``.float()`` then ``float()``
    _FIRST_VALUE_FORMATS = {"F32": (4, "<f"), "F16": (2, "<e"), "BF16": (2, "<f")}

    def first_value(self, name: str) -> float:
        """``float(get_tensor(name).float().reshape(-1)[0])``, the way readers take
        a scalar scale. For F32, F16 and BF16 (exact in fp32 and in a Python
        float) one small positional read and a ``struct`` decode, without a
        tensor: the preflight reads a few such scalars per expert (1 920 per GiB
        of a ModelOpt export), and a tensor per scalar made them a third of the
        time before the first byte is written. Any other dtype, an empty tensor
        or a short read takes `get_tensor` (and its errors)."""
        th = self.tensor_header(name)
        fmt = self._FIRST_VALUE_FORMATS.get(th.dtype)
        if fmt is not None and th.nbytes >= fmt[0]:
            path = self.file_of(name)
            size = fmt[0]
            b = os.pread(self._fd(path), size, 8 + self._headers[path].header_len + th.begin)
            if len(b) == size:
                if th.dtype == "BF16":  # the upper half of an fp32
                    b = b"\0\0" + b
                return struct.unpack(fmt[1], b)[0]
        return float(self.get_tensor(name).float().reshape(-1)[0])

    def get_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor, read from disk now (a fresh CPU tensor)."""
        t = self.tensor_header(name)
        return self._read_rows(name, 0, t.shape[0] if t.shape else 1)

    def _read_rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        th = self.tensor_header(name)
        dtype = self._torch_dtype(name)
        path = self.file_of(name)
        shape = th.shape
        if not shape:
            row_bytes, rows_shape = th.nbytes, ()
        else:
            inner = math.prod(shape[1:])
            row_bytes = inner * HEADER_DTYPE_BITS[th.dtype] // 8
            rows_shape = (hi - lo, *shape[1:])
        nbytes = row_bytes * (hi - lo) if shape else th.nbytes
        if nbytes == 0:
            return torch.empty(rows_shape, dtype=dtype)
        buf = self._read_bytes(path, th.begin + (row_bytes * lo if shape else 0), nbytes)
        return buf.view(dtype).reshape(rows_shape)

    # -- identity and pass-through ---------------------------------------------------
    def content_hash(self, full: bool = False) -> str:
        """A sha256 identifying the checkpoint's content.

        Per weight file: the LFS sha256 when the file is a hub-cache blob
        (blob names *are* the content's sha256, free to read), else with
        ``full=True`` the sha256 of all bytes, else (default, cheap: 16 reads
        of 4 KiB per file) the sha256 of the header, the size and 16 evenly
        spaced data samples, which catches any re-export or re-quantization
        but not a single edited byte between samples (use ``full=True``).
        Config and other extra files are hashed by content. Deterministic
        across runs and copies.
        """
        h = hashlib.sha256()
        for path in self.files():
            h.update(path.name.encode() + b"\0")
            h.update(_file_digest(path, full, self._headers[path]).encode() + b"\0")
        for path in self.extra_files():
            h.update(str(path.relative_to(self.root)).encode() + b"\0")
            h.update(_sha256_file(path).encode() + b"\0")
        return h.hexdigest()

    def extra_files(self) -> list[Path]:
        """Top-level files to copy next to the converted weights: configs,
        tokenizer, generation config, chat templates, custom code. Excludes
        weight files of any format, weight indexes and hidden files."""
        out = []
        for p in sorted(self.root.iterdir()):
            if not p.is_file() or p.name.startswith("."):
                continue
            if p.name in _NOT_EXTRA or p.name.endswith(_WEIGHT_SUFFIXES):
                continue
            if not self._inside(p):
                # skipped, not refused: a tokenizer or README linked from elsewhere is not needed to
                # convert, and copying it would put bytes from outside the source into OUT
                msg = (f"{p.name} is a symlink to {os.path.realpath(p)}, outside the source folder {self.base}: "
                       "not copied into the output (copy the file into the source to include it)")
                if msg not in self.warnings:
                    self.warnings.append(msg)
                continue
            out.append(p)
        return out

    def close(self) -> None:
        for fd in self._handles.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._handles.clear()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> "CheckpointSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"<CheckpointSource {self.kind} {self.id}{rev} files={len(self._headers)} tensors={len(self._weight_map)}>"


class LazySlice:
    """What ``CheckpointSource.get_slice`` returns (the subset of safetensors'
    slice API the converter uses): indexing reads only the selected rows of
    the first dimension, then applies the rest of the index in memory."""

    def __init__(self, source: CheckpointSource, name: str) -> None:
        self._source = source
        self._name = name
        self._hdr = source.tensor_header(name)

    def get_shape(self) -> list[int]:
        return list(self._hdr.shape)

    def get_dtype(self) -> str:
        return self._hdr.dtype

    def __getitem__(self, key: Any) -> torch.Tensor:
        shape = self._hdr.shape
        if not shape:
            return self._source.get_tensor(self._name)[key]
        first, rest = (key[0], key[1:]) if isinstance(key, tuple) and key else (key, ())
        n = shape[0]
        if isinstance(first, int):
            i = first + n if first < 0 else first
            if not 0 <= i < n:
                raise IndexError(f"index {first} out of range for {self._name} with {n} rows")
            t = self._source._read_rows(self._name, i, i + 1)[0]
            return t[rest] if rest else t
        if isinstance(first, slice) and first.step in (None, 1):
            lo, hi, _ = first.indices(n)
            hi = max(hi, lo)
            t = self._source._read_rows(self._name, lo, hi)
            return t[(slice(None), *rest)] if rest else t
        return self._source.get_tensor(self._name)[key]


#: iovecs per preadv call (Linux IOV_MAX is 1024)
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024, 1024)


def _pread_into(fd: int, view: memoryview, pos: int) -> int:  # pragma: no cover - platforms without preadv
    data = os.pread(fd, len(view), pos)
    view[: len(data)] = data
    return len(data)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def _file_digest(path: Path, full: bool, fh: SafetensorsHeader) -> str:
    if path.is_symlink():
        target = Path(os.path.realpath(path))
        if _SHA256_HEX.match(target.name) and target.parent.name == "blobs":
            return "lfs:" + target.name
    if full:
        return "sha256:" + _sha256_file(path)
    # cheap: header + size + 16 data samples of 4 KiB at fixed, evenly spaced offsets
    h = hashlib.sha256(f"{fh.header_sha256}:{fh.file_size}".encode())
    data0 = 8 + fh.header_len
    span = fh.file_size - data0
    with open(path, "rb") as f:
        for i in range(_SAMPLES):
            off = data0 + (span * i) // _SAMPLES
            f.seek(off)
            h.update(f.read(min(_SAMPLE_BYTES, fh.file_size - off)))
    return "sampled:" + h.hexdigest()


_SAMPLES = 16
_SAMPLE_BYTES = 4096


def _env_offline() -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUTHY:
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # pragma: no cover
        return False


def is_hub_id(src: str) -> bool:
    return bool(_HUB_ID.match(src)) and ".." not in src


def containment_base(root: Path) -> Path:
    """The folder a source's files must resolve into: the root itself (symlinks
    resolved), or for a hub-cache snapshot (``.../models--org--name/snapshots/<commit>``,
    whose files are symlinks to ``../../blobs/<sha256>``) the repo's cache folder."""
    real = Path(os.path.realpath(root))
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        return real.parent.parent
    return real


def _hub_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """The hub cache `open_source` reads: `cache_dir`, else ``$HF_HUB_CACHE``,
    else huggingface_hub's default (``$HF_HOME/hub``)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    try:
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE).expanduser()
    except Exception:  # pragma: no cover - dependency
        return Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser() / "hub"


def source_roots(src: str | Path, cache_dir: str | Path | None = None) -> list[Path]:
    """The folders reading `src` may touch, known before it is opened (the
    output must stay clear of them): a local folder itself, or the hub cache
    for a hub id (a cached snapshot's files are symlinks into it)."""
    p = Path(src).expanduser()
    if p.exists():
        return [Path(os.path.realpath(p))]
    if is_hub_id(str(src)):
        return [_hub_cache_dir(cache_dir)]
    return []


def open_source(
    src: str | Path,
    revision: str | None = None,
    *,
    cache_dir: str | Path | None = None,
    local_files_only: bool | None = None,
    token: str | None = None,
) -> CheckpointSource:
    """Open a local folder or a hub repo id (``org/name``) as a checkpoint.

    ``cache_dir``, ``local_files_only`` and ``token`` are huggingface_hub's
    (the CLI's ``--cache-dir``, ``--local-files-only``, ``--token``); a token
    of None uses ``HF_TOKEN`` or the one ``hf auth login`` saved.

    A path that exists is always local (so ``./org/name`` beats the hub).
    Hub ids are resolved through ``snapshot_download`` with
    :data:`HUB_ALLOW_PATTERNS`; ``HF_HUB_OFFLINE`` (read at call time as
    well as at import) or ``local_files_only=True`` restrict it to the cache
    (``cache_dir`` or ``$HF_HUB_CACHE`` or the library default). Errors name
    the repo and revision and say what to do.
    """
    p = Path(src).expanduser()
    if p.exists():
        if revision is not None:
            raise CheckpointError(f"{src}: --revision {revision!r} applies to hub repos only, and this is a local folder")
        if not p.is_dir():
            raise CheckpointError(
                f"{src}: is a file; give the checkpoint folder (the one holding config.json and the *.safetensors)"
            )
        return CheckpointSource(p.resolve(), id=str(p), kind="local")
    src = str(src)
    if not is_hub_id(src):
        raise CheckpointError(
            f"{src!r} is neither an existing folder nor a hub repo id of the form 'org/name'"
        )
    try:
        return _open_hub(src, revision, cache_dir=cache_dir, local_files_only=local_files_only, token=token)
    except CheckpointError as e:  # 'org/name' reads as a relative path too: name both readings
        raise CheckpointError(f"{src}: no such local folder ({Path(src).absolute()}); as a hub repo id: {e}") \
            from e.__cause__


def _one_line(e: BaseException, limit: int = 200) -> str:
    """An exception as one short line (type and first line of its text): huggingface_hub's messages run
    over several lines (request ids, URLs, advice), which broke the converter's one-line errors."""
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    text = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _open_hub(
    repo_id: str, revision: str | None, *, cache_dir: str | Path | None, local_files_only: bool | None,
    token: str | None = None,
) -> CheckpointSource:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub import errors as hf_errors
    except ImportError as e:  # pragma: no cover - dependency
        raise CheckpointError(f"{repo_id}: huggingface_hub is needed to read hub repos ({e})") from e
    offline = bool(local_files_only) or _env_offline()
    given_cache = cache_dir  # hf download honours HF_HUB_CACHE itself: only a --cache-dir goes in the hint
    if cache_dir is None and os.environ.get("HF_HUB_CACHE"):
        cache_dir = os.environ["HF_HUB_CACHE"]
    rev = revision or "main"
    where = f"hub repo {repo_id!r} (revision {rev!r})"
    cache_note = f"the hub cache at {_hub_cache_dir(cache_dir)}"
    fetch = (f"`hf download {repo_id}" + (f" --revision {revision}" if revision else "")
             + (f" --cache-dir {given_cache}" if given_cache else "") + "`")
    def download(allow: list[str]) -> Path:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=allow,
                                      ignore_patterns=_HUB_IGNORE_PATTERNS, local_files_only=offline,
                                      token=token))

    try:
        # configs and the index first: with an index, only the shards it names are fetched, so a
        # second copy of the weights beside them (e.g. consolidated.safetensors) is never downloaded
        folder_p = download(_HUB_META_PATTERNS)
        shards = _index_shards(folder_p / _INDEX_NAME, where)
        folder = download(shards if shards is not None else ["*.safetensors"])
    except hf_errors.RevisionNotFoundError as e:
        raise CheckpointError(f"{where}: revision {rev!r} does not exist on the hub") from e
    except (hf_errors.GatedRepoError,) as e:
        raise CheckpointError(
            f"{where}: the repo is gated; accept its terms on the hub and log in (`hf auth login` or HF_TOKEN)"
        ) from e
    except hf_errors.RepositoryNotFoundError as e:
        raise CheckpointError(
            f"{where}: repository not found (or private: log in with `hf auth login` or set HF_TOKEN)"
        ) from e
    except getattr(hf_errors, "IncompleteSnapshotError", ()) as e:  # type: ignore[misc]
        raise CheckpointError(
            f"{where}: the cached snapshot in {cache_note} is incomplete and the hub cannot be reached: {e}"
        ) from e
    except (hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled) as e:
        if offline:
            raise CheckpointError(
                f"{where} is not in {cache_note} and offline mode is on "
                f"({'--local-files-only' if local_files_only else 'HF_HUB_OFFLINE'}); download it once while online "
                f"({fetch}) or point --cache-dir / HF_HUB_CACHE at a cache that has it"
            ) from e
        raise CheckpointError(f"{where}: not in {cache_note} and the hub could not be reached "
                              f"({_one_line(e)}); check the network, or download it with {fetch}") from e
    except hf_errors.HfHubHTTPError as e:
        raise CheckpointError(f"{where}: hub request failed ({_one_line(e)})") from e
    except OSError as e:
        raise CheckpointError(f"{where}: could not download the snapshot ({_one_line(e)})") from e
    folder_p = Path(folder)
    commit = folder_p.name if folder_p.parent.name == "snapshots" else None
    if not (folder_p / "config.json").is_file():
        raise CheckpointError(f"{where}: the snapshot at {folder_p} has no config.json (not a transformers model repo?)")
    return CheckpointSource(folder_p, id=repo_id, kind="hub", revision=rev, commit=commit)


def _index_shards(index: Path, where: str) -> list[str] | None:
    """The shard file names ``model.safetensors.index.json`` maps to, or None without an index."""
    if not index.is_file():
        return None
    data = read_json(index, error=CheckpointError)
    try:
        weight_map = data["weight_map"]
        shards = sorted(set(weight_map.values()), key=str)
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{where}: {_INDEX_NAME} is not a valid index (no weight_map of names to files: {e})")
    check_shard_names(shards, f"{where}: {_INDEX_NAME}")
    return shards


def check_shard_names(names: list, where: str) -> None:
    """Index entries must be plain file names in the checkpoint's root: no
    folder part, no ``..``, no absolute path, no hidden file (hub and local
    sources alike). CheckpointError naming the offending entries."""
    bad = sorted({repr(f) for f in names if not isinstance(f, str) or not f or "/" in f or "\\" in f
                  or f.startswith(".") or os.path.isabs(f)})
    if bad:
        raise CheckpointError(f"{where} names shard files outside the checkpoint folder: {', '.join(bad[:3])}"
                              + (f" ... ({len(bad) - 3} more)" if len(bad) > 3 else "")
                              + "; index entries must be file names in the folder itself")

