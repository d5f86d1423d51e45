"""The conversion pipeline: source -> reader -> checks -> layout -> writer.

``convert(src, out, ...)`` is what ``megamoe-convert convert`` runs. In order:

1. refuse an existing OUT (unless ``overwrite``) before touching the source;
2. open the source and detect its reader (format, row);
3. **preflight**: every layer's spec against its row, every expert's float
   scales (w1/w3 agreement, a2 = max over all experts), see ``checks``;
4. **plan** every output tensor (kernel shapes follow from the sizes), split
   them into shards per EP rank, and derive a fingerprint of the run;
5. create ``.OUT.megamoe-tmp`` (or, with ``resume``, reuse it: files the
   journal lists as finished are re-hashed and kept if they still match);
6. **stream** layer by layer: per rank, allocate the rank's kernel tensors
   once, read one expert at a time, check it, repair it if asked, ``copy_`` it
   into place (``layout.write_expert``); where the reader offers the weights'
   byte ranges (``weight_byte_ranges``), gate/up/down weights are instead
   ``preadv``-ed straight into their kernel rows (`_DirectWeights`) and only
   the scales go through ``copy_``. Then queue the rank's tensors to its
   shard (hashed and written on background threads while the next layer is
   read and packed into a second set of buffers). Memory: two ranks' packed
   layers plus one expert in source encoding, whatever the model size;
7. copy the non-expert tensors byte for byte, the config/tokenizer files
   (``config.json`` annotated), write the index and, last, the manifest;
8. rename the temp folder to OUT.

Bad input (MegaMoEError) found at any step removes the temp folder; anything
else (a kill, a full disk, a bug) leaves it with its journal for ``resume``.

Output naming: expert shards ``megamoe-experts-rank{r:03d}-of-{N:03d}-{k:05d}``
(k from 1; each rank's files hold its experts and a replica of the fused
shared expert), non-expert shards ``model-{k:05d}-of-{n:05d}``. The index
``model.safetensors.index.json`` maps every tensor to its file; with
``ep_size > 1`` the rank files reuse the same tensor names, so the index lists
only the non-expert tensors and the manifest (keys ``{name}@rank{r:03d}``)
lists the rest.
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from megamoe_runtime import codecs, digests, layout
from megamoe_runtime.digests import SHA256
from megamoe_runtime.canonical import ExpertTensors, ProjectionTensors, expected_shapes
from megamoe_runtime.checkpoint import FILE_KEY, RANK_KEY
from megamoe_runtime.errors import CheckpointError, FormatError, LayerSpecError, MegaMoEError
from megamoe_runtime.formats import ROWS, LayerSpec, Row, SharedSpec, get_row
from megamoe_runtime.manifest import (
    DIGEST_SHA256,
    FORMAT_VERSION,
    PASSTHROUGH_ROLE,
    STORAGE_CONTIGUOUS,
    FileEntry,
    LayerEntry,
    Manifest,
    SourceInfo,
    TensorEntry,
    dtype_itemsize,
    dtype_name,
    kernel_strides_of,
    storage_of_role,
    tensor_key,
    to_stored,
    write_manifest,
)
from megamoe_runtime.tensor_bytes import byte_view

from . import checks
from .readers import detect_reader
from .readers.recipe import manifest_record
from .readers.base import CheckpointReader, MoELayerInfo
from .output_dir import (
    OutputError,
    OutputLock,
    StepHook,
    check_placement,
    ensure_parent,
    recover,
    remove_created,
    resolve_out,
    temp_dir_for,
)
from .source import CheckpointSource, open_source, source_roots
from megamoe_runtime.digests import file_digest

from .shard_writer import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_NAME,
    ST_METADATA,
    PlannedTensor,
    ShardWriter,
    copy_source_bytes,
    json_bytes,
    parse_size,
    plan_shards,
    tensor_bytes,
    write_bytes_atomic,
)
from .temp_folder import Journal, check_output_target, finalize_output, prepare_temp_dir

Progress = Callable[[int, int], None]  # (bytes done, bytes total)

DEFAULT_CHECKSUM = digests.DEFAULT_CHECKSUM
#: threads blake3 may use within one large tensor (sha256 is sequential)
HASH_THREADS = 1
Log = Callable[[str], None]


def converter_version() -> str:
    try:
        from importlib.metadata import version

        return version("megamoe")
    except Exception:  # pragma: no cover - not installed
        return "0+unknown"


def expert_file_name(rank: int, ep_size: int, k: int) -> str:
    return f"megamoe-experts-rank{rank:03d}-of-{ep_size:03d}-{k:05d}.safetensors"


def model_file_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


# --------------------------------------------------------------------------- results


@dataclass
class ConvertSummary:
    out: str
    source: str
    format: str
    row: str
    ep_size: int
    layers: int
    experts: int  # routed experts summed over layers
    bytes_in: int
    bytes_out: int
    seconds: float
    files: int
    repaired_experts: int = 0
    resumed_files: int = 0
    warnings: list[str] = field(default_factory=list)
    #: the shared-expert decisions, one per distinct decision: layers, precision, requested, reason, note
    shared: list[dict] = field(default_factory=list)
    #: megamoe.json ``source.recipe``: the source's activation recipe and what the kernel does instead
    recipe: dict | None = None

    @property
    def gb_per_s(self) -> float:
        return self.bytes_in / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {"out": self.out, "source": self.source, "format": self.format, "row": self.row,
                "ep_size": self.ep_size, "layers": self.layers, "experts": self.experts,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "seconds": round(self.seconds, 3),
                "gb_per_s": round(self.gb_per_s, 3), "files": self.files,
                "repaired_experts": self.repaired_experts, "resumed_files": self.resumed_files,
                "warnings": self.warnings, "shared": self.shared, "recipe": self.recipe}


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class _Slot:
    """A planned output tensor and what the manifest says about it."""

    key: str
    planned: PlannedTensor
    file: str
    layer: int | None
    role: str
    ep_rank: int | None
    experts: tuple[int, int] | None
    kernel_shape: tuple[int, ...]
    kernel_strides: tuple[int, ...]
    storage: str

    def entry(self, checksum: str, kind: str = SHA256) -> TensorEntry:
        return TensorEntry(
            name=self.planned.name, layer=self.layer, role=self.role, ep_rank=self.ep_rank,
            experts=self.experts, file=self.file, dtype=self.planned.dtype, stored_shape=self.planned.shape,
            kernel_shape=self.kernel_shape, kernel_strides=self.kernel_strides, storage=self.storage,
            checksum=checksum, checksum_kind=kind)


@dataclass
class _LayerPlan:
    info: MoELayerInfo
    spec: LayerSpec
    shared_record: dict
    scalar_report: checks.LayerScalarReport
    source_bytes: int
    slots: dict[int, list[_Slot]] = field(default_factory=dict)  # rank -> slots in write order


def _rank_roles(row: Row, E_l: int, H: int, I: int, shared: "checks.SharedSpec | None"
                ) -> list[tuple[str, torch.Tensor]]:
    """(role, meta kernel tensor) of one rank of one layer, in write order:
    4-byte dtypes first, then by role name, so every offset stays aligned."""
    kt = layout.allocate_kernel_tensors(row, E_l, H, I, device="meta")
    roles = list(kt.named().items())
    if row.weight.has_global_scale:
        roles.append(("l1_alpha", torch.empty(E_l, 2, dtype=torch.float32, device="meta")))
        roles.append(("l2_global_scale", torch.empty(E_l, dtype=torch.float32, device="meta")))
    if shared is not None:
        skt = layout.allocate_kernel_tensors(shared.precision, None, H, shared.folded_intermediate, device="meta")
        roles += [(f"shared_{r}", t) for r, t in skt.named().items()]
    return sorted(roles, key=lambda rt: (-rt[1].element_size(), rt[0]))


class SourceChangedError(OutputError):
    """--resume of a run whose source changed since it was interrupted."""


def _source_identity(source: CheckpointSource) -> dict[str, list[int]]:
    """name -> [size, mtime_ns] of every source file the conversion reads (weights and
    copied files), journaled at the start so --resume can name a changed file."""
    out = {}
    for p in [*source.files(), *source.extra_files()]:
        st = p.stat()
        out[str(p.relative_to(source.root))] = [st.st_size, st.st_mtime_ns]
    return out


def _identity_changes(before: dict | None, now: dict[str, list[int]]) -> list[str]:
    if not isinstance(before, dict):
        return []  # a journal from before identities were recorded: the byte check below still runs
    changes = []
    for name in sorted(set(before) | set(now)):
        a, b = before.get(name), now.get(name)
        if a is None or b is None:
            changes.append(f"{name} {'appeared' if a is None else 'is gone'}")
        elif list(a) != list(b):
            what = "size" if a[0] != b[0] else "mtime"
            changes.append(f"{name}: {what} {a[0] if what == 'size' else a[1]} -> {b[0] if what == 'size' else b[1]}")
    return changes


def _fingerprint(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------- shared experts


def shared_to_precision(experts: list[ExpertTensors], encoding: str,
                        precision: str) -> tuple[list[ExpertTensors], dict]:
    """Shared experts from their checkpoint encoding into the fusable precision.

    Same precision: bytes unchanged. mxfp4 -> mxfp8: exact (each E2M1 value is
    an E4M3 value; the UE8M0 group scales are kept). Otherwise dequantize and
    cast to bf16, or re-quantize to mxfp8 with the reference quantizer; the
    record reports the max absolute change.
    """
    if encoding == precision:
        return experts, {"conversion": "copy", "max_abs_change": 0.0}
    src_row = get_row(encoding)
    if encoding == "mxfp4" and precision == "mxfp8":
        def up(p: ProjectionTensors) -> ProjectionTensors:
            return ProjectionTensors(codecs.e2m1_packed_to_e4m3(p.weight), p.scale)
        return [ExpertTensors(up(e.gate), up(e.up), up(e.down)) for e in experts], \
            {"conversion": "mxfp4->mxfp8 (exact)", "max_abs_change": 0.0}
    out, worst = [], 0.0
    for e in experts:
        projs = []
        for _, p in e.projections():
            if encoding == "nvfp4" and precision == "mxfp8":  # the same bits as the general path, fused
                g = 1.0 if p.global_scale is None else float(p.global_scale)
                w, s, change = codecs.nvfp4_to_mxfp8(p.weight, p.scale, g)
                worst = max(worst, float(change) if w.numel() else 0.0)
                projs.append(ProjectionTensors(w, s))
                continue
            x = p.dequantize(src_row)
            if precision == "bf16":
                q = ProjectionTensors(x.to(torch.bfloat16))
                back = q.weight.float()
            elif precision == "mxfp8":
                w, s = codecs.quantize_mxfp8(x)
                q = ProjectionTensors(w, s)
                back = codecs.dequantize_mx(w, s, "e4m3")
            else:  # pragma: no cover - SHARED_PRECISIONS is mxfp8, bf16
                raise FormatError(f"no conversion of shared experts to {precision!r}")
            worst = max(worst, float((back - x).abs().max()) if x.numel() else 0.0)
            projs.append(q)
        out.append(ExpertTensors(*projs))
    return out, {"conversion": f"{encoding}->{precision} (dequantize, re-encode)", "max_abs_change": worst}


# --------------------------------------------------------------------------- shared precision

SHARED_PRECISION_CHOICES = ("auto", "mxfp8", "bf16")

#: row -> DeepGEMM API flavour -> the shared precisions that flavour fuses (`Row.shared_by_flavour`,
#: docs/KERNELS.md#feature-matrix); the manifest records the choice and the alternative.
SHARED_BY_FLAVOUR = {name: dict(r.shared_by_flavour) for name, r in ROWS.items()}
FLAVOUR_NAMES = {"dg": "newer upstream DeepGEMM", "dgv": "vLLM's DeepGEMM fork", "dgz": "DGz"}


def _flavour(row: Row, f: str) -> str:
    try:
        ep = row.entry_point(f)
    except FormatError:  # pragma: no cover - SHARED_BY_FLAVOUR follows formats.ROWS
        ep = "?"
    return f"{FLAVOUR_NAMES.get(f, f)} ({ep})"


def shared_flavour_note(row: Row, precision: str) -> str:
    """Which DeepGEMM flavours fuse `precision` shared experts for `row`, and
    what the others need instead."""
    table = SHARED_BY_FLAVOUR.get(row.name, {})
    runs = [_flavour(row, f) for f, ps in table.items() if precision in ps]
    note = f"{precision} shared experts fuse on {' and '.join(runs) or 'no known DeepGEMM flavour'}"
    for f, ps in table.items():
        if precision in ps:
            continue
        if ps:
            note += (f"; {_flavour(row, f)} fuses only {' or '.join(ps)} shared experts: "
                     f"convert with --shared-precision {ps[0]} for it")
        else:
            note += f"; {_flavour(row, f)} fuses no shared experts (they run outside the kernel there)"
    return note


def check_shared_precision(row: Row, shared_precision: str) -> None:
    """Usage check of ``--shared-precision`` against the row (before any work):
    an explicit precision the row cannot fuse is refused, naming what it can."""
    if shared_precision not in SHARED_PRECISION_CHOICES:
        raise MegaMoEError(f"--shared-precision {shared_precision!r}; valid: {', '.join(SHARED_PRECISION_CHOICES)}")
    if shared_precision == "auto" or shared_precision in row.fusable_shared:
        return
    if not row.fusable_shared:
        raise FormatError(f"--shared-precision {shared_precision}: row {row.name} cannot fuse shared experts at "
                          "all (they stay in the pass-through files); use --shared-precision auto")
    raise FormatError(f"--shared-precision {shared_precision}: row {row.name} fuses shared experts only as "
                      f"{' or '.join(row.fusable_shared)} "
                      f"({'; '.join(shared_flavour_note(row, p) for p in row.fusable_shared)}); "
                      f"use --shared-precision {' | '.join(('auto',) + row.fusable_shared)}")


def choose_shared(info: MoELayerInfo, row: Row, shared_precision: str = "auto"
                  ) -> tuple[SharedSpec | None, dict]:
    """The layer's fused shared-expert spec and the manifest's shared record,
    under ``--shared-precision``.

    ``auto``: the shared experts' own encoding when the row fuses it (bytes
    copied), else the row's first fusable precision. An explicit precision
    replaces that (the row must fuse it: see `check_shared_precision`). The
    record says what was requested, why this precision, and which DeepGEMM
    flavour needs which precision (``precision_reason``, ``flavour_note``).
    """
    check_shared_precision(row, shared_precision)
    spec, rec = checks.shared_spec_for(info, row)
    if spec is None:
        return None, {**rec, "requested_precision": shared_precision} if rec.get("present") else rec
    sh = info.shared
    if shared_precision == "auto":
        precision = spec.precision
        if precision == sh.encoding:
            why = f"auto: the shared experts' own encoding ({precision}), fusable by row {row.name}: bytes copied"
        else:
            why = (f"auto: the shared experts are {sh.encoding}, which row {row.name} cannot fuse; "
                   f"{precision} is the row's first fusable precision")
    else:
        precision = shared_precision
        why = f"--shared-precision {precision}"
        if precision != spec.precision:
            try:
                spec = SharedSpec(precision, sh.num_shared, sh.intermediate)
            except LayerSpecError as e:
                raise LayerSpecError(f"MoE layer {info.index} ({info.prefix}): --shared-precision {precision}: "
                                     f"{e}") from None
    note = shared_flavour_note(row, precision)
    return spec, {**rec, "precision": precision, "requested_precision": shared_precision,
                  "precision_reason": why, "flavour_note": note}


def _shared_decisions(plans: list["_LayerPlan"]) -> list[dict]:
    """The per-layer shared records of the summary, grouped by decision."""
    groups: list[dict] = []
    for lp in plans:
        r = lp.shared_record
        if not r.get("present"):
            continue
        d = {"precision": r.get("precision") if r.get("fused_capable") else None,
             "requested": r.get("requested_precision", "auto"),
             "reason": r.get("precision_reason") or r.get("reason", ""), "note": r.get("flavour_note", "")}
        for g in groups:
            if all(g[k] == v for k, v in d.items()):
                g["layer_list"].append(lp.info.index)
                break
        else:
            groups.append({**d, "layer_list": [lp.info.index]})
    return [{"layers": _ranges(g.pop("layer_list")), **g} for g in groups]


# --------------------------------------------------------------------------- convert


def convert(
    src: str | Path,
    out: str | Path,
    *,
    revision: str | None = None,
    format: str | None = None,
    quantize: str | None = None,
    ep_size: int = 1,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    on_scale_mismatch: str = "error",
    allow_missing_input_scales: bool = False,
    l2_activation_scale: float | None = None,
    overwrite: bool = False,
    resume: bool = False,
    progress: Progress | None = None,
    log: Log | None = None,
    shared_precision: str = "auto",
    on_step: StepHook | None = None,
    accept_activation_change: bool = False,
    checksum: str = DEFAULT_CHECKSUM,
) -> ConvertSummary:
    """Convert checkpoint `src` (folder or hub id) into a megamoe folder `out`.

    ``shared_precision`` ("auto" | "mxfp8" | "bf16"): the precision fused
    shared experts are written in (see `choose_shared`); an explicit one the
    row cannot fuse raises FormatError. ``accept_activation_change``: convert a
    source whose activation recipe the kernel makes coarser (weight-only,
    FP8 activations on nvfp4; `readers.recipe`), recorded in megamoe.json.

    ``checksum`` ("sha256" | "blake3", see ``megamoe_runtime.digests``): the
    algorithm of the manifest's tensor checksums and file digests. blake3
    hashes several times faster per core (BENCHMARKS.md); sha256 needs no
    extra package to verify and gives the bytes earlier versions wrote.

    Raises MegaMoEError subclasses for bad input (nothing is left under `out`).

    Output safety (``output_dir``): OUT may not overlap the source or contain
    the working directory; ``overwrite`` replaces only a megamoe output; the
    run holds an exclusive lock on OUT throughout (a second run raises
    OutputError naming the holder) and first finishes any swap an earlier run
    was killed in. OUT's missing parent folders are created.

    ``on_step(name)`` (tests): called at each step of ``output_dir`` (after
    every tensor, and between the renames of the final swap), so a test can
    stop the run at exactly that point.
    """
    t0 = time.perf_counter()
    out = resolve_out(out)
    max_bytes = parse_size(max_shard_size)
    if not isinstance(ep_size, int) or ep_size < 1:
        raise MegaMoEError(f"--ep-size {ep_size!r} must be an int >= 1")
    if on_scale_mismatch not in checks.SCALE_MISMATCH_POLICIES:
        raise MegaMoEError(f"--on-scale-mismatch {on_scale_mismatch!r}; "
                           f"valid: {', '.join(checks.SCALE_MISMATCH_POLICIES)}")
    if shared_precision not in SHARED_PRECISION_CHOICES:
        raise MegaMoEError(f"--shared-precision {shared_precision!r}; valid: {', '.join(SHARED_PRECISION_CHOICES)}")
    digests.check_algorithm(checksum, "--checksum")
    digests.new_hasher(checksum)  # blake3 without its package: a clear error before any work
    log = log or (lambda msg: None)
    check_placement(out, source_roots(src))
    created = ensure_parent(out)
    try:
        with OutputLock(out) as lock:
            if lock.stale is not None:
                log(f"note: {lock.path} was left by an earlier run ({lock.stale.describe()}) that is no longer "
                    "running; taking it over")
            summary = _convert_locked(
                src, out, revision=revision, format=format, quantize=quantize, ep_size=ep_size,
                max_bytes=max_bytes, on_scale_mismatch=on_scale_mismatch,
                allow_missing_input_scales=allow_missing_input_scales, l2_activation_scale=l2_activation_scale,
                overwrite=overwrite, resume=resume, progress=progress, log=log, shared_precision=shared_precision,
                on_step=on_step, accept_activation_change=accept_activation_change,
                checksum=checksum)
    except BaseException:
        remove_created(created)  # only the parents this run made, and only while empty
        raise
    summary.seconds = time.perf_counter() - t0
    return summary


def _convert_locked(src, out: Path, *, revision, format, quantize, ep_size: int, max_bytes: int,
                    on_scale_mismatch: str, allow_missing_input_scales: bool, l2_activation_scale,
                    overwrite: bool, resume: bool, progress, log: Log, shared_precision: str,
                    on_step: StepHook | None, accept_activation_change: bool = False,
                    checksum: str = SHA256) -> ConvertSummary:
    """`convert` once it holds OUT's lock."""
    recovered = recover(out, log)
    check_output_target(out, overwrite=overwrite, resume=resume, recovered=recovered is not None)

    source = open_source(src, revision)
    try:
        check_placement(out, source.roots())
        reader = detect_reader(source, format=format, quantize=quantize,
                               accept_activation_change=accept_activation_change)
        row = get_row(reader.row)
        facts = reader.model_facts()
        infos = reader.moe_layers()
        if not infos:
            raise CheckpointError(f"{source.id}: no MoE layers found (format {reader.format_name}); "
                                  "nothing to convert")
        check_shared_precision(row, shared_precision)

        plans = _preflight(reader, source, row, facts, infos, ep_size, on_scale_mismatch,
                           allow_missing_input_scales, log, shared_precision, l2_activation_scale)
        consumed = set(reader.consumed_tensor_names())
        for lp in plans:  # shared experts the row cannot fuse stay in the pass-through files
            if lp.info.shared is not None and lp.spec.shared is None:
                consumed -= set(lp.info.shared.tensor_names)
        slots_by_file = _plan_files(plans, source, consumed, row, ep_size, max_bytes)

        fingerprint = _fingerprint({
            "converter": converter_version(), "format_version": FORMAT_VERSION, "source": source.content_hash(),
            "reader": reader.format_name, "row": row.name, "quantize": quantize, "ep_size": ep_size,
            "max_shard_size": max_bytes, "on_scale_mismatch": on_scale_mismatch,
            "allow_missing_input_scales": allow_missing_input_scales, "shared_precision": shared_precision,
            "l2_activation_scale": l2_activation_scale, "accept_activation_change": bool(accept_activation_change),
            "files": {f: [s.key for s in slots] for f, slots in slots_by_file.items()},
            **({"checksum": checksum} if checksum != SHA256 else {}),
        })
        if recovered is not None:
            changed = _identity_changes(recovered.get("sources"), _source_identity(source))
            if recovered.get("fingerprint") == fingerprint and changed and not overwrite:
                raise SourceChangedError(
                    f"output folder {out} already exists: an interrupted conversion was just completed into it, "
                    f"but the source changed since that run read it ({'; '.join(changed[:3])}"
                    f"{f'; {len(changed) - 3} more' if len(changed) > 3 else ''}), so it is not this source's "
                    "conversion; pass --overwrite to replace it with a conversion of the current source")
            if recovered.get("fingerprint") == fingerprint and not changed:
                log(f"{out} is this conversion, completed from the interrupted run: nothing left to do")
                return _summary_of_output(out, source, reader, row, plans, slots_by_file, ep_size)
            if not overwrite:
                raise OutputError(
                    f"output folder {out} already exists (an interrupted conversion of other inputs or options "
                    "was just completed into it); pass --overwrite to replace it")

        tmp, resuming = prepare_temp_dir(out, overwrite=overwrite, resume=resume, fingerprint=fingerprint)
        threads = torch.get_num_threads()
        # Every op touches one expert (a few MB) and is memory-bound: torch's
        # intra-op pool only adds wake-up/spin overhead (5x slower on a loaded
        # 2-core VM). Hashing and file writes get their own thread (ShardWriter).
        torch.set_num_threads(1)
        # The cyclic garbage collector would rescan the many small objects of the
        # headers and plans again and again while tensors come and go (10-15% of the
        # wall time, measured); a conversion makes no reference cycles worth collecting.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return _run(source, reader, row, facts, plans, slots_by_file, tmp, out, resuming,
                        fingerprint, ep_size, progress, log, on_step,
                        recipe=manifest_record(reader, l2_activation_scale is not None), checksum=checksum)
        except OutputError:
            raise  # e.g. --resume of a different run: keep that run's temp folder
        except MegaMoEError:
            shutil.rmtree(tmp, ignore_errors=True)  # bad input: a resume cannot fix it (the folder is ours)
            raise
        finally:
            torch.set_num_threads(threads)
            if gc_was_enabled:
                gc.enable()
    finally:
        source.close()


