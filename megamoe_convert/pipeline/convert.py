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
   ``preadv``-ed straight into their kernel rows (`direct.DirectWeights`) and only
   the scales go through ``copy_``. Then queue the rank's tensors to its
   shard (hashed and written on background threads while the next layer is
   read and packed into a second set of buffers). Memory: two ranks' packed
   layers plus one expert in source encoding, whatever the model size;
7. copy the non-expert tensors byte for byte (the plain float ones checked
   for NaN / inf on the way, ``checks.passthrough_checked``), the
   config/tokenizer files (``config.json`` annotated), write the index and,
   last, the manifest;
8. rename the temp folder to OUT.

Bad input (MegaMoEError) found at any step removes the temp folder; anything
else (a kill, a full disk, a bug) leaves it with its journal for ``resume``.

One job per module: ``plan`` (every output tensor and file, the run's
fingerprint), ``preflight`` (step 3), ``shared`` (shared-expert precision),
``stream`` / ``direct`` (step 6), ``run`` (steps 5-8 inside the temp folder),
``temp_folder`` and ``output_dir`` (where and when bytes may be written),
``shard_writer`` (the bytes), ``inspection`` (the report without converting; not named
``inspect``, which would shadow the standard library module on a path that starts in this folder).
This module holds the entry point and keeps the names callers import from it.

Output naming: expert shards ``megamoe-experts-rank{r:03d}-of-{N:03d}-{k:05d}``
(k from 1; each rank's files hold its experts and a replica of the fused
shared expert), non-expert shards ``model-{k:05d}-of-{n:05d}``. The index
``model.safetensors.index.json`` maps every tensor to its file; with
``ep_size > 1`` the rank files reuse the same tensor names, so the index lists
only the non-expert tensors and the manifest (keys ``{name}@rank{r:03d}``)
lists the rest.
"""
from __future__ import annotations

import contextlib
import gc
import sys
import time
from pathlib import Path

import torch

from megamoe_runtime.backends.kernel_cache import FOLDER_SUBDIR
from megamoe_runtime.errors import CheckpointError, MegaMoEError
from megamoe_runtime.files import digests
from megamoe_runtime.files.digests import SHA256
from megamoe_runtime.format.formats import get_row
from megamoe_runtime.format.manifest import FORMAT_VERSION

from . import checks
from .inspection import inspect_checkpoint
from ..output.output_dir import (
    Log,
    OutputError,
    OutputLock,
    StepHook,
    check_placement,
    ensure_parent,
    is_megamoe_output,
    recover,
    remove_created,
    resolve_out,
    temp_dir_for,
)
from .plan import (
    Progress,
    SourceChangedError,
    converter_version,
    expert_file_name,
    identity_changes,
    model_file_name,
    plan_files,
    report_stage,
    run_fingerprint,
    source_identity,
)
from .preflight import preflight
from ..readers import detect_reader
from ..readers.recipe import manifest_record
from .run import run_conversion
from ..output.shard_writer import DEFAULT_MAX_SHARD_SIZE, parse_size
from .shared import (
    SHARED_BY_FLAVOUR,
    SHARED_PRECISION_CHOICES,
    check_shared_precision,
    choose_shared,
    shared_flavour_note,
    shared_to_precision,
)
from ..readers.source import open_source, source_roots
from .summary import ConvertSummary, summary_of_output
from ..output.temp_folder import check_output_target, prepare_temp_dir, remove_temp

DEFAULT_CHECKSUM = digests.DEFAULT_CHECKSUM
#: the interpreter's thread switch interval during the streaming pass, seconds (`_convert_locked`)
SWITCH_INTERVAL = 0.0005


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
    cache_dir: str | Path | None = None,
    token: str | None = None,
    local_files_only: bool | None = None,
) -> ConvertSummary:
    """Convert checkpoint `src` (folder or hub id) into a megamoe folder `out`.

    ``shared_precision`` ("auto" | "mxfp8" | "bf16"): the precision fused
    shared experts are written in (see `choose_shared`); an explicit one the
    row cannot fuse raises FormatError. ``accept_activation_change``: convert a
    source whose activation recipe the kernel makes coarser (weight-only,
    FP8 activations on nvfp4; `readers.recipe`), recorded in megamoe.json.

    ``checksum`` ("sha256" | "blake3", see ``megamoe_runtime.files.digests``): the
    algorithm of the manifest's tensor checksums and file digests. blake3
    hashes several times faster per core (BENCHMARKS.md); sha256 needs no
    extra package to verify and gives the bytes earlier versions wrote.

    Raises MegaMoEError subclasses for bad input (nothing is left under `out`).

    Output safety (``output_dir``): OUT may not overlap the source or contain
    the working directory; ``overwrite`` replaces only a megamoe output; the
    run holds an exclusive lock on OUT throughout (a second run raises
    OutputError naming the holder) and first finishes any swap an earlier run
    was killed in. OUT's missing parent folders are created.

    ``cache_dir``, ``token``, ``local_files_only``: huggingface_hub's, for a hub
    repo id `src` (`source.open_source`); none of them changes the output.

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
    check_placement(out, source_roots(src, cache_dir))
    hub = {"cache_dir": cache_dir, "token": token, "local_files_only": local_files_only}
    created = ensure_parent(out)
    try:
        with OutputLock(out, log) as lock, _heap_frozen():
            if lock.stale is not None:
                log(lock.stale_note())
            summary = _convert_locked(
                src, out, revision=revision, format=format, quantize=quantize, ep_size=ep_size,
                max_bytes=max_bytes, on_scale_mismatch=on_scale_mismatch,
                allow_missing_input_scales=allow_missing_input_scales, l2_activation_scale=l2_activation_scale,
                overwrite=overwrite, resume=resume, progress=progress, log=log, shared_precision=shared_precision,
                on_step=on_step, accept_activation_change=accept_activation_change,
                checksum=checksum, guard=lock, hub=hub)
    except BaseException:
        remove_created(created)  # only the parents this run made, and only while empty
        raise
    summary.seconds = time.perf_counter() - t0
    return summary


