"""Open a converted megamoe checkpoint and build layers from it.

    import megamoe_runtime as mr
    ckpt = mr.open_checkpoint(out_dir)          # reads and validates megamoe.json
    ckpt.layers                                 # what exists (index, prefix, spec, ...)
    layer = ckpt.build_layer(3, device="cuda", backend="auto", ep_rank=r, ep_size=n)
    ckpt.load_layer(layer)                      # reload new weights into the same storage

Loading is the pre-laid-out path of `megamoe_runtime.layer.loaders`: each stored
tensor's bytes go from the file straight into the layer's storage -- one read
per tensor into the parameter on CPU, pinned double-buffered chunks on CUDA --
with no transform and no full-size temporary (a dry run sends the same
destination views meta stand-ins through ``copy_`` instead).
An EP rank opens only the files holding its experts: with the checkpoint's
own EP size that is exactly its rank files; with another EP size it reads the
overlapping slices of the files that hold its experts.

safetensors headers are parsed up front (`safetensors_header`, docs/CHECKPOINTS.md#safetensors validation: size limit,
tiling, byte counts, file length, duplicate keys) so that a dry run can build
meta stand-ins from headers alone, and so that a truncated or corrupt file is
reported by name before any byte is copied.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Union

import torch

from ..errors import CheckpointError, LayerUnusableError, LayoutError, MegaMoEError
from ..files.file_io import FileSlice, HashedFileSlice, SafetensorsFile, deferred_gpu_reads
from ..files.folder import inside_folder
from ..files.safetensors_header import SafetensorsHeader
from ..format.formats import LayerSpec, get_row
from ..format.manifest import (EXPERT_ROLES, MANIFEST_NAME, SHARED_ROLES, LayerEntry, Manifest, TensorEntry,
                               expert_range_problem, read_manifest)
from ..format.roles import expected_roles
from .load_checks import check_layer_load, check_verify_level, identity_problems

if TYPE_CHECKING:  # pragma: no cover (imported where a layer is built, so opening a folder stays cheap)
    from ..layer.experts import DeepGemmMegaMoEExperts

__all__ = [
    "Checkpoint",
    "LayerInfo",
    "PlanItem",
    "open_checkpoint",
]



# --------------------------------------------------------------------------- checkpoint


@dataclass(frozen=True)
class LayerInfo:
    """One MoE layer of a converted checkpoint (ep_rank 0 view of its spec)."""

    index: int
    prefix: str
    spec: LayerSpec
    scalars: dict
    shared: dict


@dataclass(frozen=True)
class PlanItem:
    """One stored tensor (or expert slice of it) a rank loads: ``entry.name``
    from ``entry.file``, rows ``[src_lo, src_hi)`` of its first dim (None =
    whole tensor) into ``role`` for global experts ``experts``."""

    entry: TensorEntry
    role: str
    src_range: Optional[tuple[int, int]]
    experts: Optional[tuple[int, int]]


class Checkpoint:
    """A converted megamoe output folder (validated manifest + lazy files)."""

    def __init__(self, root: Union[str, os.PathLike], verify: str = "headers"):
        self.root = Path(root)
        #: default `load_layer` check level (load_checks.VERIFY_LEVELS)
        self.verify = check_verify_level(verify)
        self.manifest: Manifest = read_manifest(self.root)
        self._manifest_stat = _stat_identity(self.root / MANIFEST_NAME)
        #: files opened by the latest load (a test can check a rank read only its own)
        self.last_opened_files: list[str] = []

    def check_unchanged(self) -> None:
        """CheckpointError unless megamoe.json is still the one this handle read (same file, else same
        self-digest): a folder replaced under an open handle (``convert --overwrite``) must not be served with
        the old manifest's scalars and plan. A stat when nothing changed; a re-read when the file was touched."""
        path = self.root / MANIFEST_NAME
        try:
            now = _stat_identity(path)
        except OSError as e:
            raise CheckpointError(f"{path}: gone since this checkpoint was opened ({e.strerror}); the folder was "
                                  "removed or replaced: open_checkpoint it again") from None
        if now == self._manifest_stat:
            return
        try:
            digest = read_manifest(self.root).self_digest
        except MegaMoEError as e:
            raise CheckpointError(f"{path}: changed since this checkpoint was opened and no longer reads: {e}") from None
        if digest != self.manifest.self_digest:
            raise CheckpointError(
                f"{self.root}: the folder was replaced since this checkpoint was opened ({MANIFEST_NAME} digest "
                f"{str(digest)[:16]}... now, {str(self.manifest.self_digest)[:16]}... then): its files belong to "
                "another conversion; open_checkpoint it again to load the new one")
        self._manifest_stat = now  # same content (rewritten or copied back): keep serving

    def __repr__(self) -> str:
        return (f"Checkpoint({str(self.root)!r}, row={self.manifest.row}, layers={len(self.manifest.layers)}, "
                f"ep_size={self.manifest.ep_size})")

    @property
    def row(self) -> str:
        return self.manifest.row

    @property
    def ep_size(self) -> int:
        return self.manifest.ep_size

    @property
    def layers(self) -> list[LayerInfo]:
        """The MoE layers this checkpoint holds, sorted by index."""
        return [LayerInfo(le.index, le.prefix, le.layer_spec(0, self.manifest.ep_size), dict(le.scalars),
                          dict(le.shared))
                for le in sorted(self.manifest.layers, key=lambda le: le.index)]

    def layer_entry(self, layer_index: int) -> LayerEntry:
        return self.manifest.layer(layer_index)

    def layer_spec(self, layer_index: int, ep_rank: int = 0, ep_size: Optional[int] = None) -> LayerSpec:
        return self.manifest.layer(layer_index).layer_spec(ep_rank, ep_size or self.manifest.ep_size)

    def path_of(self, file: str) -> Path:
        """The path of a listed file; CheckpointError when it resolves outside the folder (a symlink out)."""
        return inside_folder(self.root, file)

    # ------------------------------------------------------------------ plan

    def plan(self, layer_index: int, ep_rank: int = 0, ep_size: int = 1, *,
             roles: Optional[list[str]] = None, strict: bool = True) -> list[PlanItem]:
        """What rank ``ep_rank`` of ``ep_size`` loads for one layer.

        Expert-stacked tensors: every stored tensor whose expert range overlaps
        the rank's experts, sliced to the overlap (with the checkpoint's own EP
        size: exactly this rank's tensors). Shared tensors (replicated per
        stored rank): from the stored rank holding the rank's first expert.
        ``strict`` checks every role is fully covered (CheckpointError otherwise).
        """
        le = self.manifest.layer(layer_index)
        spec = le.layer_spec(ep_rank, ep_size)
        n_src = self.manifest.ep_size
        E = spec.num_experts
        lo, hi = spec.local_experts.start, spec.local_experts.stop
        per_src = E // n_src
        home = lo // per_src
        items: list[PlanItem] = []
        # every entry of this layer (a malformed manifest may list a role twice: keep both, so that
        # strict mode and the dry run can report the overlap instead of silently picking one)
        entries = sorted((te.ep_rank, te.role, te.name, te) for te in self.manifest.tensors.values()
                         if te.layer == layer_index and te.ep_rank is not None)
        for q, role, _, te in entries:
            if roles is not None and role not in roles:
                continue
            if role in SHARED_ROLES:
                if q == home:
                    items.append(PlanItem(te, role, None, None))
                continue
            if role not in EXPERT_ROLES:
                continue
            a, b = te.experts if te.experts is not None else (q * per_src, (q + 1) * per_src)
            ov_lo, ov_hi = max(a, lo), min(b, hi)
            if ov_lo >= ov_hi:
                continue
            src = None if (ov_lo, ov_hi) == (a, b) else (ov_lo - a, ov_hi - a)
            items.append(PlanItem(te, role, src, (ov_lo, ov_hi)))
        if strict:
            want = roles if roles is not None else self._expected_roles(spec)
            for q in range(home, -(-hi // per_src)):  # the stored ranks this rank reads from: one rule each
                q_lo, q_hi = q * per_src, (q + 1) * per_src
                for role in want:
                    if role not in EXPERT_ROLES:
                        continue
                    bad = expert_range_problem(role, [te for r, ro, _, te in entries if r == q and ro == role],
                                               q_lo, q_hi)
                    if bad is not None:
                        raise CheckpointError(f"{self.root}: layer {layer_index} ({le.prefix}), stored rank {q} of "
                                              f"{n_src}: {bad}")
            for role in want:
                got = sorted(it.experts for it in items if it.role == role and it.experts is not None)
                if role in SHARED_ROLES:
                    if not any(it.role == role for it in items):
                        raise CheckpointError(f"{self.root}: layer {layer_index} ({le.prefix}) has no {role} tensor "
                                              "although its spec has shared experts")
                    continue
                pos = lo
                for a, b in got:
                    if a > pos:
                        break
                    if a < pos:
                        raise CheckpointError(
                            f"{self.root}: layer {layer_index} ({le.prefix}): {role} for experts [{a}, {min(b, pos)}) is "
                            f"stored more than once ({', '.join(sorted(it.entry.name for it in items if it.role == role))})")
                    pos = max(pos, b)
                if pos < hi:
                    raise CheckpointError(
                        f"{self.root}: layer {layer_index} ({le.prefix}): no {role} for experts [{pos}, {hi}) "
                        f"(rank {ep_rank} of {ep_size} needs [{lo}, {hi}))")
        return items

    def _expected_roles(self, spec: LayerSpec) -> list[str]:
        row = spec.row_spec
        shared = None if spec.shared is None else get_row(spec.shared.precision).has_scales
        return expected_roles(row.has_scales, row.weight.has_global_scale, shared)

    def files_for(self, layer_index: int, ep_rank: int = 0, ep_size: int = 1) -> list[str]:
        """The files a rank opens to load one layer."""
        return sorted({it.entry.file for it in self.plan(layer_index, ep_rank, ep_size, strict=False)})

    # ------------------------------------------------------------------ sources

    def iter_sources(self, items: list[PlanItem], *, meta: bool = False, direct: bool = False,
                     headers: Optional[dict[str, SafetensorsHeader]] = None,
                     hashed: bool = False) -> Iterator[tuple[PlanItem, Any]]:
        """(item, source) per plan item, file by file: zero-copy views of the
        mmap'ed file, `FileSlice` byte ranges to read straight into the
        destination (``direct``), or meta stand-ins from the header (``meta``).
        ``hashed`` (with ``direct``): `HashedFileSlice` sources, whose reads hash the bytes they copy and
        refuse a digest other than the manifest's (``verify="checksums"``).
        The file tensor's header must agree with the manifest entry; ``headers`` (file -> header already
        validated by `load_checks`) are used instead of parsing the file again."""
        by_file: dict[str, list[PlanItem]] = {}
        for it in items:
            by_file.setdefault(it.entry.file, []).append(it)
        self.last_opened_files = []
        for file in sorted(by_file):
            path = self.path_of(file)
            if not path.is_file():
                raise CheckpointError(f"{path}: missing (the manifest lists it for "
                                      f"{', '.join(sorted({i.entry.name for i in by_file[file]}))[:200]})")
            self.last_opened_files.append(file)
            f = SafetensorsFile(path, (headers or {}).get(file))
            try:
                _check_identity(f, file, {it.entry.ep_rank for it in by_file[file]})
                for it in by_file[file]:
                    te = it.entry
                    en = f.entry(te.name)
                    if en.dtype != te.dtype or en.shape != tuple(te.stored_shape):
                        raise LayoutError(f"{path}: {te.name} is {en.dtype} {list(en.shape)} in the file but "
                                          f"{te.dtype} {list(te.stored_shape)} in {MANIFEST_NAME}")
                    if direct and not meta:
                        shape, offset, nbytes = en.shape, f.data_start + en.begin, en.end - en.begin
                        part = (0, nbytes)
                        if it.src_range is not None:
                            row = nbytes // max(en.shape[0], 1)
                            a, b = it.src_range
                            part = (a * row, b * row)
                            shape = (b - a,) + en.shape[1:]
                        if hashed:
                            yield it, HashedFileSlice(path, offset, nbytes, part, f._dtype(te.name), tuple(shape),
                                                      te.checksum_kind, te.checksum, te.name)
                        else:
                            yield it, FileSlice(path, offset + part[0], part[1] - part[0], f._dtype(te.name),
                                                tuple(shape))
                        continue
                    src = f.meta(te.name) if meta else f.tensor(te.name)
                    if it.src_range is not None:
                        src = src[it.src_range[0]:it.src_range[1]]
                    yield it, src
                    del src
            finally:
                f.close()

    # ------------------------------------------------------------------ build / load

    def build_layer(self, layer_index: int, device: Union[str, torch.device, None] = "cpu", backend: Any = "auto",
                    ep_rank: int = 0, ep_size: int = 1, *, verify: Optional[str] = None,
                    **layer_kwargs: Any) -> "DeepGemmMegaMoEExperts":
        """Allocate layer ``layer_index`` for one EP rank in kernel layout and load it.

        ``layer_kwargs`` go to `DeepGemmMegaMoEExperts` (``fuse_shared``,
        ``backend_kwargs``, ``init``). The layer's prefix and index come from
        the manifest, so `load_layer` and `verify_reload` can find it again.
        """
        layer = self.allocate_layer(layer_index, device, backend, ep_rank, ep_size, **layer_kwargs)
        self.load_layer(layer, verify=verify)
        return layer

    def allocate_layer(self, layer_index: int, device: Union[str, torch.device, None] = "cpu", backend: Any = "auto",
                       ep_rank: int = 0, ep_size: int = 1, **layer_kwargs: Any) -> "DeepGemmMegaMoEExperts":
        """The layer `build_layer` loads, allocated and not loaded: the reload dry run builds its meta layers
        here, so what it checks is the layer a real build makes (spec for the rank, manifest prefix and index)."""
        from ..layer.experts import DeepGemmMegaMoEExperts

        le = self.manifest.layer(layer_index)
        return DeepGemmMegaMoEExperts(le.layer_spec(ep_rank, ep_size), device=device, backend=backend,
                                      prefix=le.prefix, layer_index=layer_index, **layer_kwargs)

    def match_layer(self, layer: Any) -> LayerEntry:
        """The manifest layer a built layer corresponds to (by index, else prefix)."""
        if getattr(layer, "layer_index", None) is not None:
            for le in self.manifest.layers:
                if le.index == layer.layer_index:
                    if layer.prefix and layer.prefix != le.prefix:  # which one did the caller mean?
                        raise CheckpointError(
                            f"{self.root}: the layer's layer_index={layer.layer_index} and prefix={layer.prefix!r} "
                            f"name different MoE layers (layer {le.index} is {le.prefix!r} in {MANIFEST_NAME})")
                    return le
        for le in self.manifest.layers:
            if layer.prefix and le.prefix == layer.prefix:
                return le
        raise CheckpointError(f"{self.root}: no MoE layer matches layer_index={layer.layer_index!r}, "
                              f"prefix={layer.prefix!r}; layers: {[(le.index, le.prefix) for le in self.manifest.layers]}")

    def check_load(self, layer: Any, *, verify: Optional[str] = None, adopt_semantics: bool = False):
        """What `load_layer` checks before its first byte, without loading: a `load_checks.LoadCheck`."""
        return check_layer_load(self, layer, verify=verify or self.verify, adopt_semantics=adopt_semantics)

    def load_layer(self, layer: Any, *, verify: Optional[str] = None, adopt_semantics: bool = False) -> int:
        """(Re)load a built layer from this checkpoint, in place: one read
        per stored tensor into the same storage, then the layer's scalars.
        Returns the number of bytes copied.

        All or nothing: `load_checks.check_layer_load` runs first (at level ``verify``, default the
        checkpoint's), and a LoadCheckError listing every problem leaves the layer untouched. A layer whose
        semantics (top_k, activation, routed_scaling_factor) differ from the checkpoint's is refused unless
        ``adopt_semantics`` (then it takes the checkpoint's, as a fresh build would). If a read still fails
        after writing started (a file changed under the load), the layer is marked unusable -- its forward
        raises LayerUnusableError naming this load -- until a load succeeds.
        """
        from ..layer.experts import DeepGemmMegaMoEExperts

        if not isinstance(layer, DeepGemmMegaMoEExperts):
            raise CheckpointError(f"{self.root}: load_layer takes a DeepGemmMegaMoEExperts (build_layer / "
                                  f"allocate_layer), got {type(layer).__name__}")
        if layer.device.type == "meta":
            raise CheckpointError(f"{self.root}: layer {layer.prefix or layer.layer_index} is on the meta device: it "
                                  "has no storage to load into; build it on 'cpu' or 'cuda' (mr.verify_reload is "
                                  "the dry run of a load)")
        chk = self.check_load(layer, verify=verify, adopt_semantics=adopt_semantics)
        chk.raise_if_failed(f"{self.root}: layer {layer.layer_index if layer.layer_index is not None else layer.prefix}")
        le = chk.layer_entry
        items = [it for it in chk.items if it.role in chk.wanted]
        layer.begin_load("stored")
        copied, current = 0, None
        try:
            with deferred_gpu_reads():  # a GPU layer's reads go together at the block's end (file_io)
                for it, src in self.iter_sources(items, direct=True, headers=chk.headers,
                                                 hashed=chk.verify == "checksums"):
                    current = f"{it.entry.name} ({it.entry.file})"
                    layer.load_stored(it.role, src, storage=it.entry.storage, experts=it.experts,
                                      name=it.entry.name)
                    copied += src.nbytes
                current = f"the layer's reads ({copied} bytes queued)"
            current = "the layer's scalars"
            if chk.adopted_spec is not None:
                layer.adopt_spec(chk.adopted_spec)
            layer.finish_load(scalars=le.scalars)
        except BaseException as e:
            layer.abort_load()
            if current is not None:  # writing had started: the storage may hold a mix
                layer.mark_unusable(f"the load of layer {le.index} from {self.root} failed at {current} after "
                                    f"{copied} bytes were written: {type(e).__name__}: {e}")
                if isinstance(e, MegaMoEError) or isinstance(e, OSError):
                    raise LayerUnusableError(layer.unusable_reason) from e
            raise
        return copied


def _check_identity(f: SafetensorsFile, expected_file: str, ranks: set) -> None:
    problems = identity_problems(f.path, f.metadata, expected_file, ranks)
    if problems:
        raise CheckpointError(problems[0])


def _stat_identity(path: Path) -> tuple:
    """(device, inode, size, mtime_ns) of a file, not following a final symlink's target change: what tells a
    rewritten or replaced manifest from the one read."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def open_checkpoint(directory: Union[str, os.PathLike], verify: str = "headers") -> Checkpoint:
    """Open a converted megamoe folder: reads and validates ``megamoe.json``
    (ManifestError if missing, malformed, without its self-digest, of a newer format version, or a symlink out of
    the folder).

    ``verify`` is what every load checks before its first byte (`megamoe_runtime.load.load_checks`): ``"none"``
    (spec, plan and folder identity only; file headers as each file is reached), ``"headers"`` (default: every
    file's header, length, identity and every destination, NVFP4 scales) or ``"checksums"`` (also every loaded
    tensor's sha256 against the manifest: one extra read of the bytes; see BENCHMARKS.md for the cost)."""
    return Checkpoint(directory, verify=verify)
