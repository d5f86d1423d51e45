"""Load benchmark: pre-laid-out loading vs raw reads vs load-original-then-transform.

    python bench/load.py --gb 2                       # CPU, ~2 GB of expert weights
    python bench/load.py --gb 2 --device cuda         # into GPU memory (H200)
    python bench/load.py --gb 2 --device both --cold --json results.json
    python bench/load.py --gb 2 --device cuda --pin-probe --dma-variants copy,64:2,256:1:0.5

It builds (once, cached under --workdir) a synthetic ModelOpt MXFP8 checkpoint
with at least --gb GB of routed-expert bytes and converts it with
megamoe-convert, then measures in one process, on the same bytes:

* ``raw_read``: plain ``readinto`` of the converted expert files into a
  preallocated buffer on the destination (GPU: pinned chunks, then H2D) --
  the I/O floor, no layout work at all;
* ``prelaid``: ``Checkpoint.build_layer`` for every layer (allocate in kernel
  layout + one ``copy_`` per stored tensor from the mmap'ed file);
* ``prelaid_reload``: ``Checkpoint.load_layer`` into the already-built layers
  (what a weight reload costs), at the default check level (``verify="headers"``);
  ``reload_verify_none`` / ``reload_verify_checksums``: the same at the other levels
  (``checksums`` hashes every tensor before the first byte is written: one extra read);
* ``raw_direct``: vLLM-style raw loading of the ORIGINAL checkpoint through
  ``weight_loader`` (each shard scattered straight into kernel layout);
* ``original_then_transform``: what engines do today -- allocate the
  checkpoint-format parameters, load the original tensors into them, then
  build the kernel layout from them (gate/up interleave, int32 scale packing,
  UTCCP, MN-major) into new tensors, and free the originals;
* ``pinned_h2d`` (CUDA): one ``copy_`` of the same byte count from a pinned
  host buffer into a resident device buffer -- the host-to-device link's
  practical limit, measured in the same run (issue 13: the warm-cache load
  and reload should reach >= 70% of it);
* ``safetensors``: ``safetensors.torch.load_file(f, device=...)`` of the same
  converted expert files (what a plain safetensors loader gets from them; on
  the CPU its mmap-backed tensors are cloned, so the bytes are really read).

With ``--cold`` every phase starts from an evicted page cache, and
``raw_read`` is the disk's own read rate (plus the link, on CUDA).

Goals (issue 4): prelaid >= 0.85x the raw read's throughput, and >= 3x faster
than original-then-transform. Peak EXTRA memory is what a phase needs beyond
the destination parameters: host anonymous RSS (mmap'ed page cache is
reported separately: it is file-backed and reclaimable) and, on CUDA, the
allocator's peak beyond the parameters.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from megamoe_runtime.files.tensor_bytes import byte_view

import megamoe_runtime as mr
from megamoe_runtime.files.file_io import read_workers
from megamoe_runtime.format import codecs, layout

H, I, E = 2048, 1024, 64  # per layer: 64 * 3 * 2048 * 1024 * (1 + 1/32) B ~= 415 MB (mxfp8)


# --------------------------------------------------------------------------- memory sampling


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "RssAnon:", "RssFile:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out


class PeakMemory:
    """Samples host RSS (anon / file) every 2 ms and the CUDA allocator's peak."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()

    def __enter__(self) -> "PeakMemory":
        gc.collect()
        self.base = _status()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.cuda_base = torch.cuda.memory_allocated(self.device)
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            s = _status()
            for k in self.peak:
                self.peak[k] = max(self.peak[k], s.get(k, 0))
            self._stop.wait(0.002)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()
        s = _status()
        for k in self.peak:
            self.peak[k] = max(self.peak[k], s.get(k, 0))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.cuda_peak = torch.cuda.max_memory_allocated(self.device) - self.cuda_base

    def extra(self, dest_bytes: int) -> dict[str, float]:
        """GiB beyond the destination parameters."""
        host_dest = dest_bytes if self.device.type == "cpu" else 0
        out = {"host_anon_extra_gib": (self.peak["RssAnon"] - self.base.get("RssAnon", 0) - host_dest) / 2**30,
               "host_file_rss_gib": (self.peak["RssFile"] - self.base.get("RssFile", 0)) / 2**30}
        if self.device.type == "cuda":
            out["device_extra_gib"] = (self.cuda_peak - dest_bytes) / 2**30
        return out