def _summary_of_output(out: Path, source, reader, row: Row, plans, slots_by_file, ep_size: int) -> ConvertSummary:
    """The summary of a conversion found complete in OUT (an interrupted run's swap just finished)."""
    from megamoe_runtime.manifest import read_manifest

    m = read_manifest(out)
    total = sum(lp.source_bytes for lp in plans) + sum(
        s.planned.nbytes for slots in slots_by_file.values() for s in slots if s.role == PASSTHROUGH_ROLE)
    return ConvertSummary(
        out=str(out), source=str(source.id), format=reader.format_name, row=row.name, ep_size=ep_size,
        layers=len(plans), experts=sum(lp.info.num_experts for lp in plans), bytes_in=total,
        bytes_out=sum(f.size for f in m.files.values()) + (out / "megamoe.json").stat().st_size,
        seconds=0.0, files=len(m.files) + 1, resumed_files=len(m.files),
        warnings=["completed from an interrupted earlier run of the same conversion: only its final rename "
                  "was left"], shared=_shared_decisions(plans), recipe=m.source.recipe)


def _preflight(reader: CheckpointReader, source: CheckpointSource, row: Row, facts, infos, ep_size: int,
               on_scale_mismatch: str, allow_missing: bool, log: Log,
               shared_precision: str = "auto", l2_activation_scale: float | None = None) -> list[_LayerPlan]:
    plans = []
    for info in infos:
        shared, shared_rec = choose_shared(info, row, shared_precision)
        spec = checks.layer_spec(info, facts, row, ep_size, shared)
        scal = [reader.read_expert_scalars(info.index, e) for e in range(info.num_experts)]
        rep = checks.check_layer_scalars(info, scal, row, on_scale_mismatch=on_scale_mismatch,
                                         allow_missing_input_scales=allow_missing, source=source,
                                         l2_activation_scale=l2_activation_scale)
        if l2_activation_scale is not None:
            log(f"MoE layer {info.index}: a2 = {l2_activation_scale!r} as given (--l2-activation-scale; "
                "the checkpoint has no w2 input scales)")
        if rep.mismatches:
            log(f"MoE layer {info.index}: {len(rep.mismatches)} expert(s) with w1/w3 weight_scale_2 mismatch "
                "will be requantized onto the larger scale")
        if rep.missing_input:
            log(f"MoE layer {info.index}: {len(rep.missing_input)} expert(s) without a w2 input scale; "
                f"a2 = max over the others = {rep.scalars['l2_activation_scale']!r}")
        nbytes = sum(source.nbytes(n) for n in info.expert_tensor_names)
        if shared is not None:
            nbytes += sum(source.nbytes(n) for n in info.shared.tensor_names)
        plans.append(_LayerPlan(info, spec, shared_rec, rep, nbytes))
    return plans


