"""Reload dry runs: prove a reload's coverage with meta tensors before it touches live memory.

`verify_reload(layer_or_model, checkpoint_dir)` runs the real loaders of every
`DeepGemmMegaMoEExperts` in ``layer_or_model`` against a checkpoint, with:

* **Meta stand-ins** built from safetensors headers only (shape and dtype; no
  data is read). The dtype table covers BF16, F16, F32, F8_E4M3, F8_E5M2,
  F8_E8M0, U8, I8, I32, I64 (and the rest of safetensors' integer/float set).
* **A write-intercepting TorchDispatchMode**: every op whose schema writes an
  argument (``copy_``, ``fill_``, ``out=`` variants, ...) into a real tensor is
  recorded -- destination storage, exact byte runs, source name -- and NOT
  executed: no kernel runs, no live byte changes. View ops run (they only
  make metadata); factory ops are sent to the meta device; any other op on a
  live tensor would read its data and fails the dry run (e.g. ``.item()`` on
  a parameter: loaders must skip host-side scale state for meta sources).
* **Coverage**: for every parameter, the recorded byte runs on its storage
  must tile it exactly: every byte written exactly once (missing and
  duplicated ranges are reported per parameter and expert, with the names
  that wrote them).
* **Names**: checkpoint tensors of the layers in scope that no loader used
  (unused), that no loader understands (unknown), and names present twice.
* **Rebinding guard**: ``_parameters``, ``_buffers`` and ``_modules`` of every
  module are snapshotted (objects and storage identity) before and compared
  after: a loader that rebinds a parameter, swaps ``.data`` or calls ``set_``
  is reported -- and the live model is restored, so a dry run never alters it.

Converted folders (``megamoe.json``) are checked through the pre-laid-out
loader (one copy per stored tensor); a raw checkpoint folder (any
``*.safetensors`` without a manifest) through the vLLM-style raw loader.
Also available as ``megamoe-convert verify OUT --reload-dry-run``.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import MegaMoEError, ReloadError
from ..files.file_io import SafetensorsFile
from ..format.manifest import EXPERT_ROLES, MANIFEST_NAME
from .checkpoint import Checkpoint

__all__ = ["ReloadReport", "ParamCoverage", "verify_reload", "dry_run_checkpoint", "byte_runs"]

_aten = torch.ops.aten
#: ops that rebind or reshape storage instead of writing bytes into it
_REBINDING_OPS = {"set_", "resize_", "resize_as_", "as_strided_", "_resize_output_"}
#: non-view ops that only produce or re-label tensors, safe on live tensors
_PASSTHROUGH_OPS = {"lift_fresh", "detach", "alias", "_has_compatible_shallow_copy_type", "is_same_size",
                    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_contiguous"}


# --------------------------------------------------------------------------- byte runs


def byte_runs(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Byte runs a (strided) view covers in its storage: ``(starts int64 [R], run_bytes)``.

    Dims are ordered by stride; the innermost contiguous dims merge into one
    run, the rest enumerate run starts. Reads no data (metadata only).
    """
    isz = t.element_size()
    off = t.storage_offset()
    dims = sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda d: d[1])
    if any(s == 0 for s in t.shape):
        return torch.empty(0, dtype=torch.int64), 0
    run = 1
    i = 0
    if dims and dims[0][1] == 1:
        run = dims[0][0]
        i = 1
        while i < len(dims) and dims[i][1] == run:
            run *= dims[i][0]
            i += 1
    starts = torch.tensor([off], dtype=torch.int64)
    for s, st in dims[i:]:
        starts = (starts[:, None] + torch.arange(s, dtype=torch.int64) * st).reshape(-1)
    return starts * isz, run * isz


# --------------------------------------------------------------------------- interception


@dataclass
class _Tracked:
    key: int
    label: str  # "prefix.role"
    layer: str
    role: str
    nbytes: int
    is_param: bool
    experts: Optional[tuple[int, int]]  # (first global expert, E_l) for expert-stacked params