# --------------------------------------------------------------------------- setup


def build_checkpoint(workdir: Path, gb: float, checksum: str = "sha256") -> tuple[Path, Path, int]:
    from megamoe_convert.pipeline.convert import convert
    from megamoe_convert.testing.synth import build_synthetic_checkpoint

    per_layer = E * 3 * H * I * (1 + 1 / 32)
    layers = max(1, math.ceil(gb * 1e9 / per_layer))
    tag = f"mxfp8-L{layers}-E{E}-H{H}-I{I}"
    src, out = workdir / f"src-{tag}", workdir / (f"out-{tag}" + ("" if checksum == "sha256" else f"-{checksum}"))
    if not (out / "megamoe.json").is_file():
        print(f"building a synthetic checkpoint: {layers} layers x {per_layer / 1e6:.0f} MB of experts ...", flush=True)
        t = time.perf_counter()
        if not (src / "config.json").is_file():
            build_synthetic_checkpoint(src, "modelopt-mxfp8", num_layers=layers, hidden=H, intermediate=I,
                                       num_experts=E, top_k=4, max_shard_bytes=2 << 30)
        convert(src, out, overwrite=True, checksum=checksum)
        print(f"  done in {time.perf_counter() - t:.0f} s", flush=True)
    return src, out, layers


def expert_files(out: Path) -> list[Path]:
    return sorted(out.glob("megamoe-experts-*.safetensors"))


