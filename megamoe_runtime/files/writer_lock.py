"""One writer per folder: the lock file ``.NAME.megamoe-lock`` beside a folder that megamoe writes.

The lock protocol of every megamoe writer of a folder, in the runtime so that all of them share it: the
converter (``megamoe-convert convert``, whose `OutputLock` extends `FolderLock` with its temp-folder claim,
megamoe_convert/output/output_dir.py) and the kernel-cache builder (`megamoe_runtime.integrations.warm.
build_cache`, what ``megamoe-convert warm`` runs, called from Python too). A conversion and a cache build of
one folder therefore exclude each other, whichever entry point started them (docs/ARCHITECTURE.md, "One writer
per OUT").

The protocol (the file's name and content are what two megamoe versions on one folder agree on):

* the lock is an exclusive ``fcntl.flock`` on ``.NAME.megamoe-lock`` beside the folder (not inside: the
  converter renames the folder), held for the whole write, so the kernel drops it when the holder dies, even
  by ``kill -9``;
* the file holds one JSON object naming the holder (``pid``, ``host``, ``started``, ``run_id``, the folder
  ``out`` and, for a writer other than ``convert``, its ``command``): a refused writer names it, and a file
  whose holder is gone is taken over with a note (`FolderLock.stale`);
* the file is taken and released under an ``flock`` on the folder's parent directory (`parent_locked`), so a
  writer never meets a file another one is creating or removing; it is removed on release only while it is
  still the file the writer locked.

Where a file at that name is not such a lock (a symlink, another kind of file, foreign content) it is left
alone and the write refused. Nothing here knows what the folder holds.

May import: `megamoe_runtime.errors`, `files` modules (tests/test_import_floors.py).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import socket
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

from ..errors import MegaMoEError, OutputError
from .json_io import read_json

__all__ = ["lock_path_for", "parent_locked", "open_dir", "LockHolder", "LockNotWritable", "FolderLock"]

_LOCK_SUFFIX = ".megamoe-lock"


def lock_path_for(folder: Union[str, os.PathLike]) -> Path:
    """``.NAME.megamoe-lock`` beside folder NAME (not inside: the converter renames the folder)."""
    folder = Path(folder)
    return folder.parent / f".{folder.name}{_LOCK_SUFFIX}"


def open_dir(path: Union[str, os.PathLike]) -> int:
    """A read-only descriptor of directory `path` itself (never through a symlink), to ``flock``."""
    return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW)


_PARENT_HELD = threading.local()


@contextlib.contextmanager
def parent_locked(folder: Union[str, os.PathLike]) -> Iterator[None]:
    """Exclusive ``flock`` on the folder's parent directory for the few steps that decide on and change the
    names beside it (the lock file taken or released; the converter's temp folder claimed, discarded or
    created, its recovery and swap): two writers never interleave them, even when the lock file was removed.
    Writers of other folders in the same parent wait for these steps only (milliseconds). Re-entrant in a
    thread; a no-op where the parent cannot be opened or locked (the other locks still hold)."""
    import fcntl

    parent = Path(folder).parent
    held = getattr(_PARENT_HELD, "paths", None)
    if held is None:
        held = _PARENT_HELD.paths = set()
    key = str(parent)
    if key in held:
        yield
        return
    try:
        fd = open_dir(parent)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # a file system without directory locks
        held.add(key)
        try:
            yield
        finally:
            held.discard(key)
    finally:
        os.close(fd)


@dataclass
class LockHolder:
    pid: Optional[int]
    host: Optional[str]
    started: Optional[str]
    command: Optional[str] = None  # the megamoe-convert command holding it, when not `convert` (`warm`)

    def describe(self) -> str:
        if self.pid is None:
            return "another process (its pid is not recorded)"
        return f"pid {self.pid}" + (f" on {self.host}" if self.host else "") + \
            (f", started {self.started}" if self.started else "") + \
            (f", running `megamoe-convert {self.command}`" if self.command else "")

    def alive(self) -> Optional[bool]:
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
    try:
        d = read_json(path) if path.is_file() else {}
    except MegaMoEError:
        d = {}
    pid = d.get("pid")
    cmd = d.get("command")
    return LockHolder(pid if isinstance(pid, int) else None, d.get("host"), d.get("started"),
                      cmd if isinstance(cmd, str) and cmd.isidentifier() else None)


class LockNotWritable(OutputError):
    """The lock file cannot be created beside the folder (its parent is read-only or not ours to write): no
    conversion can write the folder there either (its temp folder lives beside it too)."""


class FolderLock:
    """Exclusive ``flock`` on ``.NAME.megamoe-lock`` beside `folder`, held for a whole write (module docstring).

    The kernel drops it when the holder dies (``kill -9`` included), so a lock file left behind by a dead
    writer is recognised (`stale` holds who it was; `stale_note` is the line to log) and taken over. A second
    writer is refused at once (OutputError naming the holder). The file is removed on release (only while it
    is still ours); `acquire` re-checks that the file it locked is still the one at the path.

    ``command``: the megamoe-convert command taking it when that is not ``convert`` (``warm``: the kernel
    cache build, from the command line or from Python): recorded in the file, so a refused writer names it.
    ``run_id``: this writer's id, recorded too (the converter's temp folder marker carries the same id)."""

    def __init__(self, folder: Union[str, os.PathLike], log: Optional[Callable[[str], None]] = None,
                 command: Optional[str] = None, run_id: Optional[str] = None):
        self.out = Path(folder)
        self.command = command
        self.path = lock_path_for(self.out)
        self.fd: Optional[int] = None
        self.ident: Optional[tuple[int, int]] = None  # (st_dev, st_ino) of the file this writer locked
        self.stale: Optional[LockHolder] = None
        self.run_id = run_id or secrets.token_hex(8)
        self.log = log or (lambda m: None)

    def acquire(self) -> "FolderLock":
        """Lock the file (under the parent lock: never in the middle of another writer's swap or confirm,
        so a writer that re-creates its removed lock there never meets a half-made one)."""
        with parent_locked(self.out):
            got = self.try_lock()
        if isinstance(got, LockHolder):
            raise OutputError(
                f"another megamoe-convert run is writing {self.out} right now ({got.describe()}; "
                f"lock {self.path}); wait for it to finish, or stop it first. Two runs on one OUT are "
                "refused: they would mix their files")
        return self

    def try_lock(self) -> "FolderLock | LockHolder":
        """Lock the file at `path` (created if missing): self, or the live holder that has it. The caller
        holds the parent lock."""
        import fcntl

        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return _read_holder(self.path)
            st = os.fstat(fd)
            try:
                now = os.stat(self.path, follow_symlinks=False)
                same = (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)
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
        if prev.pid is not None and self.fd is None:
            self.stale = prev
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "out": str(self.out),
                           "run_id": self.run_id, **({"command": self.command} if self.command else {}),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, sort_keys=True)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (info + "\n").encode(), 0)
        if self.fd is not None:
            os.close(self.fd)  # the file we held before is no longer at the path: its lock guards nothing
        self.fd, self.ident = fd, (st.st_dev, st.st_ino)
        return self

    def stale_note(self) -> Optional[str]:
        """The note a writer logs when it took over a lock file a dead writer left (`stale`), else None."""
        if self.stale is None:
            return None
        return (f"note: {self.path} was left by an earlier run ({self.stale.describe()}) that is no longer "
                "running; taking it over")

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
            cls = LockNotWritable if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else OutputError
            raise cls(f"cannot open the lock file {self.path}: {e.strerror or e}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise self._not_ours("not a regular file")
        return fd

    def still_ours(self) -> Optional[bool]:
        """True: the lock path names the file we locked; False: another file; None: nothing."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return (st.st_dev, st.st_ino) == self.ident

    def release(self) -> None:
        if self.fd is None:
            return
        with parent_locked(self.out):
            if self.still_ours():  # never remove a lock file another writer put at that name
                try:
                    os.unlink(self.path)
                except OSError:
                    pass
            os.close(self.fd)  # closing drops the flock
            self.fd = None

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
