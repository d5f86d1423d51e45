"""Where the converter may write, and who may write there.

One job: keep the converter from ever deleting, overwriting or mixing bytes
it did not write. Everything here is about the output folder OUT and its
siblings, which all live beside OUT (same filesystem, so renames are atomic):

* ``.OUT.megamoe-tmp``  the run's temp folder (marker file ``megamoe-tmp.json``
  and the progress journal inside), renamed to OUT at the end;
* ``.OUT.megamoe-old``  the previous OUT during an ``--overwrite`` swap;
* ``.OUT.megamoe-lock`` the lock file: ``fcntl.flock`` held for the whole run,
  so the kernel releases it when the process dies, even by ``kill -9``; it
  holds the holder's pid, host, start time and run id for the refusal message
  (and ``command``: ``warm``, which holds the same lock while it builds
  OUT/kernel-cache, docs/KERNELS.md#cold-start).

The one-writer guarantee does not rest on that path alone (a user or a tmp
reaper may delete or replace it under a live run). Three locks,
all ``flock`` (dropped by the kernel on any death):

* the lock file: the early, named refusal of a second run;
* the temp folder's own directory descriptor (`TempClaim`), held from the
  moment the run creates or adopts ``.OUT.megamoe-tmp`` to its end, so no
  other run can resume, discard or swap in a live run's folder, whatever
  happened to the lock file; the folder's marker holds the run id;
* OUT's parent directory (`parent_locked`), for the few short steps that
  decide on and change the names beside OUT (claiming, discarding or
  creating the temp folder, `recover`, the swap), so two runs never
  interleave those steps.

Before every rename or delete under OUT a run confirms (`OutputLock.confirm`)
that the lock path still names the file it locked (re-created if only
removed) and that the temp folder is still its own (same inode, its run id
in the marker); otherwise it stops with an OutputError naming the folder and
the other run, and touches nothing.

Placement rules (`check_placement`): OUT (and its siblings) may not overlap
the source in either direction after resolving symlinks (a hub source's cache
counts as the source), and may not be the working directory or one of its
parents. Replacement rules (`check_replaceable`): ``--overwrite`` replaces only
an empty folder or a megamoe output whose every entry its manifest lists, or
is the kernel cache ``megamoe-convert warm`` built in it (provably: its own
manifest and only triton's entries; removed with the old shards it serves).
Only folders that are provably ours are ever removed (`is_our_temp`,
`_is_our_old`).

The swap (`swap_into_place`) and its recovery (`recover`): old OUT ->
``.megamoe-old``, temp -> OUT, strip the journal, remove the old folder. A run
killed between any two of these leaves every byte under a known name, and the
next run (under the lock) finishes or undoes the swap before anything else.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from megamoe_runtime.backends import kernel_cache as kc
from megamoe_runtime.errors import MegaMoEError, OutputError
from megamoe_runtime.files.json_io import parse_json
from megamoe_runtime.files.json_io import read_json
from megamoe_runtime.format.manifest import MANIFEST_NAME
from megamoe_runtime.files.writer_lock import (  # the lock protocol every megamoe writer of a folder shares
    FolderLock,
    LockHolder,
    lock_path_for,
    open_dir,
    parent_locked,
)

_TMP_SUFFIX = ".megamoe-tmp"
_OLD_SUFFIX = ".megamoe-old"
#: written first into every temp folder the converter creates: what makes it provably ours
TMP_MARKER = "megamoe-tmp.json"
JOURNAL_NAME = "megamoe-journal.jsonl"

#: the steps of a run the converter reports to an ``on_step`` callback (tests plant crashes there)
STEP_TENSOR = "tensor"  # a tensor was queued to its shard
STEP_SYNCED = "synced"  # every temp file is fsynced
STEP_COMPLETE = "complete"  # the journal says the temp folder is complete
_STEP_OLD_MOVED = "old-moved"  # the previous OUT is now .OUT.megamoe-old
_STEP_NEW_MOVED = "new-moved"  # the temp folder is now OUT
_STEP_CLEANED = "cleaned"  # the journal and marker are gone from OUT
_STEP_OLD_REMOVED = "old-removed"  # .OUT.megamoe-old is removed
SWAP_STEPS = (STEP_SYNCED, STEP_COMPLETE, _STEP_OLD_MOVED, _STEP_NEW_MOVED, _STEP_CLEANED, _STEP_OLD_REMOVED)

StepHook = Callable[[str], None]
Log = Callable[[str], None]


# OutputError (the output folder cannot be written as asked) lives in megamoe_runtime.errors, so the
# runtime's verify raises the same class; it is imported above and stays importable from here.


# --------------------------------------------------------------------------- names


def _sibling(out: Path, suffix: str) -> Path:
    out = Path(out)
    return out.parent / f".{out.name}{suffix}"


def temp_dir_for(out: Path) -> Path:
    """``.OUT.megamoe-tmp`` beside OUT (same filesystem: the final rename is atomic)."""
    return _sibling(out, _TMP_SUFFIX)


def old_dir_for(out: Path) -> Path:
    """``.OUT.megamoe-old``: where the previous OUT waits during an --overwrite swap."""
    return _sibling(out, _OLD_SUFFIX)


def resolve_out(out: str | os.PathLike) -> Path:
    """OUT as an absolute path with its parent's symlinks resolved (OUT itself
    may not exist yet). A symlink as OUT is refused: the swap would rename the
    link, not the folder it names."""
    p = Path(out).expanduser()
    if p.name in ("", ".", ".."):
        p = p.resolve()
    if p.is_symlink():
        raise OutputError(f"output folder {out} is a symlink (to {os.path.realpath(p)}); give the real folder")
    return Path(os.path.realpath(p.parent)) / p.name


# --------------------------------------------------------------------------- placement


def _inside(a: Path, b: Path) -> bool:
    """a is b or below it (both resolved)."""
    return a == b or b in a.parents


def check_placement(out: Path, source_roots: list[Path], cwd: Path | None = None) -> None:
    """Refuse an OUT that overlaps a source root (either direction) or that is
    the working directory or one of its parents. `out` from `resolve_out`;
    the temp and old folders beside OUT obey the same rules."""
    cwd = Path(os.path.realpath(cwd or os.getcwd()))
    for p in (out, temp_dir_for(out), old_dir_for(out)):
        for root in source_roots:
            root = Path(os.path.realpath(root))
            if _inside(p, root) or _inside(root, p):
                what = ("is the source folder" if p == root else
                        "is inside the source folder" if _inside(p, root) else "contains the source folder")
                raise OutputError(
                    f"output {p} {what} {root}; the output and the source may not overlap (the conversion "
                    "would overwrite or delete the source): choose an OUT outside the source")
        if _inside(cwd, p):
            raise OutputError(
                f"output {p} is the working directory {cwd}" + ("" if p == cwd else " or one of its parents")
                + "; OUT is created and replaced as a whole: choose a new folder name (e.g. ./out)")


def ensure_parent(out: Path) -> list[Path]:
    """Create OUT's missing parent folders; returns the ones created (deepest
    last), so a failed run can remove exactly those (`remove_created`)."""
    missing = []
    p = out.parent
    while not p.exists():
        missing.append(p)
        p = p.parent
    if not p.is_dir():
        raise OutputError(f"cannot create {out}: {p} is not a folder")
    created = []
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        except OSError as e:
            raise OutputError(f"cannot create {d} (parent of {out.name}): {e}") from e
        created.append(d)
    return created


def remove_created(created: list[Path]) -> None:
    """Remove the parent folders `ensure_parent` created, if still empty."""
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            break


# --------------------------------------------------------------------------- what is ours


def _read_json_object(path: Path) -> dict | None:
    """A JSON object through the runtime's guarded reader, or None when absent or invalid."""
    if not path.is_file():
        return None
    try:
        return read_json(path)
    except MegaMoEError:
        return None


