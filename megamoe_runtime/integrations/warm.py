"""Build a converted folder's kernel cache once, and seed triton's cache from it when an engine loads the folder.

The triton backend compiles a kernel per specialization at its first launch (docs/KERNELS.md#cold-start),
so a fresh machine's first token waits for the compiler. `build_cache` runs the folder's layers on the GPU
(one layer per distinct layer spec, loaded from the folder, at every token count asked for, in worker
processes that compile side by side) with triton's cache pointed into a new kernel cache folder
(`megamoe_runtime.backends.kernel_cache`), which then ships with the model or the image. `seed_for_folder`
is what the engines call before their first forward: it finds the shipped cache (``MEGAMOE_KERNEL_CACHE``,
else ``FOLDER/kernel-cache``) and copies what this process lacks into triton's cache.

``python -m megamoe_runtime.integrations.warm --worker ...`` is the worker `build_cache` starts; users run
``megamoe-convert warm FOLDER`` (megamoe_convert/cli/warm.py).

One writer per folder (docs/KERNELS.md#cold-start): `build_cache` holds the lock every megamoe writer of a folder
takes (`files.writer_lock.FolderLock`, ``.NAME.megamoe-lock`` beside it, the converter's own) on the folder it
writes (`lock_target`) from before it makes anything until its cache is renamed into place or dropped, whether
``megamoe-convert warm`` or a Python caller runs it. A new cache is built in a hidden folder beside it
(``.CACHE.partial-PID-TAG``) holding a marker (`PARTIAL_MARKER`: who made it) whose ``flock`` the build and its
worker processes hold while they write there; a build killed before it finished leaves that folder, and the next
build of the same cache removes it once it is provably such a folder and provably abandoned
(`remove_abandoned_partials`).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import secrets
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from .. import knobs
from ..backends import kernel_cache as kc
from ..errors import OutputError
from ..files.writer_lock import FolderLock, LockNotWritable

__all__ = ["DEFAULT_TOKENS", "CACHE_SUBDIR", "PARTIAL_MARKER", "distinct_layers", "parse_tokens", "build_cache",
           "run_layers", "run_workers", "lock_target", "remove_abandoned_partials", "shipped_cache",
           "seed_for_folder"]

#: token counts a cache is built for when none are named: one and a few tokens (decode), every power of two
#: to 4096 and one past each from 16 up (triton specializes integer arguments on ``== 1`` and on divisibility
#: by 16, and the tile regimes change with the pairs per expert, docs/KERNELS.md#cold-start)
DEFAULT_TOKENS = (1, 2, 3, 4, 8, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513, 1024, 1025, 2048, 2049,
                  4096, 4097)
#: where a folder's own kernel cache lives (what `shipped_cache` finds without the knob)
CACHE_SUBDIR = kc.FOLDER_SUBDIR
MAX_TOKENS = 1 << 16
#: written first into the hidden folder a new cache is built in: who made it (pid, host, start); the build
#: and its workers hold an ``flock`` on it (the workers inherit the descriptor) while they write there, and
#: it is removed before the folder becomes the cache
PARTIAL_MARKER = "megamoe-partial.json"
_PARTIAL_FORMAT = "megamoe-kernel-cache-partial"
#: the hidden folder a new cache CACHE is built in: ``.CACHE.partial-PID-TAG`` (TAG 8 hex digits)
_PARTIAL_NAME = re.compile(r"\.(?P<cache>.+)\.partial-(?P<pid>[1-9][0-9]*)-[0-9a-f]{8}")


def parse_tokens(text: str) -> list[int]:
    """``"1,8,64"`` -> [1, 8, 64] (sorted, duplicates dropped); KernelCacheError on anything else."""
    out = set()
    for t in (s.strip() for s in str(text).split(",")):
        if not t:
            continue
        if not t.isdigit() or not 1 <= int(t) <= MAX_TOKENS:
            raise kc.KernelCacheError(f"token count {t!r}: expected integers 1..{MAX_TOKENS}, comma-separated")
        out.add(int(t))
    if not out:
        raise kc.KernelCacheError("no token counts given")
    return sorted(out)


def distinct_layers(ckpt: Any) -> list[int]:
    """The first layer index of each distinct layer spec of ``ckpt`` (EP rank 0): the layers whose forwards
    launch every kernel the folder needs (layers of one spec launch the same specializations)."""
    seen, out = [], []
    for li in ckpt.layers:
        if li.spec not in seen:
            seen.append(li.spec)
            out.append(li.index)
    return out


def run_layers(folder: Union[str, os.PathLike], layers: Sequence[int], tokens: Sequence[int],
               device: str = "cuda", backend: str = "triton", seed: int = 0) -> dict:
    """Load each of ``layers`` from ``folder`` and run one forward per token count, routed uniformly at random
    (int64 global ids, as transformers' routers give them): every kernel those forwards launch is compiled
    into triton's cache of this process. Returns seconds per layer."""
    import torch

    from ..load.checkpoint import open_checkpoint

    ckpt = open_checkpoint(folder)
    g = torch.Generator(device="cpu").manual_seed(seed)
    times = {}
    for idx in layers:
        t0 = time.perf_counter()
        layer = ckpt.build_layer(idx, device=device, backend=backend, ep_rank=0, ep_size=ckpt.ep_size)
        spec = layer.spec
        with torch.no_grad():
            for T in tokens:
                x = (torch.randn(T, spec.hidden, generator=g) * 0.5).to(device=device, dtype=torch.bfloat16)
                ids = torch.rand(T, spec.num_experts, generator=g).argsort(dim=1)[:, :spec.top_k].to(device)
                w = torch.softmax(torch.randn(T, spec.top_k, generator=g), dim=1).to(device)
                layer(x, w, ids)
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()
        del layer
        times[idx] = round(time.perf_counter() - t0, 2)
    return times


def _new_cache_target(cache: Path) -> tuple[Path, bool, Optional[int]]:
    """(folder the entries go in, whether it is a new cache built beside ``cache`` and renamed at the end, the
    descriptor of its `PARTIAL_MARKER`, locked, or None). An existing ``cache`` must be a kernel cache built for
    this process; anything else is refused, so the command never writes into a folder it did not make."""
    if cache.exists() or cache.is_symlink():
        m = kc.read_manifest(cache)  # refuses a folder that is no kernel cache
        why = kc.incompatibility(m, kc.environment())
        if why:
            raise kc.KernelCacheError(f"{cache}: this kernel cache was {why}; build a new one in another folder")
        return cache, False, None
    if not cache.parent.is_dir():
        raise kc.KernelCacheError(f"{cache.parent}: no such folder to create the kernel cache in")
    # a folder this call creates, of a name no one had (never one a killed earlier build of the same pid or
    # anyone else left: it is deleted on failure and renamed into the cache on success); os.mkdir, not mkdtemp,
    # so the shipped cache gets the umask's permissions (mkdtemp's 0700 would hide it from a serving user)
    while True:
        tmp = cache.parent / f".{cache.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.mkdir(tmp)
            break
        except FileExistsError:
            continue
        except OSError as e:
            raise kc.KernelCacheError(f"{cache.parent}: cannot create the kernel cache there ({e.strerror or e}); "
                                      "name a writable folder with --cache") from None
    try:
        fd = _write_partial_marker(tmp, cache)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / kc.ENTRIES_DIR).mkdir()
    return tmp, True, fd