@contextlib.contextmanager
def _heap_frozen():
    """Keep the objects that exist now (torch's and the interpreter's, several
    hundred thousand after ``import torch``) out of the garbage collector's
    passes, and give them back afterwards (``gc.freeze`` / ``gc.unfreeze``).
    Reading the source's headers and planning make many small objects, and
    each oldest-generation pass walks the whole heap: 0.06 of the 0.16 s
    before the first layer on a 1 GiB source (docs/bench-log/convert.md;
    `_convert_locked` disables the collector for the streaming pass
    itself). Garbage made meanwhile is still collected. Left alone if the
    caller froze objects itself (its freeze is not ours to undo)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _convert_locked(src, out: Path, *, revision, format, quantize, ep_size: int, max_bytes: int,
                    on_scale_mismatch: str, allow_missing_input_scales: bool, l2_activation_scale,
                    overwrite: bool, resume: bool, progress, log: Log, shared_precision: str,
                    on_step: StepHook | None, accept_activation_change: bool = False,
                    checksum: str = SHA256, guard: OutputLock | None = None,
                    hub: dict | None = None) -> ConvertSummary:
    """`convert` once it holds OUT's lock (`guard`: confirmed before every rename or delete under OUT)."""
    recovered = recover(out, log, guard)
    read_from_ns = time.time_ns()  # before the first source byte is read (temp_folder.source_unverified)
    check_output_target(out, overwrite=overwrite, resume=resume, recovered=recovered is not None)
    if overwrite and (out / FOLDER_SUBDIR).is_dir() and is_megamoe_output(out):  # passed check_replaceable
        log(f"note: {out / FOLDER_SUBDIR} holds the kernels megamoe-convert warm compiled for the output this "
            f"run replaces; it goes with that output once the new one is complete: run `megamoe-convert warm "
            f"{out}` again for the new shards")

    report_stage(progress, f"opening {src}")
    source = open_source(src, revision, **(hub or {}))
    try:
        check_placement(out, source.roots())
        report_stage(progress, "reading the safetensors headers")
        reader = detect_reader(source, format=format, quantize=quantize,
                               accept_activation_change=accept_activation_change)
        row = get_row(reader.row)
        facts = reader.model_facts()
        infos = reader.moe_layers()
        if not infos:
            raise CheckpointError(f"{source.id}: no MoE layers found (format {reader.format_name}); "
                                  "nothing to convert")
        check_shared_precision(row, shared_precision)

        report_stage(progress, f"checking {len(infos)} MoE layer(s) of {reader.format_name} (shapes, scales)")
        plans = preflight(reader, source, row, facts, infos, ep_size, on_scale_mismatch,
                           allow_missing_input_scales, log, shared_precision, l2_activation_scale)
        consumed = set(reader.consumed_tensor_names())
        for lp in plans:  # shared experts the row cannot fuse stay in the pass-through files
            if lp.info.shared is not None and lp.spec.shared is None:
                consumed -= set(lp.info.shared.tensor_names)
        slots_by_file = plan_files(plans, source, consumed, row, ep_size, max_bytes)

        options = {
            "converter": converter_version(), "format_version": FORMAT_VERSION, "source": source.content_hash(),
            "reader": reader.format_name, "row": row.name, "quantize": quantize, "ep_size": ep_size,
            "max_shard_size": max_bytes, "on_scale_mismatch": on_scale_mismatch,
            "allow_missing_input_scales": allow_missing_input_scales, "shared_precision": shared_precision,
            "l2_activation_scale": l2_activation_scale, "accept_activation_change": bool(accept_activation_change),
            "files": {f: [s.key for s in slots] for f, slots in slots_by_file.items()},
            **({"checksum": checksum} if checksum != SHA256 else {}),
        }
        fingerprint = run_fingerprint(options)
        if recovered is not None:
            changed = identity_changes(recovered.get("sources"), source_identity(source))
            if recovered.get("fingerprint") == fingerprint and changed and not overwrite:
                raise SourceChangedError(
                    f"output folder {out} already exists: an interrupted conversion was just completed into it, "
                    f"but the source changed since that run read it ({'; '.join(changed[:3])}"
                    f"{f'; {len(changed) - 3} more' if len(changed) > 3 else ''}), so it is not this source's "
                    "conversion; pass --overwrite to replace it with a conversion of the current source")
            if recovered.get("fingerprint") == fingerprint and not changed:
                log(f"{out} is this conversion, completed from the interrupted run: nothing left to do")
                return summary_of_output(out, source, reader, row, plans, slots_by_file, ep_size)
            if not overwrite:
                raise OutputError(
                    f"output folder {out} already exists (an interrupted conversion of other inputs or options "
                    "was just completed into it); pass --overwrite to replace it")

        # the names this run's plan writes: an --overwrite discard (and a cleanup) removes only those and
        # what the temp folder's own journal/marker/manifest record, never a file it did not write
        planned = {*slots_by_file, *(p.name for p in source.extra_files())}
        tmp, resuming = prepare_temp_dir(out, overwrite=overwrite, resume=resume, fingerprint=fingerprint,
                                         guard=guard, planned=planned)
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
        # The hash, write and device-write threads each take the GIL for a moment per piece, between
        # system calls that release it; with the reader threads' Python holding it, each such moment
        # would wait up to the default 5 ms switch interval, and the writers with it
        # (docs/bench-log/convert.md).
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, SWITCH_INTERVAL))
        try:
            return run_conversion(source, reader, row, facts, plans, slots_by_file, tmp, out, resuming,
                        fingerprint, ep_size, progress, log, on_step,
                        recipe=manifest_record(reader, l2_activation_scale is not None), checksum=checksum,
                        guard=guard, options=options, read_from_ns=read_from_ns)
        except OutputError:
            raise  # e.g. --resume of a different run: keep that run's temp folder
        except MegaMoEError:
            remove_temp(tmp, guard, planned)  # bad input: a resume cannot fix it (only while the folder is still ours)
            raise
        finally:
            torch.set_num_threads(threads)
            sys.setswitchinterval(switch)
            if gc_was_enabled:
                gc.enable()
    finally:
        source.close()


__all__ = ["convert", "inspect_checkpoint", "ConvertSummary", "converter_version", "expert_file_name",
           "model_file_name", "shared_to_precision", "temp_dir_for", "SHARED_PRECISION_CHOICES", "SHARED_BY_FLAVOUR",
           "shared_flavour_note",
           "check_shared_precision", "choose_shared", "SourceChangedError"]