def drop_cache(paths: list[Path]) -> None:
    """Evict the files' clean pages from the page cache (no root needed)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- phases


def phase_raw_read(files: list[Path], device: torch.device,
                   into: torch.Tensor | None = None) -> tuple[int, Callable[[], Any]]:
    """Plain reads of the files; into a fresh buffer, or into ``into`` (already resident)."""
    total = sum(p.stat().st_size for p in files)

    def run() -> Any:
        if device.type == "cpu":
            buf = torch.empty(total, dtype=torch.uint8) if into is None else into
            mv = byte_view(buf)
            off = 0
            for p in files:
                with open(p, "rb", buffering=0) as f:
                    while True:
                        n = f.readinto(mv[off:])
                        if not n:
                            break
                        off += n
            return buf
        dst = torch.empty(total, dtype=torch.uint8, device=device) if into is None else into
        chunk = 64 << 20
        pinned = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        events = [torch.cuda.Event(), torch.cuda.Event()]
        used = [False, False]
        off, i = 0, 0
        for p in files:
            with open(p, "rb", buffering=0) as f:
                while True:
                    j = i % 2
                    if used[j]:
                        events[j].synchronize()
                    n = f.readinto(byte_view(pinned[j]))
                    if not n:
                        break
                    dst[off:off + n].copy_(pinned[j][:n], non_blocking=True)
                    events[j].record()
                    used[j] = True
                    off += n
                    i += 1
        torch.cuda.synchronize(device)
        return dst

    return total, run


def phase_pinned_h2d(total: int, device: torch.device) -> Callable[[], Any]:
    """The link limit: pinned host -> resident device buffer, one copy."""
    src = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(total, dtype=torch.uint8, device=device)

    def run() -> Any:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        return None

    return run


def phase_safetensors(files: list[Path], device: torch.device) -> Callable[[], Any]:
    from safetensors.torch import load_file

    def run() -> Any:
        out = [load_file(str(p), device=str(device)) for p in files]
        if device.type == "cpu":  # CPU tensors are lazily mmap-backed: read them into memory, as a user would
            out = [{k: v.clone() for k, v in d.items()} for d in out]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out

    return run


def phase_prelaid(ck: mr.Checkpoint, device: torch.device, backend: str = "reference") -> Callable[[], Any]:
    """Build and load every layer. backend "triton" (CUDA): the layers also derive the tiled weight
    arrangement in place after each load (`megamoe_runtime.format.weight_tiles`), so its cost is in the time."""
    def run() -> Any:
        layers = [ck.build_layer(li.index, device=device, backend=backend) for li in ck.layers]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return layers

    return run


def _has_triton() -> bool:
    from megamoe_runtime.backends.triton import TritonBackend

    return TritonBackend.available() is True


def phase_reload(ck: mr.Checkpoint, layers: list, device: torch.device, verify: str | None = None
                 ) -> Callable[[], Any]:
    """``load_layer`` into built layers at check level ``verify`` (None: the checkpoint's default, headers)."""
    def run() -> Any:
        for layer in layers:
            ck.load_layer(layer, verify=verify)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return None

    return run


def phase_raw_direct(ck: mr.Checkpoint, src: Path, device: torch.device) -> Callable[[], Any]:
    from megamoe_runtime.load.raw_load import load_raw_checkpoint

    def run() -> Any:
        model = torch.nn.ModuleList(
            mr.DeepGemmMegaMoEExperts(li.spec, device=device, backend="reference", prefix=li.prefix,
                                      layer_index=li.index) for li in ck.layers)
        load_raw_checkpoint(model, src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return model

    return run


def _interleave8(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] gate|up -> rows interleaved in groups of 8 (new tensor)."""
    e, n, *rest = t.shape
    g = t[:, : n // 2].reshape(e, n // 16, 8, *rest)
    u = t[:, n // 2:].reshape(e, n // 16, 8, *rest)
    return torch.empty_like(t).copy_(torch.stack([g, u], dim=2).reshape(e, n, *rest))


def _utccp(sf: torch.Tensor) -> torch.Tensor:
    """int32 [E, MN, P] rows permuted per 128-row block, into an MN-major tensor."""
    e, mn, p = sf.shape
    out = torch.empty((e, p, mn), dtype=torch.int32, device=sf.device).transpose(1, 2)
    out.copy_(sf.reshape(e, mn // 128, 4, 32, p).transpose(2, 3).reshape(e, mn, p))
    return out


def phase_original_then_transform(ck: mr.Checkpoint, src: Path, device: torch.device) -> Callable[[], Any]:
    """Engine-style: checkpoint-format params, loaded, then transformed into new kernel tensors."""
    files = sorted(src.glob("*.safetensors"))

    def run() -> Any:
        infos = {li.prefix: li for li in ck.layers}
        orig: dict[str, dict[str, torch.Tensor]] = {}
        for prefix, li in infos.items():
            s = li.spec
            orig[prefix] = {
                "w13": torch.empty(s.num_experts, 2 * s.intermediate, s.hidden, dtype=torch.float8_e4m3fn, device=device),
                "w13_s": torch.empty(s.num_experts, 2 * s.intermediate, s.hidden // 32, dtype=torch.uint8, device=device),
                "w2": torch.empty(s.num_experts, s.hidden, s.intermediate, dtype=torch.float8_e4m3fn, device=device),
                "w2_s": torch.empty(s.num_experts, s.hidden, s.intermediate // 32, dtype=torch.uint8, device=device),
            }
        read_source_experts(files, orig, "w13_s", "w2_s")  # the original tensors into checkpoint-format params
        kernel = []
        for prefix, o in orig.items():  # transform into new kernel-layout tensors, then drop the originals
            l1 = _interleave8(o.pop("w13"))
            l1_s = _utccp(_interleave8(codecs.pack_bytes_int32(o.pop("w13_s"))))
            l2 = o.pop("w2")
            l2_s = _utccp(codecs.pack_bytes_int32(o.pop("w2_s")))
            kernel.append(layout.KernelTensors(l1, l1_s, l2, l2_s))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return kernel

    return run


def with_env(env: dict[str, str], run: Callable[[], Any]) -> Callable[[], Any]:
    """``run`` under these environment variables, the page-cache DMA decision taken afresh."""
    from megamoe_runtime.files import page_cache_dma

    def wrapped() -> Any:
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        page_cache_dma._state.clear()
        try:
            return run()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            page_cache_dma._state.clear()

    return wrapped


def pin_probe(files: list[Path], device: torch.device) -> list[dict]:
    """How fast the kernel pins page-cache pages: one read-only mapping of the largest file,
    ``cudaHostRegister(ReadOnly)`` over it in pieces on 1..8 threads, then unregistered."""
    import ctypes
    from concurrent.futures import ThreadPoolExecutor

    from megamoe_runtime.files import page_cache_dma as D

    os.environ["MEGAMOE_LOAD_DMA"] = "1"
    D._state.clear()
    ok = D.available(device)
    os.environ.pop("MEGAMOE_LOAD_DMA")
    if ok is not True:
        print(f"pin probe: page-cache DMA unavailable: {ok}")
        return []
    rt = D._state["rt"]
    path = max(files, key=lambda p: p.stat().st_size)
    size = path.stat().st_size // D._PAGE * D._PAGE
    fd = os.open(path, os.O_RDONLY)
    out = []
    try:
        for piece_mb in (64, 256):
            for threads in (1, 2, 4, 8):
                m = D._Mapping(fd, 0, size)
                piece = piece_mb << 20
                spans = [(m.base + k, min(piece, size - k)) for k in range(0, size, piece)]
                try:
                    t = time.perf_counter()
                    with ThreadPoolExecutor(threads) as ex:
                        codes = list(ex.map(lambda s: rt.cudaHostRegister(ctypes.c_void_p(s[0]), s[1], 10), spans))
                    t_reg = time.perf_counter() - t
                    t = time.perf_counter()
                    for (b, _), c in zip(spans, codes):
                        if c == 0:
                            rt.cudaHostUnregister(ctypes.c_void_p(b))
                    t_unreg = time.perf_counter() - t
                finally:
                    m.close()
                r = {"piece_mb": piece_mb, "threads": threads, "bytes": size, "register_s": t_reg,
                     "register_gbps": size / t_reg / 1e9, "unregister_s": t_unreg, "refused": sum(c != 0 for c in codes)}
                print(f"pin probe: {size / 1e9:.2f} GB in {piece_mb} MiB pieces on {threads} threads: register "
                      f"{r['register_gbps']:.1f} GB/s ({t_reg * 1e3:.1f} ms), unregister {t_unreg * 1e3:.1f} ms"
                      + (f", {r['refused']} refused" if r["refused"] else ""), flush=True)
                out.append(r)
    finally:
        os.close(fd)
    return out


# --------------------------------------------------------------------------- driver


def _trim() -> None:
    """Return freed heap memory to the OS, so every run allocates (and faults in) fresh pages."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


def _one(run: Callable[[], Any], device: torch.device, mem_dest: int, cold_files: list[Path] | None
         ) -> tuple[float, dict[str, float]]:
    if cold_files:
        drop_cache(cold_files)
    _trim()
    with PeakMemory(device) as pm:
        t = time.perf_counter()
        res = run()
        dt = time.perf_counter() - t
    m = pm.extra(mem_dest)
    del res
    _trim()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dt, m


def bench_device(device: torch.device, src: Path, out: Path, repeats: int, cold: bool,
                 skip: frozenset = frozenset(), dma_variants: tuple[str, ...] = ()) -> list[dict]:
    """Every phase once per round, ``repeats`` rounds (round-robin, so that a
    transient load on the machine hits all phases alike); best and median."""
    ck = mr.open_checkpoint(out)
    files = expert_files(out)
    cold_out = files if cold else None
    cold_src = sorted(src.glob("*.safetensors")) if cold else None
    total, raw = phase_raw_read(files, device)
    # destination bytes = the kernel-layout expert parameters (what every phase produces)
    dest = sum(te.nbytes for te in ck.manifest.tensors.values() if te.role != "passthrough")
    resident = torch.zeros(total, dtype=torch.uint8, device=device)  # for the "already resident" pair
    built = phase_prelaid(ck, device)()
    _, raw_res = phase_raw_read(files, device, into=resident)
    phases = [  # name, run, bytes moved, destination bytes allocated by the run, files to evict
        ("raw_read", raw, total, total, cold_out),
        ("prelaid", phase_prelaid(ck, device), dest, dest, cold_out),
        ("raw_read_resident", raw_res, total, 0, cold_out),
        ("prelaid_reload", phase_reload(ck, built, device), dest, 0, cold_out),
        ("reload_verify_none", phase_reload(ck, built, device, "none"), dest, 0, cold_out),
        ("reload_verify_checksums", phase_reload(ck, built, device, "checksums"), dest, 0, cold_out),
        ("raw_direct", phase_raw_direct(ck, src, device), dest, dest, cold_src),
        ("original_then_transform", phase_original_then_transform(ck, src, device), dest, dest, cold_src),
        ("safetensors", phase_safetensors(files, device), total, total, cold_out),
    ]
    if device.type == "cuda":
        phases.append(("pinned_h2d", phase_pinned_h2d(total, device), total, 0, None))
        if _has_triton():  # the Hopper layers: load + the in-place tiling pass (issue 11 point 2)
            built_t = phase_prelaid(ck, device, "triton")()
            phases.append(("prelaid_triton", phase_prelaid(ck, device, "triton"), dest, dest, cold_out))
            phases.append(("reload_triton", phase_reload(ck, built_t, device), dest, 0, cold_out))
        for v in dma_variants:  # "PIECE_MB:THREADS": page-cache DMA on, with these knobs; "copy": off
            if v.startswith("copy"):  # copy[:CHUNK_MB:THREADS]: the copying readers with these knobs
                _, *knobs = v.split(":")
                env = {"MEGAMOE_LOAD_DMA": "0"}
                if knobs:
                    env.update(MEGAMOE_LOAD_GPU_CHUNK_MB=knobs[0], MEGAMOE_LOAD_THREADS=knobs[1])
            else:
                mb, th, *share = v.split(":")
                env = {"MEGAMOE_LOAD_DMA": "1", "MEGAMOE_LOAD_DMA_PIECE_MB": mb, "MEGAMOE_LOAD_DMA_THREADS": th,
                       "MEGAMOE_LOAD_DMA_SHARE": share[0] if share else "1"}
            phases.append((f"prelaid[{v}]", with_env(env, phase_prelaid(ck, device)), dest, dest, cold_out))
            phases.append((f"reload[{v}]", with_env(env, phase_reload(ck, built, device)), dest, 0, cold_out))
    phases = [p for p in phases if p[0] not in skip]
    times: dict[str, list[float]] = {p[0]: [] for p in phases}
    mem: dict[str, dict[str, float]] = {}
    for _ in range(repeats):
        for name, run, _nbytes, alloc, cold_files in phases:
            dt, m = _one(run, device, alloc, cold_files)
            times[name].append(dt)
            mem[name] = m if name not in mem else {k: max(mem[name][k], v) for k, v in m.items()}
    del built, resident
    _trim()
    results = []
    for name, _run, nbytes, _alloc, _cold in phases:
        best = min(times[name])
        results.append({"phase": name, "device": str(device), "bytes": nbytes, "best_s": best,
                        "median_s": statistics.median(times[name]), "gbps": nbytes / best / 1e9, **mem[name]})
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.0, help="GB of routed-expert weights (default 2)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "both"])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/megamoe-bench-load"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="evict the files from the page cache before every run")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--checksum", default="sha256", choices=["sha256", "blake3"],
                    help="tensor checksum algorithm of the converted folder (what reload_verify_checksums hashes)")
    ap.add_argument("--skip", default="", help="comma-separated phases to leave out (e.g. raw_direct)")
    ap.add_argument("--dma-variants", default="",
                    help="CUDA: extra prelaid/reload phases with page-cache DMA on, comma-separated "
                         "PIECE_MB:THREADS[:SHARE] (SHARE: the DMA'd fraction, the rest copied at the same "
                         "time; default 1), e.g. 64:2,256:1:0.5; 'copy' for DMA off, 'copy:CHUNK_MB:THREADS' with "
                         "the copying readers' pinned chunk size and thread count")
    ap.add_argument("--pin-probe", action="store_true",
                    help="CUDA: time cudaHostRegister(ReadOnly) of the largest file's page cache on 1-8 threads")
    args = ap.parse_args(argv)

    args.workdir.mkdir(parents=True, exist_ok=True)
    src, out, n_layers = build_checkpoint(args.workdir, args.gb, args.checksum)
    devices = {"cpu": ["cpu"], "cuda": ["cuda"], "both": ["cpu", "cuda"]}[args.device]
    if "cuda" in devices and not torch.cuda.is_available():
        print("no CUDA device: skipping the GPU runs", file=sys.stderr)
        devices = [d for d in devices if d != "cuda"]
    all_results = []
    for d in devices:
        dev = torch.device(d)
        if args.pin_probe and d == "cuda":
            all_results += [{"phase": "pin_probe", **r} for r in pin_probe(expert_files(out), dev)]
        res = bench_device(dev, src, out, args.repeats, args.cold, frozenset(filter(None, args.skip.split(","))),
                           tuple(filter(None, args.dma_variants.split(","))))
        all_results += res
        by = {r["phase"]: r for r in res}
        print(f"\n== {d}: {n_layers} layers, {by['prelaid']['bytes'] / 1e9:.2f} GB of kernel-layout expert "
              f"tensors ({'cold' if args.cold else 'warm'} page cache, best of {args.repeats}; "
              f"{read_workers()} reader threads, {os.cpu_count()} cores)")
        print(f"{'phase':26s} {'best s':>8s} {'median s':>9s} {'GB/s':>7s} {'host anon extra':>16s} "
              f"{'host file rss':>14s}" + (f" {'device extra':>13s}" if d == "cuda" else ""))
        for r in res:
            print(f"{r['phase']:26s} {r['best_s']:8.3f} {r['median_s']:9.3f} {r['gbps']:7.2f} "
                  f"{r['host_anon_extra_gib']:13.2f} GiB {r['host_file_rss_gib']:11.2f} GiB"
                  + (f" {r['device_extra_gib']:10.2f} GiB" if d == "cuda" else ""))
        def ratio(a: str, b: str, key: str) -> float:
            return (by[b][key] / by[b]["bytes"]) / (by[a][key] / by[a]["bytes"])  # throughput a / b

        print("ratios (best / median):")
        if "pinned_h2d" in by:
            link = by["pinned_h2d"]
            print(f"  pinned H2D (same run): {link['gbps']:.1f} GB/s best")
            for ph in ("prelaid", "prelaid_reload", "prelaid_triton", "reload_triton", "safetensors", "raw_read",
                       *[p for p in by if p.startswith(("prelaid[", "reload["))]):
                if ph in by:
                    print(f"  {ph} vs pinned H2D: {ratio(ph, 'pinned_h2d', 'best_s'):.2f}x / "
                          f"{ratio(ph, 'pinned_h2d', 'median_s'):.2f}x of the link"
                          + (" (goal >= 0.70x)" if ph.startswith(("prelaid", "reload[")) else ""))
        if "safetensors" in by:
            print(f"  prelaid vs safetensors.load_file: {ratio('prelaid', 'safetensors', 'best_s'):.2f}x / "
                  f"{ratio('prelaid', 'safetensors', 'median_s'):.2f}x throughput")
        for ph in [p for p in ("prelaid_triton", "reload_triton") if p in by]:
            base = "prelaid" if ph == "prelaid_triton" else "prelaid_reload"
            print(f"  {ph} (+ in-place weight tiling) vs {base}: {ratio(ph, base, 'best_s'):.2f}x / "
                  f"{ratio(ph, base, 'median_s'):.2f}x throughput")
            if "safetensors" in by:
                print(f"  {ph} vs safetensors.load_file: {ratio(ph, 'safetensors', 'best_s'):.2f}x / "
                      f"{ratio(ph, 'safetensors', 'median_s'):.2f}x throughput (goal >= 2x)")
        if "raw_read" in by and "prelaid" in by:
            print(f"  prelaid (allocate + load) vs raw read into a fresh buffer: "
                  f"{ratio('prelaid', 'raw_read', 'best_s'):.2f}x / {ratio('prelaid', 'raw_read', 'median_s'):.2f}x "
                  f"throughput (goal >= 0.85x)")
        if "raw_read_resident" in by and "prelaid_reload" in by:
            print(f"  prelaid reload vs raw read into a resident buffer: "
                  f"{ratio('prelaid_reload', 'raw_read_resident', 'best_s'):.2f}x / "
                  f"{ratio('prelaid_reload', 'raw_read_resident', 'median_s'):.2f}x throughput (goal >= 0.85x)")
        for lvl in [v for v in ("none", "checksums") if f"reload_verify_{v}" in by]:
            ph = by[f"reload_verify_{lvl}"]
            print(f"  reload verify={lvl} vs the default (headers): {ph['best_s'] / by['prelaid_reload']['best_s']:.2f}x"
                  f" / {ph['median_s'] / by['prelaid_reload']['median_s']:.2f}x the time")
        for other in [o for o in ("original_then_transform", "raw_direct") if o in by]:
            print(f"  prelaid vs {other}: {by[other]['best_s'] / by['prelaid']['best_s']:.1f}x / "
                  f"{by[other]['median_s'] / by['prelaid']['median_s']:.1f}x faster"
                  + (" (goal >= 3x)" if other == "original_then_transform" else ""))
    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "gb": args.gb, "checksum": args.checksum, "cold": args.cold, "load_threads": read_workers(), "shape": {"H": H, "I": I, "E": E, "layers": n_layers, "row": "mxfp8"}}
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": all_results}, indent=1))
    return 0



def read_source_experts(files, orig: dict, l1_scale: str, l2_scale: str) -> None:
    """Copy a source's per-expert tensors into stacked buffers, gate rows above up rows: the read a loader
    that transforms at load does before its transform. ``orig[prefix]`` holds ``w13``, ``w2`` and the two
    scale buffers under the names given."""
    from megamoe_runtime.files.file_io import SafetensorsFile
    from megamoe_runtime.layer.loaders import parse_expert_weight_name

    for path in files:
        with SafetensorsFile(path) as f:
            for name in f.keys():
                ref = parse_expert_weight_name(name)
                if ref is None or ref.prefix not in orig or ref.kind not in ("weight", "scale"):
                    continue
                o, t = orig[ref.prefix], f.tensor(name)
                if ref.shard_id == "w2":
                    o["w2" if ref.kind == "weight" else l2_scale][ref.expert_id].copy_(t)
                    continue
                dst = o["w13" if ref.kind == "weight" else l1_scale]
                n = dst.shape[1] // 2
                dst[ref.expert_id, slice(0, n) if ref.shard_id == "w1" else slice(n, 2 * n)].copy_(t)

if __name__ == "__main__":
    sys.exit(main())