def _manifest_files(folder: Path) -> set[str] | None:
    """The file names a megamoe manifest in `folder` lists (plus the manifest
    itself), or None when `folder` holds no readable megamoe manifest."""
    m = _read_json_object(Path(folder) / MANIFEST_NAME)
    if m is None or m.get("format") != "megamoe" or not isinstance(m.get("files"), dict):
        return None
    return {str(k) for k in m["files"]} | {MANIFEST_NAME}


def is_megamoe_output(folder: Path) -> bool:
    return Path(folder).is_dir() and _manifest_files(folder) is not None


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in Path(folder).iterdir())


def _list(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" ... ({len(names) - n} more)" if len(names) > n else "")


def check_replaceable(out: Path) -> None:
    """What ``--overwrite`` may replace: an empty folder, or a megamoe output
    holding only what its manifest lists (a leftover journal/marker of our
    own swap included) and the ``kernel-cache`` ``megamoe-convert warm`` built
    of it, when that is provably warm's own (`kernel_cache.not_own_reason`:
    its manifest valid, only the files warm and triton write; it is removed
    with the shards it was compiled for). Anything else is refused, naming
    what is there."""
    if out.is_symlink() or not out.is_dir():
        raise OutputError(f"{out} exists and is not a folder; --overwrite replaces only megamoe output folders")
    names = _entries(out)
    if not names:
        return
    listed = _manifest_files(out)
    if listed is None:
        raise OutputError(
            f"{out} is not a megamoe output (no readable megamoe.json) and holds {len(names)} entr"
            f"{'y' if len(names) == 1 else 'ies'} ({_list(names)}); --overwrite replaces only a folder "
            "megamoe-convert wrote: choose another OUT or move these away yourself")
    cache_why = None
    if kc.FOLDER_SUBDIR in names:  # `megamoe-convert warm`'s cache of the shards: ours only when provably so
        cache_why = kc.not_own_reason(out / kc.FOLDER_SUBDIR)
    foreign = [n for n in names if not (n == kc.FOLDER_SUBDIR and cache_why is None) and (
               n not in listed | {JOURNAL_NAME, TMP_MARKER} or not (out / n).is_file() or (out / n).is_symlink())]
    if foreign:
        raise OutputError(
            f"{out} is a megamoe output but also holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} "
            f"its manifest does not list ({_list(foreign)}); --overwrite would delete them: move them away first"
            + (f" ({out / kc.FOLDER_SUBDIR} is not a kernel cache megamoe-convert warm made: {cache_why})"
               if cache_why is not None else ""))
    changed = changed_listed_files(out)
    if changed:
        raise OutputError(
            f"{out} is a megamoe output, but {len(changed)} file(s) it lists changed since megamoe-convert wrote "
            f"them ({_list(changed)}: not the size or digest megamoe.json records); edited files are yours, and "
            "--overwrite would delete them: move them away (or put the written ones back) first")