def _plan_files(plans: list[_LayerPlan], source: CheckpointSource, consumed: set[str], row: Row,
                ep_size: int, max_bytes: int) -> dict[str, list[_Slot]]:
    """Every output safetensors file and the tensors it holds, in write order
    (also fills each layer plan's per-rank ``slots``). Expert files per rank,
    layer-major; pass-through files sorted by descending item size, then name,
    as safetensors' own writer orders tensors."""
    slots_by_file: dict[str, list[_Slot]] = {}
    plans_by_index = {lp.info.index: lp for lp in plans}
    for r in range(ep_size):
        rank_items = []
        for lp in plans:
            info, E_l = lp.info, lp.spec.experts_per_rank
            lo = r * E_l
            for role, t in _rank_roles(row, E_l, info.hidden, info.intermediate, lp.spec.shared):
                stored, storage = to_stored(t, storage_of_role(role))
                name = f"{info.prefix}.megamoe.{role}"
                pt = PlannedTensor(name, dtype_name(t.dtype), tuple(stored.shape))
                is_shared = role.startswith("shared_")
                rank_items.append((pt, dict(
                    key=tensor_key(name, r, ep_size), layer=info.index, role=role, ep_rank=r,
                    experts=None if is_shared else (lo, lo + E_l), kernel_shape=tuple(t.shape),
                    kernel_strides=kernel_strides_of(storage, t.shape), storage=storage)))
        shards = plan_shards([pt for pt, _ in rank_items], max_bytes)
        meta = {id(pt): m for pt, m in rank_items}
        for k, shard in enumerate(shards, 1):
            fname = expert_file_name(r, ep_size, k)
            slots = [_Slot(planned=pt, file=fname, **meta[id(pt)]) for pt in shard]
            slots_by_file[fname] = slots
            for s in slots:
                plans_by_index[s.layer].slots.setdefault(r, []).append(s)

    passthrough = sorted(set(source.tensor_names()) - consumed)
    pts = []
    for name in passthrough:
        dt, shape = source.header(name)
        pts.append(PlannedTensor(name, dt, tuple(shape)))
    pts.sort(key=lambda p: (-dtype_itemsize(p.dtype), p.name))
    shards = plan_shards(pts, max_bytes)
    for k, shard in enumerate(shards, 1):
        fname = model_file_name(k, len(shards))
        slots_by_file[fname] = [
            _Slot(key=p.name, planned=p, file=fname, layer=None, role=PASSTHROUGH_ROLE, ep_rank=None,
                  experts=None, kernel_shape=p.shape, kernel_strides=kernel_strides_of(STORAGE_CONTIGUOUS, p.shape),
                  storage=STORAGE_CONTIGUOUS)
            for p in shard]
    return slots_by_file


