"""The plan of a conversion: every output tensor and file, before a byte is read.

Kernel shapes follow from the layer sizes, so the converter knows each output
tensor's name, dtype, stored shape, file and manifest entry up front
(`plan_files`); the streaming writer then only fills the plan in. The run's
fingerprint and the source's identity (sizes and mtimes) are planned here
too: they decide whether ``--resume`` may reuse an interrupted run's files.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Callable

import torch

from megamoe_runtime.files.digests import SHA256
from megamoe_runtime.format import layout
from megamoe_runtime.format.formats import LayerSpec, Row
from megamoe_runtime.format.manifest import (
    PASSTHROUGH_ROLE,
    STORAGE_CONTIGUOUS,
    TensorEntry,
    dtype_itemsize,
    dtype_name,
    kernel_strides_of,
    storage_of_role,
    tensor_key,
    to_stored,
)
from megamoe_runtime.format.roles import is_shared_role, shared_role

from . import checks
from ..output.output_dir import OutputError
from ..readers.base import MoELayerInfo
from ..output.shard_writer import PlannedTensor, plan_shards
from ..readers.source import CheckpointSource

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


def report_stage(progress: Progress | None, text: str) -> None:
    """Tell a progress display that supports it (`progress.ProgressDisplay.stage`) which phase without
    bytes the run is in (checking, planning, finishing), so the screen or log is never silent; a plain
    ``(done, total)`` callable is left alone."""
    fn = getattr(progress, "stage", None)
    if fn is not None:
        fn(text)


def report_file(progress: Progress | None, name: str) -> None:
    """The output file the byte pass is writing, for displays that show it (`ProgressDisplay.writing`)."""
    fn = getattr(progress, "writing", None)
    if fn is not None:
        fn(name)


def report_where(progress: Progress | None, text: str) -> None:
    """Where the byte pass is (``layer 3/8 model.layers.3.mlp``), for displays that show it."""
    fn = getattr(progress, "where", None)
    if fn is not None:
        fn(text)


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


@dataclass(frozen=True)
class Slot:
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
class LayerPlan:
    info: MoELayerInfo
    spec: LayerSpec
    shared_record: dict
    scalar_report: checks.LayerScalarReport
    source_bytes: int
    slots: dict[int, list[Slot]] = field(default_factory=dict)  # rank -> slots in write order


def rank_roles(row: Row, E_l: int, H: int, I: int, shared: "checks.SharedSpec | None"
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
        roles += [(shared_role(r), t) for r, t in skt.named().items()]
    return sorted(roles, key=lambda rt: (-rt[1].element_size(), rt[0]))


def plan_files(plans: list[LayerPlan], source: CheckpointSource, consumed: set[str], row: Row,
                ep_size: int, max_bytes: int) -> dict[str, list[Slot]]:
    """Every output safetensors file and the tensors it holds, in write order
    (also fills each layer plan's per-rank ``slots``). Expert files per rank,
    layer-major; pass-through files sorted by descending item size, then name,
    as safetensors' own writer orders tensors."""
    slots_by_file: dict[str, list[Slot]] = {}
    plans_by_index = {lp.info.index: lp for lp in plans}
    for r in range(ep_size):
        rank_items = []
        for lp in plans:
            info, E_l = lp.info, lp.spec.experts_per_rank
            lo = r * E_l
            for role, t in rank_roles(row, E_l, info.hidden, info.intermediate, lp.spec.shared):
                stored, storage = to_stored(t, storage_of_role(role, row if not is_shared_role(role) else None))
                name = f"{info.prefix}.megamoe.{role}"
                pt = PlannedTensor(name, dtype_name(t.dtype), tuple(stored.shape))
                is_shared = is_shared_role(role)
                rank_items.append((pt, dict(
                    key=tensor_key(name, r, ep_size), layer=info.index, role=role, ep_rank=r,
                    experts=None if is_shared else (lo, lo + E_l), kernel_shape=tuple(t.shape),
                    kernel_strides=kernel_strides_of(storage, t.shape), storage=storage)))
        shards = plan_shards([pt for pt, _ in rank_items], max_bytes)
        meta = {id(pt): m for pt, m in rank_items}
        for k, shard in enumerate(shards, 1):
            fname = expert_file_name(r, ep_size, k)
            slots = [Slot(planned=pt, file=fname, **meta[id(pt)]) for pt in shard]
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
            Slot(key=p.name, planned=p, file=fname, layer=None, role=PASSTHROUGH_ROLE, ep_rank=None,
                  experts=None, kernel_shape=p.shape, kernel_strides=kernel_strides_of(STORAGE_CONTIGUOUS, p.shape),
                  storage=STORAGE_CONTIGUOUS)
            for p in shard]
    return slots_by_file


class SourceChangedError(OutputError):
    """--resume of a run whose source changed since it was interrupted."""


def source_identity(source: CheckpointSource) -> dict[str, list[int]]:
    """name -> [size, mtime_ns] of every source file the conversion reads (weights and
    copied files), journaled at the start so --resume can name a changed file."""
    out = {}
    for p in [*source.files(), *source.extra_files()]:
        st = p.stat()
        out[str(p.relative_to(source.root))] = [st.st_size, st.st_mtime_ns]
    return out


def identity_changes(before: dict | None, now: dict[str, list[int]]) -> list[str]:
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


def run_fingerprint(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def layer_ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(out)


def model_record(facts) -> dict:
    return {
        "model_type": facts.model_type, "num_experts": facts.num_experts, "top_k": facts.top_k,
        "routed_scaling_factor": float(facts.routed_scaling_factor), "activation": facts.activation.to_dict(),
        "norm_topk_prob": facts.norm_topk_prob, "num_shared": facts.num_shared,
        "shared_intermediate": facts.shared_intermediate,
    }


__all__ = ["Progress", "report_stage", "report_where", "converter_version", "expert_file_name", "model_file_name", "Slot", "LayerPlan",
           "rank_roles", "plan_files", "SourceChangedError", "source_identity", "identity_changes",
           "run_fingerprint", "layer_ranges", "model_record"]
