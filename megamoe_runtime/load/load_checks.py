"""The checks a (re)load passes before its first byte is written: one function for the real reload and the dry run.

A reload copies a checkpoint's bytes into a live layer's storage in place. If it stopped halfway, the layer
would hold a mix of two checkpoints and still run. So `Checkpoint.load_layer` calls :func:`check_layer_load`
first and writes nothing unless it passes, and `verify_reload` (the meta dry run) calls the same function, so the
two cannot disagree about what is loadable. What is checked, by ``verify`` level:

* always: the folder was not replaced since it was opened (manifest identity, `Checkpoint.check_unchanged`); the
  layer's spec against the checkpoint's: storage fields (row, sizes, experts, EP, shared expert) must be equal,
  semantic fields (``top_k``, ``activation.*``, ``routed_scaling_factor``) must be equal unless the caller adopts
  them; every expert of every role covered exactly once (the plan).
* ``"headers"`` (default) and ``"checksums"``: every file the plan reads exists inside the folder (no symlink out),
  its header is valid and matches the file's length, it names itself as the manifest expects, every tensor's
  dtype and shape agree with the manifest and with the destination in the layer, and the NVFP4 per-expert global
  scales and ``l2_activation_scale`` are finite and > 0 and not fp32 subnormals (a few bytes per expert are read
  for that; docs/FORMATS.md#subnormal-scales). Block scales are not read (only ``"checksums"`` finds a flipped
  byte there).
* ``"checksums"``: every stored tensor the plan reads is hashed and compared with the manifest's checksum
  (sha256 or blake3, as the manifest says).
* ``"none"``: only the always-checks; headers are parsed as each file is reached, so a defective file is found
  midway and the layer is then marked unusable (see `DeepGemmMegaMoEExperts.mark_unusable`).

Each check is a named function returning problem strings, so they can move (e.g. into a verify module) whole.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import LoadCheckError, MegaMoEError
from ..files.folder import inside_folder
from ..files.safetensors_header import SafetensorsHeader, parse_safetensors_header
from ..format.formats import SEMANTIC_FIELDS, spec_differences
from ..format.manifest import MANIFEST_NAME, LayerEntry
from ..format import scales
from ..format.roles import SCALAR_ROLES

__all__ = [
    "VERIFY_LEVELS",
    "DEFAULT_VERIFY",
    "LoadCheck",
    "check_layer_load",
    "check_verify_level",
    "identity_problems",
    "FILE_KEY",
    "RANK_KEY",
]

VERIFY_LEVELS = ("none", "headers", "checksums")
#: headers are parsed by every load anyway (they give the byte offsets), so checking them all up front costs a
#: stat and a header read per file: measured in bench/load.py (BENCHMARKS.md), within noise of "none"
DEFAULT_VERIFY = "headers"
_HASH_CHUNK = 16 << 20


def check_verify_level(verify: str) -> str:
    """`verify` if it is one of VERIFY_LEVELS; MegaMoEError listing them otherwise."""
    if verify not in VERIFY_LEVELS:
        raise MegaMoEError(f"verify={verify!r}; valid: {', '.join(VERIFY_LEVELS)}")
    return verify


@dataclass
class LoadCheck:
    """Outcome of :func:`check_layer_load`: what to load and whether it may start."""

    layer_entry: Optional[LayerEntry]
    verify: str
    #: every manifest entry of the layer this rank reads (duplicates kept; roles the layer lacks included)
    items: list = field(default_factory=list)
    #: the roles the layer writes (items of other roles are not loaded)
    wanted: set = field(default_factory=set)
    #: file -> validated header (files whose header check failed are absent; empty under verify="none")
    headers: dict = field(default_factory=dict)
    #: files that failed a check
    bad_files: set = field(default_factory=set)
    #: semantic field -> (layer's value, checkpoint's value)
    differences: dict = field(default_factory=dict)
    #: the spec the layer takes when the caller adopts the differences (None: keep its own)
    adopted_spec: Any = None
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_failed(self, where: str) -> None:
        if self.problems:
            shown = "\n  ".join(self.problems[:40])
            more = f"\n  ... and {len(self.problems) - 40} more" if len(self.problems) > 40 else ""
            raise LoadCheckError(f"{where}: load refused before writing any byte ({len(self.problems)} "
                                 f"problem(s)); the layer is unchanged:\n  {shown}{more}", self.problems,
                                 self.differences)


# --------------------------------------------------------------------------- spec


def _check_spec(layer: Any, le: LayerEntry, ckpt_root: Any, *, adopt: bool, chk: LoadCheck) -> None:
    """Storage fields must match; semantic ones must match unless adopted (then `chk.adopted_spec` is the layer's
    spec with the checkpoint's semantics, validated, and the backend must support it)."""
    from ..format.formats import LayerSpec

    spec = layer.spec
    try:
        mine = le.layer_spec(spec.ep_rank, spec.ep_size)
    except MegaMoEError as e:
        chk.problems.append(f"{ckpt_root}: layer {le.index} ({le.prefix}): spec for rank {spec.ep_rank} of "
                            f"{spec.ep_size}: {e}")
        return
    storage, semantic = spec_differences(spec, mine, compare_shared=not getattr(layer, "shared_from_module", False))
    for k, (have, want) in storage.items():
        chk.problems.append(f"{ckpt_root}: layer {le.index} ({le.prefix}) has {k}={want!r} but the layer was built "
                            f"with {k}={have!r} (fixes the layer's storage: build a new layer)")
    chk.differences = semantic
    if not semantic:
        return
    if not adopt:
        fields = ", ".join(f"{k}: layer {have!r} vs checkpoint {want!r}" for k, (have, want) in semantic.items())
        chk.problems.append(f"{ckpt_root}: layer {le.index} ({le.prefix}) has other semantics than the layer "
                            f"({fields}); pass adopt_semantics=True to take the checkpoint's")
        return
    d = spec.to_dict()
    new = mine.to_dict()
    for k in SEMANTIC_FIELDS:
        d[k] = new[k]
    try:
        adopted = LayerSpec.from_dict(d)
    except MegaMoEError as e:
        chk.problems.append(f"{ckpt_root}: layer {le.index}: the checkpoint's semantics do not fit the layer: {e}")
        return
    sup = layer.backend.supports(adopted) if hasattr(layer.backend, "supports") else True
    if sup is not True:
        chk.problems.append(f"{ckpt_root}: layer {le.index}: backend {getattr(layer.backend, 'name', '?')!r} cannot "
                            f"run the checkpoint's semantics: {sup}")
        return
    chk.adopted_spec = adopted


# --------------------------------------------------------------------------- files

#: ``__metadata__`` keys by which a converted expert file names itself (the converter writes them), so that a
#: renamed, copied or swapped rank file is caught at load time for free
FILE_KEY, RANK_KEY = "megamoe.file", "megamoe.ep_rank"


def identity_problems(path: Any, md: dict, expected_file: str, ranks: set) -> list[str]:
    """What is wrong with how a file names itself (``__metadata__``) against where the manifest puts it."""
    if FILE_KEY in md and md[FILE_KEY] != expected_file:
        return [f"{path}: the file names itself {md[FILE_KEY]!r} but the manifest expects "
                f"{expected_file!r} here (rank files renamed, copied or swapped?)"]
    if RANK_KEY in md:
        try:
            r = int(md[RANK_KEY])
        except ValueError:
            return [f"{path}: {RANK_KEY}={md[RANK_KEY]!r} is not an integer"]
        if ranks and r not in ranks:
            return [f"{path}: holds the experts of EP rank {r}, but the manifest lists it for "
                    f"rank {sorted(ranks)} (rank files swapped?)"]
    return []


def _check_file_header(root: Any, file: str, items: list, ranks: set) -> tuple[Optional[SafetensorsHeader], list[str]]:
    """A file the plan reads: inside the folder, header valid and of the file's length, self-named as the manifest
    expects, every planned tensor present with the manifest's dtype and shape."""
    try:
        path = inside_folder(root, file)
    except MegaMoEError as e:
        return None, [str(e)]
    if not path.is_file():
        names = ", ".join(sorted({it.entry.name for it in items}))[:200]
        return None, [f"{path}: missing (the manifest lists it for {names})"]
    try:
        h = parse_safetensors_header(path)
    except MegaMoEError as e:
        return None, [str(e)]
    problems = identity_problems(path, h.metadata, file, ranks)
    for it in items:
        te = it.entry
        en = h.tensors.get(te.name)
        if en is None:
            problems.append(f"{path}: no tensor {te.name!r} in this file (listed in {MANIFEST_NAME})")
        elif en.dtype != te.dtype or en.shape != tuple(te.stored_shape):
            problems.append(f"{path}: {te.name} is {en.dtype} {list(en.shape)} in the file but "
                            f"{te.dtype} {list(te.stored_shape)} in {MANIFEST_NAME}")
    return h, problems


def _check_destinations(layer: Any, items: list, headers: dict) -> list[str]:
    """Every planned source fits its destination view in the layer (the checks `copy_stored` makes at write time,
    made here first)."""
    from ..layer.loaders import check_stored_source

    problems = []
    for it in items:
        h = headers.get(it.entry.file)
        if h is None:
            continue
        en = h.tensors.get(it.entry.name)
        if en is None:
            continue
        shape = tuple(en.shape)
        if it.src_range is not None:
            shape = (it.src_range[1] - it.src_range[0],) + shape[1:]
        try:
            check_stored_source(layer, it.role, en.torch_dtype, shape, storage=it.entry.storage,
                                experts=it.experts, name=it.entry.name)
        except MegaMoEError as e:
            problems.append(str(e))
    return problems


def _read_exact(path: Any, offset: int, nbytes: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(nbytes)
    if len(data) != nbytes:
        raise OSError(f"short read: {len(data)} of {nbytes} bytes at offset {offset}")
    return data


def _check_nv_scales(root: Any, le: LayerEntry, items: list, headers: dict, nv: bool) -> list[str]:
    """NVFP4: ``l2_activation_scale`` in the manifest and every planned per-expert global scale (f32) finite,
    > 0 and not an fp32 subnormal (`scales.is_valid_scale`), read from the files (a few bytes per expert) so
    that `finish_load` cannot refuse after the writes. Pure Python, so it also runs under the dry run's dispatch
    mode."""
    if not nv:
        return []
    problems = []
    a2 = le.scalars.get("l2_activation_scale")
    if not scales.is_valid_fp32_scale(a2):
        problems.append(f"{root}: layer {le.index} ({le.prefix}): {MANIFEST_NAME} scalars.l2_activation_scale = "
                        f"{a2!r}; must be {scales.SCALE_RULE}")
    for it in items:
        if it.role not in SCALAR_ROLES:
            continue
        h = headers.get(it.entry.file)
        en = h.tensors.get(it.entry.name) if h is not None else None
        if en is None or en.dtype != "F32":
            continue
        row = en.nbytes // max(en.shape[0], 1) if en.shape else en.nbytes
        a, b = it.src_range if it.src_range is not None else (0, en.shape[0] if en.shape else 1)
        try:
            raw = _read_exact(h.path, h.data_start + en.begin + a * row, (b - a) * row)
        except OSError as e:
            problems.append(f"{h.path}: cannot read {it.entry.name}: {e}")
            continue
        vals = struct.unpack(f"<{len(raw) // 4}f", raw)
        per = max(row // 4, 1)
        e0 = it.experts[0] if it.experts else 0
        bad = [(i, v) for i, v in enumerate(vals) if not scales.is_valid_scale(v)]
        for what, found in (("not finite and > 0", [(i, v) for i, v in bad if not (math.isfinite(v) and v > 0)]),
                            ("an fp32 subnormal (< 2^-126; docs/FORMATS.md#subnormal-scales)",
                             [(i, v) for i, v in bad if math.isfinite(v) and v > 0])):
            if found:
                experts = sorted({e0 + i // per for i, _ in found})
                problems.append(f"{h.path}: {it.entry.name}: {it.role} is {what} for experts {experts[:8]}"
                                f"{' ...' if len(experts) > 8 else ''}; first: expert {e0 + found[0][0] // per}, "
                                f"index {found[0][0] % per} = {found[0][1]!r}")
    return problems


def _tensor_checksum(path: Any, offset: int, nbytes: int, algorithm: str = "sha256") -> str:
    """Digest (hex, `algorithm` of megamoe_runtime.files.digests) of ``nbytes`` bytes of ``path`` at ``offset``, read in
    16 MiB chunks: the manifest's tensor checksum."""
    from ..files.digests import new_hasher

    h = new_hasher(algorithm)
    buf = bytearray(min(_HASH_CHUNK, max(nbytes, 1)))
    mv = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [mv[:min(len(buf), nbytes - done)]], offset + done)
            if n <= 0:
                raise OSError(f"short read at offset {offset + done}")
            h.update(mv[:n])
            done += n
    finally:
        os.close(fd)
    return h.hexdigest()


def check_checksums(items: list, headers: dict) -> list[str]:
    """Every stored tensor the plan reads (whole, even when only a slice is loaded) hashes to the manifest's
    checksum (of the manifest's algorithm). Tensors are hashed on the loader's reader threads (hashlib and blake3
    release the GIL on large updates)."""
    from concurrent.futures import ThreadPoolExecutor

    from ..files.file_io import read_workers

    todo, seen = [], set()
    for it in items:
        te = it.entry
        h = headers.get(te.file)
        en = h.tensors.get(te.name) if h is not None else None
        if en is None or (te.file, te.name) in seen:
            continue
        seen.add((te.file, te.name))
        todo.append((te, h, en))

    def one(job: tuple) -> Optional[str]:
        te, h, en = job
        kind = getattr(te, "checksum_kind", "sha256")
        try:
            got = _tensor_checksum(h.path, h.data_start + en.begin, en.nbytes, kind)
        except (OSError, MegaMoEError) as e:
            return f"{h.path}: cannot check {te.name}: {e}"
        if got != te.checksum:
            return (f"{h.path}: {te.name}: {kind} {got} does not match the manifest's {te.checksum} "
                    "(flipped or replaced bytes)")
        return None

    workers = min(read_workers(), max(len(todo), 1))
    if workers > 1:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="megamoe-checksum") as pool:
            found = list(pool.map(one, todo))
    else:
        found = [one(j) for j in todo]
    return [p for p in found if p is not None]


# --------------------------------------------------------------------------- the one entry point


def check_layer_load(ckpt: Any, layer: Any, *, verify: str = DEFAULT_VERIFY, adopt_semantics: bool = False,
                     check_folder: bool = True) -> LoadCheck:
    """Every check a load of `layer` from `ckpt` must pass before its first byte (module docstring). Never
    raises for a defect: all problems go into the result (`LoadCheck.raise_if_failed`)."""
    check_verify_level(verify)
    chk = LoadCheck(None, verify)
    if check_folder:
        try:
            ckpt.check_unchanged()
        except MegaMoEError as e:
            chk.problems.append(str(e))
            return chk  # the manifest in hand no longer describes the folder: nothing else is meaningful
    try:
        le = ckpt.match_layer(layer)
    except MegaMoEError as e:
        chk.problems.append(str(e))
        return chk
    chk.layer_entry = le
    _check_spec(layer, le, ckpt.root, adopt=adopt_semantics, chk=chk)
    if any("fixes the layer's storage" in p for p in chk.problems):
        return chk  # another shape: the plan and destinations would only repeat it
    spec = layer.spec
    chk.wanted = set(layer.checkpoint_roles())
    try:
        ckpt.plan(le.index, spec.ep_rank, spec.ep_size, roles=sorted(chk.wanted), strict=True)
    except MegaMoEError as e:
        chk.problems.append(str(e))
    chk.items = ckpt.plan(le.index, spec.ep_rank, spec.ep_size, strict=False)
    if verify == "none":
        return chk
    by_file: dict[str, list] = {}
    for it in chk.items:
        by_file.setdefault(it.entry.file, []).append(it)
    for file in sorted(by_file):
        h, probs = _check_file_header(ckpt.root, file, by_file[file], {it.entry.ep_rank for it in by_file[file]})
        if h is not None and not probs:
            chk.headers[file] = h
        else:
            chk.bad_files.add(file)
        chk.problems += probs
    loaded = [it for it in chk.items if it.role in chk.wanted]
    chk.problems += _check_destinations(layer, loaded, chk.headers)
    chk.problems += _check_nv_scales(ckpt.root, le, loaded, chk.headers, spec.row_spec.has_alphas)
    if verify == "checksums":
        chk.problems += check_checksums(loaded, chk.headers)
    return chk