#: listed files up to this size are re-hashed by `changed_listed_files` (the config, tokenizer and index
#: files a user may edit); larger ones (the shards) are compared by size
_REHASH_MAX_BYTES = 64 << 20


def changed_listed_files(folder: Path) -> list[str]:
    """The files a megamoe output's manifest lists that are present but not as written: another size, or,
    for files of at most `_REHASH_MAX_BYTES` with a whole-file digest (config.json, tokenizer files, the
    index), other bytes. A user who edited the config.json of an output owns that edit; `--overwrite`
    replaced it silently before. Shards are checked by size only: hashing gigabytes on every --overwrite
    would cost minutes, and a shard is not a file users edit."""
    from megamoe_runtime.files.digests import hash_file, is_composite, kind_algorithm
    from megamoe_runtime.format.manifest import DIGEST_SHA256

    m = _read_json_object(Path(folder) / MANIFEST_NAME)
    files = m.get("files") if isinstance(m, dict) else None
    out = []
    for name, fe in sorted(files.items()) if isinstance(files, dict) else []:
        p = Path(folder) / str(name)
        if not isinstance(fe, dict) or not p.is_file() or p.is_symlink():
            continue  # absent: nothing to lose; not a plain file: `check_replaceable` names it as foreign
        size = p.stat().st_size
        if isinstance(fe.get("size"), int) and size != fe["size"]:
            out.append(name)
            continue
        kind = fe.get("digest", DIGEST_SHA256)
        if not isinstance(kind, str) or is_composite(kind) or size > _REHASH_MAX_BYTES:
            continue
        alg = kind_algorithm(kind)
        if isinstance(fe.get(alg), str) and hash_file(p, alg) != fe[alg]:
            out.append(name)
    return out


def is_our_temp(tmp: Path) -> bool:
    """A temp folder the converter made: it holds our marker or journal."""
    return tmp.is_dir() and not tmp.is_symlink() and ((tmp / TMP_MARKER).is_file() or (tmp / JOURNAL_NAME).is_file())


def _is_our_old(old: Path) -> bool:
    """A ``.megamoe-old`` folder we may remove: empty, or a megamoe output
    holding only what its manifest lists (what `check_replaceable` let us move there)."""
    if not old.is_dir() or old.is_symlink():
        return False
    try:
        check_replaceable(old)
    except OutputError:
        return False
    return True


def new_run_id() -> str:
    """A run's id: in its lock file and in its temp folder's marker, so a run can tell its folder from another's."""
    return secrets.token_hex(8)


#: options whose value is a secret: never written into the marker (nor shown from it)
_SECRET_OPTIONS = ("--token",)


