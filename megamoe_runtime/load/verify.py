"""Verify a converted folder against its manifest, without the converter.

``megamoe-convert verify`` runs this, and so can a serve-only install (it
needs only the manifest, the digests and the safetensors header parser, all
in the runtime): a server can check a folder it was handed before it loads
it. Every finding goes into a `VerifyReport`; nothing here raises for a
damaged folder.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import CheckpointError, ManifestError, MegaMoEError, OutputError
from ..files.digests import SHA256, hash_file, is_composite, new_hasher, safetensors_digests
from ..files.folder import inside_folder
from ..files.safetensors_header import file_kind, parse_safetensors_header
from ..format.manifest import MANIFEST_NAME, read_manifest


#: problems a `VerifyReport` lists one by one; beyond them it only counts (`VerifyReport.unlisted`): a header
#: with a million stray entries printed a million lines (148 MB) and took gigabytes to hold them
MAX_LISTED_PROBLEMS = 100


@dataclass
class VerifyReport:
    """What `verify_output` found. `ok` is False when any problem was found. The first
    `MAX_LISTED_PROBLEMS` problems are listed (`add`); the rest only counted in `unlisted`."""

    path: str
    problems: list[str] = field(default_factory=list)
    unlisted: int = 0
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
        return not self.problems and not self.unlisted

    @property
    def problem_count(self) -> int:
        return len(self.problems) + self.unlisted

    def add(self, problem: str) -> None:
        """Record a problem: listed while fewer than `MAX_LISTED_PROBLEMS` are, else counted."""
        if len(self.problems) < MAX_LISTED_PROBLEMS:
            self.problems.append(problem)
        else:
            self.unlisted += 1

    def to_dict(self) -> dict:
        return {
            "path": self.path, "ok": self.ok, "problems": self.problems,
            **({"problems_unlisted": self.unlisted} if self.unlisted else {}),  # only when the listing is cut
            "warnings": self.warnings,
            "files_checked": self.files_checked, "tensors_checked": self.tensors_checked,
            "bytes_checked": self.bytes_checked, "format_version": self.format_version,
            "row": self.row, "ep_size": self.ep_size, "layers": self.layers,
        }


def verify_output(out: str | os.PathLike, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Check a converted folder against its manifest.

    Schema and version (read_manifest), every listed file present with the
    listed size and digest (of the entry's kind, see
    ``megamoe_runtime.format.manifest.DIGEST_KINDS``), every safetensors header valid
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
        rep.add(str(e))
        return rep
    rep.format_version, rep.row, rep.ep_size, rep.layers = m.format_version, m.row, m.ep_size, len(m.layers)
    rep.files_checked = 1  # the manifest itself (schema, version, self-digest): files count as convert counts them
    for alg in sorted({m.checksum} | {fe.algorithm for fe in m.files.values()}):
        new_hasher(alg)  # DigestUnavailableError (blake3 not installed) before reading anything: not a mismatch
    for p in spec_tensor_problems(m, str(out / MANIFEST_NAME)):
        rep.add(p)

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
    extras = sorted(on_disk - set(m.files))
    for extra in extras[:MAX_LISTED_PROBLEMS]:
        rep.warnings.append(f"{out / extra}: file not listed in the manifest (ignored)")
    if len(extras) > MAX_LISTED_PROBLEMS:
        rep.warnings.append(f"{len(extras) - MAX_LISTED_PROBLEMS} more file(s) not listed in the manifest (ignored)")

    for fname in sorted(m.files):
        fe = m.files[fname]
        tensors = by_file.pop(fname, {})  # even when the file is missing: one problem per missing file
        try:
            path = inside_folder(out, fname)
        except CheckpointError as e:
            rep.add(str(e))
            continue
        if not path.is_file():
            if path.exists():  # a FIFO, a device, a folder: named, never opened (a FIFO's read would block)
                rep.add(f"{path}: {file_kind(path.stat().st_mode)}, not a regular file (the manifest lists a "
                        f"file of {fe.size} bytes)")
                continue
            rep.add(f"{path}: missing (manifest lists it with {fe.size} bytes"
                                + (f" and {len(tensors)} tensor(s)" if tensors else "") + ")")
            continue
        size = path.stat().st_size
        if size != fe.size:
            rep.add(f"{path}: size {size} bytes, manifest says {fe.size}")
        if fname.endswith(".safetensors"):
            _verify_safetensors(path, fe, tensors, rep, progress, m.checksum)
        else:  # read_manifest allows the header-and-tensors kinds for safetensors files only
            digest = hash_file(path, fe.algorithm)
            progress(size)
            if digest != fe.checksum:
                rep.add(f"{path}: {fe.algorithm} {digest} does not match the manifest's {fe.checksum}")
        rep.files_checked += 1
    for fname, tensors in by_file.items():  # pragma: no cover - read_manifest refuses this
        rep.add(f"tensors {sorted(tensors)[:3]} name file {fname!r}, which the manifest does not list")
    return rep


def _verify_safetensors(path: Path, fe, tensors: dict, rep: VerifyReport,
                        progress: Callable[[int], None], checksum: str = SHA256) -> None:
    """One read of the file checks every tensor's checksum and the file digest
    (of the entry's kind). The header must be valid (header + data offsets
    tiling the file exactly, which is what lets the header-and-tensors digest
    cover every byte); an invalid header is itself a failure."""
    try:
        fh = parse_safetensors_header(path)
    except CheckpointError as e:
        rep.add(f"{e} (cannot check its {fe.digest} digest)")
        progress(path.stat().st_size)
        return
    names = set(fh.tensors)
    for name in sorted(names - set(tensors)):
        rep.add(f"{path}: tensor {name!r} is in the file but not in the manifest")
    checks = []
    for name, (key, t) in sorted(tensors.items()):
        th = fh.tensors.get(name)
        if th is None:
            rep.add(f"{path}: manifest tensor {key!r} is missing from the file")
            continue
        if th.dtype != t.dtype or tuple(th.shape) != tuple(t.stored_shape):
            rep.add(
                f"{path}: tensor {name!r} is {th.dtype} {list(th.shape)} in the header, manifest says "
                f"{t.dtype} {list(t.stored_shape)}")
            continue
        checks.append((name, key, t.checksum))
    whole = not is_composite(fe.digest)
    try:
        composite, got, whole_sha = safetensors_digests(path, fh, algorithm=checksum, whole=whole,
                                                        whole_algorithm=fe.algorithm, progress=progress)
    except (OSError, CheckpointError) as e:
        rep.add(f"{path}: cannot read it to check its digests: {e}")
        return
    digest = whole_sha if whole else composite
    if digest != fe.checksum:
        rep.add(f"{path}: {fe.digest} digest {digest} does not match the manifest's {fe.checksum}")
    for name, key, want in checks:
        rep.tensors_checked += 1
        if got[name] != want:
            rep.add(f"{path}: tensor {key!r} {checksum} {got[name]} does not match the manifest's {want}")


# --------------------------------------------------------------------------- the spec against the stored tensors


def spec_tensor_problems(manifest: Any, where: str = MANIFEST_NAME) -> list[str]:
    """Every layer's spec against the tensors the manifest lists for it: each role the spec implies present on
    every rank, each entry's dtype, per-expert kernel shape and strides those of the layer the spec builds (a
    meta layer: no memory), and no role the spec does not have. Catches a spec edited to another ``num_experts``
    or ``hidden`` that the manifest's own schema checks accept. (`megamoe-convert verify` runs it.)"""
    from ..format.manifest import EXPERT_ROLES, dtype_name, expert_range_problem
    from ..layer.experts import DeepGemmMegaMoEExperts

    problems: list[str] = []
    for le in sorted(manifest.layers, key=lambda le: le.index):
        w = f"{where}: layer {le.index} ({le.prefix})"
        try:
            spec = le.layer_spec(0, manifest.ep_size)
            layer = DeepGemmMegaMoEExperts(spec, device="meta", backend="reference", prefix=le.prefix,
                                           layer_index=le.index)
        except MegaMoEError as e:
            problems.append(f"{w}: spec does not build a layer: {e}")
            continue
        want = {r: layer.param_for_role(r) for r in layer.checkpoint_roles()}
        by_rank: dict[int, dict[str, list]] = {}
        for te in manifest.tensors.values():
            if te.layer == le.index and te.ep_rank is not None:
                by_rank.setdefault(te.ep_rank, {}).setdefault(te.role, []).append(te)
        for rank in range(manifest.ep_size):
            got = by_rank.get(rank, {})
            for role in sorted(set(want) - set(got)):
                problems.append(f"{w}, rank {rank}: no {role} tensor, which its spec ({spec.row}) needs")
            for role in sorted(set(got) - set(want)):
                problems.append(f"{w}, rank {rank}: {', '.join(t.name for t in got[role])} has role {role}, "
                                f"which a layer of its spec ({spec.row}, shared={spec.shared}) does not have")
            lo, hi = rank * spec.experts_per_rank, (rank + 1) * spec.experts_per_rank
            for role in sorted(set(got) & set(want) & set(EXPERT_ROLES)):
                bad = expert_range_problem(role, got[role], lo, hi)
                if bad is not None:
                    problems.append(f"{w}, rank {rank}: {bad} (but its spec has num_experts={spec.num_experts}, "
                                    f"ep_size={manifest.ep_size})")
            for role in sorted(set(got) & set(want)):
                p = want[role]
                for te in got[role]:
                    expert = role in EXPERT_ROLES
                    shape = tuple(te.kernel_shape[1:]) if expert else tuple(te.kernel_shape)
                    want_shape = tuple(p.shape[1:]) if expert else tuple(p.shape)
                    n = te.experts[1] - te.experts[0] if expert and te.experts is not None else None
                    if (te.dtype != dtype_name(p.dtype) or shape != want_shape
                            or tuple(te.kernel_strides) != tuple(p.stride())
                            or (n is not None and te.kernel_shape and te.kernel_shape[0] != n)):
                        problems.append(
                            f"{w}, rank {rank}: {te.name} is {te.dtype} {list(te.kernel_shape)} strides "
                            f"{list(te.kernel_strides)}, but its spec (hidden={spec.hidden}, intermediate="
                            f"{spec.intermediate}, num_experts={spec.num_experts}) makes {role} "
                            f"{dtype_name(p.dtype)} {list(p.shape)} strides {list(p.stride())}"
                            + (" per rank" if expert else ""))
    return problems


__all__ = ["VerifyReport", "verify_output", "spec_tensor_problems", "MAX_LISTED_PROBLEMS"]
