"""Where the converter may write, and who may write there.

One job: keep the converter from ever deleting, overwriting or mixing bytes
it did not write. Everything here is about the output folder OUT and its
siblings, which all live beside OUT (same filesystem, so renames are atomic):

* ``.OUT.megamoe-tmp``  the run's temp folder (marker file ``megamoe-tmp.json``
  and the progress journal inside), renamed to OUT at the end;
* ``.OUT.megamoe-old``  the previous OUT during an ``--overwrite`` swap;
* ``.OUT.megamoe-lock`` the lock file: ``fcntl.flock`` held for the whole run,
  so the kernel releases it when the process dies, even by ``kill -9``; it
  holds the holder's pid, host and start time for the refusal message.

Placement rules (`check_placement`): OUT (and its siblings) may not overlap
the source in either direction after resolving symlinks (a hub source's cache
counts as the source), and may not be the working directory or one of its
parents. Replacement rules (`check_replaceable`): ``--overwrite`` replaces only
an empty folder or a megamoe output whose every entry its manifest lists.
Only folders that are provably ours are ever removed (`is_our_temp`,
`is_our_old`).

The swap (`swap_into_place`) and its recovery (`recover`): old OUT ->
``.megamoe-old``, temp -> OUT, strip the journal, remove the old folder. A run
killed between any two of these leaves every byte under a known name, and the
next run (under the lock) finishes or undoes the swap before anything else.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from megamoe_runtime.errors import MegaMoEError, OutputError
from megamoe_runtime.json_io import parse_json
from megamoe_runtime.json_io import read_json
from megamoe_runtime.manifest import MANIFEST_NAME

TMP_SUFFIX = ".megamoe-tmp"
OLD_SUFFIX = ".megamoe-old"
LOCK_SUFFIX = ".megamoe-lock"
#: written first into every temp folder the converter creates: what makes it provably ours
TMP_MARKER = "megamoe-tmp.json"
JOURNAL_NAME = "megamoe-journal.jsonl"

#: the steps of a run the converter reports to an ``on_step`` callback (tests plant crashes there)
STEP_TENSOR = "tensor"  # a tensor was queued to its shard
STEP_SYNCED = "synced"  # every temp file is fsynced
STEP_COMPLETE = "complete"  # the journal says the temp folder is complete
STEP_OLD_MOVED = "old-moved"  # the previous OUT is now .OUT.megamoe-old
STEP_NEW_MOVED = "new-moved"  # the temp folder is now OUT
STEP_CLEANED = "cleaned"  # the journal and marker are gone from OUT
STEP_OLD_REMOVED = "old-removed"  # .OUT.megamoe-old is removed
SWAP_STEPS = (STEP_SYNCED, STEP_COMPLETE, STEP_OLD_MOVED, STEP_NEW_MOVED, STEP_CLEANED, STEP_OLD_REMOVED)

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
    return _sibling(out, TMP_SUFFIX)


def old_dir_for(out: Path) -> Path:
    """``.OUT.megamoe-old``: where the previous OUT waits during an --overwrite swap."""
    return _sibling(out, OLD_SUFFIX)


def lock_path_for(out: Path) -> Path:
    """``.OUT.megamoe-lock`` beside OUT (not inside: OUT is renamed)."""
    return _sibling(out, LOCK_SUFFIX)


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


def manifest_files(folder: Path) -> set[str] | None:
    """The file names a megamoe manifest in `folder` lists (plus the manifest
    itself), or None when `folder` holds no readable megamoe manifest."""
    m = _read_json_object(Path(folder) / MANIFEST_NAME)
    if m is None or m.get("format") != "megamoe" or not isinstance(m.get("files"), dict):
        return None
    return {str(k) for k in m["files"]} | {MANIFEST_NAME}


def is_megamoe_output(folder: Path) -> bool:
    return Path(folder).is_dir() and manifest_files(folder) is not None


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in Path(folder).iterdir())


def _list(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" ... ({len(names) - n} more)" if len(names) > n else "")


def check_replaceable(out: Path) -> None:
    """What ``--overwrite`` may replace: an empty folder, or a megamoe output
    holding only what its manifest lists (a leftover journal/marker of our
    own swap included). Anything else is refused, naming what is there."""
    if out.is_symlink() or not out.is_dir():
        raise OutputError(f"{out} exists and is not a folder; --overwrite replaces only megamoe output folders")
    names = _entries(out)
    if not names:
        return
    listed = manifest_files(out)
    if listed is None:
        raise OutputError(
            f"{out} is not a megamoe output (no readable megamoe.json) and holds {len(names)} entr"
            f"{'y' if len(names) == 1 else 'ies'} ({_list(names)}); --overwrite replaces only a folder "
            "megamoe-convert wrote: choose another OUT or move these away yourself")
    foreign = [n for n in names if n not in listed | {JOURNAL_NAME, TMP_MARKER}
               or not (out / n).is_file() or (out / n).is_symlink()]
    if foreign:
        raise OutputError(
            f"{out} is a megamoe output but also holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} "
            f"its manifest does not list ({_list(foreign)}); --overwrite would delete them: move them away first")


def is_our_temp(tmp: Path) -> bool:
    """A temp folder the converter made: it holds our marker or journal."""
    return tmp.is_dir() and not tmp.is_symlink() and ((tmp / TMP_MARKER).is_file() or (tmp / JOURNAL_NAME).is_file())


def is_our_old(old: Path) -> bool:
    """A ``.megamoe-old`` folder we may remove: empty, or a megamoe output
    holding only what its manifest lists (what `check_replaceable` let us move there)."""
    if not old.is_dir() or old.is_symlink():
        return False
    try:
        check_replaceable(old)
    except OutputError:
        return False
    return True


def write_temp_marker(tmp: Path, out: Path) -> None:
    (tmp / TMP_MARKER).write_text(json.dumps({
        "format": "megamoe-temp", "out": str(out), "pid": os.getpid(), "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, sort_keys=True) + "\n")


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


def discard_temp(tmp: Path) -> None:
    """Remove an interrupted run's temp folder, only if provably ours."""
    if not is_our_temp(tmp):
        raise OutputError(
            f"{tmp} exists but was not made by megamoe-convert (no {TMP_MARKER} or journal inside); "
            "it is left alone: remove or rename it yourself")
    shutil.rmtree(tmp)