def this_command() -> dict:
    """The command line of this process and where it ran: kept in the temp folder's marker, so a later
    run can show what an interrupted run was started with (``--resume`` with other options names them).
    A secret (``--token``'s value) is written as ``$HF_TOKEN``, as the printed resume command says it."""
    argv, out, hide = sys.argv[1:], [], False
    for a in argv:
        if hide:
            out.append("$HF_TOKEN")
            hide = False
        elif a in _SECRET_OPTIONS:
            out.append(a)
            hide = True
        elif a.split("=", 1)[0] in _SECRET_OPTIONS and "=" in a:
            out.append(a.split("=", 1)[0] + "=$HF_TOKEN")
        else:
            out.append(a)
    return {"argv": [os.path.basename(sys.argv[0] or "python"), *out], "cwd": os.getcwd()}


def write_temp_marker(tmp: Path, out: Path, run_id: str | None = None, command: dict | None = None,
                      previous: dict | None = None) -> None:
    """The marker that makes `tmp` provably ours: the owning run (id, pid, host, start) and the command
    the folder was created by. `previous` (a resume taking the folder over): the old marker, whose
    ``command`` and ``created`` are kept, and whose run is appended to ``resumes``."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rec = {"format": "megamoe-temp", "out": str(out), "pid": os.getpid(), "host": socket.gethostname(),
           "started": now, "run_id": run_id or new_run_id(), "command": command or this_command(), "created": now}
    if previous:
        rec["command"] = previous.get("command", rec["command"])
        rec["created"] = previous.get("created", previous.get("started", now))
        rec["resumes"] = [*previous.get("resumes", []), {k: previous.get(k) for k in ("run_id", "pid", "started")}]
    data = (json.dumps(rec, sort_keys=True) + "\n").encode()
    fd = os.open(tmp / TMP_MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def read_temp_marker(tmp: Path) -> dict:
    """The marker of `tmp` ({} when absent or unreadable)."""
    return _read_json_object(Path(tmp) / TMP_MARKER) or {}


def _describe_marker(m: dict) -> str:
    """Who a temp folder's marker says owns it, for messages."""
    if not m.get("pid"):
        return "a run whose marker is unreadable"
    return (f"run {m.get('run_id', '?')}, pid {m['pid']}" + (f" on {m['host']}" if m.get("host") else "")
            + (f", started {m['started']}" if m.get("started") else ""))


def journal_state(tmp: Path) -> tuple[str | None, bool]:
    """(run fingerprint, complete) from a temp folder's journal; (None, False) without one.
    Complete: the journal's last record says every file and the manifest are written and synced."""
    record, complete = _journal_run(tmp)
    return (record or {}).get("fingerprint"), complete


def _journal_run(tmp: Path) -> tuple[dict | None, bool]:
    """(the journal's ``run`` record, complete): `journal_state` with the record's source identities too."""
    p = tmp / JOURNAL_NAME
    fingerprint, complete = None, False
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None, False
    for line in lines:
        try:
            rec = parse_json(line, str(p))
        except MegaMoEError:
            continue
        if not isinstance(rec, dict):
            continue
        if rec.get("kind") == "run":
            fingerprint = rec
        complete = rec.get("kind") == "complete"
    return fingerprint, complete and (tmp / MANIFEST_NAME).is_file()


#: the index the converter writes into every output (``shard_writer.INDEX_NAME``; not imported: that pulls in torch)
_OUT_INDEX_NAME = "model.safetensors.index.json"


def temp_own_names(tmp: Path, planned=()) -> set[str]:
    """The entry names of a temp folder the converter can prove it wrote: its marker and journal, the
    manifest and index, every file the journal records as finished, every file a manifest there lists,
    and `planned` (this run's output plan: shard names and config/tokenizer copies), each also with the
    ``.part`` suffix (``write_bytes_atomic``) and the manifest's own temp name."""
    names = {TMP_MARKER, JOURNAL_NAME, MANIFEST_NAME, _OUT_INDEX_NAME, *(str(n) for n in planned)}
    names |= _manifest_files(tmp) or set()
    try:
        lines = (Path(tmp) / JOURNAL_NAME).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            rec = parse_json(line, str(Path(tmp) / JOURNAL_NAME))
        except MegaMoEError:
            continue
        if isinstance(rec, dict) and rec.get("kind") == "file" and isinstance(rec.get("name"), str):
            names.add(rec["name"])
    names = {n for n in names if n and "/" not in n and n not in (".", "..")}
    return names | {n + ".part" for n in names} | {f".{MANIFEST_NAME}.{os.getpid()}.tmp"}


def foreign_temp_entries(tmp: Path, planned=()) -> list[str]:
    """Entries of `tmp` the converter cannot prove it wrote (`temp_own_names`; a folder or a symlink at
    one of those names counts as foreign: the converter writes only plain files there)."""
    own = temp_own_names(tmp, planned)
    return [n for n in _entries(tmp)
            if n not in own or (tmp / n).is_symlink() or not (tmp / n).is_file()]


