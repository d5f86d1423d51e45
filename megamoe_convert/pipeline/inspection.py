"""`megamoe-convert inspect`: what a conversion would do, and what would stop it.

Runs the preflight's checks in collecting mode (every problem listed, none
raised) and estimates the output, reading headers and scalar scales only.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from megamoe_runtime.errors import MegaMoEError
from megamoe_runtime.format.canonical import expected_shapes
from megamoe_runtime.format.formats import get_row

from . import checks
from .plan import LayerPlan, layer_ranges, model_record, plan_files, rank_roles
from .preflight import layer_decisions, layer_scalars
from ..readers import detect_reader
from ..readers.recipe import manifest_record
from .shared import check_shared_precision
from ..readers.source import open_source


@dataclass
class InspectReport:
    """What `inspect_checkpoint` found, as `ConvertSummary` is what `convert` did: the CLI prints it, ``--json``
    dumps `to_dict()` (keys in field order). `ok` is False when convert would refuse (``problems``).

    The nested records (``model``, ``recipe``, ``layers``, ``shapes``, ``shared``, ``scales``) are the JSON the
    report shows, as the manifest and the summary write them; they stay dicts so both print the same bytes."""

    source: str
    kind: str
    revision: str | None
    files: int
    bytes: int  # of the source's safetensors files
    format: str
    row: str
    model: dict
    recipe: dict | None  # what megamoe.json ``source.recipe`` would hold
    activations: str
    layers: list[dict]  # per MoE layer: index, prefix, sizes, ``shared``; ``scalars`` and mismatches with alphas
    layer_groups: list[dict]  # consecutive layers of one shape
    shapes: dict  # gate / up / down: checkpoint weight and scale shapes of the first layer
    shared: dict  # the shared-expert decision; per layer (keyed by index) when layers differ
    scales: dict | None  # the w1/w3 agreement and input-scale report (rows with a global scale only)
    ep_size: int
    #: None when a layer has no layout at this ep_size (``problems`` says why): an estimate of 0 would read
    #: as "no expert bytes"
    estimated_expert_bytes: int | None
    passthrough_bytes: int
    estimated_output_bytes: int | None
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: what the previewed convert command would repair or decide on the way (``--on-scale-mismatch
    #: requantize``, ``--allow-missing-input-scales``), one line each; not problems
    repairs: list[str] = field(default_factory=list)
    #: the tensor bytes convert reads and reports as ``bytes_in`` (``bytes`` is the files' size on disk)
    tensor_bytes: int = 0
    #: the convert options this report answers for (so a script can tell which command it previewed)
    options: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def exit_code(self) -> int:
        """What `megamoe-convert inspect` exits with: 0 convertible, 2 convert would refuse."""
        return 0 if self.ok else 2

    def to_dict(self) -> dict:
        """The fields in order, then ``ok`` and ``exit_code`` as every other ``--json`` answer (errors
        included) has them; appended, so the keys scripts already read keep their order."""
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                "ok": self.ok, "exit_code": self.exit_code}


#: a manifest's layer record (spec, scalars, shared note, repairs), per layer and rank: measured 650-700 bytes
#: on the real fixtures; the tensors and files sections, which grow with the model, are computed exactly
_MANIFEST_LAYER_BYTES = 700


def _estimate_output_bytes(plans: list, source, consumed: set[str], row, ep_size: int, reader, facts,
                          max_bytes: int | None = None) -> int:
    """What convert writes, from the plan alone: every safetensors file as its writer writes it (the
    header `shard_writer.safetensors_header` builds for the planned tensors and metadata, then their
    bytes), the config/tokenizer copies, the index (exact: built as ``run`` builds it) and megamoe.json
    (its tensors and files sections serialized as the manifest writes them, digests as placeholders of
    their length; `_MANIFEST_LAYER_BYTES` per layer record)."""
    from megamoe_runtime.format.manifest import FileEntry
    from megamoe_runtime.load.load_checks import FILE_KEY, RANK_KEY

    from ..output.shard_writer import DEFAULT_MAX_SHARD_SIZE, INDEX_NAME, ST_METADATA, json_bytes, safetensors_header

    slots_by_file = plan_files(plans, source, consumed, row, ep_size,
                               DEFAULT_MAX_SHARD_SIZE if max_bytes is None else max_bytes)
    digest = "0" * 64
    sizes: dict[str, int] = {}
    for fname, slots in slots_by_file.items():
        meta = dict(ST_METADATA)
        if slots[0].ep_rank is not None:  # as stream.Run opens an expert file
            meta.update({FILE_KEY: fname, RANK_KEY: str(slots[0].ep_rank)})
        sizes[fname] = len(safetensors_header([s.planned for s in slots], meta)) + \
            sum(s.planned.nbytes for s in slots)
    for p in source.extra_files():
        sizes[p.name] = p.stat().st_size
    shown = [s for slots in slots_by_file.values() for s in slots if s.ep_rank is None or ep_size == 1]
    index = {"metadata": {"total_size": sum(s.planned.nbytes for s in shown)},
             "weight_map": dict(sorted((s.planned.name, s.file) for s in shown))}
    sizes[INDEX_NAME] = len(json_bytes(index))
    sections = {
        "format": "megamoe", "format_version": 1, "converter_version": "0.0.0", "row": row.name,
        "ep_size": ep_size, "checksum": "sha256", "model": model_record(facts),
        "source": {"id": str(source.id), "kind": source.kind, "revision": source.revision,
                   "format": reader.format_name, "content_hash": digest, "recipe": manifest_record(reader)},
        "tensors": {s.key: s.entry(digest).to_dict() for slots in slots_by_file.values() for s in slots},
        "files": {n: FileEntry(size, digest).to_dict() for n, size in sorted(sizes.items())},
        "manifest_sha256": digest,
    }
    manifest = len(json.dumps(sections, indent=1, ensure_ascii=True)) + 1 + \
        _MANIFEST_LAYER_BYTES * len(plans) * ep_size
    return sum(sizes.values()) + manifest


def inspect_checkpoint(src: str | Path, *, revision: str | None = None, format: str | None = None,
                       quantize: str | None = None, ep_size: int = 1, shared_precision: str = "auto",
                       accept_activation_change: bool = False, l2_activation_scale: float | None = None,
                       on_scale_mismatch: str = "error", allow_missing_input_scales: bool = False,
                       cache_dir: str | Path | None = None, token: str | None = None,
                       local_files_only: bool | None = None) -> InspectReport:
    """What `megamoe-convert inspect` reports.

    Reads headers and the scalar scale tensors only. Problems that would stop
    `convert` (row size rules, EP divisibility, bad or disagreeing scales)
    are collected in ``problems`` rather than raised, so one run shows them
    all; a checkpoint that cannot be opened or read at all still raises.
    ``accept_activation_change``, ``l2_activation_scale``, ``on_scale_mismatch``
    and ``allow_missing_input_scales`` are convert's, so the report answers for
    the convert command about to be run: with ``on_scale_mismatch="requantize"``
    the w1/w3 mismatches are repairs (``repairs``), not problems, and with
    ``allow_missing_input_scales`` experts without a w2 input scale are too.
    """
    if on_scale_mismatch not in checks.SCALE_MISMATCH_POLICIES:
        raise MegaMoEError(f"--on-scale-mismatch {on_scale_mismatch!r}; "
                           f"valid: {', '.join(checks.SCALE_MISMATCH_POLICIES)}")
    source = open_source(src, revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only)
    try:
        # accepted here so the report can show the recipe; a change convert would refuse is a problem below
        reader = detect_reader(source, format=format, quantize=quantize, accept_activation_change=True)
        row = get_row(reader.row)
        facts = reader.model_facts()
        infos = reader.moe_layers()
        problems: list[str] = []
        from ..readers import accepted_by

        by = accepted_by(accept_activation_change, quantize)
        change = reader.activation_change = dataclasses.replace(reader.activation_change, accepted=by is not None,
                                                                accepted_by=by)
        if change.needs_flag and not change.accepted:
            problems.append(change.summary())
        if not row.has_alphas:
            try:
                checks.check_l2_activation_scale(row, l2_activation_scale)
            except MegaMoEError as e:
                problems.append(str(e))
        layers, groups = [], []
        repairs: list[str] = []
        unchecked: dict[int, str] = {}
        expert_bytes: int | None = 0
        pairs = mismatched = 0
        max_rel = 0.0
        missing_input: dict[int, int] = {}
        consumed = set(reader.consumed_tensor_names())
        shared_notes = {}
        lplans: list[LayerPlan] = []
        check_shared_precision(row, shared_precision)
        global_name = reader.global_scale_name()
        for info in infos:
            shared, shared_rec, spec = layer_decisions(info, row, facts, ep_size, shared_precision, problems)
            if info.shared is not None and shared is None:
                consumed -= set(info.shared.tensor_names)
            layer = {"index": info.index, "prefix": info.prefix, "num_experts": info.num_experts,
                     "hidden": info.hidden, "intermediate": info.intermediate, "shared": shared_rec}
            if row.weight.has_global_scale:
                try:
                    rep = layer_scalars(reader, info, row, on_scale_mismatch="requantize",
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
                        what = (f"MoE layer {info.index}: {len(rep.mismatches)} expert(s) with w1/w3 "
                                f"{global_name} mismatch (first: expert {e}, {g!r} vs {u!r})")
                        if on_scale_mismatch == "requantize":
                            repairs.append(f"{what}: requantized onto the larger scale (--on-scale-mismatch "
                                           "requantize; block scales rescaled, nibbles unchanged)")
                        else:
                            problems.append(f"{what}; convert needs --on-scale-mismatch requantize")
                    if rep.missing_a2:
                        problems.append(rep.missing_a2)
                    if rep.missing_input:
                        missing_input[info.index] = len(rep.missing_input)
                        what = f"MoE layer {info.index}: {len(rep.missing_input)} expert(s) without a w2 input scale"
                        if allow_missing_input_scales:
                            repairs.append(f"{what}: a2 = max over the others = "
                                           f"{rep.scalars['l2_activation_scale']!r} (--allow-missing-input-scales)")
                        else:
                            problems.append(f"{what}; convert needs --allow-missing-input-scales")
                except MegaMoEError as e:
                    problems.append(str(e))
                    unchecked[info.index] = str(e)
            if spec is not None:
                lplans.append(LayerPlan(info, spec, shared_rec, None, 0))  # what plan_files reads of a plan
            if spec is None:
                expert_bytes = None  # no layout at this ep_size (a problem says why): no estimate
            elif expert_bytes is not None:
                for _, t in rank_roles(row, spec.experts_per_rank, info.hidden, info.intermediate, spec.shared):
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
        return InspectReport(
            source=str(source.id), kind=source.kind, revision=source.revision,
            files=len(source.files()), bytes=sum(p.stat().st_size for p in source.files()),
            format=reader.format_name, row=row.name, model=model_record(facts),
            recipe=manifest_record(reader), activations=change.summary(),
            layers=layers,
            layer_groups=[{"layers": layer_ranges(g["layers"]), "hidden": g["key"][0], "intermediate": g["key"][1],
                           "num_experts": g["key"][2]} for g in groups],
            shapes=shapes, shared=shared_summary,
            scales=({"tensor": global_name, "pairs": pairs, "mismatched_pairs": mismatched, "max_rel_diff": max_rel,
                     "tolerance": checks.GATE_UP_RTOL, "missing_input_scales": missing_input,
                     "unchecked_layers": sorted(unchecked)}
                    if row.weight.has_global_scale else None),
            ep_size=ep_size, estimated_expert_bytes=expert_bytes, passthrough_bytes=pt_bytes,
            estimated_output_bytes=(None if expert_bytes is None else
                                    _estimate_output_bytes(lplans, source, consumed, row, ep_size, reader, facts)),
            problems=problems, warnings=list(source.warnings), repairs=repairs,
            tensor_bytes=sum(source.nbytes(n) for n in source.tensor_names()),
            options={"format": format, "quantize": quantize, "ep_size": ep_size, "shared_precision": shared_precision,
                     "accept_activation_change": bool(accept_activation_change),
                     "l2_activation_scale": l2_activation_scale, "on_scale_mismatch": on_scale_mismatch,
                     "allow_missing_input_scales": bool(allow_missing_input_scales)},
        )
    finally:
        source.close()


__all__ = ["InspectReport", "inspect_checkpoint"]