@dataclass
class _Write:
    key: int
    starts: torch.Tensor
    run: int
    source: str
    op: str


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _WriteInterceptor(TorchDispatchMode):
    """Records writes into real tensors instead of running them (see module doc)."""

    def __init__(self, tracked: dict[int, _Tracked]):
        super().__init__()
        self.tracked = tracked
        self.writes: list[_Write] = []
        self.untracked: list[str] = []
        self.rebinds: list[str] = []
        self.live_reads: list[str] = []
        self.source = "<loader>"

    def _label(self, t: torch.Tensor) -> str:
        tr = self.tracked.get(_storage_key(t))
        return tr.label if tr else f"<untracked {t.device} {t.dtype} {list(t.shape)}>"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        name = schema.name.split("::")[-1]
        targets = []
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if i < len(args) else kwargs.get(a.name)
                if isinstance(v, torch.Tensor):
                    targets.append(v)
                elif isinstance(v, (list, tuple)):
                    targets.extend(x for x in v if isinstance(x, torch.Tensor))
        if targets:
            # a write into a verified layer's storage (live, or meta when the layer itself was
            # built on the meta device) is recorded, never run; a write into a meta temporary
            # of the loader is harmless and runs; anything else is a write into live memory
            hits = [t for t in targets if _storage_key(t) in self.tracked or not t.is_meta]
            if not hits:
                return func(*args, **kwargs)
            for t in hits:
                if name in _REBINDING_OPS:
                    self.rebinds.append(f"{self._label(t)}: {name} (via {self.source}) rebinds or resizes storage; "
                                        "only copy_ into the existing storage is allowed")
                    continue
                key = _storage_key(t)
                if key not in self.tracked:
                    self.untracked.append(f"{self.source}: {func} wrote into a live tensor that is not a parameter "
                                          f"or buffer of the layers being verified ({t.device} {t.dtype} {list(t.shape)})")
                    continue
                starts, run = byte_runs(t)
                self.writes.append(_Write(key, starts, run, self.source, name))
            return targets[0] if len(targets) == 1 else tuple(targets)
        if func.is_view or name in _PASSTHROUGH_OPS:
            return func(*args, **kwargs)
        tensors = [a for a in _flat(args) + _flat(list(kwargs.values())) if isinstance(a, torch.Tensor)]
        live = [t for t in tensors if not t.is_meta]
        if not live:
            if not tensors and "device" in kwargs:
                kwargs = dict(kwargs, device=torch.device("meta"))
            elif not tensors and any(a.name == "device" for a in schema.arguments):
                kwargs = dict(kwargs, device=torch.device("meta"))
            return func(*args, **kwargs)
        self.live_reads.append(f"{self.source}: {func} would read live data of {self._label(live[0])}; a dry run "
                               "runs no kernel on real tensors (loaders must skip host-side state for meta sources)")
        raise ReloadError(self.live_reads[-1])


def _flat(xs: Any) -> list:
    out = []
    for x in xs:
        if isinstance(x, (list, tuple)):
            out.extend(_flat(x))
        else:
            out.append(x)
    return out


# --------------------------------------------------------------------------- report


@dataclass
class ParamCoverage:
    """Coverage of one parameter's storage."""

    label: str
    nbytes: int
    written_bytes: int = 0
    writes: int = 0
    missing: list[tuple[int, int]] = field(default_factory=list)  # byte ranges [lo, hi)
    duplicated: list[tuple[int, int]] = field(default_factory=list)
    missing_experts: list[int] = field(default_factory=list)
    duplicated_experts: list[int] = field(default_factory=list)
    duplicated_by: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.duplicated

    def to_dict(self) -> dict:
        return {"nbytes": self.nbytes, "written_bytes": self.written_bytes, "writes": self.writes,
                "missing": [list(r) for r in self.missing[:16]], "duplicated": [list(r) for r in self.duplicated[:16]],
                "missing_experts": self.missing_experts, "duplicated_experts": self.duplicated_experts,
                "duplicated_by": self.duplicated_by[:16], "ok": self.ok}