def _foreign_error(tmp: Path, foreign: list[str], doing: str) -> OutputError:
    return OutputError(
        f"{tmp} was made by megamoe-convert but also holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} "
        f"it did not write ({_list(foreign)}); {doing} would delete {'it' if len(foreign) == 1 else 'them'}, so "
        f"everything in it is left in place: move {'it' if len(foreign) == 1 else 'them'} away first")


def remove_own_entries(tmp: Path, planned=()) -> None:
    """Delete `tmp` entry by entry: only when every entry is one of ours (`foreign_temp_entries`), else
    OutputError naming the others and nothing removed. The folder itself goes last (rmdir: it fails,
    leaving the rest, if something appeared meanwhile)."""
    foreign = foreign_temp_entries(tmp, planned)
    if foreign:
        raise _foreign_error(tmp, foreign, "removing it")
    for n in _entries(tmp):
        if n != TMP_MARKER:
            (tmp / n).unlink(missing_ok=True)
    (tmp / TMP_MARKER).unlink(missing_ok=True)  # last: until it is gone the folder is provably ours
    try:
        tmp.rmdir()
    except OSError as e:
        raise OutputError(f"cannot remove {tmp}: {e.strerror or e} (something was added to it meanwhile; "
                          "it is left as it is)") from None


def discard_temp(tmp: Path, out: Path | None = None, guard: "OutputLock | None" = None, planned=()) -> None:
    """Remove an interrupted run's temp folder, only if provably ours and no live run holds it
    (`TempClaim.adopt` first: refused naming that run), and only entry by entry: an entry the converter
    cannot prove it wrote (`foreign_temp_entries`; `planned`: this run's output file names) refuses the
    whole removal, naming it. `guard`: the caller's lock, confirmed first."""
    if not is_our_temp(tmp):
        raise OutputError(
            f"{tmp} exists but was not made by megamoe-convert (no {TMP_MARKER} or journal inside); "
            "it is left alone: remove or rename it yourself")
    if out is None:  # ".NAME.megamoe-tmp" -> NAME
        out = tmp.parent / tmp.name[1:-len(_TMP_SUFFIX)]
    with parent_locked(out):
        claim = TempClaim.adopt(tmp, out)
        try:
            _confirm(guard, f"removing the interrupted run's temp folder {tmp}")
            foreign = foreign_temp_entries(tmp, planned)
            if foreign:
                raise _foreign_error(tmp, foreign, "discarding the interrupted run (--overwrite)")
            remove_own_entries(tmp, planned)
        finally:
            claim.release()


# --------------------------------------------------------------------------- lock


class OutputLock(FolderLock):
    """The converter's lock on OUT: the shared lock file (`FolderLock`, ``.OUT.megamoe-lock`` beside OUT,
    megamoe_runtime/files/writer_lock.py), held for a whole run, and the run's claim on its temp folder
    (`claim`, a `TempClaim`).

    The kernel drops it when the holder dies (``kill -9`` included), so a
    lock file left behind by a dead run is recognised (`stale` holds who it
    was) and taken over. A second run is refused at once, naming the holder.
    The file is removed on release (only while it is still ours); `acquire`
    re-checks that the file it locked is still the one at the path.

    The path can still be removed or replaced while the run holds it (issue
    30): `confirm`, called before every rename or delete under OUT, re-checks
    it, re-creates a removed lock, and stops the run (OutputError) when
    another live process holds whatever now lies at that name, or when the
    temp folder is no longer this run's. What actually keeps a second run out
    of a live run's files is the claim on the temp folder itself and the
    parent-directory lock around the swap (module docstring).

    ``command``: the megamoe-convert command taking it when that is not
    ``convert``: recorded in the file, so a refused run names it. ``warm``
    (`megamoe_runtime.integrations.warm.build_cache`) takes the same file as a
    plain `FolderLock`, so a conversion and a cache build of one OUT exclude
    each other."""

    def __init__(self, out: Path, log: Log | None = None, command: str | None = None):
        super().__init__(out, log, command=command, run_id=new_run_id())
        self.claim: TempClaim | None = None

    def confirm(self, doing: str = "") -> None:
        """Before a rename or delete under OUT (`doing` names it): the lock and
        the temp folder must still be this run's.

        A lock file that was removed is re-created and locked again (nobody
        else holds the name, so nobody else is in). One that was replaced by a
        file no live process holds is locked again too. One that another live
        process holds means a second run got past the lock while this one was
        running: wait `TAKEOVER_GRACE_S` (a run that is only being refused by
        this run's temp-folder claim lets go within milliseconds), then stop
        with an OutputError naming the folder and the other run; nothing is
        touched (the temp folder stays, resumable). Outside a run (no lock
        held) a no-op."""
        if self.fd is None:
            return
        with parent_locked(self.out):
            self._confirm(doing)

    def _confirm(self, doing: str) -> None:
        deadline = time.monotonic() + TAKEOVER_GRACE_S
        while self.still_ours() is not True:
            got = self.try_lock()
            if got is self:
                self.log(f"note: {self.path} was removed or replaced while this run held it; locked again "
                         f"(run {self.run_id})")
                break
            if time.monotonic() >= deadline:
                where = (f"its temp folder {self.claim.path} is left as it is (resumable with --resume once the "
                         "other run is done)" if self.claim is not None else "nothing was written")
                raise OutputError(
                    f"the lock {self.path} of {self.out} was removed or replaced while this run (run {self.run_id}, "
                    f"pid {os.getpid()}) held it, and another process now holds it ({got.describe()}); this run "
                    f"stops before {doing or 'going on'} and touches nothing: {where}. Never delete a "
                    "*.megamoe-lock while a conversion is running")
            time.sleep(0.05)
        if self.claim is not None:
            self.claim.confirm(doing)

    def release(self) -> None:
        if self.claim is not None:
            self.claim.release()
            self.claim = None
        super().release()

    def __enter__(self) -> "OutputLock":
        self.acquire()
        return self


