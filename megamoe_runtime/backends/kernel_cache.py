"""A kernel cache a user builds once and ships: compiled triton kernels for one GPU architecture.

The triton backend compiles its kernels at their first launch (docs/KERNELS.md#cold-start): on a fresh
machine the first token waits for every specialization the first prompt and the first decode step
need. Triton keeps what it compiled in its own cache folder, one directory per kernel key (a hash of the
kernel source, its constexprs and argument specializations, the triton version, the GPU target and the
compiler options), so a kernel compiled once can be taken by any process whose key is the same.

A *kernel cache* is such a set of entries with a manifest that says what they were built for::

    CACHE/megamoe-kernel-cache.json   # this module's manifest (``MANIFEST_NAME``)
    CACHE/triton/<key>/...            # triton's own entries, as triton wrote them

and nothing else: `not_own_reason` tells a folder holding only that (what `megamoe-convert warm` and the
triton it runs write) from one holding anything more, which is how the converter's ``--overwrite`` knows
that a converted folder's ``kernel-cache`` (``FOLDER_SUBDIR``) is megamoe's own output and may go with it.

`seed` copies the entries into the triton cache a process uses (``triton_cache_dir``) before its first
kernel launch: only entries it lacks, file by file, never replacing a file that is there. A cache built
with another triton, another GPU architecture or another Python is skipped with a reason: the kernels
then compile at first use, as without a cache. Even a file that got past the manifest check can do no
harm: triton looks entries up by its own key, so an entry whose key this process never computes is
never read.

Host side only: imports triton only to ask for its version and its cache folder, and works without it
(the CPU tests build and seed caches of plain files).
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from ..errors import MegaMoEError
from ..files.json_io import read_json

__all__ = ["MANIFEST_NAME", "ENTRIES_DIR", "FORMAT_VERSION", "FOLDER_SUBDIR", "KernelCacheError", "SeedReport",
           "environment", "triton_cache_dir", "read_manifest", "incompatibility", "seed", "write_manifest",
           "entry_count", "foreign_entries", "not_own_reason"]

MANIFEST_NAME = "megamoe-kernel-cache.json"
#: the subfolder holding triton's entries (one directory per kernel key)
ENTRIES_DIR = "triton"
FORMAT_VERSION = 1
#: what a cache must match to be seeded (the rest of the manifest is informational)
MATCH_KEYS = ("triton", "capability", "python")
#: where a converted folder's own kernel cache lives (``megamoe-convert warm FOLDER`` builds it there)
FOLDER_SUBDIR = "kernel-cache"
#: the temporary manifest `write_manifest` renames over the manifest (left behind by a kill between the two)
_TMP_MANIFEST = re.compile(rf"\.{re.escape(MANIFEST_NAME)}\.tmp\.\d+")
#: the folder triton writes an entry's file in before renaming it into the entry (left by a killed compile)
_TRITON_TMP = re.compile(r"tmp\.pid_[0-9A-Za-z_-]+")


class KernelCacheError(MegaMoEError):
    """A kernel cache folder is not one, or cannot be read or written as asked."""


def environment(device: Any = None) -> dict:
    """What this process would build kernels for: triton / torch / CUDA / Python versions and the GPU
    (name and ``sm_XY`` capability of ``device``, the current CUDA device by default). Fields that
    cannot be known here (no triton, no GPU) are None."""
    import torch

    try:
        import triton

        tv: Optional[str] = triton.__version__
    except Exception:  # triton absent (a CPU install)
        tv = None
    cap = name = None
    try:
        if torch.cuda.is_available():
            d = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
            major, minor = torch.cuda.get_device_capability(d)
            cap, name = f"sm_{major}{minor}", torch.cuda.get_device_name(d)
    except Exception:
        pass
    return {"triton": tv, "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}", "machine": platform.machine(),
            "capability": cap, "gpu": name}


def triton_cache_dir() -> Path:
    """The folder triton of this process reads and writes its cache in: ``triton.knobs.cache.dir`` when
    triton is importable, else what triton would take: ``TRITON_CACHE_DIR``, else
    ``$TRITON_HOME/.triton/cache`` (home folder when ``TRITON_HOME`` is unset)."""
    try:
        from triton import knobs

        d = knobs.cache.dir
        if d:
            return Path(d)
    except Exception:
        pass
    env = os.environ.get("TRITON_CACHE_DIR", "").strip()
    if env:
        return Path(env)
    return Path(os.environ.get("TRITON_HOME") or Path.home()) / ".triton" / "cache"


def read_manifest(cache: Union[str, os.PathLike]) -> dict:
    """The manifest of kernel cache ``cache``; KernelCacheError naming the folder when it is no kernel
    cache (no folder, no manifest, unreadable or foreign JSON, no entries folder)."""
    cache = Path(cache)
    if not cache.is_dir():
        raise KernelCacheError(f"{cache}: no such kernel cache folder")
    mpath = cache / MANIFEST_NAME
    if not mpath.is_file():
        raise KernelCacheError(f"{cache}: not a megamoe kernel cache (no {MANIFEST_NAME}; build one with "
                               f"`megamoe-convert warm FOLDER --cache {cache}`)")
    m = read_json(mpath, error=KernelCacheError, max_bytes=1 << 20, what="kernel cache manifest")
    if m.get("format") != FORMAT_VERSION:
        raise KernelCacheError(f"{mpath}: kernel cache format {m.get('format')!r}; this megamoe reads "
                               f"format {FORMAT_VERSION}")
    missing = [k for k in MATCH_KEYS if k not in m]
    if missing:
        raise KernelCacheError(f"{mpath}: kernel cache manifest lacks {', '.join(missing)}")
    if not (cache / ENTRIES_DIR).is_dir():
        raise KernelCacheError(f"{cache}: kernel cache has no {ENTRIES_DIR}/ folder of entries")
    return m


def incompatibility(manifest: dict, env: dict) -> Optional[str]:
    """Why a cache built as ``manifest`` says cannot serve a process in ``env`` (`environment`), or None.
    A field unknown on either side (None) counts as a mismatch: a cache is only ever taken on evidence."""
    diffs = [f"{k} {manifest.get(k)!r} (this process: {env.get(k)!r})" for k in MATCH_KEYS
             if manifest.get(k) is None or manifest.get(k) != env.get(k)]
    return ("built for " + ", ".join(diffs)) if diffs else None


def entry_count(cache: Union[str, os.PathLike]) -> int:
    """Kernel entries (triton cache keys) under ``cache``'s entries folder."""
    d = Path(cache) / ENTRIES_DIR
    return sum(1 for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")) if d.is_dir() else 0


def _plain_files(folder: Path) -> list[str]:
    """Names in ``folder`` that are not plain files (a symlink counts as not plain)."""
    return [p.name for p in folder.iterdir() if p.is_symlink() or not p.is_file()]


def foreign_entries(cache: Union[str, os.PathLike]) -> list[str]:
    """What kernel cache folder ``cache`` holds besides what `build_cache` (``megamoe-convert warm``) and the
    triton it runs write there, as paths relative to ``cache``: anything but the manifest (and a temporary
    manifest a killed write left), the entries folder, and in it entry folders of plain files (each maybe
    with triton's own ``tmp.pid_*`` folder of plain files, which a killed compile leaves). A symlink anywhere
    is foreign. ``[]``: nothing in it was written by anyone else."""
    cache = Path(cache)
    out = []
    for p in sorted(cache.iterdir()):
        if p.name == ENTRIES_DIR and p.is_dir() and not p.is_symlink():
            continue
        if (p.name == MANIFEST_NAME or _TMP_MANIFEST.fullmatch(p.name)) and p.is_file() and not p.is_symlink():
            continue
        out.append(p.name)
    entries = cache / ENTRIES_DIR
    if entries.is_dir() and not entries.is_symlink():
        for e in sorted(entries.iterdir()):
            rel = f"{ENTRIES_DIR}/{e.name}"
            if e.is_symlink() or not e.is_dir():
                out.append(rel)
                continue
            for p in sorted(e.iterdir()):
                if p.is_dir() and not p.is_symlink() and _TRITON_TMP.fullmatch(p.name):
                    out += [f"{rel}/{p.name}/{n}" for n in _plain_files(p)]
                elif p.is_symlink() or not p.is_file():
                    out.append(f"{rel}/{p.name}")
    return out


def not_own_reason(cache: Union[str, os.PathLike]) -> Optional[str]:
    """None when ``cache`` is provably a kernel cache megamoe wrote: a folder (not a symlink) with a valid
    manifest (`read_manifest`) holding nothing `foreign_entries` names; else why not, for a message."""
    cache = Path(cache)
    if cache.is_symlink() or not cache.is_dir():
        return "not a folder" if not cache.is_symlink() else f"a symlink (to {os.readlink(cache)})"
    try:
        read_manifest(cache)
    except KernelCacheError as e:
        return str(e)
    try:
        foreign = foreign_entries(cache)
    except OSError as e:
        return f"cannot be listed ({e.strerror or e})"
    if foreign:
        names = ", ".join(foreign[:5]) + (f" ... ({len(foreign) - 5} more)" if len(foreign) > 5 else "")
        return f"it also holds what neither megamoe-convert warm nor triton writes there: {names}"
    return None


def write_manifest(cache: Union[str, os.PathLike], env: dict, **extra: Any) -> dict:
    """Write (or rewrite) ``cache``'s manifest for entries built in ``env``: atomically (a temporary
    file renamed over it), so a reader sees the old manifest or the new one."""
    cache = Path(cache)
    m = {"format": FORMAT_VERSION, **{k: env.get(k) for k in ("triton", "torch", "cuda", "python", "machine",
                                                                "capability", "gpu")},
         "entries": entry_count(cache), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **extra}
    tmp = cache / f".{MANIFEST_NAME}.tmp.{os.getpid()}"
    tmp.write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, cache / MANIFEST_NAME)
    return m


