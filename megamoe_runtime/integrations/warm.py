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
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import secrets
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from .. import knobs
from ..backends import kernel_cache as kc

__all__ = ["DEFAULT_TOKENS", "CACHE_SUBDIR", "distinct_layers", "parse_tokens", "build_cache", "run_layers",
           "shipped_cache", "seed_for_folder"]

#: token counts a cache is built for when none are named: one and a few tokens (decode), every power of two
#: to 4096 and one past each from 16 up (triton specializes integer arguments on ``== 1`` and on divisibility
#: by 16, and the tile regimes change with the pairs per expert, docs/KERNELS.md#cold-start)
DEFAULT_TOKENS = (1, 2, 3, 4, 8, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513, 1024, 1025, 2048, 2049,
                  4096, 4097)
#: where a folder's own kernel cache lives (what `shipped_cache` finds without the knob)
CACHE_SUBDIR = kc.FOLDER_SUBDIR
MAX_TOKENS = 1 << 16


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


def _new_cache_target(cache: Path) -> tuple[Path, bool]:
    """(folder the entries go in, whether it is a new cache built beside ``cache`` and renamed at the end).
    An existing ``cache`` must be a kernel cache built for this process; anything else is refused, so the
    command never writes into a folder it did not make."""
    if cache.exists() or cache.is_symlink():
        m = kc.read_manifest(cache)  # refuses a folder that is no kernel cache
        why = kc.incompatibility(m, kc.environment())
        if why:
            raise kc.KernelCacheError(f"{cache}: this kernel cache was {why}; build a new one in another folder")
        return cache, False
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
    (tmp / kc.ENTRIES_DIR).mkdir()
    return tmp, True


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
    CUDA or triton, and an existing ``cache`` that is not a compatible kernel cache."""
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
    layers = distinct_layers(ckpt)
    target, fresh = _new_cache_target(cache)
    before = kc.entry_count(target)
    work = [(li, t) for li in layers for t in tokens]
    n = min(jobs, len(work))
    # interleave so every worker gets small and large token counts of each layer
    parts = [work[j::n] for j in range(n)]
    entries = str((target / kc.ENTRIES_DIR).resolve())
    t0 = time.perf_counter()
    log(f"warm: {len(layers)} distinct layer(s) x {len(tokens)} token counts in {n} worker(s) -> {cache}")
    procs: list = []
    try:
        for part in parts:
            ls = sorted({li for li, _ in part})
            ts = sorted({t for _, t in part})
            cmd = [sys.executable, "-m", "megamoe_runtime.integrations.warm", "--worker", str(folder),
                   "--layers", ",".join(map(str, ls)), "--tokens", ",".join(map(str, ts)), "--backend", backend,
                   "--device", device, "--triton-cache", entries]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        failed = []
        for p in procs:
            _, err = p.communicate()
            if p.returncode:
                failed.append(err.strip().splitlines()[-1] if err.strip() else f"exit code {p.returncode}")
        if failed:
            raise kc.KernelCacheError(f"warm worker failed: {failed[0]}")
    except BaseException:  # a failed worker, Ctrl-C, SIGTERM: stop our workers, drop the folder this call made
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if fresh:
            shutil.rmtree(target, ignore_errors=True)
        raise
    specs = [ckpt.layer_spec(i) for i in layers]
    name = folder.resolve().name
    held = [dict(model_folder=name, index=i, row=s.row, hidden=s.hidden, intermediate=s.intermediate,
                 experts=s.num_experts, top_k=s.top_k, ep_size=ckpt.ep_size) for i, s in zip(layers, specs)]
    folders = [name]
    if not fresh:  # what the cache held stays listed: entries are only ever added
        old = kc.read_manifest(target)
        tokens = sorted(set(tokens) | set(old.get("tokens") or []))
        held, folders = _merged_contents(old, held, name)
    m = kc.write_manifest(target, env, tokens=tokens, layers=held, model_folders=folders, model_folder=name,
                          built_in_s=round(time.perf_counter() - t0, 1))
    if fresh:
        if cache.exists():  # another build finished first: keep its folder, drop ours
            shutil.rmtree(target, ignore_errors=True)
            raise kc.KernelCacheError(f"{cache} appeared while building; nothing of it was changed")
        os.rename(target, cache)
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
