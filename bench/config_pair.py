#!/usr/bin/env python
"""The triton forward's default tiles against the same tiles with one or more KernelConfig fields changed:
whole layer in a CUDA graph (L2 flushed, ``do_bench`` median, the two timed alternately), and whether the
outputs are bitwise equal. For an off-by-default kernel option (``k_unroll``, ``scale_load``) this is the
measurement that decides its default.

    python bench/config_pair.py --set k_unroll=2 --rows mxfp4,mxfp8 --shapes dsv3,qwen3-30b --tokens 8,64
    python bench/config_pair.py --set scale_load=ahead --rows mxfp8 --json out.json

Random valid kernel-layout bytes, uniform top-k routing, weights in the arrangement a loaded layer reads
(``configs.resolve_w_tile``), one process, one card.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel import _bench, copy_bandwidth, parse_shapes, random_layer, routing  # noqa: E402


def _value(text: str):
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", required=True, help="FIELD=VALUE[,FIELD=VALUE...]: the KernelConfig change to time")
    ap.add_argument("--rows", default="mxfp4,mxfp8")
    ap.add_argument("--shapes", default="dsv3,qwen3-30b")
    ap.add_argument("--tokens", default="8,64")
    ap.add_argument("--rounds", type=int, default=3, help="alternate default / changed this many times")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    from megamoe_runtime.backends.triton import configs, moe

    change = dict(kv.split("=", 1) for kv in a.set.split(","))
    change = {k: _value(v) for k, v in change.items()}
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, copy {bw:.0f} GB/s; change {change}", flush=True)
    res = []
    for s, sh in parse_shapes(a.shapes):
        H, I, E, K = sh["H"], sh["I"], sh["E"], sh["K"]
        for row in a.rows.split(","):
            probe = random_layer(row, H, I, E, K)[0]
            wt = configs.resolve_w_tile(probe, "cuda")
            spec, _, kt, sc = random_layer(row, H, I, E, K, wt)
            ff = moe.fold_flags(spec, kt)
            for T in (int(t) for t in a.tokens.split(",")):
                tw, ids = routing(T, E, K, seed=T)
                x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
                wk = configs.ROW_W_KIND[row]  # the forward's own default (moe._config), then the change on it
                base = configs.default_config(T * K, E, configs.resolve_k_order(configs.KernelConfig(), wk, H, I),
                                              w_kind=wk, H=H, I=I, num_experts=E)
                cfgs = {"default": None, "changed": dataclasses.replace(base, **change)}
                run = {n: (lambda c=c: moe.moe_forward(spec, kt, x, tw, ids, scalars=sc, config=c, w_tile=wt,
                                                       fold_flags=ff)) for n, c in cfgs.items()}
                same = bool(torch.equal(run["default"]().view(torch.int16), run["changed"]().view(torch.int16)))
                times = {n: [] for n in run}
                for _ in range(a.rounds):
                    for n, fn in run.items():
                        times[n].append(_bench(fn) * 1e3)
                us = {n: sorted(v)[len(v) // 2] for n, v in times.items()}
                r = dict(shape=s, row=row, T=T, default_us=us["default"], changed_us=us["changed"],
                         speedup=us["default"] / us["changed"], bitwise_equal=same)
                res.append(r)
                print(f"{s:12s} {row:6s} T={T:5d} default {us['default']:9.1f} us  changed {us['changed']:9.1f} us"
                      f"  {r['speedup']:.3f}x  bitwise {'equal' if same else 'DIFFERENT'}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(change=change, gpu=torch.cuda.get_device_name(), copy_GBps=bw,
                                                points=res), indent=1))


if __name__ == "__main__":
    main()