class _Run:
    """Mutable state of one streaming pass.

    Tensors are queued to their shard writers (hash and write on background
    threads) and their manifest entries recorded in queue order once done.
    Kernel buffers are double-buffered: layer L+1 is read and packed into one
    set while layer L's set is still being hashed and written, so memory is
    about two ranks' layers (independent of model size)."""

    NUM_BUFFER_SETS = 2

    def __init__(self, tmp: Path, journal: Journal, slots_by_file: dict[str, list[_Slot]],
                 done_files: dict[str, dict], total: int, progress: Progress | None,
                 on_step: StepHook | None = None, checksum: str = SHA256):
        self.tmp = tmp
        self.checksum = checksum
        self.on_step = on_step
        self.check_done = False  # resume: re-derive the finished files' tensors and compare (`check`)
        self.checked = 0
        self.journal = journal
        self.slots_by_file = slots_by_file
        self.done_files = done_files  # name -> journal record (size, sha256, digest, tensors)
        self.writers: dict[str, ShardWriter] = {}
        self.entries: dict[str, dict] = {}
        self.total = total
        self.done_bytes = 0
        self.progress = progress
        self._buffers: dict = {}
        self._turn = 0  # which buffer set the next layer packs into
        # (slot, pending digest, buffer set or -1, is a resume check rather than a write)
        self._queued: list[tuple[_Slot, object, int, bool]] = []
        self._check_pool = None
        self._side = None

    def advance(self, n: int) -> None:
        self.done_bytes += n
        if self.progress:
            self.progress(min(self.done_bytes, self.total), self.total)

    def needed(self, slot: _Slot) -> bool:
        return slot.file not in self.done_files

    def writer(self, fname: str) -> ShardWriter:
        w = self.writers.get(fname)
        if w is None:
            slots = self.slots_by_file[fname]
            meta = dict(ST_METADATA)
            if slots[0].ep_rank is not None:  # an expert file names itself (the loader checks it)
                meta.update({FILE_KEY: fname, RANK_KEY: str(slots[0].ep_rank)})
            w = ShardWriter(self.tmp / fname, [s.planned for s in slots], meta, on_step=self.on_step,
                            algorithm=self.checksum, hash_threads=HASH_THREADS)
            self.writers[fname] = w
        return w

    def finish_tensor(self, slot: _Slot, checksum: str) -> None:
        self.entries.setdefault(slot.file, {})[slot.key] = slot.entry(checksum, self.checksum).to_dict()
        w = self.writers[slot.file]
        if len(self.entries[slot.file]) == len(w.plan):  # its last tensor is hashed and written
            size, fsha = w.close()
            del self.writers[slot.file]
            rec = {"name": slot.file, "size": size, "sha256": fsha, "digest": w.digest_kind,
                   "tensors": self.entries.pop(slot.file)}
            self.journal.record_file(slot.file, size, fsha, rec["tensors"], w.digest_kind)
            self.done_files[slot.file] = rec

    def write(self, slot: _Slot, tensor: torch.Tensor, buffer_set: int = -1) -> None:
        """Queue `tensor` (which lives in kernel buffer set `buffer_set`, -1 for
        none) for `slot`; its entry is recorded once hashed and written."""
        stored, _ = to_stored(tensor, slot.storage)
        if tuple(tensor.stride()) != slot.kernel_strides:
            raise MegaMoEError(f"{slot.key}: kernel tensor strides {list(tensor.stride())} do not match the plan "
                               f"{list(slot.kernel_strides)} ({slot.storage})")
        self._queued.append((slot, self.writer(slot.file).write_async(slot.planned.name, stored), buffer_set,
                             False))

    def check(self, slot: _Slot, tensor: torch.Tensor, buffer_set: int = -1) -> None:
        """On resume: the tensor re-derived from the current source must be the
        one the interrupted run wrote into its finished file (journal checksum).
        Hashed on a background thread like a write; compared in `settle`."""
        stored, _ = to_stored(tensor, slot.storage)
        if self._check_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._check_pool = ThreadPoolExecutor(1, thread_name_prefix="megamoe-check")
        data, alg = tensor_bytes(stored), self.checksum
        self._queued.append((slot, self._check_pool.submit(lambda: digests.digest_bytes(alg, data).hex()),
                             buffer_set, True))

    def check_bytes(self, slot: _Slot, got: str) -> None:
        want = self.done_files[slot.file]["tensors"][slot.key].get(self.checksum)
        if got != want:
            where = f"layer {slot.layer} " if slot.layer is not None else ""
            raise SourceChangedError(
                f"--resume refused: the source changed since the interrupted run: {where}tensor {slot.key!r} of "
                f"the finished file {slot.file} would now be {self.checksum} {got[:16]}..., the interrupted run "
                f"wrote {str(want)[:16]}... (same sizes and mtimes, different bytes); the output would mix old and "
                f"new source bytes. Pass --overwrite to discard {self.tmp} and convert again")
        self.checked += 1

    def settle(self, buffer_set: int | None = None) -> None:
        """Record finished tensors in queue order: all of them (`buffer_set`
        None), or up to the last one using `buffer_set` (its memory is then
        free to reuse); also any already done beyond that."""
        if buffer_set is None:
            upto = len(self._queued)
        else:
            upto = max((i + 1 for i, q in enumerate(self._queued) if q[2] == buffer_set), default=0)
        i = 0
        while i < len(self._queued) and (i < upto or self._queued[i][1].done()):
            i += 1
        done, self._queued = self._queued[:i], self._queued[i:]
        for slot, digest, _, is_check in done:
            if is_check:
                self.check_bytes(slot, digest.result())
            else:
                self.finish_tensor(slot, digest.result())

    def buffers(self, row: Row, E_l: int, H: int, I: int
                ) -> tuple[int, tuple[layout.KernelTensors, torch.Tensor, torch.Tensor]]:
        """(set index, one rank's kernel tensors + NVFP4 alphas) to pack the
        next layer into. Sets are allocated once per shape and reused: no
        allocation or page faults per layer. Every byte is overwritten by the
        expert writes (the layout views cover the whole tensors). Writes still
        queued from the set's previous use are waited for first."""
        key = (row.name, E_l, H, I)
        if key not in self._buffers:
            self.settle()  # a different layer shape: let the old ones go
            self._buffers.clear()
            self._buffers[key] = [None] * self.NUM_BUFFER_SETS
        k = self._turn
        self._turn = (self._turn + 1) % self.NUM_BUFFER_SETS
        self.settle(k)
        sets = self._buffers[key]
        if sets[k] is None:
            sets[k] = (layout.allocate_kernel_tensors(row, E_l, H, I),
                       torch.zeros(E_l, 2, dtype=torch.float32), torch.zeros(E_l, dtype=torch.float32))
        return k, sets[k]

    def side_pool(self):
        """One extra worker thread for per-layer work that overlaps the main loop."""
        if self._side is None:
            from concurrent.futures import ThreadPoolExecutor

            self._side = ThreadPoolExecutor(1, thread_name_prefix="megamoe-layer")
        return self._side

    def close_side_pool(self) -> None:
        if self._side is not None:
            self._side.shutdown(wait=True)
            self._side = None

    def abort(self) -> None:
        self.close_side_pool()
        for w in self.writers.values():
            w.abort()
        self.close()

    def close(self) -> None:
        if self._check_pool is not None:
            self._check_pool.shutdown(wait=True)
            self._check_pool = None