@dataclass
class SeedReport:
    """What `seed` did: files copied, entries already present, and why it skipped (None: it did not)."""

    cache: str
    target: str
    copied_files: int = 0
    new_entries: int = 0
    present_entries: int = 0
    skipped: Optional[str] = None
    errors: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _group_first_last(files: list[Path]) -> list[Path]:
    """Triton finds an entry through its ``__grp__*`` file, which names the other files: copy it last,
    so a process compiling beside us never reads a group whose files are not there yet."""
    return sorted(files, key=lambda p: (p.name.startswith("__grp__"), p.name))


def _copy_new_file(src: Path, dst: Path, tmp_tag: str) -> bool:
    """Copy ``src`` to ``dst`` unless ``dst`` exists; never replaces a file (a hard link of a finished
    temporary copy, which fails when another writer got there first). True when it wrote ``dst``."""
    if dst.exists():
        return False
    tmp = dst.parent / f".{dst.name}.{tmp_tag}"
    shutil.copyfile(src, tmp)
    try:
        os.link(tmp, dst)
        return True
    except FileExistsError:
        return False
    except OSError:  # a filesystem without hard links: rename, still only when dst is absent
        if dst.exists():
            return False
        os.rename(tmp, dst)
        return True
    finally:
        if tmp.exists():
            tmp.unlink()


