"""One conversion run inside its temp folder, from resume check to swap.

Resume first (the journal's fingerprint and source identity must match; the
finished files are re-hashed), then the streaming pass (``stream``), then
the small files (config annotated, index), the manifest last, and the swap
into OUT (``temp_folder.finalize_output``).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from megamoe_runtime.errors import MegaMoEError
from megamoe_runtime.files import digests
from megamoe_runtime.files.digests import SHA256
from megamoe_runtime.format.formats import Row
from megamoe_runtime.format.manifest import (
    DIGEST_SHA256,
    FORMAT_VERSION,
    MANIFEST_NAME,
    PASSTHROUGH_ROLE,
    FileEntry,
    LayerEntry,
    Manifest,
    SourceInfo,
    TensorEntry,
    write_manifest,
)

from ..output.output_dir import Log, StepHook
from .plan import LayerPlan, Progress, Slot, SourceChangedError, converter_version, report_stage, identity_changes, model_record, source_identity
from ..output.shard_writer import INDEX_NAME, json_bytes, write_bytes_atomic
from .shared import shared_decisions
from .stream import Run, convert_layer, copy_passthrough
from .summary import ConvertSummary
from ..output.temp_folder import (
    Journal,
    check_kept_files,
    file_stat,
    finalize_output,
    journal_options,
    other_options_error,
    source_stats,
    source_unverified,
)


def run_conversion(source, reader, row: Row, facts, plans: list[LayerPlan],
         slots_by_file: dict[str, list[Slot]], tmp: Path, out: Path, resuming: bool, fingerprint: str,
         ep_size: int, progress: Progress | None, log: Log, on_step: StepHook | None = None,
         recipe: dict | None = None, checksum: str = SHA256, guard=None, options: dict | None = None,
         read_from_ns: int | None = None) -> ConvertSummary:
    """Steps 5-8 of `convert.convert` in the temp folder `tmp`. `options`: the run fingerprint's parts
    (journaled, so a resume with other options names them); `read_from_ns`: when the run began reading
    the source (`temp_folder.source_unverified`); `guard`: the run's `OutputLock`."""
    journal = Journal(tmp, guard)
    done_files: dict[str, dict] = {}
    layer_records: dict[int, dict] = {}
    resumed = 0
    identity = source_identity(source)
    stats = source_stats(source)
    check_source = resuming
    if resuming:
        report_stage(progress, f"resume: checking what {tmp.name} keeps")
        fp, jfiles, layer_records = journal.load()
        changed = identity_changes((journal.run_record or {}).get("sources"), identity)
        if changed:
            raise SourceChangedError(
                f"--resume refused: the source changed since the interrupted run ({'; '.join(changed[:3])}"
                f"{f'; {len(changed) - 3} more' if len(changed) > 3 else ''}); the output would mix old and new "
                f"source bytes. Pass --overwrite to discard {tmp} and convert again")
        if fp != fingerprint:
            raise other_options_error(tmp, fp, fingerprint, (journal.run_record or {}).get("options"),
                                      journal_options(options) if options is not None else None)
        done_files.update(check_kept_files(tmp, jfiles, set(slots_by_file), journal.run_record, log, progress))
        resumed = len(done_files)
        why = source_unverified(journal.run_record, stats)
        check_source = why is not None and resumed > 0
        if check_source:
            log(f"resume: keeping {resumed} finished file(s) once their tensors are re-derived from the source "
                f"and match ({why}), redoing the rest")
        else:
            log(f"resume: keeping {resumed} finished file(s) (they and the source are as the interrupted run "
                "left them), redoing the rest")
    else:
        journal.start(fingerprint, sources=identity, source_stats=stats, read_from_ns=read_from_ns,
                      **({"options": journal_options(options)} if options is not None else {}))

    passthrough_bytes = sum(s.planned.nbytes for slots in slots_by_file.values() for s in slots
                            if s.role == PASSTHROUGH_ROLE)
    total = sum(lp.source_bytes for lp in plans) + passthrough_bytes
    run = Run(tmp, journal, slots_by_file, done_files, total, progress, on_step, checksum)
    run.check_done = check_source
    repaired = 0
    layer_entries = []
    try:
        run.start_passthrough(source)
        for lp in plans:
            run.passthrough.raise_refusal()  # bad input in a pass-through tensor: stop now, not after the layers
            rec = convert_layer(reader, row, lp, ep_size, run, layer_records.get(lp.info.index), log)
            repaired += len(rec["repairs"])
            layer_entries.append(LayerEntry(
                index=lp.info.index, prefix=lp.info.prefix, spec=lp.spec.to_dict(), scalars=lp.scalar_report.scalars,
                shared={**lp.shared_record, **rec["shared"]}, repairs=tuple(rec["repairs"])))
        run.close_side_pool()
        report_stage(progress, "finishing: flushing the shards, copying the pass-through tensors")
        run.settle()
        copy_passthrough(source, run)
        run.close()
    except BaseException:
        run.abort()
        raise

    # extra files (config annotated), index, manifest
    report_stage(progress, "finishing: writing the index and megamoe.json, moving the output into place")
    file_entries: dict[str, FileEntry] = {n: FileEntry(r["size"], r["sha256"], r.get("digest", DIGEST_SHA256))
                                                  for n, r in done_files.items()}
    tensors: dict[str, TensorEntry] = {}
    for rec in done_files.values():
        for key, d in rec["tensors"].items():  # the journal holds each entry as the manifest writes it
            tensors[key] = TensorEntry.from_json(d, f"{journal.path.name} {rec['name']} tensors[{key!r}]",
                                                 checksum_kind=checksum)
    missing = [f for f in slots_by_file if f not in done_files]
    if missing:  # pragma: no cover - every planned file is written above
        raise MegaMoEError(f"internal error: files {missing} were planned but not written")

    journal.confirm("writing the config files, the index and the manifest")
    # what the swap proves is still there, as written (`temp_folder.check_written`); a file journaled
    # without a status (an older journal) is checked by its size
    written: dict[str, list[int]] = {n: r.get("stat") or [None, None, r["size"], None, None]
                                     for n, r in done_files.items()}
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
        written[p.name] = file_stat(dst)
        file_entries[p.name] = FileEntry(dst.stat().st_size, digests.hash_file(dst, checksum),
                                         digests.whole_kind(checksum))
    weight_map = {t.name: t.file for t in tensors.values() if t.ep_rank is None or ep_size == 1}
    index = {"metadata": {"total_size": sum(tensors[k].nbytes for k in tensors
                                            if tensors[k].ep_rank is None or ep_size == 1)},
             "weight_map": dict(sorted(weight_map.items()))}
    write_bytes_atomic(tmp / INDEX_NAME, json_bytes(index))
    written[INDEX_NAME] = file_stat(tmp / INDEX_NAME)
    file_entries[INDEX_NAME] = FileEntry((tmp / INDEX_NAME).stat().st_size,
                                         digests.hash_file(tmp / INDEX_NAME, checksum), digests.whole_kind(checksum))

    manifest = Manifest(
        converter_version=converter_version(),
        source=SourceInfo(id=str(source.id), kind=source.kind, revision=source.commit or source.revision,
                          format=reader.format_name, content_hash=source.content_hash(), recipe=recipe),
        row=row.name, ep_size=ep_size, layers=layer_entries, tensors=tensors, files=file_entries,
        model=model_record(facts), checksum=checksum, layout=row.layout,
    )
    write_manifest(tmp, manifest)
    written[MANIFEST_NAME] = file_stat(tmp / MANIFEST_NAME)
    finalize_output(tmp, out, mark_complete=journal.mark_complete, on_step=on_step, guard=guard, written=written)
    return ConvertSummary(
        out=str(out), source=str(source.id), format=reader.format_name, row=row.name, ep_size=ep_size,
        layers=len(plans), experts=sum(lp.info.num_experts for lp in plans), bytes_in=total,
        bytes_out=sum(f.size for f in file_entries.values()) + (out / "megamoe.json").stat().st_size,
        seconds=0.0, files=len(file_entries) + 1, repaired_experts=repaired, resumed_files=resumed,
        bytes_kept=run.kept_bytes, warnings=list(source.warnings), shared=shared_decisions(plans), recipe=recipe)


def _annotated_config(config: dict, row: Row) -> dict:
    """The source's config with ``quantization_config`` naming the megamoe method (docs/ENGINES.md#config).

    Engines pick a checkpoint's loader from ``quant_method``; after conversion the experts are no longer in the
    producer's layout, so a source method left in place would make a stock loader misread the renamed expert
    tensors. The source's own quantization config is kept whole under ``source_quantization_config``: the
    non-expert tensors are still in its format, and the engine integrations read it to decode them."""
    cfg = json.loads(json.dumps(config))
    qc = cfg.get("quantization_config")
    cfg["quantization_config"] = {"quant_method": "megamoe", "format_version": FORMAT_VERSION, "row": row.name,
                                  "manifest": "megamoe.json",
                                  "source_quantization_config": qc if isinstance(qc, dict) else None}
    return cfg


__all__ = ["run_conversion"]
