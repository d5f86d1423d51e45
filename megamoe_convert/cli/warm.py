"""`megamoe-convert warm`: compile a converted folder's triton kernels once, into a kernel cache that ships.

A module of its own (cli.py registers it with one line): the command only parses its options and hands the
work to `megamoe_runtime.integrations.warm.build_cache`, under the converter's lock (`lock_target`,
`output_dir.OutputLock`): a `convert` (or its `--overwrite` swap) and a second `warm` on the folder the cache is
built in are refused while this runs, and it is refused while they run (docs/KERNELS.md#cold-start).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import click

from megamoe_runtime.errors import MegaMoEError

_DEFAULT_TOKENS = "1,2,3,4,8,16,17,32,33,64,65,128,129,256,257,512,513,1024,1025,2048,2049,4096,4097"


def lock_target(folder: Path, cache: Path | None) -> Path:
    """The folder whose converter lock (``.NAME.megamoe-lock`` beside it) `warm` holds while it writes: FOLDER
    when the cache is built inside it (the default FOLDER/kernel-cache), so `convert FOLDER --overwrite` and
    another `warm FOLDER` are kept out; for a --cache outside FOLDER, the converted folder holding it (a
    ``megamoe.json`` beside it) or else the cache folder itself, so two builds into one cache never interleave.
    FOLDER itself is then only read and is not locked (docs/KERNELS.md#cold-start says why)."""
    from megamoe_runtime.format.manifest import MANIFEST_NAME
    from megamoe_runtime.integrations.warm import CACHE_SUBDIR

    real = Path(os.path.realpath(folder))
    where = Path(os.path.realpath(cache)) if cache is not None else real / CACHE_SUBDIR
    if where == real or real in where.parents:
        return real
    return where.parent if (where.parent / MANIFEST_NAME).is_file() else where


@contextlib.contextmanager
def _locked(target: Path, log):
    """Hold `target`'s converter lock for the build (a dead run's lock is taken over with the converter's
    note). Where no lock file can be made beside `target` (its parent read-only: a model folder mounted
    read-only above, writable inside), no conversion can write `target` either; the build then holds an
    ``flock`` on `target`'s own directory, which keeps a second warm out (the kernel drops it on any death)."""
    import fcntl

    from megamoe_convert.output.output_dir import LockNotWritable, OutputError, OutputLock

    lock = OutputLock(target, log, command="warm")
    try:
        lock.acquire()
    except LockNotWritable as e:
        unwritable = e
    else:
        try:
            if lock.stale is not None:
                log(lock.stale_note())
            yield
        finally:
            lock.release()
        return
    try:
        fd = os.open(target, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW)
    except OSError:
        raise unwritable from None  # names the place that cannot be written
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OutputError(f"another megamoe-convert warm is writing {target} right now (its lock is on the folder "
                          "itself: no lock file can be made beside it); wait for it to finish, or stop it "
                          "first") from None
    except OSError:
        os.close(fd)
        raise unwritable from None
    try:
        yield
    finally:
        os.close(fd)  # closing drops the flock


def _fail(msg: str, as_json: bool, code: int = 2) -> None:
    click.echo(f"error: {msg}", err=True)
    if as_json:
        click.echo(json.dumps({"ok": False, "exit_code": code, "error": msg}, indent=2))
    sys.exit(code)


@click.command("warm", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path))
@click.option("--cache", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Kernel cache folder to create, or an existing one (built for this triton, GPU architecture "
                   "and Python) to add to. Default: FOLDER/kernel-cache, which the transformers integration "
                   "finds by itself.")
@click.option("--tokens", default=_DEFAULT_TOKENS, show_default=True,
              help="Token counts per forward to compile for, comma-separated (a server's prompt lengths and "
                   "batch sizes; counts not listed still run, compiling at first use).")
@click.option("--jobs", type=click.IntRange(min=1, max=64), default=4, show_default=True,
              help="Worker processes compiling side by side (each loads one layer per distinct layer spec "
                   "on the GPU).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout (only JSON).")
def warm(folder, cache, tokens, jobs, as_json):
    """Compile every triton kernel FOLDER's layers launch into a kernel cache, once, on the GPU kind it serves.

    A fresh machine's first token otherwise waits for triton to compile the kernels it needs. This runs
    one layer of each distinct layer spec, loaded from FOLDER, at each token count, with triton's cache
    pointed into the kernel cache; ship the folder with the model or bake it into the image. Loading
    FOLDER through transformers copies FOLDER/kernel-cache (or MEGAMOE_KERNEL_CACHE) into triton's cache
    before the first forward. A cache built with another triton, GPU architecture or Python is not used
    (one warning; the kernels compile at first use): rebuild it where the image changes.

    \b
    Examples:
      megamoe-convert warm ./out                              # -> ./out/kernel-cache
      megamoe-convert warm ./out --tokens 1,8,64,512 --jobs 8
      megamoe-convert warm ./out --cache /opt/kernels && MEGAMOE_KERNEL_CACHE=/opt/kernels python serve.py

    One run at a time writes a folder: while this builds FOLDER/kernel-cache it holds the converter's lock on
    FOLDER, so `convert ... FOLDER --overwrite` and a second `warm FOLDER` are refused (exit 2, naming this
    process), and this is refused while they run. A lock left by a killed run is taken over.

    Exit codes: 0 built, 2 bad input (not a converted folder, an --ep-size > 1 folder, no GPU or triton,
    --cache not a compatible kernel cache, a worker failed, the folder locked by another run), 3 internal
    error.
    """
    from megamoe_runtime.integrations.warm import build_cache, parse_tokens

    log = lambda m: click.echo(m, err=True)  # noqa: E731
    try:
        toks = parse_tokens(tokens)
        target = lock_target(folder, cache)
        if not target.parent.is_dir():  # nothing to lock, nor to build in: build_cache names what is missing
            res = build_cache(folder, cache, toks, jobs=jobs, log=log)
        else:
            with _locked(target, log):
                res = build_cache(folder, cache, toks, jobs=jobs, log=log)
    except MegaMoEError as e:
        _fail(str(e), as_json)
    except OSError as e:
        _fail(f"{type(e).__name__}: {e}", as_json)
    if as_json:
        click.echo(json.dumps(res, indent=2))
    else:
        click.echo(f"kernel cache {res['cache']}: {res['entries']} kernels ({res['new_entries']} new) for "
                   f"{res['gpu']} ({res['capability']}), triton {res['triton']}, {len(res['tokens'])} token counts, "
                   f"{res['seconds']} s in {res['jobs']} worker(s)")
