#!/usr/bin/env python
"""Compile the default (bf16 "frag") path's L1/L2 kernels for sm_90 without a GPU and count
the SASS instructions of their main K loop (issue 11; BENCHMARKS.md quotes these counts).

    python bench/inspect_frag.py                    # the table below, with the installed triton
    python bench/inspect_frag.py --out DIR          # also write each kernel's SASS and TTGIR

Per variant (kernel, weight kind, BM, BN, warps, fold decode, scale words, one-dot L1, stages,
tile rows of the weight arrangement; compiled without a register cap): the
instructions between the main loop's label and its backward branch (the largest loop when the
kernel has two: with the fold decode the second, never-taken redo loop is smaller, unpipelined),
the top opcodes, shared-memory stores and barriers inside the loop (a layout round trip of the
operand shows as PRMT/STS/BAR), registers and stack per thread (cuobjdump -res-usage). Pointer
and size arguments get the divisibility-by-16 hint the JIT gives them at run time.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from megamoe_runtime.backends.triton import configs, l1, l2  # noqa: E402

DIV = {"H", "I", "stride_we", "stride_wn", "stride_wse"}
L1_TYPES = {"x_ptr": "*bf16", "xts_ptr": "*fp32", "w_ptr": "*u8", "wsb_ptr": "*u8", "alpha_ptr": "*fp32",
            "fflag_ptr": "*i32",
            "pair_ptr": "*i32", "blk_ptr": "*i32", "nblk_ptr": "*i32", "tw_ptr": "*fp32", "act_ptr": "*bf16",
            "T": "i32", "H": "i32", "I": "i32", "TOPK": "i32", "stride_we": "i64", "stride_wn": "i32",
            "stride_wse": "i64", "rsf": "fp32", "clamp_c": "fp32", "act_alpha": "fp32", "act_beta": "fp32",
            "situ_b": "fp32", "situ_bl": "fp32", "a2_ptr": "*fp32"}
L2_TYPES = {"act_ptr": "*bf16", "w_ptr": "*u8", "wsb_ptr": "*u8", "fflag_ptr": "*i32", "pair_ptr": "*i32", "blk_ptr": "*i32",
            "nblk_ptr": "*i32", "tw_ptr": "*fp32", "l2s_ptr": "*fp32", "slot_ptr": "*bf16", "T": "i32", "H": "i32",
            "I": "i32", "TOPK": "i32", "NSLOT": "i32", "stride_we": "i64", "stride_wn": "i32", "stride_wse": "i64",
            "a2_ptr": "*fp32"}
KINDS = {"mxfp4": configs.W_E2M1_MX, "nvfp4": configs.W_E2M1_NV, "mxfp8": configs.W_E4M3_MX}


def compile_kernel(which, w_kind, bm, bn, warps, fold, sword, gu, stages=3, wt=0, fflags=True):
    fn = l1._l1_kernel if which == "l1" else l2._l2_kernel
    types = L1_TYPES if which == "l1" else L2_TYPES
    nv = w_kind == configs.W_E2M1_NV
    cx = dict(W_KIND=w_kind, BM=bm, BN=bn, BK=128, HW_CVT=True, ASM=True, FRAG=True, FOLD=fold, SWORD=sword,
              SHARED=False, WT=wt, FFLAGS=fflags)
    if which == "l1":
        cx.update(NV_IN=nv, ACT=0, HAS_CLAMP=True, REQ=configs.REQ_NV4 if nv else configs.REQ_MX8, APPLY_W=not nv,
                  SPLIT_OUT=3 if w_kind == configs.W_E4M3_MX else 2, GU=gu)
    else:
        cx.update(NV_EPI=nv)
    sig = {n: types.get(n, "constexpr") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if types.get(n, "").startswith("*") or n in DIV}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False})


def sass_and_regs(c, tmpdir, name):
    cub = os.path.join(tmpdir, name + ".cubin")
    with open(cub, "wb") as f:
        f.write(c.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    sass = subprocess.run([tool, "--dump-sass", cub], capture_output=True, text=True).stdout
    res = subprocess.run([tool, "-res-usage", cub], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", res)
    return sass, (int(m.group(1)), int(m.group(2))) if m else (None, None)


def main_loop(sass):
    """Instructions of the main K loop: the backward-branch region with the most cp.async
    copies (LDGSTS; the fold decode's redo loop is unpipelined), the largest on a tie."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    best = []
    for a, t in ins:
        m = re.search(r"BRA (?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", t)
        if m and m.group(1) and int(m.group(1), 16) < a:
            body = [x for (b, x) in ins if int(m.group(1), 16) <= b <= a]
            key = (sum(1 for x in body if "LDGSTS" in x), len(body))
            if not best or key > best[0]:
                best = (key, body)
    return best[1] if best else []


VARIANTS = [  # (kernel, row, BM, BN, warps, fold, words, one-dot L1[, stages, tile rows])
    ("l1", "mxfp4", 16, 64, 4, False, False, False), ("l1", "mxfp4", 16, 64, 4, False, False, True),
    ("l1", "mxfp4", 16, 64, 4, True, False, False), ("l1", "mxfp4", 16, 64, 4, True, False, True),
    ("l1", "mxfp4", 16, 64, 4, True, True, True), ("l1", "nvfp4", 16, 64, 4, False, False, False),
    ("l1", "nvfp4", 16, 64, 4, True, False, True), ("l1", "mxfp4", 128, 64, 4, False, False, False),
    ("l1", "mxfp4", 128, 64, 8, False, False, True), ("l2", "mxfp4", 16, 64, 4, False, False, False),
    ("l2", "mxfp4", 16, 64, 4, True, False, False), ("l2", "mxfp4", 16, 64, 4, False, True, False),
    ("l2", "mxfp4", 128, 64, 4, False, False, False), ("l2", "mxfp4", 128, 128, 8, False, False, False),
    # the defaults of the fifth pass, on tiled weights (FRAG_TILES)
    ("l1", "mxfp4", 16, 64, 4, True, False, True, 3, 16), ("l1", "nvfp4", 16, 64, 4, True, False, True, 3, 16),
    ("l1", "mxfp8", 16, 64, 4, False, False, True, 3, 16), ("l2", "mxfp4", 16, 128, 4, True, False, False, 3, 16),
    ("l1", "nvfp4", 64, 64, 4, False, False, True, 3, 16), ("l1", "mxfp4", 128, 64, 4, False, False, True, 3, 16),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90")
    print("| kernel | row | BM | BN | warps | fold | words | one-dot L1 | stages | tile rows | loop instr | top opcodes "
          "| STS/BAR in loop | regs | stack |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for which, row, bm, bn, w, fold, words, gu, *rest in VARIANTS:
            stages, wt = rest if rest else (3, 0)
            name = f"{which}_{row}_bm{bm}_bn{bn}_w{w}_f{int(fold)}_s{int(words)}_g{int(gu)}_st{stages}_t{wt}"
            c = compile_kernel(which, KINDS[row], bm, bn, w, fold, words, gu, stages, wt)
            sass, (regs, stack) = sass_and_regs(c, tmp, name)
            body = main_loop(sass)
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in body)
            sts = sum(1 for x in body if x.startswith("STS"))
            bar = sum(1 for x in body if x.startswith("BAR"))
            top = ", ".join(f"{k} {v}" for k, v in ops.most_common(4))
            print(f"| {which} | {row} | {bm} | {bn} | {w} | {fold} | {words} | {gu if which == 'l1' else '-'} | "
                  f"{stages} | {wt} | {len(body)} | {top} | {sts}/{bar} | {regs} | {stack} |", flush=True)
            if args.out:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                (Path(args.out) / (name + ".sass")).write_text(sass)
                (Path(args.out) / (name + ".ttgir")).write_text(c.asm["ttgir"])


if __name__ == "__main__":
    main()