def _relocate_group(path: Path, entry: Path) -> None:
    """Older triton wrote a group file as {file name: absolute path}; such paths point into the machine
    that built the cache. Rewrite our own copy to point at the copied files (newer triton writes bare
    names, left as they are)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    child = data.get("child_paths") if isinstance(data, dict) else None
    if isinstance(child, dict):
        data["child_paths"] = {k: str(entry / Path(str(v)).name) for k, v in child.items()}
        tmp = path.parent / f".{path.name}.relocate.{os.getpid()}"
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)


def seed(cache: Union[str, os.PathLike], target: Union[str, os.PathLike, None] = None,
         env: Optional[dict] = None) -> SeedReport:
    """Copy kernel cache ``cache``'s entries into triton's cache folder ``target`` (`triton_cache_dir` by
    default) when the cache was built for this process (`incompatibility` against ``env``, `environment`
    by default); otherwise copy nothing and say why in ``SeedReport.skipped``. Never replaces a file of
    ``target``; an entry directory that is there gets only the files it lacks."""
    cache = Path(cache)
    target = Path(target) if target is not None else triton_cache_dir()
    rep = SeedReport(str(cache), str(target))
    m = read_manifest(cache)
    why = incompatibility(m, env if env is not None else environment())
    if why:
        rep.skipped = f"kernel cache {cache} {why}: the kernels compile at first use"
        return rep
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        rep.skipped = f"cannot create triton's cache folder {target} ({e.strerror or e})"
        return rep
    tag = f"megamoe-seed.{os.getpid()}"
    for entry in sorted(p for p in (cache / ENTRIES_DIR).iterdir() if p.is_dir() and not p.name.startswith(".")):
        dst = target / entry.name
        new = not dst.exists()
        try:
            dst.mkdir(exist_ok=True)
            wrote = 0
            for f in _group_first_last([p for p in entry.iterdir() if p.is_file() and not p.name.startswith(".")]):
                if _copy_new_file(f, dst / f.name, tag):
                    wrote += 1
                    if f.name.startswith("__grp__"):
                        _relocate_group(dst / f.name, dst)
            rep.copied_files += wrote
            if new:
                rep.new_entries += 1
            else:
                rep.present_entries += 1
        except OSError as e:
            rep.errors.append(f"{entry.name}: {e.strerror or e}")
    return rep
