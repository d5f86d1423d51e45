"""The temp folder and its progress journal: how a run becomes OUT.

A conversion writes into ``.OUT.megamoe-tmp`` beside OUT (``output_dir``
names it and owns the swap), appending each finished file and layer to an
fsynced journal there, so a killed run can be resumed (``--resume``) instead
of redone, and is swapped into place only after every byte is synced
(`finalize_output`). Kept apart from the safetensors writer: this module
decides *whether and where* a run may write; ``shard_writer`` only writes
bytes.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

from megamoe_runtime.errors import CheckpointError
from megamoe_runtime.json_io import parse_json
from megamoe_runtime.manifest import DIGEST_SHA256

from .output_dir import (
    JOURNAL_NAME,
    STEP_COMPLETE,
    STEP_SYNCED,
    OutputError,
    OutputLock,
    StepHook,
    TempClaim,
    _busy_temp,
    _fsync_dir,
    check_old_name_free,
    check_replaceable,
    discard_temp,
    is_our_temp,
    journal_state,
    new_run_id,
    parent_locked,
    swap_into_place,
    temp_dir_for,
    temp_holder,
)


def check_output_target(out: Path, *, overwrite: bool, resume: bool, recovered: bool = False) -> None:
    """The checks of `prepare_temp_dir`, creating and removing nothing: run
    (under the output lock) before the source is opened, so a refusal comes
    before a hub download and the preflight, not after. `recovered`: this run
    has just finished an earlier run's swap into OUT (OUT may then exist).
    A temp folder a live run holds (its lock file removed) is refused here."""
    out = Path(out)
    tmp = temp_dir_for(out)
    if out.exists() or out.is_symlink():
        if not overwrite and not recovered:
            raise OutputError(
                f"output folder {out} already exists; pass --overwrite to replace it "
                "(only a megamoe output is replaced, and only after the new conversion has finished)"
            )
        if overwrite:
            check_replaceable(out)
            check_old_name_free(out)
    if tmp.exists() or tmp.is_symlink():
        if not is_our_temp(tmp):
            discard_temp(tmp)  # raises: not ours, left alone
        holder = temp_holder(tmp)
        if holder is not None:
            raise _busy_temp(tmp, out, holder)
        fp, complete = journal_state(tmp)
        if complete or overwrite or (resume and (tmp / JOURNAL_NAME).is_file()):
            return  # a complete one is resumed when this run's fingerprint matches (prepare_temp_dir)
        hint = ("it has no progress journal, so it cannot be resumed; " if resume else
                "pass --resume to continue that run, or ")
        raise OutputError(
            f"{tmp} exists: an earlier conversion to {out} was interrupted (no process holds its lock, so it "
            f"is not running); {hint}pass --overwrite to discard it and start over"
        )


def prepare_temp_dir(out: Path, *, overwrite: bool, resume: bool,
                     fingerprint: str | None = None, guard: OutputLock | None = None) -> tuple[Path, bool]:
    """Check OUT (`check_output_target`) and create or reuse its temp folder.
    Returns (tmp, resuming). A complete temp folder (killed just before its
    swap) whose journal has this run's `fingerprint` is resumed without
    --resume: only the swap is left to do.

    Under OUT's parent lock. `guard` (the run's `OutputLock`): the folder is
    claimed for the run (`guard.claim`, held until the lock is released; a
    folder another live run holds is refused) and the marker names the run;
    without one (tests) the folder is claimed only while this function runs."""
    out = Path(out)
    with parent_locked(out):
        check_output_target(out, overwrite=overwrite, resume=resume)
        tmp = temp_dir_for(out)
        claim = None
        try:
            if tmp.exists():
                claim = TempClaim.adopt(tmp, out)  # refused, naming it, if a live run holds it
                fp, complete = journal_state(tmp)
                keep = (resume and (tmp / JOURNAL_NAME).is_file()) or \
                    (complete and fingerprint is not None and fp == fingerprint)
                if keep:
                    if guard is not None:
                        guard.confirm(f"resuming {tmp}")
                        claim.take_over(out, guard.run_id)
                        guard.claim, claim = claim, None
                    return tmp, True
                if not overwrite:
                    raise OutputError(
                        f"{tmp} holds a finished conversion to {out} of different inputs or options (run fingerprint "
                        f"{str(fp)[:12]}..., this run {str(fingerprint)[:12]}...); pass --overwrite to discard it")
                claim.release()
                claim = None
                discard_temp(tmp, out, guard)  # only reachable with --overwrite; only our own
            if guard is not None:
                guard.confirm(f"creating {tmp}")
            claim = TempClaim.create(tmp, out, guard.run_id if guard is not None else new_run_id())
            if guard is not None:
                guard.claim, claim = claim, None
            return tmp, False
        finally:
            if claim is not None:
                claim.release()


def remove_temp(tmp: Path, guard: OutputLock | None) -> None:
    """Remove this run's temp folder after bad input (a resume cannot fix it): only while it is
    still this run's (`guard.confirm`); one taken over is left to the run that has it."""
    if guard is None or guard.claim is None or guard.claim.path != tmp:  # none, or already swapped into OUT
        return
    with parent_locked(guard.out):
        try:
            guard.confirm(f"removing its temp folder {tmp}")
        except OutputError:
            return
        shutil.rmtree(tmp, ignore_errors=True)