def _run(source, reader, row: Row, facts, plans: list[_LayerPlan],
         slots_by_file: dict[str, list[_Slot]], tmp: Path, out: Path, resuming: bool, fingerprint: str,
         ep_size: int, progress: Progress | None, log: Log, on_step: StepHook | None = None,
         recipe: dict | None = None, checksum: str = SHA256) -> ConvertSummary:
    journal = Journal(tmp)
    done_files: dict[str, dict] = {}
    layer_records: dict[int, dict] = {}
    resumed = 0
    identity = _source_identity(source)
    if resuming:
        fp, jfiles, layer_records = journal.load()
        changed = _identity_changes((journal.run_record or {}).get("sources"), identity)
        if changed:
            raise SourceChangedError(
                f"--resume refused: the source changed since the interrupted run ({'; '.join(changed[:3])}"
                f"{f'; {len(changed) - 3} more' if len(changed) > 3 else ''}); the output would mix old and new "
                f"source bytes. Pass --overwrite to discard {tmp} and convert again")
        if fp != fingerprint:
            raise OutputError(
                f"{tmp} holds an interrupted conversion of different inputs or options (run fingerprint "
                f"{str(fp)[:12]}..., this run {fingerprint[:12]}...); pass --overwrite to discard it")
        for name, rec in jfiles.items():
            p = tmp / name
            kind = rec.setdefault("digest", DIGEST_SHA256)  # journals without a kind hashed whole files
            try:
                ok = name in slots_by_file and p.is_file() and p.stat().st_size == rec["size"] \
                    and file_digest(p, kind) == rec["sha256"]
            except MegaMoEError:  # e.g. a damaged header: not finished after all
                ok = False
            if ok:
                done_files[name] = rec
            else:
                log(f"resume: {name} failed its checksum re-check; rewriting it")
        resumed = len(done_files)
        log(f"resume: keeping {resumed} finished file(s) once their tensors are re-derived from the source "
            "and match, redoing the rest")
    else:
        journal.start(fingerprint, sources=identity)

    passthrough_bytes = sum(s.planned.nbytes for slots in slots_by_file.values() for s in slots
                            if s.role == PASSTHROUGH_ROLE)
    total = sum(lp.source_bytes for lp in plans) + passthrough_bytes
    run = _Run(tmp, journal, slots_by_file, done_files, total, progress, on_step, checksum)
    run.check_done = resuming
    repaired = 0
    layer_entries = []
    try:
        for lp in plans:
            rec = _convert_layer(reader, row, lp, ep_size, run, layer_records.get(lp.info.index), log)
            repaired += len(rec["repairs"])
            layer_entries.append(LayerEntry(
                index=lp.info.index, prefix=lp.info.prefix, spec=lp.spec.to_dict(), scalars=lp.scalar_report.scalars,
                shared={**lp.shared_record, **rec["shared"]}, repairs=tuple(rec["repairs"])))
        run.close_side_pool()
        run.settle()
        _copy_passthrough(source, run)
        run.close()
    except BaseException:
        run.abort()
        raise

    # extra files (config annotated), index, manifest
    file_entries: dict[str, FileEntry] = {n: FileEntry(r["size"], r["sha256"], r.get("digest", DIGEST_SHA256))
                                                  for n, r in done_files.items()}
    tensors: dict[str, TensorEntry] = {}
    for rec in done_files.values():
        for key, d in rec["tensors"].items():
            tensors[key] = TensorEntry(
                name=d["name"], layer=d["layer"], role=d["role"], ep_rank=d["ep_rank"],
                experts=tuple(d["experts"]) if d["experts"] is not None else None, file=d["file"],
                dtype=d["dtype"], stored_shape=tuple(d["stored_shape"]), kernel_shape=tuple(d["kernel_shape"]),
                kernel_strides=tuple(d["kernel_strides"]), storage=d["storage"], checksum=d[checksum],
                checksum_kind=checksum)
    missing = [f for f in slots_by_file if f not in done_files]
    if missing:  # pragma: no cover - every planned file is written above
        raise MegaMoEError(f"internal error: files {missing} were planned but not written")

    extra = source.extra_files()
    for w in source.warnings:
        log(f"warning: {w}")
    for p in extra:
        dst = tmp / p.name
        if p.name == "config.json":
            write_bytes_atomic(dst, json_bytes(_annotated_config(source.config, row)))
        elif p.name == "hf_quant_config.json" and isinstance(source.hf_quant_config, dict):
            # engines read this file too: say the experts are no longer in the producer's layout
            note = {"format_version": FORMAT_VERSION, "row": row.name, "manifest": "megamoe.json"}
            write_bytes_atomic(dst, json_bytes({**source.hf_quant_config, "megamoe": note}))
        else:
            shutil.copyfile(p, dst)
        file_entries[p.name] = FileEntry(dst.stat().st_size, digests.hash_file(dst, checksum),
                                         digests.whole_kind(checksum))
    weight_map = {t.name: t.file for t in tensors.values() if t.ep_rank is None or ep_size == 1}
    index = {"metadata": {"total_size": sum(tensors[k].nbytes for k in tensors
                                            if tensors[k].ep_rank is None or ep_size == 1)},
             "weight_map": dict(sorted(weight_map.items()))}
    write_bytes_atomic(tmp / INDEX_NAME, json_bytes(index))
    file_entries[INDEX_NAME] = FileEntry((tmp / INDEX_NAME).stat().st_size,
                                         digests.hash_file(tmp / INDEX_NAME, checksum), digests.whole_kind(checksum))

    manifest = Manifest(
        converter_version=converter_version(),
        source=SourceInfo(id=str(source.id), kind=source.kind, revision=source.commit or source.revision,
                          format=reader.format_name, content_hash=source.content_hash(), recipe=recipe),
        row=row.name, ep_size=ep_size, layers=layer_entries, tensors=tensors, files=file_entries,
        model=_model_facts(facts), checksum=checksum,
    )
    write_manifest(tmp, manifest)
    finalize_output(tmp, out, mark_complete=journal.mark_complete, on_step=on_step)
    return ConvertSummary(
        out=str(out), source=str(source.id), format=reader.format_name, row=row.name, ep_size=ep_size,
        layers=len(plans), experts=sum(lp.info.num_experts for lp in plans), bytes_in=total,
        bytes_out=sum(f.size for f in file_entries.values()) + (out / "megamoe.json").stat().st_size,
        seconds=0.0, files=len(file_entries) + 1, repaired_experts=repaired, resumed_files=resumed,
        warnings=list(source.warnings), shared=_shared_decisions(plans), recipe=recipe)


