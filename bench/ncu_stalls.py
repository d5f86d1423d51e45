#!/usr/bin/env python
"""Summarize Nsight Compute reports of the triton kernels: headline metrics, stall reasons summed
over the kernel, and the SASS lines holding the most stall samples (issue 11; BENCHMARKS.md quotes
these summaries). Needs ``ncu`` on the PATH (the device machine has it).

    ncu --clock-control none -k regex:_l1_kernel -s 2 -c 1 --set full --import-source no \\
        -o $OUT/l1 python bench/one_forward.py --row nvfp4 --tokens 64
    python bench/ncu_stalls.py $OUT/l1.ncu-rep [--grep 0x7f7f7f7f]

``--grep TEXT`` also prints the share of all stall samples on SASS lines containing TEXT (e.g. the
fold range check's ``0x7f7f7f7f`` masks). The per-line table is written next to the report as
``REPORT.source.csv``.
"""
from __future__ import annotations

import argparse
import collections
import csv
import io
import subprocess

HEADLINE = ("Duration", "DRAM Throughput", "Compute (SM) Throughput", "Issue Slots Busy", "Registers Per Thread",
            "Achieved Occupancy", "Theoretical Occupancy", "Block Limit Shared Mem", "Block Limit Registers",
            "Active Warps Per Scheduler", "Eligible Warps Per Scheduler", "Warp Cycles Per Issued Instruction",
            "Dynamic Shared Memory Per Block", "Shared Memory Configuration Size", "L2 Hit Rate")


def _ncu(rep: str, *args: str) -> str:
    return subprocess.run(["ncu", "-i", rep, *args], capture_output=True, text=True).stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report")
    ap.add_argument("--grep", action="append", default=[])
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    for row in csv.reader(io.StringIO(_ncu(args.report, "--page", "details", "--csv"))):
        if len(row) > 14 and row[12] in HEADLINE:  # kernel, section, metric, unit, value
            print(f"{row[4][:24]:24s} {row[12]:36s} {row[14]} {row[13]}")
    src = _ncu(args.report, "--page", "source", "--csv", "--print-source", "sass")
    with open(args.report + ".source.csv", "w") as f:
        f.write(src)
    rows = list(csv.reader(io.StringIO(src)))
    hdr = next((i for i, r in enumerate(rows) if "Warp Stall Sampling (All Samples)" in r), None)
    if hdr is None:
        print("no source page in the report (was it taken with --set full?)")
        return
    h = rows[hdr]
    data = [r for r in rows[hdr + 1:] if len(r) == len(h)]
    ia, isrc = h.index("Warp Stall Sampling (All Samples)"), h.index("Source")
    num = lambda v: float(v or 0)  # noqa: E731
    total = sum(num(r[ia]) for r in data) or 1.0
    reasons = collections.Counter()
    for r in data:
        for j, c in enumerate(h):
            if c.startswith("stall_"):  # both the all-samples and the "(Not Issued)" columns, as BENCHMARKS.md
                reasons[c[6:]] += num(r[j])
    rs = sum(reasons.values()) or 1.0
    print("stall reasons (share of every stall_ column):", ", ".join(f"{k} {100 * v / rs:.1f}%" for k, v in reasons.most_common(8)))
    for text in args.grep:
        share = sum(num(r[ia]) for r in data if text in r[isrc]) / total
        print(f"lines containing {text!r}: {100 * share:.1f}% of the stall samples")
    for r in sorted(data, key=lambda r: -num(r[ia]))[:args.top]:
        print(f"{100 * num(r[ia]) / total:5.1f}%  {r[isrc][:90]}")


if __name__ == "__main__":
    main()
