#!/usr/bin/env python
"""Loading a block-FP8 (DeepSeek-V3 native FP8) MoE layer onto a Hopper GPU: megamoe's converted folder
loaded in place vs the source checkpoint read, then laid out by DeepGEMM's SM90 transform at load.

    python bench/load_sm90.py --out DIR                       # 1 layer x 24 experts of DeepSeek-V3's shape
    python bench/load_sm90.py --experts 64 --layers 2 --workdir /tmp/l --out DIR

Why: a server that runs sgl-deep-gemm's ``fp8_mega_moe`` on a DeepSeek-native checkpoint must read the
source's per-expert tensors into checkpoint-format stacks and then call
``deep_gemm.transform_weights_for_mega_moe_sm90`` (a gate/up row interleave into new tensors); a megamoe
folder holds those bytes already, so its load is one read per stored tensor into the tensors the kernel
reads. Measured in one process, on the same experts (H 7168, I 2048, random E4M3 bytes with fp32 128x128
block scales; source written by the converter's own synthetic block-FP8 writer, converted by megamoe):

* ``raw_read``: plain reads of the converted expert files into one device buffer through pinned chunks: the
  floor of any load from these files (the disk's rate when cold, the page cache and link when warm);
* ``pinned_h2d``: one copy of the same byte count from pinned host memory: the host-to-device link;
* ``converted_build``: ``Checkpoint.build_layer`` (allocate the kernel tensors, read each stored tensor into
  them in place); ``converted_reload``: ``Checkpoint.load_layer`` into the built layers;
* ``source_then_sm90_transform``: the source's expert tensors into checkpoint-format device stacks, then
  ``transform_weights_for_mega_moe_sm90`` (falls back to megamoe's byte-identical ``block_fp8_kernel_layout``
  where deep_gemm does not import; the JSON says which ran), originals freed.
Each phase runs cold (files' pages evicted first) and warm; GB/s are the kernel bytes over the time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

H, I = 7168, 2048


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def log(msg: str) -> None:
    print(msg, flush=True)


def build(workdir: Path, layers: int, experts: int) -> tuple[Path, Path]:
    """Source (synthetic DeepSeek-native block FP8) and its megamoe conversion, built once under workdir.
    Every expert reuses one of four generated fp32 experts (the bytes' values do not matter to a load)."""
    from megamoe_convert.pipeline.convert import convert
    from megamoe_convert.testing import synth

    tag = f"fp8block-L{layers}-E{experts}"
    src, out = workdir / f"src-{tag}", workdir / f"out-{tag}"
    if (out / "megamoe.json").is_file():
        return src, out
    made = {}
    real = synth.synthetic_expert_weights

    def cached(seed, layer, expert, hidden, intermediate):
        k = expert % 4
        if k not in made:
            made[k] = real(seed, layer, k, hidden, intermediate)
        return made[k]

    synth.synthetic_expert_weights = cached
    try:
        t0 = time.perf_counter()
        if not (src / "config.json").is_file():
            synth.build_synthetic_checkpoint(src, "fp8-block", num_layers=layers, hidden=H, intermediate=I,
                                             num_experts=experts, top_k=8, max_shard_bytes=2 << 30)
        log(f"source written in {time.perf_counter() - t0:.0f}s")
        t0 = time.perf_counter()
        convert(src, out, overwrite=True)
        log(f"converted in {time.perf_counter() - t0:.0f}s")
    finally:
        synth.synthetic_expert_weights = real
    os.sync()
    return src, out


def source_then_transform(ck, src: Path, device: torch.device):
    """Engine-style load of the source, then the SM90 layout built from it at load."""
    from load import read_source_experts  # bench/load.py: the same source read

    try:
        import deep_gemm

        transform = deep_gemm.transform_weights_for_mega_moe_sm90
        which = "deep_gemm.transform_weights_for_mega_moe_sm90"
    except Exception as exc:  # noqa: BLE001  (the fallback is byte-identical; recorded)
        from megamoe_runtime.format.layout import block_fp8_kernel_layout

        def transform(l1, l2):
            kt = block_fp8_kernel_layout(l1, l2)
            return (kt.l1_weight, kt.l1_scale), (kt.l2_weight, kt.l2_scale)

        which = f"megamoe block_fp8_kernel_layout (deep_gemm: {type(exc).__name__})"
    files = sorted(src.glob("*.safetensors"))

    def run():
        infos = {li.prefix: li for li in ck.layers}
        orig = {}
        for prefix, li in infos.items():
            s = li.spec
            e, i, h = s.num_experts, s.intermediate, s.hidden
            orig[prefix] = {"w13": torch.empty(e, 2 * i, h, dtype=torch.float8_e4m3fn, device=device),
                            "s13": torch.empty(e, 2 * i // 128, h // 128, dtype=torch.float32, device=device),
                            "w2": torch.empty(e, h, i, dtype=torch.float8_e4m3fn, device=device),
                            "s2": torch.empty(e, h // 128, i // 128, dtype=torch.float32, device=device)}
        read_source_experts(files, orig, "s13", "s2")
        kernel = []
        for prefix, o in orig.items():
            kernel.append(transform((o.pop("w13"), o.pop("s13")), (o.pop("w2"), o.pop("s2"))))
        sync(device)
        return kernel

    return run, which


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=24)
    ap.add_argument("--workdir", default="/tmp/load_sm90")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dry", action="store_true", help="CPU, H 1024, I 512: a check of the script")
    ap.add_argument("--build-only", action="store_true", help="write and convert the checkpoint, then stop")
    args = ap.parse_args()
    global H, I

    import megamoe_runtime as mr
    from load import drop_cache, expert_files, phase_pinned_h2d, phase_raw_read  # bench/load.py

    device = torch.device("cpu" if args.dry else "cuda")
    if args.dry:
        H, I = 1024, 512
    wd = Path(args.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    src, out = build(wd, args.layers, args.experts)
    if args.build_only:
        return 0
    ck = mr.Checkpoint(out)
    files = expert_files(out)
    src_files = sorted(src.glob("*.safetensors"))
    nbytes, raw = phase_raw_read(files, device)
    kernel_bytes = sum(p.stat().st_size for p in files)
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "layers": args.layers, "experts": args.experts,
           "converted_bytes": kernel_bytes, "source_bytes": sum(p.stat().st_size for p in src_files), "phases": {}}
    built = [ck.build_layer(li.index, device=device, backend="reference") for li in ck.layers]
    sync(device)
    sot, which = source_then_transform(ck, src, device)
    res["transform"] = which
    (l1w, l1s), (l2w, l2s) = sot()[0]
    try:  # the two loads must give the kernel the same bytes
        lay = built[0]
        res["same_bytes"] = all(torch.equal(a.view(torch.uint8), getattr(lay, n).view(torch.uint8))
                                for a, n in ((l1w, "l1_weight"), (l2w, "l2_weight")))
        res["same_scales"] = all(torch.equal(a.float(), getattr(lay, n).float())
                                 for a, n in ((l1s, "l1_scale"), (l2s, "l2_scale")))
    except Exception as exc:  # noqa: BLE001
        res["same_bytes"] = f"not compared: {exc!r}"[:200]
    log(f"transform: {which}; same bytes {res.get('same_bytes')}, scales {res.get('same_scales')}")
    del l1w, l1s, l2w, l2s

    def converted_build():
        ls = [ck.build_layer(li.index, device=device, backend="reference") for li in ck.layers]
        sync(device)
        return ls

    def converted_reload():
        for layer in built:
            ck.load_layer(layer)
        sync(device)

    phases = {"raw_read": (raw, files)}
    if device.type == "cuda":
        phases["pinned_h2d"] = (phase_pinned_h2d(kernel_bytes, device), [])
    phases |= {"converted_build": (converted_build, files), "converted_reload": (converted_reload, files),
              "source_then_sm90_transform": (sot, src_files)}
    for name, (run, fs) in phases.items():
        for mode in ("cold", "warm"):
            ts = []
            for _ in range(args.repeats):
                if mode == "cold":
                    drop_cache(fs)
                elif not ts:
                    run()  # warm the page cache once
                sync(device)
                t0 = time.perf_counter()
                r = run()
                ts.append(time.perf_counter() - t0)
                del r
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            s = statistics.median(ts)
            res["phases"][f"{name}/{mode}"] = {"s": s, "GBps": kernel_bytes / s / 1e9, "runs": ts}
            log(f"{name:28s} {mode}: {s:.3f} s  {kernel_bytes / s / 1e9:6.2f} GB/s")
    p = res["phases"]
    for mode in ("cold", "warm"):
        res[f"ratio_{mode}"] = {
            "source_then_transform / converted_build": p[f"source_then_sm90_transform/{mode}"]["s"]
            / p[f"converted_build/{mode}"]["s"],
            "converted_build / raw_read": p[f"converted_build/{mode}"]["s"] / p[f"raw_read/{mode}"]["s"],
            "converted_reload / raw_read": p[f"converted_reload/{mode}"]["s"] / p[f"raw_read/{mode}"]["s"]}
        log(f"{mode}: {res[f'ratio_{mode}']}")
    with open(os.path.join(args.out, "load_sm90.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