@dataclass
class ReloadReport:
    """Result of `verify_reload`. ``ok`` iff every parameter byte is written
    exactly once, no name is unknown, unused or duplicated, nothing was
    rebound, no live data was read or written, and no loader raised."""

    checkpoint: str
    mode: str  # "prelaid" | "raw"
    layers: list[str] = field(default_factory=list)
    params: dict[str, ParamCoverage] = field(default_factory=dict)
    unknown_names: list[str] = field(default_factory=list)
    unused_names: list[str] = field(default_factory=list)
    duplicate_names: list[str] = field(default_factory=list)
    rebinds: list[str] = field(default_factory=list)
    untracked_writes: list[str] = field(default_factory=list)
    live_reads: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    plan: Counter = field(default_factory=Counter)
    writes: int = 0
    ep_rank: Optional[int] = None

    @property
    def missing(self) -> dict[str, ParamCoverage]:
        return {k: v for k, v in self.params.items() if v.missing}

    @property
    def duplicated(self) -> dict[str, ParamCoverage]:
        return {k: v for k, v in self.params.items() if v.duplicated}

    @property
    def ok(self) -> bool:
        return (all(p.ok for p in self.params.values()) and not self.unknown_names and not self.unused_names
                and not self.duplicate_names and not self.rebinds and not self.untracked_writes
                and not self.live_reads and not self.errors)

    def problems(self) -> list[str]:
        """One line per defect, naming the parameter, experts and tensors."""
        out: list[str] = []
        for lbl, p in self.params.items():
            if p.missing:
                ex = f" (experts {_ids(p.missing_experts)})" if p.missing_experts else ""
                out.append(f"{lbl}: {sum(b - a for a, b in p.missing)} of {p.nbytes} bytes never written{ex}")
            if p.duplicated:
                ex = f" (experts {_ids(p.duplicated_experts)})" if p.duplicated_experts else ""
                by = f"; written by {', '.join(sorted(set(p.duplicated_by))[:6])}" if p.duplicated_by else ""
                out.append(f"{lbl}: {sum(b - a for a, b in p.duplicated)} bytes written more than once{ex}{by}")
        out += [f"unknown checkpoint tensor: {n}" for n in self.unknown_names]
        out += [f"unused checkpoint tensor: {n}" for n in self.unused_names]
        out += [f"duplicate checkpoint tensor: {n}" for n in self.duplicate_names]
        out += [f"rebinding: {r}" for r in self.rebinds]
        out += [f"write outside the layers: {w}" for w in self.untracked_writes]
        out += [f"live data read: {r}" for r in self.live_reads]
        out += [f"loader error: {e}" for e in self.errors]
        return out

    def summary(self) -> str:
        total = sum(p.nbytes for p in self.params.values())
        rank = f" rank {self.ep_rank}" if self.ep_rank is not None else ""
        head = (f"reload dry run ({self.mode}){rank} of {self.checkpoint}: {len(self.layers)} layer(s), "
                f"{len(self.params)} parameters, {total} bytes, {self.writes} writes: ")
        if self.ok:
            return head + "OK (every parameter byte written exactly once, no rebinding, all names used)"
        probs = self.problems()
        return head + f"{len(probs)} problem(s)\n  " + "\n  ".join(probs[:50])

    def raise_if_failed(self) -> None:
        if not self.ok:
            raise ReloadError(self.summary())

    def to_dict(self) -> dict:
        return {"checkpoint": self.checkpoint, "mode": self.mode, "ep_rank": self.ep_rank, "ok": self.ok,
                "layers": self.layers,
                "writes": self.writes, "params": {k: v.to_dict() for k, v in self.params.items()},
                "unknown_names": self.unknown_names, "unused_names": self.unused_names,
                "duplicate_names": self.duplicate_names, "rebinds": self.rebinds,
                "untracked_writes": self.untracked_writes, "live_reads": self.live_reads, "errors": self.errors,
                "problems": self.problems()}


