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
from pathlib import Path
from typing import Callable

from megamoe_runtime.errors import CheckpointError, MegaMoEError
from megamoe_runtime.files.json_io import parse_json
from megamoe_runtime.format.manifest import DIGEST_SHA256

from .output_dir import (
    JOURNAL_NAME,
    STEP_COMPLETE,
    STEP_SYNCED,
    OutputError,
    OutputLock,
    StepHook,
    TempClaim,
    busy_temp_error,
    check_old_name_free,
    check_replaceable,
    discard_temp,
    foreign_temp_entries,
    fsync_dir,
    remove_own_entries,
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
            raise busy_temp_error(tmp, out, holder)
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
                     fingerprint: str | None = None, guard: OutputLock | None = None,
                     planned=()) -> tuple[Path, bool]:
    """Check OUT (`check_output_target`) and create or reuse its temp folder.
    Returns (tmp, resuming). A complete temp folder (killed just before its
    swap) whose journal has this run's `fingerprint` is resumed without
    --resume: only the swap is left to do.

    Under OUT's parent lock. `guard` (the run's `OutputLock`): the folder is
    claimed for the run (`guard.claim`, held until the lock is released; a
    folder another live run holds is refused) and the marker names the run;
    without one (tests) the folder is claimed only while this function runs.
    `planned`: this run's output file names (shards, config/tokenizer copies): an --overwrite discard
    removes only those and the names the folder's journal/marker/manifest prove ours (`discard_temp`)."""
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
                discard_temp(tmp, out, guard, planned)  # only reachable with --overwrite; only our own
            if guard is not None:
                guard.confirm(f"creating {tmp}")
            claim = TempClaim.create(tmp, out, guard.run_id if guard is not None else new_run_id())
            if guard is not None:
                guard.claim, claim = claim, None
            return tmp, False
        finally:
            if claim is not None:
                claim.release()


def remove_temp(tmp: Path, guard: OutputLock | None, planned=()) -> None:
    """Remove this run's temp folder after bad input (a resume cannot fix it): only while it is
    still this run's (`guard.confirm`); one taken over is left to the run that has it. Only entries
    the run can prove its own (`remove_own_entries`; `planned`: its output file names): a folder
    holding anything else is left whole."""
    if guard is None or guard.claim is None or guard.claim.path != tmp:  # none, or already swapped into OUT
        return
    with parent_locked(guard.out):
        try:
            guard.confirm(f"removing its temp folder {tmp}")
        except OutputError:
            return
        try:
            remove_own_entries(tmp, planned)
        except (OutputError, OSError):
            pass  # something not ours is in it: the folder stays (a later --overwrite names it)


# --------------------------------------------------------------------------- resume: what is kept, and why


#: a source file changed less than this before the interrupted run began reading it is "racy": its
#: timestamps cannot prove a later same-tick edit did not happen (coarse file-system clocks: 1-2 s on
#: FAT/ext3), so its tensors are re-derived and compared on resume (git's "racy clean" rule)
RACY_NS = 2_000_000_000