# --------------------------------------------------------------------------- lock


@dataclass
class LockHolder:
    pid: int | None
    host: str | None
    started: str | None

    def describe(self) -> str:
        if self.pid is None:
            return "another process (its pid is not recorded)"
        return f"pid {self.pid}" + (f" on {self.host}" if self.host else "") + \
            (f", started {self.started}" if self.started else "")

    def alive(self) -> bool | None:
        """True/False for a pid on this host; None when it cannot be told."""
        if self.pid is None or (self.host and self.host != socket.gethostname()):
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _read_holder(path: Path) -> LockHolder:
    d = _read_json_object(path) or {}
    pid = d.get("pid")
    return LockHolder(pid if isinstance(pid, int) else None, d.get("host"), d.get("started"))


class OutputLock:
    """Exclusive ``flock`` on ``.OUT.megamoe-lock``, held for a whole run.

    The kernel drops it when the holder dies (``kill -9`` included), so a
    lock file left behind by a dead run is recognised (`stale` holds who it
    was) and taken over. A second run is refused at once, naming the holder.
    The file is removed on release; `acquire` re-checks that the file it
    locked is still the one at the path, so removal cannot let two runs in."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.path = lock_path_for(self.out)
        self.fd: int | None = None
        self.stale: LockHolder | None = None

    def acquire(self) -> "OutputLock":
        import fcntl

        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                holder = _read_holder(self.path)
                raise OutputError(
                    f"another megamoe-convert run is writing {self.out} right now ({holder.describe()}; "
                    f"lock {self.path}); wait for it to finish, or stop it first. Two runs on one OUT are "
                    "refused: they would mix their files") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the previous holder removed the file between our open and our lock: retry
        try:
            raw = os.pread(fd, 4096, 0)
        except OSError:
            raw = b"x"
        prev = _read_holder(self.path)
        if raw.strip() and prev.pid is None:  # not empty (a kill between create and write) and not our JSON
            os.close(fd)
            raise self._not_ours("a file whose content is not a megamoe-convert lock")
        if prev.pid is not None:
            self.stale = prev
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "out": str(self.out),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, sort_keys=True)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (info + "\n").encode(), 0)
        self.fd = fd
        return self

    def _not_ours(self, what: str) -> OutputError:
        return OutputError(
            f"{self.path} is {what}; it is not a megamoe-convert lock and is left alone (the lock of {self.out} "
            "lives at that name): move it away, or choose another OUT")

    def _open(self) -> int:
        """The lock file, created if missing; never through a symlink (a link planted there would make the
        lock truncate and then overwrite its target) and only a regular file."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if self.path.is_symlink():
                raise self._not_ours(f"a symlink (to {os.readlink(self.path)})") from None
            raise OutputError(f"cannot open the lock file {self.path}: {e.strerror or e}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise self._not_ours("not a regular file")
        return fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)  # closing drops the flock
        self.fd = None

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# --------------------------------------------------------------------------- swap