def finalize_output(tmp: Path, out: Path, mark_complete: Callable[[], None] | None = None,
                    on_step: StepHook | None = None, guard: OutputLock | None = None) -> None:
    """fsync every file, mark the journal complete, then swap the temp folder
    into place (``output_dir.swap_into_place``: an old OUT is replaced only
    now), so OUT never names unwritten data.

    `mark_complete` runs after the sync: the converter appends the journal's
    ``complete`` record there. A kill before it leaves a temp folder that
    ``--resume`` finishes; a kill after it, one the next run swaps in itself."""
    out = Path(out)
    for p in sorted(tmp.iterdir()):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(tmp)
    if on_step is not None:
        on_step(STEP_SYNCED)
    if mark_complete is not None:
        mark_complete()
        if on_step is not None:
            on_step(STEP_COMPLETE)
    swap_into_place(tmp, out, on_step, guard)


class Journal:
    """Append-only progress log in the temp folder (JSON lines; ``complete`` fsynced).

    Records: the run fingerprint (first line), each finished file (name, size,
    sha256, its tensors' manifest entries) and each finished layer (scalars,
    repairs), and last ``complete`` once everything is synced. A torn last
    line from a kill is ignored. On resume, finished files are re-hashed and
    kept only if they still match, and their tensors are re-derived from the
    source and compared (``stream.Run.check``).
    """

    def __init__(self, tmp: Path, guard: OutputLock | None = None):
        self.path = Path(tmp) / JOURNAL_NAME
        self.run_record: dict | None = None  # the first record, once `load` has run
        self.guard = guard  # the run's lock: its temp-folder claim is checked before each record (`confirm`)

    def confirm(self, doing: str) -> None:
        """Before the run creates a file in its temp folder (a shard, a journal record, the small files):
        the folder at that name must still be this run's (`TempClaim.confirm`). Files are opened by path, so
        a folder moved away and replaced by another (a user's) would otherwise receive them."""
        if self.guard is not None and self.guard.claim is not None:
            self.guard.claim.confirm(doing)

    def start(self, fingerprint: str, sources: dict | None = None) -> None:
        """First record: the run fingerprint and (``sources``) each source file's [size, mtime_ns]."""
        self.confirm(f"starting {self.path.name}")
        self.path.write_text("")
        self._append({"kind": "run", "fingerprint": fingerprint, **({"sources": sources} if sources else {})},
                     durable=True)  # cheap (nothing else is dirty yet); a resume needs the fingerprint

    def load(self) -> tuple[str | None, dict[str, dict], dict[int, dict]]:
        fingerprint, files, layers = None, {}, {}
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = parse_json(line, str(self.path), error=CheckpointError)
            except CheckpointError:
                continue  # torn write of the last record
            kind = rec.get("kind")
            if kind == "run":
                fingerprint = rec.get("fingerprint")
                self.run_record = rec
            elif kind == "file":
                files[rec["name"]] = rec
            elif kind == "layer":
                layers[int(rec["index"])] = rec
        return fingerprint, files, layers

    def record_file(self, name: str, size: int, sha256: str, tensors: dict[str, dict],
                    digest: str = DIGEST_SHA256) -> None:
        """A finished file; `digest` is the kind of `sha256` (manifest DIGEST_KINDS)."""
        self._append({"kind": "file", "name": name, "size": size, "sha256": sha256, "digest": digest,
                      "tensors": tensors})

    def record_layer(self, index: int, record: dict) -> None:
        self._append({"kind": "layer", "index": index, **record})

    def mark_complete(self) -> None:
        """Every file and the manifest are written and synced: only the swap is left."""
        self._append({"kind": "complete"}, durable=True)

    def _append(self, rec: dict, durable: bool = False) -> None:
        """Append one record. Only the first (``run``) and the ``complete`` records
        are fsynced: ``complete`` alone changes what a resume does without
        checking (swap only). A file or layer
        record lost to a crash only means that work is redone, and one that
        survives while its file's bytes did not is caught by the resume's
        re-hash of every listed file; an fsync per record, on the other hand,
        stalled the conversion (on ext4 it commits the writes queued before it,
        0.8 s of 7 s on a 1 GiB run)."""
        self.confirm(f"appending to {self.path.name}")
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
            f.flush()
            if durable:
                os.fsync(f.fileno())

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


__all__ = ["check_output_target", "prepare_temp_dir", "remove_temp", "finalize_output", "Journal"]