def _convert_layer(reader, row: Row, lp: _LayerPlan, ep_size: int, run: _Run, journaled: dict | None,
                   log: Log) -> dict:
    """Write one layer's tensors (the ranks whose files are not finished yet)
    and return its record (repairs, shared conversion), journaled once."""
    info = lp.info
    E_l = lp.spec.experts_per_rank
    needed = [r for r in range(ep_size) if any(run.needed(s) or run.check_done for s in lp.slots.get(r, []))]
    if not needed and journaled is not None:
        run.advance(lp.source_bytes)
        return {"repairs": journaled["repairs"], "shared": journaled["shared"]}
    mismatched = {e for e, _, _ in lp.scalar_report.mismatches}
    repairs: list[dict] = []
    where = f"MoE layer {info.index} ({info.prefix})"

    # The shared experts (read, checked, re-encoded, packed) are prepared on a
    # second thread while this one reads the routed experts: torch ops and
    # positional reads release the GIL, so the two overlap on two cores.
    shared_fut = None
    if lp.spec.shared is not None:
        shared_fut = run.side_pool().submit(_prepare_shared, reader, lp, run, needed, where)
    try:
        return _convert_routed(reader, row, lp, ep_size, run, log, needed, mismatched, repairs, where, shared_fut)
    finally:
        if shared_fut is not None and not shared_fut.done():
            shared_fut.cancel()
            try:  # an error elsewhere: let the side thread finish before the source closes
                shared_fut.result()
            except BaseException:
                pass


def _prepare_shared(reader, lp: _LayerPlan, run: _Run, needed: list[int], where: str
                    ) -> tuple[layout.KernelTensors | None, dict]:
    """One layer's fused shared expert, packed (None if no rank needs it), and its record."""
    info = lp.info
    sh = info.shared
    sexperts = reader.read_shared(info.index)
    if not sexperts:
        raise CheckpointError(f"{where}: config declares shared experts but the reader found none")
    for i, ex in enumerate(sexperts):
        ex.validate(sh.encoding, info.hidden, sh.total_intermediate // len(sexperts),
                    f"{where} shared expert {i}")
        for role, p in ex.projections():
            checks.check_block_scales(p, get_row(sh.encoding), f"{where} shared expert {i} {role} scale",
                                      lambda role=role: checks.named_shared(info, role, "scale",
                                                                            reader.source))
    converted, shared_rec = shared_to_precision(sexperts, sh.encoding, lp.spec.shared.precision)
    shared_kt = None
    if any(run.needed(s) or run.check_done for r in needed for s in lp.slots.get(r, [])
           if s.role.startswith("shared_")):
        shared_kt = layout.pack_shared(lp.spec.shared.precision, converted)
    return shared_kt, shared_rec