def _ids(xs: list[int]) -> str:
    return ", ".join(str(x) for x in xs[:12]) + (" ..." if len(xs) > 12 else "")


# --------------------------------------------------------------------------- snapshots (rebinding guard)


def _fingerprint(t: Optional[torch.Tensor]) -> Optional[tuple]:
    if t is None:
        return None
    return (_storage_key(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


@dataclass
class _Snapshot:
    modules: list[tuple[str, nn.Module, dict, dict, dict]]
    data: dict[int, tuple[Optional[tuple], Optional[torch.Tensor]]]  # id(tensor) -> (fingerprint, .data alias)


def _snapshot(root: nn.Module) -> _Snapshot:
    mods = []
    data: dict[int, tuple] = {}
    for name, m in root.named_modules(remove_duplicate=False):
        mods.append((name, m, dict(m._parameters), dict(m._buffers), dict(m._modules)))
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None and id(t) not in data:
                data[id(t)] = (_fingerprint(t), t.data)
    return _Snapshot(mods, data)


def _check_and_restore(snap: _Snapshot) -> list[str]:
    issues: list[str] = []
    for name, m, params, bufs, subs in snap.modules:
        pre = f"{name}." if name else ""
        for kind, before, now in (("parameter", params, m._parameters), ("buffer", bufs, m._buffers),
                                  ("module", subs, m._modules)):
            for k in sorted(set(before) | set(now)):
                b, a = before.get(k, _MISSING), now.get(k, _MISSING)
                if a is b:
                    continue
                if b is _MISSING:
                    issues.append(f"{pre}{k}: a new {kind} was registered during the load")
                    del now[k]
                elif a is _MISSING:
                    issues.append(f"{pre}{k}: {kind} was removed during the load")
                    now[k] = b
                else:
                    issues.append(f"{pre}{k}: {kind} rebound to a new object during the load (a loader must copy_ "
                                  "into the existing storage, never assign a new tensor)")
                    now[k] = b
        for k, t in list(m._parameters.items()) + list(m._buffers.items()):
            if t is None or id(t) not in snap.data:
                continue
            fp, alias = snap.data[id(t)]
            if _fingerprint(t) != fp:
                issues.append(f"{pre}{k}: storage changed during the load (.data swapped or set_); "
                              "CUDA-graph pointers would go stale")
                with torch.no_grad():
                    t.data = alias
    return issues


class _Missing:
    pass


_MISSING = _Missing()


# --------------------------------------------------------------------------- the dry run


def _find_layers(root: nn.Module) -> dict[str, Any]:
    from ..layer.experts import DeepGemmMegaMoEExperts

    if not isinstance(root, nn.Module):
        raise ReloadError(f"verify_reload takes a layer or a model (torch.nn.Module), got {type(root).__name__}")
    out = {}
    for name, m in root.named_modules():
        if isinstance(m, DeepGemmMegaMoEExperts):
            out[name or m.prefix or "layer"] = m
    if not out:
        raise ReloadError("verify_reload: no DeepGemmMegaMoEExperts layer in the given module")
    return out


def _tracked_of(layers: dict[str, Any]) -> dict[int, _Tracked]:
    tracked: dict[int, _Tracked] = {}
    for lname, layer in layers.items():
        shown = layer.prefix or lname
        items = [(n, t, True) for n, t in layer.named_parameters()] + [(n, t, False) for n, t in layer.named_buffers()]
        owned = set(layer.checkpoint_roles())
        for n, t, is_param in items:
            key = _storage_key(t)
            if key in tracked:
                continue
            role = n.rsplit(".", 1)[-1]
            if is_param and role not in owned:
                is_param = False  # packed from an engine module at construction: not the checkpoint's to write
            experts = None
            if role in EXPERT_ROLES and t.dim() >= 1 and t.shape[0] == layer.spec.experts_per_rank:
                experts = (layer.spec.local_experts.start, layer.spec.experts_per_rank)
            tracked[key] = _Tracked(key, f"{shown}.{n}", shown, role, t.untyped_storage().nbytes(), is_param, experts)
    return tracked


def _coverage(tr: _Tracked, writes: list[_Write]) -> ParamCoverage:
    cov = ParamCoverage(tr.label, tr.nbytes)
    mine = [w for w in writes if w.key == tr.key and w.run > 0 and w.starts.numel()]
    cov.writes = len(mine)
    if not mine:
        if tr.nbytes:
            cov.missing = [(0, tr.nbytes)]
            if tr.experts:
                cov.missing_experts = [tr.experts[0] + e for e in range(tr.experts[1])]
        return cov
    starts = torch.cat([w.starts for w in mine])
    ends = torch.cat([w.starts + w.run for w in mine])
    wid = torch.cat([torch.full_like(w.starts, i) for i, w in enumerate(mine)])
    cov.written_bytes = int((ends - starts).sum())
    order = torch.argsort(starts, stable=True)
    s, e, wid = starts[order], ends[order], wid[order]
    cmax, cidx = torch.cummax(e, dim=0)
    per_expert = tr.nbytes // tr.experts[1] if tr.experts else None

    def experts_of(lo: int, hi: int) -> list[int]:
        if not per_expert:
            return []
        return [tr.experts[0] + x for x in range(lo // per_expert, (hi - 1) // per_expert + 1)]

    dup_experts: set[int] = set()
    miss_experts: set[int] = set()
    # overlaps: run i starts before the furthest end of the runs before it
    if s.numel() > 1:
        prev_end = cmax[:-1]
        ov = (s[1:] < prev_end).nonzero().flatten() + 1
        for i in ov[:4096].tolist():
            lo, hi = int(s[i]), int(min(e[i], cmax[i - 1]))
            cov.duplicated.append((lo, hi))
            cov.duplicated_by += [mine[int(wid[i])].source, mine[int(wid[int(cidx[i - 1])])].source]
            dup_experts.update(experts_of(lo, hi))
    # gaps: before the first run, between runs, after the last
    bounds_lo = torch.cat([torch.zeros(1, dtype=torch.int64), cmax])
    bounds_hi = torch.cat([s, torch.tensor([tr.nbytes], dtype=torch.int64)])
    gap = (bounds_hi > bounds_lo).nonzero().flatten()
    for i in gap[:4096].tolist():
        lo, hi = int(bounds_lo[i]), int(bounds_hi[i])
        cov.missing.append((lo, hi))
        miss_experts.update(experts_of(lo, hi))
    # sets, sorted once: a membership scan of the growing list was quadratic in the experts (800k: > 10 min)
    cov.duplicated_experts, cov.missing_experts = sorted(dup_experts), sorted(miss_experts)
    if int(cmax[-1]) > tr.nbytes:
        cov.duplicated.append((tr.nbytes, int(cmax[-1])))  # out of bounds: cannot happen for real views
    cov.missing = _merge(cov.missing)
    cov.duplicated = _merge(cov.duplicated)
    return cov


def _merge(rs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(rs):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def verify_reload(layer_or_model: nn.Module, checkpoint_dir: Union[str, os.PathLike], *,
                  raise_on_failure: bool = False, adopt_semantics: bool = False) -> ReloadReport:
    """Dry-run a reload of every MegaMoE layer in ``layer_or_model`` from
    ``checkpoint_dir`` (converted folder or raw checkpoint) and report coverage.

    Touches no live byte and reads no tensor data but the NVFP4 global scales: sources are meta tensors
    from the safetensors headers and every write is intercepted. The layers'
    own loaders run (``load_stored`` / ``weight_loader``), so a broken or
    monkeypatched loader is what gets checked. The live module is restored
    if a loader rebinds anything. See the module docstring for the checks.
    A converted folder first goes through `load_checks.check_layer_load`, the
    checks the real reload makes (spec and semantics -- ``adopt_semantics``
    as for `Checkpoint.load_layer` --, files, headers, destinations, and the
    NVFP4 global scales, the only tensor bytes it reads: a few per expert).
    """
    root = Path(checkpoint_dir)
    layers = _find_layers(layer_or_model)
    mode = "prelaid" if (root / MANIFEST_NAME).is_file() else "raw"
    rep = ReloadReport(str(root), mode, layers=[m.prefix or n for n, m in layers.items()])
    tracked = _tracked_of(layers)
    snap = _snapshot(layer_or_model)
    icpt = _WriteInterceptor(tracked)
    try:
        with torch.no_grad(), icpt:
            if mode == "prelaid":
                _dry_prelaid(root, layers, icpt, rep, adopt_semantics=adopt_semantics)
            else:
                _dry_raw(root, layers, icpt, rep)
    finally:
        rep.rebinds += _check_and_restore(snap)
    rep.rebinds = icpt.rebinds + rep.rebinds
    rep.untracked_writes = icpt.untracked
    rep.live_reads = icpt.live_reads
    rep.writes = len(icpt.writes)
    for tr in tracked.values():
        if tr.is_param:
            rep.params[tr.label] = _coverage(tr, icpt.writes)
    for w in icpt.writes:
        rep.plan[(w.source, tracked[w.key].label, w.op)] += 1
    if raise_on_failure:
        rep.raise_if_failed()
    return rep


def dry_run_checkpoint(checkpoint_dir: Union[str, os.PathLike], *, ep_size: Optional[int] = None) -> list[ReloadReport]:
    """Dry-run a full reload of a converted folder, one report per EP rank.

    Builds every layer of every rank on the META device (no memory, no data)
    with the checkpoint's own EP size (or ``ep_size``) and runs
    `verify_reload` on them: what ``megamoe-convert verify OUT
    --reload-dry-run`` prints.
    """
    ckpt = Checkpoint(checkpoint_dir)
    n = ep_size or ckpt.ep_size
    reports = []
    for rank in range(n):
        model = nn.ModuleDict({f"layer{li.index}": ckpt.allocate_layer(li.index, "meta", "reference", rank, n)
                               for li in ckpt.layers})
        rep = verify_reload(model, checkpoint_dir)
        rep.ep_rank = rank
        reports.append(rep)
    return reports


def _guard(rep: ReloadReport, icpt: _WriteInterceptor, source: str, fn: Callable[[], Any]) -> Any:
    icpt.source = source
    try:
        return fn()
    except ReloadError as e:
        if str(e) not in icpt.live_reads:
            rep.errors.append(f"{source}: {e}")
    except (MegaMoEError, RuntimeError, TypeError, ValueError, IndexError, KeyError) as e:
        rep.errors.append(f"{source}: {type(e).__name__}: {e}")
    return None


def _dry_prelaid(root: Path, layers: dict[str, Any], icpt: _WriteInterceptor, rep: ReloadReport, *,
                 adopt_semantics: bool = False) -> None:
    """Each layer goes through `load_checks.check_layer_load` -- the very checks `Checkpoint.load_layer` runs
    before its first byte, so the dry run and the real reload cannot disagree -- and then its loaders run on meta
    stand-ins built from the headers those checks validated."""
    from .load_checks import check_layer_load

    try:
        ckpt = Checkpoint(root)
    except MegaMoEError as e:
        rep.errors.append(str(e))
        return
    m = ckpt.manifest
    consumed: Counter = Counter()
    headers: dict[str, Any] = {}
    for lname, layer in layers.items():
        chk = check_layer_load(ckpt, layer, verify="headers", adopt_semantics=adopt_semantics, check_folder=False)
        rep.errors += [p for p in chk.problems if p not in rep.errors]
        headers.update(chk.headers)
        for it in chk.items:
            te = it.entry
            if te.role not in chk.wanted:
                rep.unused_names.append(f"{te.name} ({te.file}): role {te.role} has no destination in "
                                        f"{layer.prefix or lname}")
                continue
            h = chk.headers.get(te.file)
            if h is None:
                continue  # its problems are reported above
            en = h.tensors[te.name]
            src = torch.empty(en.shape, dtype=en.torch_dtype, device="meta")
            if it.src_range is not None:
                src = src[it.src_range[0]:it.src_range[1]]
            consumed[(te.file, te.name)] += 1
            _guard(rep, icpt, te.name, lambda layer=layer, te=te, src=src, experts=it.experts: layer.load_stored(
                te.role, src, storage=te.storage, experts=experts, name=te.name))
    # names in the files the layers read that the manifest does not list
    listed = {(te.file, te.name) for te in m.tensors.values()}
    for file in sorted(headers):
        for name in sorted(headers[file].tensors):
            if (file, name) not in listed:
                rep.unknown_names.append(f"{name} ({file}): not listed in {MANIFEST_NAME}")
    rep.duplicate_names += [f"{n} ({fi}) loaded {c} times" for (fi, n), c in consumed.items() if c > 1]


def _raw_files(root: Path) -> list[Path]:
    files = sorted(p for p in root.glob("*.safetensors"))
    if not files:
        raise ReloadError(f"{root}: no {MANIFEST_NAME} and no *.safetensors files: nothing to reload from")
    return files


def _dry_raw(root: Path, layers: dict[str, Any], icpt: _WriteInterceptor, rep: ReloadReport) -> None:
    from ..layer.loaders import parse_expert_weight_name

    by_prefix = {}
    for lname, layer in layers.items():
        by_prefix[layer.prefix or lname] = layer
    try:
        paths = _raw_files(root)
    except ReloadError as e:
        rep.errors.append(str(e))
        return
    seen: dict[str, str] = {}
    for path in paths:
        try:
            f = SafetensorsFile(path)
        except MegaMoEError as e:
            rep.errors.append(str(e))
            continue
        with f:
            for name in sorted(f.entries):
                ref = parse_expert_weight_name(name)
                if ref is None or ref.prefix not in by_prefix:
                    continue  # not an expert tensor of a layer in scope (router, norms, other layers)
                layer = by_prefix[ref.prefix]
                if name in seen:
                    rep.duplicate_names.append(f"{name} in {seen[name]} and {path.name}")
                else:
                    seen[name] = path.name
                if ref.unsupported:
                    rep.unknown_names.append(f"{name} ({path.name}): {ref.unsupported}")
                    continue
                try:
                    src = f.meta(name)
                except MegaMoEError as e:
                    rep.errors.append(str(e))
                    continue
                if ref.shared:
                    if layer.param_for_role(ref.weight_role) is None:
                        rep.unused_names.append(f"{name} ({path.name}): the layer has no shared expert parameters")
                        continue
                    _guard(rep, icpt, name, lambda layer=layer, src=src, ref=ref: layer.shared_weight_loader(
                        None, src, ref.name, ref.shard_id))
                    continue
                if ref.expert_id >= layer.spec.num_experts:
                    rep.unknown_names.append(f"{name} ({path.name}): expert {ref.expert_id} >= num_experts "
                                             f"{layer.spec.num_experts}")
                    continue
                _guard(rep, icpt, name, lambda layer=layer, src=src, ref=ref: layer.weight_loader(
                    None, src, ref.name, ref.shard_id, ref.expert_id))