#: how long `OutputLock.confirm` waits for another holder of a replaced lock file to let go, seconds
TAKEOVER_GRACE_S = 2.0
#: errors of a file system that cannot flock a directory (NFS emulates flock with fcntl locks, which need
#: a descriptor open for writing): the temp-folder claim then rests on its inode and run id checks alone
_NO_DIR_LOCK = {errno.EBADF, errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}


def temp_holder(tmp: Path) -> dict | None:
    """The marker of the live run that holds `tmp`'s claim, or None when no
    live process holds it (or it cannot be told): a probe, changing nothing."""
    import fcntl

    try:
        fd = open_dir(tmp)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return read_temp_marker(tmp)
    except OSError:
        return None
    finally:
        os.close(fd)  # closing drops a lock we got
    return None


def busy_temp_error(tmp: Path, out: Path, holder: dict) -> OutputError:
    return OutputError(
        f"another megamoe-convert run is writing {tmp} right now ({_describe_marker(holder)}), although the lock "
        f"{lock_path_for(out)} does not say so (it was removed or replaced while that run held it); this run "
        f"touches nothing: wait for that run to finish, or stop it first")


class TempClaim:
    """This run's hold on its temp folder: an exclusive ``flock`` on the
    folder's own directory descriptor, from creation (`create`) or adoption
    (`adopt`: resume, discard, swap-in of a complete one) to the end of the
    run. The lock lives on the folder's inode, so it follows the folder
    through the rename to OUT and no deleted or replaced path can hand it to
    another run; `confirm` checks that the path still names that folder and
    that the marker still carries this run's id."""

    def __init__(self, path: Path, fd: int, run_id: str | None, locked: bool):
        self.path = Path(path)
        self.fd = fd
        st = os.fstat(fd)
        self.ident = (st.st_dev, st.st_ino)
        self.run_id = run_id
        self.locked = locked

    @classmethod
    def _lock(cls, tmp: Path, out: Path, run_id: str | None) -> "TempClaim":
        import fcntl

        try:
            fd = open_dir(tmp)
        except OSError as e:
            raise OutputError(f"cannot open the temp folder {tmp}: {e.strerror or e}") from None
        locked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise busy_temp_error(tmp, out, read_temp_marker(tmp)) from None
        except OSError as e:
            if e.errno not in _NO_DIR_LOCK:
                os.close(fd)
                raise OutputError(f"cannot lock the temp folder {tmp}: {e.strerror or e}") from None
            locked = False
        claim = cls(tmp, fd, run_id, locked)
        if not claim._names_it(tmp):  # removed or replaced between our open and our lock
            claim.release()
            raise OutputError(f"{tmp} was replaced while this run was taking it; this run touches nothing: "
                              "another run is probably writing there")
        return claim

    @classmethod
    def create(cls, tmp: Path, out: Path, run_id: str, command: dict | None = None) -> "TempClaim":
        """Make `tmp` (it must not exist), lock it and write its marker."""
        tmp.mkdir()
        claim = cls._lock(tmp, out, run_id)
        write_temp_marker(tmp, out, run_id, command)
        return claim

    @classmethod
    def adopt(cls, tmp: Path, out: Path) -> "TempClaim":
        """Lock an existing temp folder (an earlier, dead run's); OutputError naming the live run that holds it.
        Its marker is left as it is until `take_over`."""
        return cls._lock(tmp, out, None)

    def take_over(self, out: Path, run_id: str) -> None:
        """This run continues the adopted folder: the marker names it now, the original command kept."""
        write_temp_marker(self.path, out, run_id, previous=read_temp_marker(self.path))
        self.run_id = run_id

    def _names_it(self, path: Path) -> bool:
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.ident

    def moved(self, path: Path) -> None:
        """The folder was renamed to `path` (the swap): `confirm` looks there now."""
        self.path = Path(path)

    def confirm(self, doing: str = "") -> None:
        """The folder at `path` is still this run's (same inode, and its marker, while it has one, names
        this run); otherwise OutputError naming the folder and what is there now."""
        if not self._names_it(self.path):
            other = read_temp_marker(self.path) if self.path.is_dir() else {}
            now = f"it now holds the folder of another run ({_describe_marker(other)})" if other else \
                "it was removed or replaced by something else"
            raise OutputError(
                f"{self.path} is no longer this run's temp folder (run {self.run_id}, pid {os.getpid()}): {now}; "
                f"this run stops before {doing or 'going on'} and touches nothing")
        m = read_temp_marker(self.path)
        if self.run_id is not None and (self.path / TMP_MARKER).exists() and m.get("run_id") != self.run_id:
            raise OutputError(
                f"{self.path} was taken over by another run ({_describe_marker(m)}; this run is run {self.run_id}, "
                f"pid {os.getpid()}); this run stops before {doing or 'going on'} and touches nothing")

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _confirm(guard: "OutputLock | None", doing: str) -> None:
    if guard is not None:
        guard.confirm(doing)