def _fsync_dir(path: Path) -> None:
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
    _fsync_dir(out)


def _step(on_step: StepHook | None, name: str) -> None:
    if on_step is not None:
        on_step(name)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
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
    """``.OUT.megamoe-old`` must be absent or a folder `is_our_old` may remove before an existing OUT is
    moved there; anything else (a user's folder, a link) is refused and left alone."""
    old = old_dir_for(out)
    if (old.exists() or old.is_symlink()) and not is_our_old(old):
        kind = f"a symlink (to {os.readlink(old)})" if old.is_symlink() else "not a megamoe output"
        raise OutputError(f"{old} exists and is {kind}; it is left alone: move it away so {out} can be replaced"
                          + (f" (the new output is complete in {tmp})" if tmp is not None else ""))


def swap_into_place(tmp: Path, out: Path, on_step: StepHook | None = None) -> None:
    """Make the complete temp folder OUT: old OUT -> ``.OUT.megamoe-old``,
    temp -> OUT, journal and marker removed from OUT, old folder removed.
    Each step is fsynced; a kill between any two is finished by `recover`."""
    old = old_dir_for(out)
    moved_old = False
    with signals_deferred():
        if out.exists() or out.is_symlink():
            check_replaceable(out)  # again: something may have been added while we converted
            check_old_name_free(out, tmp)
            if old.exists():
                shutil.rmtree(old)
            os.rename(out, old)
            moved_old = True
            _fsync_dir(out.parent)
            _step(on_step, STEP_OLD_MOVED)
        os.rename(tmp, out)
        _fsync_dir(out.parent)
        _step(on_step, STEP_NEW_MOVED)
        _strip_temp_files(out)
        _step(on_step, STEP_CLEANED)
        if moved_old:  # only what this swap put there: a folder that was already at that name is not ours
            shutil.rmtree(old)
            _fsync_dir(out.parent)
            _step(on_step, STEP_OLD_REMOVED)


def recover(out: Path, log: Log | None = None) -> dict | None:
    """Finish (or undo) a swap an earlier run was killed in; call under the lock.

    * no OUT, complete temp folder: the temp folder becomes OUT;
    * no OUT, no complete temp, ``.megamoe-old`` ours: it is put back as OUT;
    * OUT still holding our journal: stripped;
    * OUT and ``.megamoe-old`` both present: the old one is removed (if ours).

    Returns the finished run's journal ``run`` record (its ``fingerprint`` and
    the ``sources`` identities it read) when this completed its swap into OUT
    (the caller may then be done already, if its source is still that one), else None."""
    log = log or (lambda m: None)
    tmp, old = temp_dir_for(out), old_dir_for(out)
    finished = None
    with signals_deferred():
        if not out.exists() and not out.is_symlink():
            fp, complete = _journal_run(tmp) if is_our_temp(tmp) else (None, False)
            if complete:
                os.rename(tmp, out)
                _fsync_dir(out.parent)
                finished = fp
                log(f"recovered: an earlier run to {out} was stopped just before its final rename; "
                    f"its complete output in {tmp} is now {out}")
            elif old.exists() and is_our_old(old):
                os.rename(old, out)
                _fsync_dir(out.parent)
                log(f"recovered: an earlier --overwrite run was stopped mid-swap; the previous output "
                    f"{old} is back at {out}")
        if out.is_dir() and not out.is_symlink() and (out / JOURNAL_NAME).is_file() and is_megamoe_output(out):
            fp, complete = _journal_run(out)
            if complete:
                _strip_temp_files(out)
                finished = finished or fp
        if old.exists() and out.exists():
            if is_our_old(old):
                shutil.rmtree(old)
                _fsync_dir(out.parent)
                log(f"removed {old}, the previous output left by an earlier --overwrite run")
            else:
                log(f"warning: {old} exists and is not a megamoe output; it is left alone")
    return finished


__all__ = [
    "OutputError", "OutputLock", "LockHolder", "temp_dir_for", "old_dir_for", "lock_path_for", "resolve_out",
    "check_placement", "check_old_name_free", "ensure_parent", "remove_created", "check_replaceable", "is_megamoe_output",
    "manifest_files", "is_our_temp", "is_our_old", "write_temp_marker", "journal_state", "discard_temp",
    "swap_into_place", "recover", "signals_deferred", "TMP_MARKER", "JOURNAL_NAME", "SWAP_STEPS",
    "STEP_TENSOR", "STEP_SYNCED", "STEP_COMPLETE", "STEP_OLD_MOVED", "STEP_NEW_MOVED", "STEP_CLEANED",
    "STEP_OLD_REMOVED", "StepHook",
]
