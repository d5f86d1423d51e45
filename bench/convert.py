"""Conversion benchmark: throughput against `cp`, and peak memory at two sizes.

    python bench/convert.py                    # >= 2 GB of expert weights (default)
    python bench/convert.py --expert-gb 8      # scale up
    python bench/convert.py --format modelopt-nvfp4 --workdir /mnt/fast/bench

What it does, all on the same disk (``--workdir``, default a temporary folder
beside the current directory):

1. builds two synthetic checkpoints with ``megamoe_convert.synth`` that have
   the same MoE layer shape (default Qwen3-30B-A3B-like: hidden 2048,
   intermediate 768, 128 experts) and different layer counts: the large one
   holds at least ``--expert-gb`` of expert weights, the small one a quarter
   of the layers (at least 2);
2. for each: copies the source's ``*.safetensors`` with ``cp`` (then
   ``sync``), and converts it with ``megamoe-convert`` in a subprocess
   (which fsyncs every shard), best of ``--repeat`` runs each;
3. reports GB/s (source bytes / seconds), the ratio to ``cp`` (+sync), and
   the converter subprocess's peak RSS (``VmHWM`` from /proc/self/status, read
   by the subprocess itself at exit) next to one layer's expert bytes.

The goal: conversion >= 0.7x cp, and peak RSS ~ two layers + a constant
(the converter double-buffers), the same at both model sizes. Prints a
Markdown section for BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def child(src: str, out: str, max_shard: str) -> None:
    """Runs in the measured subprocess: convert, then report time and memory."""
    from megamoe_convert.convert import convert

    base = _status_kb("VmRSS")
    t = time.perf_counter()
    s = convert(src, out, max_shard_size=max_shard)
    dt = time.perf_counter() - t
    print(json.dumps({"seconds": dt, "bytes_in": s.bytes_in, "bytes_out": s.bytes_out, "layers": s.layers,
                      "experts": s.experts, "rss_base_kb": base, "vmhwm_kb": _status_kb("VmHWM")}))


def layer_expert_bytes(fmt: str, H: int, I: int, E: int) -> int:
    per = {"mxfp4": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16, "mxfp8": 1 + 1 / 32, "bf16": 2.0}
    from megamoe_convert.synth import ROW_OF

    return int(3 * H * I * E * per[ROW_OF[fmt]])


def build(path: Path, fmt: str, layers: int, H: int, I: int, E: int) -> float:
    from megamoe_convert import synth

    t = time.perf_counter()
    synth.build_synthetic_checkpoint(path, fmt, num_layers=layers, hidden=H, intermediate=I, num_experts=E,
                                     top_k=8, max_shard_bytes=2_000_000_000, vocab_size=1024)
    return time.perf_counter() - t


def src_bytes(src: Path) -> int:
    return sum(p.stat().st_size for p in src.glob("*.safetensors"))


def time_cp(src: Path, dst: Path) -> tuple[float, float]:
    """(cp seconds, cp + sync seconds) for the source's safetensors files."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir()
    subprocess.run(["sync"], check=True)
    t = time.perf_counter()
    subprocess.run(["cp", *map(str, sorted(src.glob("*.safetensors"))), str(dst)], check=True)
    t_cp = time.perf_counter() - t
    subprocess.run(["sync"], check=True)
    return t_cp, time.perf_counter() - t


def time_convert(src: Path, out: Path, max_shard: str) -> dict:
    if out.exists():
        shutil.rmtree(out)
    subprocess.run(["sync"], check=True)
    p = subprocess.run([sys.executable, __file__, "--child", str(src), str(out), max_shard],
                       check=True, capture_output=True, text=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--expert-gb", type=float, default=2.0, help="expert weight GB of the large model (>= 2)")
    ap.add_argument("--format", default="modelopt-mxfp4", help="synthetic source format")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--repeat", type=int, default=2, help="runs per measurement; the best is reported")
    ap.add_argument("--workdir", type=Path, default=None, help="folder on the disk to measure (default: ./)")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(*a.child)
        return

    H, I, E = a.hidden, a.intermediate, a.experts
    per_layer = layer_expert_bytes(a.format, H, I, E)
    big_layers = max(1, math.ceil(a.expert_gb * 1e9 / per_layer))
    # at least 2 layers: the converter double-buffers (layer L+1 is packed while layer L is hashed and
    # written), so a 1-layer model would not show the steady-state memory
    small_layers = max(2, big_layers // 4)
    root = Path(tempfile.mkdtemp(prefix="megamoe-bench-", dir=a.workdir or Path.cwd()))
    rows = []
    try:
        for name, layers in (("small", small_layers), ("large", big_layers)):
            src = root / f"src-{name}"
            gen = build(src, a.format, layers, H, I, E)
            nbytes = src_bytes(src)
            cps, cpss, convs = [], [], []
            for _ in range(a.repeat):
                c, cs = time_cp(src, root / "cp")
                cps.append(c)
                cpss.append(cs)
                convs.append(time_convert(src, root / "out", a.max_shard_size))
            shutil.rmtree(root / "cp", ignore_errors=True)
            shutil.rmtree(root / "out", ignore_errors=True)
            conv = min(convs, key=lambda r: r["seconds"])
            rows.append({
                "model": name, "layers": layers, "expert_bytes": per_layer * layers, "source_bytes": nbytes,
                "gen_s": gen, "cp_s": min(cps), "cp_sync_s": min(cpss), "convert_s": conv["seconds"],
                "convert_gbps": nbytes / conv["seconds"] / 1e9, "cp_gbps": nbytes / min(cps) / 1e9,
                "cp_sync_gbps": nbytes / min(cpss) / 1e9,
                "ratio_cp": min(cps) / conv["seconds"], "ratio_cp_sync": min(cpss) / conv["seconds"],
                "peak_rss_mb": conv["vmhwm_kb"] / 1024, "base_rss_mb": conv["rss_base_kb"] / 1024,
                "layer_mb": per_layer / 1e6,
            })
            print(json.dumps(rows[-1]), file=sys.stderr)
            if not a.keep:
                shutil.rmtree(src)
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    print_markdown(a, rows, H, I, E)


def print_markdown(a, rows: list[dict], H: int, I: int, E: int) -> None:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    print(f"## Conversion ({time.strftime('%Y-%m-%d')})\n")
    print(f"Command: `python bench/convert.py --expert-gb {a.expert_gb:g} --format {a.format}` "
          f"(layer: hidden {H}, intermediate {I}, {E} experts; best of {a.repeat}).")
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"Machine: {os.cpu_count()}-core CPU VM ({cpu or platform.processor()}), "
          f"{platform.system()} {platform.release()}, Python {platform.python_version()}; "
          f"load average at the end {load}.\n")
    print("| model | MoE layers | source bytes | cp | cp + sync | convert (fsynced) | vs cp | vs cp+sync "
          "| peak RSS | RSS after imports | one layer's experts |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['layers']} | {r['source_bytes'] / 1e9:.2f} GB | {r['cp_gbps']:.2f} GB/s "
              f"| {r['cp_sync_gbps']:.2f} GB/s | {r['convert_gbps']:.2f} GB/s ({r['convert_s']:.1f} s) "
              f"| {r['ratio_cp']:.2f}x | {r['ratio_cp_sync']:.2f}x | {r['peak_rss_mb']:.0f} MB "
              f"| {r['base_rss_mb']:.0f} MB | {r['layer_mb']:.0f} MB |")


if __name__ == "__main__":
    main()