# --------------------------------------------------------------------------- swap


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _strip_temp_files(out: Path) -> None:
    for name in (JOURNAL_NAME, TMP_MARKER):
        (out / name).unlink(missing_ok=True)
    fsync_dir(out)


def _step(on_step: StepHook | None, name: str) -> None:
    if on_step is not None:
        on_step(name)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT/SIGTERM arriving inside the block are held and re-raised after
    it (main thread only; elsewhere a no-op): the few renames of a swap run
    to the end instead of stopping between two of them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    sigs = [signal.SIGINT, signal.SIGTERM]
    old = {s: signal.getsignal(s) for s in sigs}
    for s in sigs:
        signal.signal(s, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for s in dict.fromkeys(pending):
            signal.raise_signal(s)


def check_old_name_free(out: Path, tmp: Path | None = None) -> None:
    """``.OUT.megamoe-old`` must be absent or a folder `_is_our_old` may remove before an existing OUT is
    moved there; anything else (a user's folder, a link) is refused and left alone."""
    old = old_dir_for(out)
    if (old.exists() or old.is_symlink()) and not _is_our_old(old):
        kind = f"a symlink (to {os.readlink(old)})" if old.is_symlink() else "not a megamoe output"
        raise OutputError(f"{old} exists and is {kind}; it is left alone: move it away so {out} can be replaced"
                          + (f" (the new output is complete in {tmp})" if tmp is not None else ""))


def swap_into_place(tmp: Path, out: Path, on_step: StepHook | None = None,
                    guard: "OutputLock | None" = None) -> None:
    """Make the complete temp folder OUT: old OUT -> ``.OUT.megamoe-old``,
    temp -> OUT, journal and marker removed from OUT, old folder removed.
    Each step is fsynced; a kill between any two is finished by `recover`.

    Under OUT's parent lock (`parent_locked`), and with `guard` (the run's
    `OutputLock`) each rename and delete is preceded by `guard.confirm`: a run
    whose lock or temp folder was taken over stops there, touching nothing."""
    old = old_dir_for(out)
    moved_old = False
    with parent_locked(out), _signals_deferred():
        if out.exists() or out.is_symlink():
            check_replaceable(out)  # again: something may have been added while we converted
            check_old_name_free(out, tmp)
            _confirm(guard, f"moving {out} to {old}")
            if old.exists():
                shutil.rmtree(old)
            os.rename(out, old)
            moved_old = True
            fsync_dir(out.parent)
            _step(on_step, _STEP_OLD_MOVED)
        _confirm(guard, f"renaming {tmp} to {out}")
        _rename_no_replace(tmp, out)
        if guard is not None and guard.claim is not None:
            guard.claim.moved(out)
        fsync_dir(out.parent)
        _step(on_step, _STEP_NEW_MOVED)
        _confirm(guard, f"removing the journal and marker from {out}")
        _strip_temp_files(out)
        _step(on_step, _STEP_CLEANED)
        if moved_old:  # only what this swap put there: a folder that was already at that name is not ours
            _confirm(guard, f"removing the previous output {old}")
            shutil.rmtree(old)
            fsync_dir(out.parent)
            _step(on_step, _STEP_OLD_REMOVED)


def _rename_no_replace(src: Path, dst: Path) -> None:
    """rename(2) of a folder, refusing (OutputError, both names) where `dst` appeared meanwhile: rename
    would replace an empty folder there silently, and fails with a bare ENOTEMPTY on a full one."""
    if dst.exists() or dst.is_symlink():
        raise OutputError(f"{dst} appeared while this run was finishing (another process made it); {src} is "
                          "complete and left as it is: move one of them away")
    try:
        os.rename(src, dst)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise OutputError(f"{dst} appeared while this run was finishing (another process made it); {src} "
                              "is complete and left as it is: move one of them away") from None
        raise


def recover(out: Path, log: Log | None = None, guard: "OutputLock | None" = None) -> dict | None:
    """Finish (or undo) a swap an earlier run was killed in; call under the lock.

    * no OUT, complete temp folder: the temp folder becomes OUT;
    * no OUT, no complete temp, ``.megamoe-old`` ours: it is put back as OUT;
    * OUT still holding our journal: stripped;
    * OUT and ``.megamoe-old`` both present: the old one is removed (if ours).

    Under OUT's parent lock, so a live run's swap is never seen half done; a
    temp folder a live run holds (`TempClaim`) is refused, not swapped in.

    Returns the finished run's journal ``run`` record (its ``fingerprint`` and
    the ``sources`` identities it read) when this completed its swap into OUT
    (the caller may then be done already, if its source is still that one), else None."""
    log = log or (lambda m: None)
    tmp, old = temp_dir_for(out), old_dir_for(out)
    finished = None
    with parent_locked(out), _signals_deferred():
        if not out.exists() and not out.is_symlink():
            fp, complete = _journal_run(tmp) if is_our_temp(tmp) else (None, False)
            if complete:
                claim = TempClaim.adopt(tmp, out)  # refused if a live run holds it
                try:
                    _confirm(guard, f"renaming {tmp} to {out}")
                    _rename_no_replace(tmp, out)
                finally:
                    claim.release()
                fsync_dir(out.parent)
                finished = fp
                log(f"recovered: an earlier run to {out} was stopped just before its final rename; "
                    f"its complete output in {tmp} is now {out}")
            elif old.exists() and _is_our_old(old):
                _confirm(guard, f"renaming {old} to {out}")
                _rename_no_replace(old, out)
                fsync_dir(out.parent)
                log(f"recovered: an earlier --overwrite run was stopped mid-swap; the previous output "
                    f"{old} is back at {out}")
        if out.is_dir() and not out.is_symlink() and (out / JOURNAL_NAME).is_file() and is_megamoe_output(out):
            fp, complete = _journal_run(out)
            if complete:
                _confirm(guard, f"removing the journal and marker from {out}")
                _strip_temp_files(out)
                finished = finished or fp
        if old.exists() and out.exists():
            if _is_our_old(old):
                _confirm(guard, f"removing {old}")
                shutil.rmtree(old)
                fsync_dir(out.parent)
                log(f"removed {old}, the previous output left by an earlier --overwrite run")
            else:
                log(f"warning: {old} exists and is not a megamoe output; it is left alone")
    return finished


__all__ = [
    "OutputError", "fsync_dir", "busy_temp_error", "OutputLock", "LockHolder", "temp_dir_for", "old_dir_for", "lock_path_for", "resolve_out",
    "TempClaim", "parent_locked", "temp_holder", "read_temp_marker", "new_run_id", "this_command",
    "TAKEOVER_GRACE_S", "check_placement", "check_old_name_free", "ensure_parent", "remove_created", "check_replaceable", "changed_listed_files", "is_megamoe_output",
    "is_our_temp", "write_temp_marker", "journal_state", "discard_temp",
    "temp_own_names", "foreign_temp_entries", "remove_own_entries",
    "swap_into_place", "recover", "TMP_MARKER", "JOURNAL_NAME", "SWAP_STEPS",
    "STEP_TENSOR", "STEP_SYNCED", "STEP_COMPLETE", "StepHook",
]