def _convert_routed(reader, row: Row, lp: _LayerPlan, ep_size: int, run: _Run, log: Log, needed: list[int],
                    mismatched: set, repairs: list, where: str, shared_fut) -> dict:
    """The routed experts of one layer, rank by rank (see `_convert_layer`)."""
    info = lp.info
    E_l = lp.spec.experts_per_rank
    shared_kt, shared_rec = None, {}
    per_expert = lp.source_bytes / max(info.num_experts, 1)
    for r in range(ep_size):
        lo = r * E_l
        if r not in needed:
            for e in sorted(mismatched & set(range(lo, lo + E_l))):  # reports only
                _, rr = checks.requantize_gate_up(reader.read_expert(info.index, e), f"{where} expert {e}")
                repairs.append({"expert": e, **rr})
            run.advance(int(per_expert * E_l))
            continue
        bset, (kt, alpha, l2g) = run.buffers(row, E_l, info.hidden, info.intermediate)
        direct = _DirectWeights(reader, kt)
        for e in range(lo, lo + E_l):
            # the requantize repair needs the weights in hand: those experts take the read_expert path
            if e not in mismatched and direct.read(info.index, e, e - lo):
                et = reader.read_expert(info.index, e, weights=False)  # meta weights: dtype/shape still checked
                checks.check_expert(et, row, info, e, reader.source, weights=direct.weights(row, e - lo))
                layout.write_expert_scales(row, kt, e - lo, et, where=f"{where} expert {e}")
            else:
                et = reader.read_expert(info.index, e)
                checks.check_expert(et, row, info, e, reader.source)
                if e in mismatched:
                    et, rr = checks.requantize_gate_up(et, f"{where} expert {e}")
                    repairs.append({"expert": e, **rr})
                layout.write_expert(row, kt, e - lo, et, where=f"{where} expert {e}")
            if row.weight.has_global_scale:
                alpha[e - lo, 0] = et.gate.global_scale
                alpha[e - lo, 1] = et.up.global_scale
                l2g[e - lo] = et.down.global_scale
            del et
            run.advance(int(per_expert))
        tensors = dict(kt.named())
        if row.weight.has_global_scale:
            tensors["l1_alpha"] = alpha
            tensors["l2_global_scale"] = l2g
        if shared_fut is not None:
            shared_kt, shared_rec = shared_fut.result()
            shared_fut = None
        if shared_kt is not None:
            tensors.update({f"shared_{k}": v for k, v in shared_kt.named().items()})
        for slot in lp.slots.get(r, []):
            if run.needed(slot):
                run.write(slot, tensors[slot.role], -1 if slot.role.startswith("shared_") else bset)
            elif run.check_done:
                run.check(slot, tensors[slot.role], -1 if slot.role.startswith("shared_") else bset)
        del tensors
    if shared_fut is not None:  # no rank wrote anything this time (all finished earlier)
        shared_kt, shared_rec = shared_fut.result()
    rec = {"repairs": repairs, "shared": shared_rec}
    run.journal.record_layer(info.index, rec)
    zeroed = [r for r in repairs if r["zeroed_blocks"]]
    if zeroed:
        log(f"warning: {where}: requantizing w1/w3 onto the larger weight_scale_2 pushed "
            f"{sum(r['zeroed_blocks'] for r in zeroed)} block scale(s) of {len(zeroed)} expert(s) below the E4M3 "
            f"range (they now dequantize to 0; first: expert {zeroed[0]['expert']}, "
            f"max relative change {zeroed[0]['max_rel_change']:.3g})")
    return rec


