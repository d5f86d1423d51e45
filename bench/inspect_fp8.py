#!/usr/bin/env python
"""Compile the FP8 path's kernels for sm_90 without a GPU and report what the compiler made.

    python bench/inspect_fp8.py [OUT_DIR]     # needs triton (3.6) importable; no GPU needed

Per kernel variant: the wgmma instructions in the PTX, QGMMA / HGMMA / HMMA counts and
local-memory traffic (LDL/STL = spills) in the SASS (triton's bundled cuobjdump), async
copies (software pipelining) and layout conversions in the TTGIR, shared memory bytes.
Pointer and size arguments get the divisibility-by-16 hint that the JIT gives them at run
time, without which nothing is pipelined. With OUT_DIR the TTGIR and SASS are written there.
"""
import sys, re, subprocess, os
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megamoe_runtime.backends.triton import mma8

def sig(names, types):
    return dict(zip(names, types))

def compile_l1(BM, BN, GPI, W_KIND, warps, stages):
    fn = mma8._l1_fp8_kernel
    names = fn.arg_names
    types = {"x_ptr":"*u8","xsf_ptr":"*u8","w_ptr":"*u8","wsb_ptr":"*u8","pair_ptr":"*i32","blk_ptr":"*i32","nblk_ptr":"*i32",
             "tw_ptr":"*fp32","act_ptr":"*u8","asf_ptr":"*u8","T":"i32","H":"i32","I":"i32","TOPK":"i32","stride_we":"i64",
             "stride_wn":"i32","stride_wse":"i64","rsf":"fp32","clamp_c":"fp32","act_alpha":"fp32","act_beta":"fp32","situ_b":"fp32","situ_bl":"fp32"}
    cx = dict(W_KIND=W_KIND, ACT=0, HAS_CLAMP=True, APPLY_W=True, SHARED=False, BM=BM, BN=BN, GPI=GPI, ASM=True)
    s = {n: types.get(n, "constexpr") for n in names}
    src = ASTSource(fn=fn, signature=s, constexprs=cx, attrs=attrs_for(fn, types))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False})

def compile_l2(BM, BN, GPI, W_KIND, warps, stages):
    fn = mma8._l2_fp8_kernel
    types = {"act_ptr":"*u8","asf_ptr":"*u8","w_ptr":"*u8","wsb_ptr":"*u8","pair_ptr":"*i32","blk_ptr":"*i32","nblk_ptr":"*i32",
             "slot_ptr":"*bf16","T":"i32","H":"i32","I":"i32","TOPK":"i32","NSLOT":"i32","stride_we":"i64","stride_wn":"i32","stride_wse":"i64"}
    cx = dict(W_KIND=W_KIND, SHARED=False, BM=BM, BN=BN, GPI=GPI, ASM=True)
    s = {n: types.get(n, "constexpr") for n in fn.arg_names}
    return triton.compile(ASTSource(fn=fn, signature=s, constexprs=cx, attrs=attrs_for(fn, types)), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False})

DIV = {"H", "I", "stride_we", "stride_wn", "stride_wse"}
def attrs_for(fn, types):
    return {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
            if (types.get(n, "").startswith("*") or n in DIV)}

def report(name, c, out=None):
    ptx = c.asm["ptx"]; ttgir = c.asm["ttgir"]
    wg = sorted(set(re.findall(r"wgmma.mma_async[^ ]*", ptx)))
    nwg = len(re.findall(r"wgmma.mma_async", ptx))
    asyncc = len(re.findall(r"async_copy_global_to_local|ttng.async_tma_copy", ttgir))
    cvt = len(re.findall(r"ttg.convert_layout", ttgir))
    sass = ""
    cub = c.asm["cubin"]
    tmp = f"/tmp/aot/{name}.cubin"; open(tmp, "wb").write(cub)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    try:
        sass = subprocess.run([tool, "--dump-sass", tmp], capture_output=True, text=True).stdout
    except Exception as e:
        sass = str(e)
    q = len(re.findall(r"QGMMA", sass)); h = len(re.findall(r"HGMMA", sass)); hm = len(re.findall(r"\bHMMA", sass))
    ldl = len(re.findall(r"\bLDL|\bSTL", sass))
    print(f"{name}: wgmma {nwg} {wg} QGMMA={q} HGMMA={h} HMMA={hm} LDL/STL={ldl} async_copies={asyncc} convert_layout={cvt} "
          f"shared={c.metadata.shared} regs={getattr(c,'n_regs','?')} spills={getattr(c,'n_spills','?')}")
    if out:
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, name + ".ttgir"), "w").write(ttgir)
        open(os.path.join(out, name + ".sass"), "w").write(sass)

if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else None
    for (BM, BN, GPI, W, w, st) in [(16, 64, 2, 0, 4, 4), (16, 64, 2, 1, 4, 4), (128, 64, 2, 0, 8, 3)]:
        report(f"l1_bm{BM}_bn{BN}_g{GPI}_w{W}", compile_l1(BM, BN, GPI, W, w, st), out)
    for (BM, BN, GPI, W, w, st) in [(16, 128, 2, 0, 4, 4), (16, 128, 2, 1, 4, 4), (128, 128, 2, 0, 8, 3)]:
        report(f"l2_bm{BM}_bn{BN}_g{GPI}_w{W}", compile_l2(BM, BN, GPI, W, w, st), out)