def boot_id() -> str | None:
    """This boot's id (Linux), or None. Files a killed run wrote are whole in the page cache until the
    machine restarts; only across a restart (power loss) can a journaled file have lost bytes."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _stat_record(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def file_stat(path: Path) -> list[int]:
    """[dev, inode, size, mtime_ns, ctime_ns] of `path`: what a resume compares instead of re-reading it.
    ctime cannot be set back by a user (``touch``/``utime`` set it to now), and a replaced file has
    another inode, so equal records mean the bytes were not touched since."""
    return _stat_record(os.stat(path))


def source_stats(source) -> dict[str, list[int]]:
    """name -> `file_stat` of every source file the conversion reads (the journal's ``source_stats``)."""
    return {str(p.relative_to(source.root)): file_stat(p) for p in [*source.files(), *source.extra_files()]}


def source_unverified(run_record: dict | None, now: dict[str, list[int]]) -> str | None:
    """Why a resume must re-derive the finished files' tensors from the source and compare them
    (`stream.Run.check`), or None when the source provably holds the bytes the interrupted run read:
    every file has the journaled dev/inode/size/mtime/ctime, and none was changed within `RACY_NS`
    before that run began reading (`read_from_ns`)."""
    rec = run_record or {}
    before, t0 = rec.get("source_stats"), rec.get("read_from_ns")
    if not isinstance(before, dict) or not isinstance(t0, int):
        return "the interrupted run's journal has no file status of the source (an older converter)"
    for name in sorted(set(before) | set(now)):
        a, b = before.get(name), now.get(name)
        if a is None or b is None or list(a) != list(b):
            what = "is new" if a is None else "is gone" if b is None else \
                "was replaced (another inode)" if a[:2] != b[:2] else "had its status changed (ctime)"
            return f"{name} {what} since the interrupted run read it"
        if b[4] > t0 - RACY_NS:
            return (f"{name} was written {max(0, t0 - b[4]) / 1e9:.1f} s before the interrupted run read it "
                    f"(less than {RACY_NS / 1e9:g} s: its timestamps cannot rule out a later edit)")
    return None


def check_kept_files(tmp: Path, jfiles: dict[str, dict], planned: set[str], run_record: dict | None,
                     log: Callable[[str], None], progress=None) -> dict[str, dict]:
    """The journaled finished files a resume keeps: name -> journal record.

    A file is kept without reading it when it has the `file_stat` the interrupted run journaled right
    after closing it, on the same boot (`boot_id`: a kill never loses written bytes, only a restart can).
    Otherwise (another boot, a touched file, an older journal) it is re-hashed (its digest kind) and kept
    only if it matches. Before, every kept file was re-hashed, read back from disk (the shards are written
    with O_DIRECT, so nothing is cached), before the first progress line: 12.5 s of blank screen on a
    5 GB source. The re-hash shows each file in the progress display's phase line (`stage`)."""
    from megamoe_runtime.files.digests import file_digest

    from .units import format_bytes

    stage = getattr(progress, "stage", None)  # plan.report_stage's protocol: displays that show a phase
    same_boot = boot_id() is not None and (run_record or {}).get("boot_id") == boot_id()
    kept, rehash = {}, []
    for name, rec in jfiles.items():
        p = tmp / name
        rec.setdefault("digest", DIGEST_SHA256)  # journals without a kind hashed whole files
        if name not in planned:
            continue
        try:
            st = file_stat(p)
        except OSError:
            log(f"resume: {name} is gone from {tmp}; rewriting it")
            continue
        if same_boot and rec.get("stat") == st:
            kept[name] = rec
        elif st[2] != rec["size"]:
            log(f"resume: {name} is {st[2]} bytes, the journal says {rec['size']}; rewriting it")
        else:
            rehash.append((name, rec, p))
    if rehash:
        why = ("this system has no boot id to tell a restart from a kill since" if boot_id() is None else
               "the machine restarted since" if not same_boot else "they were touched after")
        total = sum(r["size"] for _, r, _ in rehash)
        log(f"resume: re-hashing {len(rehash)} kept file(s) ({format_bytes(total)}): {why} the interrupted run "
            "wrote them")
        done = 0
        for i, (name, rec, p) in enumerate(rehash):
            if stage is not None:
                stage(f"resume: re-hashing kept file {i + 1}/{len(rehash)} {name} "
                      f"({format_bytes(done)} of {format_bytes(total)})")
            try:
                ok = file_digest(p, rec["digest"]) == rec["sha256"]
            except MegaMoEError:  # e.g. a damaged header: not finished after all
                ok = False
            done += rec["size"]
            if ok:
                kept[name] = {**rec, "stat": file_stat(p)}  # its bytes are proven: this status is theirs
            else:
                log(f"resume: {name} failed its checksum re-check; rewriting it")
    return kept


#: the run fingerprint's parts as the user names them (a resume with other options says which differ)
_OPTION_NAMES = {
    "quantize": "--quantize", "ep_size": "--ep-size", "max_shard_size": "--max-shard-size",
    "on_scale_mismatch": "--on-scale-mismatch", "allow_missing_input_scales": "--allow-missing-input-scales",
    "shared_precision": "--shared-precision", "l2_activation_scale": "--l2-activation-scale",
    "accept_activation_change": "--accept-activation-change", "checksum": "--checksum",
    "reader": "--format (the source format read)", "row": "the kernel row", "source": "the source's content hash",
    "converter": "the converter version", "format_version": "the output format version",
    "files": "the planned files (which tensors go where)",
}


def journal_options(parts: dict) -> dict:
    """The fingerprint's parts as journaled: the file plan (long) as its sha256, the rest as given."""
    import hashlib

    out = {k: v for k, v in parts.items() if k != "files"}
    out.setdefault("checksum", "sha256")
    if "files" in parts:
        out["files"] = hashlib.sha256(json.dumps(parts["files"], sort_keys=True).encode()).hexdigest()
    return out


def _option_changes(before: dict, now: dict) -> list[str]:
    """What differs between two `journal_options`, named as flags: ``--ep-size: 1 then, 2 now``."""
    from .units import format_bytes

    def show(k, v):
        if k == "max_shard_size" and isinstance(v, int):
            return format_bytes(v)
        if k in ("source", "files") and isinstance(v, str):
            return v[:12] + "..."
        return "(not given)" if v is None else json.dumps(v)

    out = []
    for k in sorted(set(before) | set(now), key=lambda k: (k not in _OPTION_NAMES or k.startswith("-"), k)):
        a, b = before.get(k), now.get(k)
        if a != b:
            out.append(f"{_OPTION_NAMES.get(k, k)}: {show(k, a)} then, {show(k, b)} now")
    return out


def _started_command(tmp: Path) -> str | None:
    """The command line the temp folder was created by (its marker), shell-quoted, or None."""
    import shlex

    from .output_dir import read_temp_marker

    cmd = read_temp_marker(tmp).get("command")
    if not isinstance(cmd, dict) or not isinstance(cmd.get("argv"), list):
        return None
    return shlex.join(str(a) for a in cmd["argv"]) + (f"   (in {cmd['cwd']})" if cmd.get("cwd") else "")


def other_options_error(tmp: Path, fp: str | None, fingerprint: str, before: dict | None,
                        now: dict | None) -> OutputError:
    """The refusal of a resume with other inputs or options: which differ, and how the run began."""
    from .output_dir import TMP_MARKER

    changes = _option_changes(before, now) if isinstance(before, dict) and now is not None else []
    what = ("; ".join(changes) if changes else
            f"run fingerprint {str(fp)[:12]}..., this run {fingerprint[:12]}... (the interrupted run's journal "
            "does not name its options)")
    cmd = _started_command(tmp)
    return OutputError(
        f"{tmp} holds an interrupted conversion of different inputs or options: {what}. "
        + (f"It was started as: {cmd} (kept in {tmp / TMP_MARKER}). " if cmd else "")
        + "Resume it with the same options, or pass --overwrite to discard it")


def check_written(tmp: Path, out: Path, written: dict[str, list[int] | None]) -> None:
    """Every file the manifest lists is still the one this run wrote (or kept, proven): a plain file at its
    name with the `file_stat` taken when it was closed (device, inode, size, mtime, ctime), or, where none
    was taken, at least the size (`[None, None, size, ...]`). Run right before the temp folder is marked
    complete and swapped in: a shard deleted, moved, truncated or rewritten in the temp folder while the
    run went on would otherwise be renamed into OUT, and the run would end 0 with a broken output.
    Raises OutputError naming the file; the temp folder stays, and ``--resume`` rewrites what changed."""
    import stat as stat_mod

    for name, want in sorted(written.items()):
        p = tmp / name
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            got = "is gone"
        else:
            have = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
            if not stat_mod.S_ISREG(st.st_mode):
                got = "is no longer a regular file"
            elif want is None:
                continue
            elif have[2] != want[2]:
                got = f"is {have[2]} bytes, {want[2]} were written"
            elif want[0] is not None and have[:2] != want[:2]:
                got = "was replaced by another file (another inode)"
            elif want[3] is not None and have[3:] != want[3:]:
                got = "was modified (its mtime/ctime changed)"
            else:
                continue
        raise OutputError(
            f"{p} {got} since this run wrote it: nothing was moved into {out}. The temp folder stays; "
            f"run the same command with --resume to rewrite what changed (leave {tmp.name} alone while a "
            "run writes it)")


def finalize_output(tmp: Path, out: Path, mark_complete: Callable[[], None] | None = None,
                    on_step: StepHook | None = None, guard: OutputLock | None = None,
                    written: dict[str, list[int] | None] | None = None) -> None:
    """fsync every file, mark the journal complete, then swap the temp folder
    into place (``output_dir.swap_into_place``: an old OUT is replaced only
    now), so OUT never names unwritten data. `written`: name -> `file_stat` of
    every file the manifest lists (and the manifest), each proven unchanged
    (`check_written`) before the journal says complete.

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
    fsync_dir(tmp)
    if on_step is not None:
        on_step(STEP_SYNCED)
    if written is not None:
        check_written(tmp, out, written)
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
    line from a kill is ignored. On resume, finished files are kept when their
    status is the journaled one on the same boot, else re-hashed
    (`check_kept_files`); their tensors are re-derived from the source and
    compared (``stream.Run.check``) only when the source's status cannot prove
    it unchanged (`source_unverified`).
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

    def start(self, fingerprint: str, sources: dict | None = None, **extra) -> None:
        """First record: the run fingerprint, (``sources``) each source file's [size, mtime_ns], and
        what a resume needs to trust instead of re-reading (`extra`: ``options`` (`journal_options`),
        ``source_stats`` (`source_stats`), ``read_from_ns``; ``boot_id`` is added here)."""
        self.confirm(f"starting {self.path.name}")
        self.path.write_text("")
        self._append({"kind": "run", "fingerprint": fingerprint, **({"sources": sources} if sources else {}),
                      "boot_id": boot_id(), **extra},
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
                    digest: str = DIGEST_SHA256) -> list[int] | None:
        """A finished file (closed: no byte of it is written after this); `digest` is the kind of
        `sha256` (manifest DIGEST_KINDS). Its `file_stat` goes with it, and is returned: a resume on the
        same boot keeps a file whose status is unchanged without re-reading it (`check_kept_files`), and
        the swap proves the file is still the one written (`check_written`)."""
        try:
            st = file_stat(self.path.parent / name)
        except OSError:
            st = None
        self._append({"kind": "file", "name": name, "size": size, "sha256": sha256, "digest": digest,
                      "tensors": tensors, **({"stat": st} if st else {})})
        return st

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


__all__ = ["check_output_target", "prepare_temp_dir", "remove_temp", "finalize_output", "check_written",
           "Journal", "RACY_NS",
           "boot_id", "file_stat", "source_stats", "source_unverified", "check_kept_files", "journal_options",
           "other_options_error"]