class _DirectWeights:
    """Routed weights read from the source straight into one rank's kernel
    buffers, where the reader offers their byte ranges
    (``reader.weight_byte_ranges``): one ``preadv`` per expert and half for
    gate/up, with one iovec per 8-row group at its interleaved place (kernel
    rows ``16g + 8*half .. +8``, contiguous), and one read for down (L2
    weights are stored unchanged). This skips the temporary source buffer and
    the ``copy_`` into the kernel layout; the bytes land exactly where
    ``layout.write_l1_weight`` / ``write_l2_weight`` put them."""

    def __init__(self, reader: CheckpointReader, kt: layout.KernelTensors) -> None:
        self.reader = reader
        self.kt = kt
        E_l, n2, dw = kt.l1_weight.shape
        isz = kt.l1_weight.element_size()
        self.groups = n2 // 16
        self.row_bytes = dw * isz
        self.half_bytes = (n2 // 2) * self.row_bytes  # what one gate/up source tensor holds
        #: per half, (kernel byte offset, nbytes) of each 8-row run in source order (layout's placement)
        self.runs = [[(k * self.row_bytes, n * self.row_bytes) for _, k, n in layout.l1_half_row_runs(n2 // 2, h)]
                     for h in (0, 1)] if n2 % 16 == 0 else None
        self.l1_bytes = n2 * dw * isz  # one expert's l1_weight
        self.l2_bytes = kt.l2_weight[0].numel() * kt.l2_weight.element_size()
        self._l1 = self._l2 = None  # byte views, made on first use

    def read(self, layer: int, e: int, slot: int) -> bool:
        """Read expert ``e``'s gate/up/down weights into kernel slot ``slot``;
        False (nothing read) when the reader offers no ranges or their sizes
        do not fit (the read_expert path then reports any problem)."""
        ranges = [self.reader.weight_byte_ranges(layer, e, role) for role in ("gate", "up", "down")]
        if any(r is None for r in ranges) or ranges[0][2] != self.half_bytes or ranges[1][2] != self.half_bytes \
                or ranges[2][2] != self.l2_bytes or self.groups * 16 != self.kt.l1_weight.shape[1]:
            return False
        if self._l1 is None:
            self._l1, self._l2 = byte_view(self.kt.l1_weight), byte_view(self.kt.l2_weight)
        src, base = self.reader.source, slot * self.l1_bytes
        for half in (0, 1):
            path, pos, _ = ranges[half]
            src.read_into(path, pos, [self._l1[base + off: base + off + n] for off, n in self.runs[half]])
        path, pos, _ = ranges[2]
        src.read_into(path, pos, [self._l2[slot * self.l2_bytes:(slot + 1) * self.l2_bytes]])
        return True

    def weights(self, row: Row, slot: int) -> dict[str, Callable[[], torch.Tensor]]:
        """role -> the weight as read_expert would give it, from the kernel
        buffer (for checks that look at weight values: a copy, made only then)."""
        ke = self.kt.expert(slot)
        wdt = row.weight.checkpoint_dtype
        return {"gate": lambda: layout.read_l1_weight(ke.l1_weight, 0).view(wdt),
                "up": lambda: layout.read_l1_weight(ke.l1_weight, 1).view(wdt),
                "down": lambda: ke.l2_weight.view(wdt)}


def _copy_passthrough(source: CheckpointSource, run: _Run) -> None:
    for fname, slots in run.slots_by_file.items():
        if not slots or slots[0].role != PASSTHROUGH_ROLE:
            continue
        if fname in run.done_files:
            if not run.check_done:
                run.advance(sum(s.planned.nbytes for s in slots))
                continue
            for slot in slots:  # resume: the finished file's bytes must still be the source's
                path, pos, n = source.tensor_data_range(slot.planned.name)
                h = digests.new_hasher(run.checksum)
                for chunk in copy_source_bytes(path, pos, n, run.advance):
                    h.update(chunk)
                run.check_bytes(slot, h.hexdigest())
            continue
        for slot in slots:
            th = source.tensor_header(slot.planned.name)
            path = source.file_of(slot.planned.name)
            fh = source.file_header(path)
            chunks = copy_source_bytes(path, 8 + fh.header_len + th.begin, th.nbytes, run.advance)
            run.finish_tensor(slot, run.writer(fname).write_chunks(slot.planned.name, chunks))


def inspect_checkpoint(src: str | Path, *, revision: str | None = None, format: str | None = None,
                       quantize: str | None = None, ep_size: int = 1, shared_precision: str = "auto",
                       accept_activation_change: bool = False, l2_activation_scale: float | None = None) -> dict:
    """What `megamoe-convert inspect` reports (JSON-safe dict).

    Reads headers and the scalar scale tensors only. Problems that would stop
    `convert` (row size rules, EP divisibility, bad or disagreeing scales)
    are collected in ``problems`` rather than raised, so one run shows them
    all; a checkpoint that cannot be opened or read at all still raises.
    ``accept_activation_change`` and ``l2_activation_scale`` are convert's,
    so the report answers for the convert command about to be run.
    """
    source = open_source(src, revision)
    try:
        # accepted here so the report can show the recipe; a change convert would refuse is a problem below
        reader = detect_reader(source, format=format, quantize=quantize, accept_activation_change=True)
        row = get_row(reader.row)
        facts = reader.model_facts()
        infos = reader.moe_layers()
        problems: list[str] = []
        change = reader.activation_change = dataclasses.replace(reader.activation_change,
                                                                accepted=quantize is not None
                                                                or bool(accept_activation_change))
        if change.needs_flag and not change.accepted:
            problems.append(change.summary())
        if not row.has_alphas:
            try:
                checks.check_l2_activation_scale(row, l2_activation_scale)
            except MegaMoEError as e:
                problems.append(str(e))
        layers, groups = [], []
        expert_bytes = 0
        pairs = mismatched = 0
        max_rel = 0.0
        missing_input: dict[int, int] = {}
        consumed = set(reader.consumed_tensor_names())
        shared_notes = {}
        check_shared_precision(row, shared_precision)
        for info in infos:
            try:
                shared, shared_rec = choose_shared(info, row, shared_precision)
            except MegaMoEError as e:  # an explicit precision the layer's sizes refuse
                problems.append(str(e))
                shared, shared_rec = checks.shared_spec_for(info, row)
            if info.shared is not None and shared is None:
                consumed -= set(info.shared.tensor_names)
            spec = None
            try:
                spec = checks.layer_spec(info, facts, row, ep_size, shared)
            except MegaMoEError as e:
                problems.append(str(e))
            layer = {"index": info.index, "prefix": info.prefix, "num_experts": info.num_experts,
                     "hidden": info.hidden, "intermediate": info.intermediate, "shared": shared_rec}
            if row.weight.has_global_scale:
                try:
                    scal = [reader.read_expert_scalars(info.index, e) for e in range(info.num_experts)]
                    rep = checks.check_layer_scalars(info, scal, row, on_scale_mismatch="requantize",
                                                     allow_missing_input_scales=True, report_missing_a2=True,
                                                     l2_activation_scale=l2_activation_scale)
                    layer["scalars"] = rep.scalars
                    layer["w1_w3_mismatches"] = len(rep.mismatches)
                    pairs += info.num_experts
                    mismatched += len(rep.mismatches)
                    for _, g, u in rep.mismatches:
                        max_rel = max(max_rel, abs(g - u) / max(g, u))
                    if rep.mismatches:
                        e, g, u = rep.mismatches[0]
                        problems.append(
                            f"MoE layer {info.index}: {len(rep.mismatches)} expert(s) with w1/w3 weight_scale_2 "
                            f"mismatch (first: expert {e}, {g!r} vs {u!r}); convert needs "
                            "--on-scale-mismatch requantize")
                    if rep.missing_a2:
                        problems.append(rep.missing_a2)
                    if rep.missing_input:
                        missing_input[info.index] = len(rep.missing_input)
                        problems.append(
                            f"MoE layer {info.index}: {len(rep.missing_input)} expert(s) without a w2 input scale; "
                            "convert needs --allow-missing-input-scales")
                except MegaMoEError as e:
                    problems.append(str(e))
            if spec is not None:
                for _, t in _rank_roles(row, spec.experts_per_rank, info.hidden, info.intermediate, spec.shared):
                    expert_bytes += ep_size * t.numel() * t.element_size()
            layers.append(layer)
            key = (info.hidden, info.intermediate, info.num_experts)
            if groups and groups[-1]["key"] == key:
                groups[-1]["layers"].append(info.index)
            else:
                groups.append({"key": key, "layers": [info.index]})
            shared_notes[info.index] = shared_rec
        passthrough = set(source.tensor_names()) - consumed
        pt_bytes = sum(source.nbytes(n) for n in passthrough)
        H, I = (infos[0].hidden, infos[0].intermediate) if infos else (0, 0)
        shapes = {}
        for role in ("gate", "up", "down"):
            w, sc = expected_shapes(row, H, I, role) if infos else ((), None)
            shapes[role] = {"weight": list(w), "scale": list(sc) if sc else None}
        uniq = {json.dumps(v, sort_keys=True) for v in shared_notes.values()}
        shared_summary = (json.loads(uniq.pop()) if len(uniq) == 1 else
                          {str(k): v for k, v in shared_notes.items()})
        if not infos:
            problems.append(f"{source.id}: no MoE layers found")
        return {
            "source": str(source.id), "kind": source.kind, "revision": source.revision,
            "files": len(source.files()), "bytes": sum(p.stat().st_size for p in source.files()),
            "format": reader.format_name, "row": row.name, "model": _model_facts(facts),
            "recipe": manifest_record(reader), "activations": change.summary(),
            "layers": layers,
            "layer_groups": [{"layers": _ranges(g["layers"]), "hidden": g["key"][0], "intermediate": g["key"][1],
                              "num_experts": g["key"][2]} for g in groups],
            "shapes": shapes, "shared": shared_summary,
            "scales": ({"pairs": pairs, "mismatched_pairs": mismatched, "max_rel_diff": max_rel,
                        "tolerance": checks.GATE_UP_RTOL, "missing_input_scales": missing_input}
                       if row.weight.has_global_scale else None),
            "ep_size": ep_size, "estimated_expert_bytes": expert_bytes, "passthrough_bytes": pt_bytes,
            "estimated_output_bytes": expert_bytes + pt_bytes + sum(p.stat().st_size for p in source.extra_files()),
            "problems": problems, "warnings": list(source.warnings),
        }
    finally:
        source.close()


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(out)


def _annotated_config(config: dict, row: Row) -> dict:
    cfg = json.loads(json.dumps(config))
    note = {"format_version": FORMAT_VERSION, "row": row.name, "manifest": "megamoe.json"}
    qc = cfg.get("quantization_config")
    if isinstance(qc, dict):
        qc["megamoe"] = note
    else:
        cfg["quantization_config"] = {"quant_method": "megamoe", "megamoe": note}
    return cfg


def _model_facts(facts) -> dict:
    return {
        "model_type": facts.model_type, "num_experts": facts.num_experts, "top_k": facts.top_k,
        "routed_scaling_factor": float(facts.routed_scaling_factor), "activation": facts.activation.to_dict(),
        "norm_topk_prob": facts.norm_topk_prob, "num_shared": facts.num_shared,
        "shared_intermediate": facts.shared_intermediate,
    }


__all__ = ["convert", "inspect_checkpoint", "ConvertSummary", "converter_version", "expert_file_name",
           "model_file_name", "shared_to_precision", "temp_dir_for", "SHARED_PRECISION_CHOICES", "SHARED_BY_FLAVOUR",
           "shared_flavour_note",
           "check_shared_precision", "choose_shared"]