def _write_partial_marker(tmp: Path, cache: Path) -> int:
    """Create ``tmp``'s `PARTIAL_MARKER`, lock it (``flock``, exclusive) and write who made the folder: its
    descriptor, which stays open (and is passed to the workers) until the folder is renamed or removed."""
    import fcntl

    fd = os.open(tmp / PARTIAL_MARKER, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a new file: waits at most for a sweep that opened it meanwhile
        rec = {"format": _PARTIAL_FORMAT, "cache": cache.name, "pid": os.getpid(), "host": socket.gethostname(),
               "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        os.write(fd, (json.dumps(rec, sort_keys=True) + "\n").encode())
    except BaseException:
        os.close(fd)
        raise
    return fd


def _partial_verdict(path: Path, cache_name: str) -> tuple[Optional[int], str]:
    """(the locked descriptor of ``path``'s marker, "") when ``path`` is provably the hidden folder of a build
    of cache ``cache_name`` that no process writes any more; else (None, why not: "" for a folder that is no
    such build's at all). Provably a build's: the name `build_cache` gives it, a folder (no symlink) holding a
    plain-file `PARTIAL_MARKER` of the format it writes, naming the pid the name carries. Provably abandoned:
    the marker's ``flock`` is free (the build and every worker it started are gone: the kernel drops it at any
    death, and the workers inherit it), and that pid, on this host, is no longer running."""
    import fcntl

    m = _PARTIAL_NAME.fullmatch(path.name)
    if m is None or m["cache"] != cache_name or path.is_symlink() or not path.is_dir():
        return None, ""
    try:
        fd = os.open(path / PARTIAL_MARKER, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None, f"it has no {PARTIAL_MARKER} of megamoe's (a build only writes there after making one)"
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None, ("a running process holds it (a killed build's workers finishing their compiles); the "
                          "next build removes it once they are done")
        st = os.fstat(fd)
        try:
            rec = json.loads(os.pread(fd, 4096, 0).decode()) if st.st_size <= 4096 else None
        except (OSError, ValueError):
            rec = None
        if not (stat.S_ISREG(st.st_mode) and isinstance(rec, dict)
                and rec.get("format") == _PARTIAL_FORMAT and rec.get("cache") == cache_name
                and rec.get("pid") == int(m["pid"])):
            os.close(fd)
            return None, f"its {PARTIAL_MARKER} is not the one a build of {cache_name} writes"
        if rec.get("host") != socket.gethostname():
            os.close(fd)
            return None, f"it was made on host {rec.get('host')!r}, whose processes cannot be checked from here"
        try:
            os.kill(rec["pid"], 0)
            alive = True
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True
        if alive:
            os.close(fd)
            return None, f"pid {rec['pid']}, which made it, is running"
        return fd, ""
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def remove_abandoned_partials(cache: Union[str, os.PathLike], log: Callable[[str], None] = lambda m: None) \
        -> list[Path]:
    """Remove the hidden folders beside ``cache`` that a build of it killed before it finished left behind
    (``kill -9`` of ``megamoe-convert warm``: the folder its workers wrote is neither renamed nor removed, and a
    converted folder holding it is refused by ``convert --overwrite``), when each is provably such a folder and
    provably abandoned (`_partial_verdict`), and then only what it held when it was judged, whose every entry
    is what a build and triton write there (`kernel_cache.foreign_entries`): the tool never deletes a byte it
    did not write. A look-alike of any other kind is left as it is (logged when its name is a build's). Called
    by `build_cache` under its lock; returns the folders removed."""
    cache = Path(cache)
    removed: list[Path] = []
    try:
        names = sorted(os.listdir(cache.parent))
    except OSError:
        return removed
    for name in names:
        path = cache.parent / name
        fd, why = _partial_verdict(path, cache.name)
        if fd is None:
            if why:
                log(f"warm: note: {path} is left as it is: {why}")
            continue
        try:
            what = [(Path(d), sorted(fs)) for d, _, fs in os.walk(path, topdown=False)]  # judged, then removed
            foreign = [e for e in kc.foreign_entries(path) if e != PARTIAL_MARKER]
            if foreign:
                log(f"warm: note: {path} is left as it is: it holds what neither a build nor triton writes "
                    f"there ({', '.join(foreign[:5])})")
                continue
            rec = json.loads(os.pread(fd, 4096, 0).decode())
            for d, files in what:
                for f in files:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(d / f)
                os.rmdir(d)  # fails on anything that appeared since it was judged: that stays
            removed.append(path)
            log(f"warm: removed {path}, the unfinished folder of a build killed before it finished (pid "
                f"{rec['pid']} on {rec['host']}, started {rec.get('started')})")
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            log(f"warm: note: {path} is left partly removed: something appeared in it while it was removed")
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def _locked(target: Path, log: Callable[[str], None]) -> Iterator[None]:
    """Hold `target`'s writer lock for the build (`FolderLock`: the converter's lock file, recording
    ``command: warm``; a dead writer's lock is taken over with the converter's note). Where no lock file can
    be made beside `target` (its parent read-only: a model folder mounted read-only above, writable inside),
    no conversion can write `target` either; the build then holds an ``flock`` on `target`'s own directory,
    which keeps a second build out (the kernel drops it on any death)."""
    import fcntl

    lock = FolderLock(target, log, command="warm")
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


def lock_target(folder: Union[str, os.PathLike], cache: Union[str, os.PathLike, None]) -> Path:
    """The folder whose writer lock (``.NAME.megamoe-lock`` beside it) `build_cache` holds while it writes:
    FOLDER when the cache is built inside it (the default FOLDER/kernel-cache), so ``convert FOLDER
    --overwrite`` and another build into FOLDER are kept out; for a cache outside FOLDER, the converted folder
    holding it (a ``megamoe.json`` beside it) or else the cache folder itself, so two builds into one cache
    never interleave. FOLDER itself is then only read and is not locked (docs/KERNELS.md#cold-start says why)."""
    from ..format.manifest import MANIFEST_NAME

    real = Path(os.path.realpath(folder))
    where = Path(os.path.realpath(cache)) if cache is not None else real / CACHE_SUBDIR
    if where == real or real in where.parents:
        return real
    return where.parent if (where.parent / MANIFEST_NAME).is_file() else where


def _merged_contents(old: dict, layers: list[dict], folder: str) -> tuple[list[dict], list[str]]:
    """(layers, model_folders) of a cache that held what manifest ``old`` lists and now also the kernels of
    ``layers`` of ``folder``: both lists keep what they had (a manifest of an earlier megamoe, whose layers
    carry no folder and which names one ``model_folder``, gets that folder on its layers) and gain what is
    new, each once."""
    prev = old.get("model_folder") if isinstance(old.get("model_folder"), str) else None
    folders = old.get("model_folders") if isinstance(old.get("model_folders"), list) else [prev]
    folders = [f for f in folders if isinstance(f, str) and f]
    merged: list[dict] = []
    for d in [*(old.get("layers") if isinstance(old.get("layers"), list) else []), *layers]:
        if isinstance(d, dict):
            d = {"model_folder": prev, **d} if "model_folder" not in d and prev else d
            if d not in merged:
                merged.append(d)
    return merged, list(dict.fromkeys([*folders, folder]))


def run_workers(folder: Path, parts: Sequence[Sequence[tuple[int, int]]], entries: Path, backend: str = "triton",
                device: str = "cuda", pass_fds: Sequence[int] = ()) -> None:
    """Start one worker process per part of (layer, token count) pairs (``python -m
    megamoe_runtime.integrations.warm --worker``, triton's cache pointed at ``entries``) and wait for all;
    KernelCacheError naming the first that failed. ``pass_fds``: descriptors the workers inherit (the locked
    `PARTIAL_MARKER`, so its ``flock`` is held as long as any of them runs). On any exception (a failed worker,
    Ctrl-C, SIGTERM) the workers still running are killed and waited for before it propagates."""
    procs: list = []
    try:
        for part in parts:
            ls = sorted({li for li, _ in part})
            ts = sorted({t for _, t in part})
            cmd = [sys.executable, "-m", "megamoe_runtime.integrations.warm", "--worker", str(folder),
                   "--layers", ",".join(map(str, ls)), "--tokens", ",".join(map(str, ts)), "--backend", backend,
                   "--device", device, "--triton-cache", str(entries)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          pass_fds=tuple(pass_fds)))
        failed = []
        for p in procs:
            _, err = p.communicate()
            if p.returncode:
                failed.append(err.strip().splitlines()[-1] if err.strip() else f"exit code {p.returncode}")
        if failed:
            raise kc.KernelCacheError(f"warm worker failed: {failed[0]}")
    except BaseException:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        raise


def build_cache(folder: Union[str, os.PathLike], cache: Union[str, os.PathLike, None] = None,
                tokens: Sequence[int] = DEFAULT_TOKENS, jobs: int = 4, backend: str = "triton",
                device: str = "cuda", log: Callable[[str], None] = lambda m: None) -> dict:
    """Compile every kernel ``folder``'s layers launch at ``tokens`` into kernel cache ``cache`` (default
    ``FOLDER/kernel-cache``): a new cache is built in a hidden folder beside it and renamed into place when
    complete; an existing one (built for this triton, GPU and Python) gets the entries it lacks, and its
    manifest keeps listing what it held: ``tokens``, ``layers`` (each distinct layer spec, with the
    ``model_folder`` it was built from) and ``model_folders`` are unions over every build into it, while
    ``model_folder``, ``built_in_s``, ``created`` and the versions describe the latest build. ``jobs``
    worker processes share the (layer, tokens) work, each compiling its part with triton's cache pointed at
    the entries folder. Refuses (KernelCacheError) a folder that is no converted checkpoint, a machine without
    CUDA or triton, and an existing ``cache`` that is not a compatible kernel cache.

    One writer at a time: the build holds the writer lock of the folder it writes (`lock_target`: FOLDER for a
    cache inside it), the converter's own lock file, from before it makes anything to the end, so a
    ``convert FOLDER`` (``--overwrite`` included) and another build there are refused while it runs
    (OutputError naming this process), and it is refused while they run; a lock a killed writer left is taken
    over (its note logged). Under it, the hidden folders a killed build of the same cache left are removed
    first where provably abandoned (`remove_abandoned_partials`)."""
    from ..load.checkpoint import open_checkpoint

    folder = Path(folder)
    ckpt = open_checkpoint(folder)  # ManifestError when folder is no converted checkpoint
    cache = Path(cache) if cache is not None else folder / CACHE_SUBDIR
    env = kc.environment()
    if env["triton"] is None:
        raise kc.KernelCacheError("triton is not installed: the kernel cache holds triton's compiled kernels")
    if env["capability"] is None:
        raise kc.KernelCacheError("no CUDA device: a kernel cache is compiled on the GPU (architecture) it serves")
    if jobs < 1:
        raise kc.KernelCacheError(f"jobs={jobs}: expected at least 1 worker process")
    if ckpt.ep_size != 1:  # its forwards dispatch over torch.distributed, which one worker process does not have
        raise kc.KernelCacheError(
            f"{folder} was converted with --ep-size {ckpt.ep_size}: warm runs single-process forwards, and an "
            "expert-parallel layer's forward dispatches its tokens over torch.distributed; no cache is built for "
            "it (its kernels compile at first use, as without one)")
    tokens = sorted(set(int(t) for t in tokens))
    target = lock_target(folder, cache)
    # nothing to lock where the folder to write in is missing: `_new_cache_target` names it, writing nothing
    with _locked(target, log) if target.parent.is_dir() else contextlib.nullcontext():
        remove_abandoned_partials(cache, log)
        return _build_locked(folder, ckpt, cache, env, tokens, jobs, backend, device, log)


def _build_locked(folder: Path, ckpt: Any, cache: Path, env: dict, tokens: list[int], jobs: int, backend: str,
                  device: str, log: Callable[[str], None]) -> dict:
    """`build_cache`'s work, under its lock."""
    layers = distinct_layers(ckpt)
    target, fresh, marker_fd = _new_cache_target(cache)
    try:
        before = kc.entry_count(target)
        work = [(li, t) for li in layers for t in tokens]
        n = min(jobs, len(work))
        # interleave so every worker gets small and large token counts of each layer
        parts = [work[j::n] for j in range(n)]
        entries = (target / kc.ENTRIES_DIR).resolve()
        t0 = time.perf_counter()
        log(f"warm: {len(layers)} distinct layer(s) x {len(tokens)} token counts in {n} worker(s) -> {cache}")
        try:
            run_workers(folder, parts, entries, backend, device,
                        pass_fds=() if marker_fd is None else (marker_fd,))
            specs = [ckpt.layer_spec(i) for i in layers]
            name = folder.resolve().name
            held = [dict(model_folder=name, index=i, row=s.row, hidden=s.hidden, intermediate=s.intermediate,
                         experts=s.num_experts, top_k=s.top_k, ep_size=ckpt.ep_size)
                    for i, s in zip(layers, specs)]
            folders = [name]
            if not fresh:  # what the cache held stays listed: entries are only ever added
                old = kc.read_manifest(target)
                tokens = sorted(set(tokens) | set(old.get("tokens") or []))
                held, folders = _merged_contents(old, held, name)
            m = kc.write_manifest(target, env, tokens=tokens, layers=held, model_folders=folders,
                                  model_folder=name, built_in_s=round(time.perf_counter() - t0, 1))
            if fresh:
                if cache.exists() or cache.is_symlink():  # another build finished first: keep its folder
                    raise kc.KernelCacheError(f"{cache} appeared while building; nothing of it was changed")
                os.unlink(target / PARTIAL_MARKER)  # the cache holds only what it lists (`kc.foreign_entries`)
                os.rename(target, cache)
        except BaseException:  # a failed worker, Ctrl-C, SIGTERM: the workers are gone; drop the folder we made
            if fresh and target.is_dir() and not target.is_symlink():
                shutil.rmtree(target, ignore_errors=True)
            raise
    finally:
        if marker_fd is not None:
            os.close(marker_fd)
    return {"ok": True, "cache": str(cache), "entries": m["entries"], "new_entries": m["entries"] - before,
            "layers": layers, "tokens": tokens, "jobs": n, "seconds": m["built_in_s"],
            **{k: env[k] for k in ("triton", "capability", "gpu", "python")}}


def shipped_cache(folder: Union[str, os.PathLike, None]) -> Optional[Path]:
    """The kernel cache an engine seeds from: ``MEGAMOE_KERNEL_CACHE`` (a folder; ``off`` for none), else
    ``FOLDER/kernel-cache`` when it holds a kernel cache manifest, else None."""
    v = knobs.get("MEGAMOE_KERNEL_CACHE")
    if v is not None and v.strip():
        return None if v.strip().lower() == "off" else Path(v.strip())
    if folder is None:
        return None
    p = Path(folder) / CACHE_SUBDIR
    return p if (p / kc.MANIFEST_NAME).is_file() else None


def seed_for_folder(folder: Union[str, os.PathLike, None]) -> Optional[kc.SeedReport]:
    """Seed triton's cache from ``folder``'s shipped kernel cache (`shipped_cache`) before the first forward,
    on a machine with CUDA. Never stops a load: a cache that is unreadable or built for another
    triton/GPU/Python gives one warning and the kernels compile at first use, as without one."""
    cache = shipped_cache(folder)
    if cache is None:
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        rep = kc.seed(cache)
    except kc.KernelCacheError as e:
        warnings.warn(f"megamoe: kernel cache not used: {e}", stacklevel=2)
        return None
    if rep.skipped or rep.errors:
        warnings.warn(f"megamoe: {rep.skipped or 'kernel cache partly copied: ' + '; '.join(rep.errors[:3])}",
                      stacklevel=2)
    return rep


def _worker(argv: Sequence[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m megamoe_runtime.integrations.warm",
                                 description="one warm worker of megamoe-convert warm (see the module doc)")
    ap.add_argument("--worker", required=True, help="the converted folder")
    ap.add_argument("--layers", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--triton-cache", default=None, help="triton's cache folder for this process (the entries)")
    a = ap.parse_args(argv)
    if a.triton_cache:  # before anything imports triton, which reads it
        os.environ["TRITON_CACHE_DIR"] = a.triton_cache
    times = run_layers(a.worker, [int(v) for v in a.layers.split(",")], parse_tokens(a.tokens), device=a.device,
                       backend=a.backend)
    print(json.dumps({"layers_s": times}))


if __name__ == "__main__":  # pragma: no cover - run by build_cache in a fresh process
    _worker(sys.argv[1:])
