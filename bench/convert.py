"""Conversion benchmark: megamoe-convert beside ``cp -r`` + ``sync`` in the same run.

    python bench/convert.py                              # 1 GiB and ~3 GB, 3 rounds
    python bench/convert.py --gb 1 --repeat 5 --cpus "0;0,1"  # 1- vs 2-core scaling
    python bench/convert.py --peer-python /path/venv/bin/python   # + compressed-tensors column
    python bench/convert.py --baseline-tree /tmp/old-checkout     # + the same converter at another commit
    python bench/convert.py --format bf16 --gb 1.3 --baseline-tree /tmp/old   # a BF16 source (bf16 row)

The workload (issue 13) is the format NVIDIA publishes its large MoE
checkpoints in: a ModelOpt NVFP4 export with NVFP4 shared experts and
DeepSeek-V3 naming (``model.layers.N.mlp.experts.E.{gate,up,down}_proj``,
``mlp.shared_experts``, ``model_type: deepseek_v3``), built with
``megamoe_convert.testing.synth``. Every layer: hidden 2048, moe_intermediate 768,
64 routed experts, 2 shared experts (one MLP of width 1536, re-encoded to
MXFP8 for the nvfp4 row's fused shared path) and bf16 attention weights
(passed through). The layer count is chosen per ``--gb`` target. ``--format bf16`` (or fp16 / fp32)
builds the same model as a plain float checkpoint instead, converted to the bf16 row (weights copied or
cast, and checked for NaN / inf).

Method, per size: sources are built once (cached under ``--workdir`` with
``--keep``), warmed into the page cache, and then every contender runs once
per round, round-robin, with the order rotated each round, so load from other
jobs on the machine hits all of them alike:

* ``cp``: ``cp -r SRC DST`` then ``sync DST/*`` (fsync of every copied file:
  the converter also fsyncs each file it writes, and a global ``sync`` would
  also wait for other jobs' dirty pages);
* ``convert``: ``megamoe_convert.pipeline.convert.convert()`` in a fresh subprocess
  (fsyncs every file before its final rename). Reported: the time of the call
  (imports excluded, as for ``cp``) and of the whole process, and its peak RSS
  (``VmHWM``);
* ``ct`` (``--peer-python``): compressed-tensors' ``convert_checkpoint`` with
  its ModelOpt NVFP4 converter, in that interpreter (its own venv);
* ``baseline`` (``--baseline-tree``): the converter from another source tree
  (e.g. ``git archive`` of an older commit), to show before/after paired.

``--cpus "0;0,1"`` runs every contender under ``taskset -c 0`` and ``-c
0,1`` in the same rounds. A global ``sync`` (untimed) precedes each timed
run. Reported: medians over rounds, GB/s of source bytes, each contender's
ratio to the cp + sync median, and the load average. Prints Markdown for
BENCHMARKS.md (stdout) and per-run JSON lines (stderr, or ``--json FILE``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

H, I, E, S = 2048, 768, 64, 2
FMT = "modelopt-nvfp4"
#: source bytes per weight element of each ``--format``
ELEMENT_BYTES = {"modelopt-nvfp4": 0.5 + 1 / 16, "bf16": 2, "fp16": 2, "fp32": 4}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def child(src: str, out: str, checksum: str | None) -> None:
    """Runs in the measured subprocess: convert, then report time and memory."""
    t_start = float(os.environ.get("MEGAMOE_BENCH_T0", time.time()))
    import megamoe_convert.pipeline.convert as mc

    convert = mc.convert
    kwargs = {}
    if checksum:  # "blake3" or "blake3:2" (hash threads per tensor)
        alg, _, threads = checksum.partition(":")
        kwargs["checksum"] = alg
        if threads:
            import megamoe_convert.pipeline.stream as stream

            stream.HASH_THREADS = int(threads)
    base = _status_kb("VmRSS")
    t = time.perf_counter()
    r0 = os.times()
    s = convert(src, out, **kwargs)
    r1 = os.times()
    dt = time.perf_counter() - t
    print(json.dumps({"seconds": dt, "process_s": time.time() - t_start, "bytes_in": s.bytes_in,
                      "user_s": r1.user - r0.user, "sys_s": r1.system - r0.system,
                      "rss_base_kb": base, "vmhwm_kb": _status_kb("VmHWM")}))


def ct_child(src: str, out: str) -> None:
    """compressed-tensors' converter (run with --peer-python's interpreter)."""
    t_start = float(os.environ.get("MEGAMOE_BENCH_T0", time.time()))
    from compressed_tensors.entrypoints.convert import ModelOptNvfp4Converter, convert_checkpoint

    experts = r"re:.*\.mlp\.(experts\.\d+|shared_experts)\.(gate|up|down)_proj$"
    t = time.perf_counter()
    convert_checkpoint(model_stub=src, save_directory=out, converter=ModelOptNvfp4Converter(targets=[experts]))
    for p in Path(out).rglob("*"):  # fsync like the other contenders
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    dt = time.perf_counter() - t
    print(json.dumps({"seconds": dt, "process_s": time.time() - t_start, "vmhwm_kb": _status_kb("VmHWM")}))


def layer_bytes(fmt: str = FMT) -> int:
    """Source bytes of one layer: routed + shared experts in `fmt`, bf16 attention, norms, router."""
    return int(3 * H * I * (E + S) * ELEMENT_BYTES[fmt]) + 4 * H * H * 2 + E * H * 2


def build(path: Path, layers: int, fmt: str = FMT) -> None:
    from megamoe_convert.testing import synth

    synth.build_synthetic_checkpoint(path, fmt, num_layers=layers, hidden=H, intermediate=I, num_experts=E,
                                     shared=S, top_k=8, model_type="deepseek_v3",
                                     max_shard_bytes=2_000_000_000, vocab_size=1024)


def src_bytes(src: Path) -> int:
    return sum(p.stat().st_size for p in src.iterdir() if p.is_file())


def _sync_all() -> None:
    subprocess.run(["sync"], check=True)


def _taskset(cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus] if cpus else []


def run_cp(src: Path, dst: Path, cpus: str | None) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    _sync_all()
    t = time.perf_counter()
    subprocess.run([*_taskset(cpus), "cp", "-r", str(src), str(dst)], check=True)
    t_cp = time.perf_counter() - t
    subprocess.run([*_taskset(cpus), "sync", *map(str, sorted(p for p in dst.iterdir()))], check=True)
    return {"seconds": time.perf_counter() - t, "cp_only_s": t_cp}


def run_child(args: list[str], out: Path, cpus: str | None, python: str, env_path: str | None) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    _sync_all()
    env = dict(os.environ, MEGAMOE_BENCH_T0=repr(time.time()))
    if env_path is not None:
        env["PYTHONPATH"] = env_path
    t = time.perf_counter()
    p = subprocess.run([*_taskset(cpus), python, __file__, *args], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"{args[0]} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["process_s"] = wall
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", default="1.074,3.2", help="source sizes in GB, comma separated (1.074 GB = 1 GiB)")
    ap.add_argument("--format", default=FMT, choices=sorted(ELEMENT_BYTES),
                    help="source format (synthetic); default %(default)s")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (every contender once per round); medians")
    ap.add_argument("--cpus", default="", help="taskset CPU lists separated by ';' (e.g. '0;0,1'); default: all")
    ap.add_argument("--checksum", default=None,
                    help="comma-separated convert --checksum values, each a contender (e.g. 'sha256,blake3,blake3:2'; "
                         "':N' = blake3 threads per tensor); default: the converter's default")
    ap.add_argument("--peer-python", default=None, help="python with compressed-tensors for the CT column")
    ap.add_argument("--baseline-tree", type=Path, default=None, help="another megamoe source tree to compare")
    ap.add_argument("--workdir", type=Path, default=None, help="folder on the disk to measure (default: /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep (and reuse) the generated sources in --workdir")
    ap.add_argument("--json", type=Path, default=None, help="also write every run as JSON lines here")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--ct-child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], a.child[1], a.child[2] if a.child[2] != "-" else None)
        return
    if a.ct_child:
        ct_child(*a.ct_child)
        return

    workdir = a.workdir or Path(tempfile.gettempdir())
    root = workdir / "megamoe-bench-convert" if a.keep else Path(tempfile.mkdtemp(prefix="megamoe-bench-", dir=workdir))
    root.mkdir(parents=True, exist_ok=True)
    cpu_sets = [c.strip() or None for c in a.cpus.split(";")] if a.cpus else [None]
    here = str(Path(__file__).resolve().parents[1])
    contenders = [("cp", None)]
    contenders += [(f"convert[{c}]", here) for c in a.checksum.split(",")] if a.checksum else [("convert", here)]
    if a.baseline_tree:
        contenders.append(("baseline", str(a.baseline_tree.resolve())))
    if a.peer_python:
        contenders.append(("ct", None))
    log = open(a.json, "a") if a.json else None
    rows = []
    try:
        for gb in (float(x) for x in a.gb.split(",")):
            layers = max(2, round(gb * 1e9 / layer_bytes(a.format)))
            src = root / (f"src-{layers}" if a.format == FMT else f"src-{a.format}-{layers}")
            if not (src / "config.json").is_file():
                shutil.rmtree(src, ignore_errors=True)
                build(src, layers, a.format)
            nbytes = src_bytes(src)
            run_cp(src, root / "dst", None)  # warm-up: source into the page cache
            load_start = os.getloadavg()
            runs: dict[tuple[str, str | None], list[dict]] = {}
            jobs = [(c, cpus) for cpus in cpu_sets for c in contenders]
            for rnd in range(a.repeat):
                k = rnd % len(jobs)
                for (name, tree), cpus in jobs[k:] + jobs[:k]:
                    if name == "cp":
                        r = run_cp(src, root / "dst", cpus)
                    elif name == "ct":
                        r = run_child(["--ct-child", str(src), str(root / "dst")], root / "dst", cpus,
                                      a.peer_python, None)
                    else:
                        ck = name[len("convert["):-1] if name.startswith("convert[") else "-"
                        r = run_child(["--child", str(src), str(root / "dst"), ck], root / "dst",
                                      cpus, sys.executable, tree)
                    shutil.rmtree(root / "dst", ignore_errors=True)
                    r.update(contender=name, cpus=cpus or "all", round=rnd, gb=nbytes / 1e9, layers=layers,
                             load=os.getloadavg()[0])
                    runs.setdefault((name, cpus), []).append(r)
                    print(json.dumps(r), file=log or sys.stderr, flush=True)
            load_end = os.getloadavg()
            for cpus in cpu_sets:
                cp_med = statistics.median(r["seconds"] for r in runs[("cp", cpus)])
                for name, _ in contenders:
                    rs = runs[(name, cpus)]
                    med = statistics.median(r["seconds"] for r in rs)
                    rows.append({
                        "gb": nbytes / 1e9, "layers": layers, "cpus": cpus or f"all ({os.cpu_count()})",
                        "contender": name, "median_s": med, "min_s": min(r["seconds"] for r in rs),
                        "max_s": max(r["seconds"] for r in rs), "gbps": nbytes / med / 1e9,
                        "ratio": cp_med / med,
                        "process_s": statistics.median(r.get("process_s", r["seconds"]) for r in rs),
                        "peak_rss_mb": max((r.get("vmhwm_kb", 0) for r in rs), default=0) / 1024 or None,
                        "load": f"{load_start[0]:.1f} -> {load_end[0]:.1f}",
                        "cpu_s": statistics.median(r["user_s"] + r["sys_s"] for r in rs) if "user_s" in rs[0] else None,
                    })
            if not a.keep:
                shutil.rmtree(src)
    finally:
        if log:
            log.close()
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    print_markdown(a, rows)


def print_markdown(a, rows: list[dict]) -> None:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    print(f"## Conversion ({time.strftime('%Y-%m-%d %H:%M')})\n")
    print(f"Command: `python bench/convert.py {' '.join(sys.argv[1:])}` ({a.format}, DeepSeek-V3 naming; layer: hidden "
          f"{H}, moe_intermediate {I}, {E} routed + {S} shared experts; median of {a.repeat} rounds).")
    print(f"Machine: {os.cpu_count()}-core CPU VM ({cpu or platform.processor()}), "
          f"{platform.system()} {platform.release()}, Python {platform.python_version()}.\n")
    print("| source | cpus | tool | median s (min-max) | GB/s | vs cp + sync | process s | CPU s | peak RSS | load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rss = f"{r['peak_rss_mb']:.0f} MB" if r["peak_rss_mb"] else "-"
        cpu_s = f"{r['cpu_s']:.1f}" if r["cpu_s"] is not None else "-"
        print(f"| {r['gb']:.2f} GB ({r['layers']} layers) | {r['cpus']} | {r['contender']} "
              f"| {r['median_s']:.2f} ({r['min_s']:.2f}-{r['max_s']:.2f}) | {r['gbps']:.3f} | {r['ratio']:.2f}x "
              f"| {r['process_s']:.2f} | {cpu_s} | {rss} | {r['load']} |")


if __name__ == "__main__":
    main()
