"""Compile the triton backend's kernels for Hopper (sm_90) on a machine without a GPU.

Why: the interpreter (``TRITON_INTERPRET=1``) never lowers a kernel, so a kernel that only the GPU
compiler rejects -- a global that is not a ``tl.constexpr``, inline PTX that ptxas refuses, a layout
the Hopper lowering cannot take, a tile past shared memory -- passes every CPU test. Here the public
forward (``moe.moe_forward``) runs on CPU tensors with Triton's driver replaced by one that names an
sm_90 target: each launch records its specialization (argument types, alignment, constexprs,
warps, stages, options) instead of running, and each distinct one is then compiled to a cubin by
Triton's own CUDA backend and ptxas. The data the kernels would have written stays unwritten: the
forward's host code reads no device value (it is CUDA-graph capturable), so the launches it makes are
the GPU's.

    python tools/sm90_compile.py                 # every case, a table of registers / spills / shared
    python tools/sm90_compile.py --only mxfp4 --json out.json --jobs 2
    python tools/sm90_compile.py --only layer_default --sass _l1_kernel   # + the K loop's instruction mix
    python tools/sm90_compile.py --only layer_default --ptxas   # + ptxas' notes: wgmma serialized?
    python tools/sm90_compile.py --digest before.json            # each specialization's SASS digest
    python tools/sm90_compile.py --compare before.json           # the same SASS as before, all of them?

Spills are the cubin's stack frame (cuobjdump's STACK): ptxas puts spilled registers there, and equal to its
own "bytes spill stores" for every specialization here; cuobjdump's LOCAL stays 0 for them.

``--sass``: for the specializations whose kernel name holds the substring, the cubin's SASS is read
back (cuobjdump) and the main K loop -- the backward branch whose body holds the most asynchronous
copies and MMAs -- is counted by instruction class, per warp and iteration. With the weight bytes one
iteration consumes (from the tile's constexprs, ``weight_bytes_per_step``) that gives warp instructions
per weight byte, and the bandwidth at which the SM schedulers' issue slots would be full
(``issue_bound_gbs``). Why: at decode sizes the quantized GEMMs are bound by instruction issue, not
by memory (docs/bench-log/kernels.md), so instructions per byte is the figure to drive down.

``--ptxas``: ptxas is run again on each kernel's PTX with ``-v`` for what Triton does not show: its
"wgmma.mma_async instructions are serialized" notes (C7511 / C7512 / C7514 / C7515). A serialized kernel
computes the same bits but waits for each wgmma before going on (docs/KERNELS.md "Compiling for Hopper
without a GPU").

``--digest FILE`` / ``--compare FILE``: a sha256 of each specialization's SASS (cuobjdump, with the lines that
name the kernel left out), keyed by the kernel and its specialization key, written to FILE or compared with
the digests a FILE of an earlier run holds (exit 1 where one differs, is missing or is new). Why: a change
meant to leave the machine code alone (a refactor, a helper taken out of a kernel) is proved to by the SASS
of every launch the forward makes, on a machine without a GPU. The SASS text holds each instruction's
encoding, scheduling bits included, and no line-number information, which moved code changes in the cubin.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

# launches are recorded, not interpreted: the kernels must be JITFunctions
if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
    sys.exit("tools/sm90_compile.py: unset TRITON_INTERPRET (it compiles, it does not interpret)")

import torch  # noqa: E402

#: the Hopper target: compute capability 9.0, warp size 32
SM90 = ("cuda", 90, 32)


@dataclass
class Launch:
    """One distinct kernel specialization the forward asked for."""

    kernel: str
    key: str
    fn: Any = field(repr=False)
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    cases: list


class _Sm90Driver:
    """Stands in for Triton's CUDA driver: a device 0 with an sm_90 target and no launches."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget(*SM90)

    def is_active(self) -> bool:
        return True

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int = 0) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda


@contextlib.contextmanager
def recording(case: str, into: dict) -> Iterator[None]:
    """Within: every ``kernel[grid](...)`` records its specialization into ``into`` and launches nothing."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    def _do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        k = (self.fn.__module__ + "." + self.fn.__qualname__, repr(key))
        if k not in into:
            into[k] = Launch(k[0], k[1], self, dict(signature), dict(constexprs), dict(attrs), dict(options.__dict__),
                             [])
        into[k].cases.append(case)
        return None

    saved = JITFunction._do_compile
    # for the rest of the process: a machine without a GPU has no driver to go back to
    driver.set_active(_Sm90Driver())
    JITFunction._do_compile = _do_compile
    try:
        yield
    finally:
        JITFunction._do_compile = saved


def _cases(only: str) -> list[dict]:
    """The launch-digest cases (every row x token count x code path, GPU shapes), plus each row's default
    forward on tiled weights (``resolve_w_tile``: what a layer loaded on a GPU runs) and its decode tiles
    with two K blocks per loop trip (``KernelConfig.k_unroll``)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    import launch_digests
    from megamoe_runtime.backends.triton.configs import DEFAULT_W_TILE

    out = launch_digests.cases(cpu=False)
    for row in ("mxfp4", "mxfp8", "nvfp4"):
        for T in (1, 8, 64, 300):
            out.append(dict(row=row, T=T, name="layer_default", wt=DEFAULT_W_TILE))
        # two K blocks per loop trip (off by default, so no default case reaches it)
        out.append(dict(row=row, T=8, name="k_unroll", wt=DEFAULT_W_TILE,
                        cfg=dict(k_unroll=2, l1_gu=True, block_m=16, l1_bn=64, l2_bn=128)))
    return [c for c in out if only in json.dumps(c)]


def record(only: str = "") -> dict:
    """Run every case's forward on CPU tensors under ``recording``: {key: Launch}."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    import launch_digests
    from megamoe_runtime.backends.triton import decode_check, moe

    launches: dict = {}
    with recording("decode_check", launches):
        decode_check.asm_decode_check(torch.device("cpu"))
    with recording("helpers", launches):  # kernels the forward's default paths do not reach
        from megamoe_runtime.backends.triton import mma8, staging

        x = torch.zeros(4, 7168, dtype=torch.bfloat16)
        staging.bf16_passthrough(x)
        staging.quantize_nvfp4_per_token(x, impl="chunk", dequant="frag")
        staging.division_mismatches(staging.NV_DIV_STEPS, device="cpu")
        mma8.e2m1_e4m3_table(torch.device("cpu"), True)
        from megamoe_runtime.backends.triton import bit_order  # the tiling pass's bit move (a load, not a forward)

        words = torch.zeros(4096, dtype=torch.int64)
        for to_tiled in (True, False):
            bit_order.copy_e2m1_bits(words, torch.empty_like(words), to_tiled)
    moe.asm_decode_ok = lambda device: True  # what the GPU's self-check answers
    for c in _cases(only):
        name = f"{c['row']}/{c['T']}/{c['name']}"
        with recording(name, launches):
            launch_digests.run_case(c, "cpu", cpu=False)
    return launches


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """``cuobjdump FLAG`` of a cubin (the one in Triton's package), as text."""
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def _resources(cubin: bytes) -> dict:
    """Registers, spill bytes and static shared memory of a cubin, from ``cuobjdump --dump-resource-usage``."""
    import re

    txt = _cuobjdump(cubin, "--dump-resource-usage")
    res = {}
    for key, pat in (("regs", r"REG:(\d+)"), ("stack", r"STACK:(\d+)"), ("local", r"LOCAL:(\d+)")):
        m = re.search(pat, txt)
        res[key] = int(m.group(1)) if m else None
    return res


#: instruction classes of ``loop_mix``, by SASS opcode (the mnemonic before its first dot)
SASS_CLASSES = {
    "mma": {"HGMMA", "WGMMA", "HMMA", "IMMA", "QGMMA"},
    "global/async load": {"LDG", "LDGSTS", "UTMALDG", "LDGDEPBAR"},
    "shared load/store": {"LDS", "LDSM", "STS", "STSM"},
    "other memory": {"STG", "LD", "ST", "LDL", "STL", "RED", "ATOM", "ATOMG", "LDC", "ULDC"},
    "sync": {"BAR", "DEPBAR", "WARPSYNC", "WARPGROUP", "ARRIVES", "SYNCS", "MEMBAR", "ERRBAR", "CCTL"},
    "branch": {"BRA", "BSSY", "BSYNC", "EXIT", "CALL", "RET", "JMP", "BREAK", "YIELD"},
    "bit ops": {"PRMT", "LOP3", "LOP", "SHF", "SHL", "SHR", "BFE", "BFI", "BMSK", "SGXT", "POPC", "FLO", "BREV"},
    "conversion": {"F2F", "I2F", "F2I", "F2FP", "I2I", "I2IP", "FRND"},
    "half2 math": {"HMUL2", "HFMA2", "HADD2", "HMNMX2", "HSETP2", "HSET2"},
    "int alu": {"IMAD", "IADD3", "IADD", "LEA", "ISETP", "IMNMX", "SEL", "MOV", "IABS", "ISCADD", "PLOP3", "P2R",
                "R2P", "VIADD", "VIMNMX", "ICMP", "IDP", "IMUL"},
    "fp alu": {"FADD", "FMUL", "FFMA", "FSETP", "FMNMX", "FSEL", "MUFU", "FCHK", "FSET", "DADD", "DMUL", "DFMA"},
}
#: SM schedulers of the H200 / H100 SXM (132 SMs x 4) and the SM clock the issue bound assumes: the H200's
#: maximum SM clock, 1980 MHz (BENCHMARKS.md's H200 runs, clocks not locked: an issue-bound kernel runs at
#: most that fast, less where the card meets its power limit)
SCHEDULERS = 132 * 4
CLOCK_HZ = 1.98e9
#: copy bandwidth of the H200 the decode-size goals are stated against (BENCHMARKS.md, read + write)
COPY_GBS = 4274.0


def sass_class(instr: str) -> str:
    """The ``SASS_CLASSES`` class of one SASS instruction (predicate guard and modifiers dropped); uniform-
    datapath instructions (``U...`` that are not in a class themselves) are "uniform", the rest "other"."""
    op = instr.split()[1] if instr.startswith("@") else instr.split()[0]
    op = op.split(".")[0]
    for name, ops in SASS_CLASSES.items():
        if op in ops:
            return name
    return "uniform" if op.startswith("U") else "other"


def sass_instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction) of each SASS line of ``cuobjdump --dump-sass`` output."""
    import re

    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def sass_digest(sass: str) -> str:
    """sha256 of ``cuobjdump --dump-sass`` output without the lines that name the function (``Function :``)
    and without blank lines: the instructions, their encodings (scheduling control bits included) and the
    header flags. Two kernels of different names but the same machine code have the same digest."""
    import hashlib

    keep = [ln.strip() for ln in sass.splitlines() if ln.strip() and not ln.strip().startswith("Function :")]
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()


def ptx_code(ptx: str) -> str:
    """The PTX's instructions without what only the debugger reads: the DWARF sections, ``.file`` / ``.loc``
    lines, and the ``$L__tmpN:`` labels that bound an inlined helper's instructions for the debugger (no
    branch goes to one). Why: ptxas schedules around those labels, so code moved into a ``@triton.jit``
    helper can give other SASS from the same instructions; equal ``ptx_code`` says that is all that changed
    (docs/KERNELS.md "Compiling for Hopper without a GPU")."""
    import re

    code = re.split(r"^\s*\.section\s+\.debug", ptx, maxsplit=1, flags=re.M)[0]
    return "\n".join(ln.rstrip() for ln in code.splitlines()
                     if not re.match(r"\s*(\.loc|\.file)\b", ln) and not re.match(r"\$L__tmp\d+:\s*$", ln))


def spec_id(kernel: str, key: str) -> str:
    """The name of one specialization in a ``--digest`` file: the kernel and a hash of its JIT key (argument
    types, alignment, constexprs, options), the same in every run that launches it."""
    import hashlib

    return f"{kernel}:{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def compare_digests(before: dict, after: dict) -> dict:
    """``--compare``: the specialization ids of two ``--digest`` maps ({id: {"sass": sha, "ptx": sha, ...}}) sorted
    into ``same`` and ``differ`` (both hold the id, the SASS digests equal or not), ``only_before`` and
    ``only_after``; ``same_ptx``: those of ``differ`` whose PTX instructions are the same (``ptx_code``)."""
    both = sorted(set(before) & set(after))
    differ = [k for k in both if before[k]["sass"] != after[k]["sass"]]
    return dict(same=[k for k in both if before[k]["sass"] == after[k]["sass"]], differ=differ,
                same_ptx=[k for k in differ if before[k].get("ptx") and before[k].get("ptx") == after[k].get("ptx")],
                only_before=sorted(set(before) - set(after)), only_after=sorted(set(after) - set(before)))


def main_loop(ins: list[tuple[int, str]]) -> list[str]:
    """The instructions of the main K loop: of the regions a backward branch closes (its target up to the
    branch), the one with the most asynchronous loads and MMAs (a fold decode's never-taken redo loop is
    unpipelined, an epilogue loop has neither), the longest on a tie; [] for a kernel without a loop."""
    import re

    best: tuple = ((-1, -1), [])
    for addr, text in ins:
        m = re.search(r"\bBRA(?:\.\w+)*\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", text)
        if m and m.group(1) and int(m.group(1), 16) < addr:  # (a branch to itself is the trap after EXIT)
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            heavy = sum(sass_class(t) == "mma" or "LDGSTS" in t or "UTMALDG" in t for t in body)
            if (heavy, len(body)) > best[0]:
                best = ((heavy, len(body)), body)
    return best[1]


def named(arg_names: list, constexprs: dict) -> dict:
    """``constexprs`` as the JIT records them (keyed by argument index paths) keyed by argument name."""
    return {(arg_names[k[0]] if isinstance(k, tuple) and len(k) == 1 else k): v for k, v in constexprs.items()}


def weight_bytes_per_step(qualname: str, constexprs: dict) -> int | None:
    """Weight and weight-scale bytes one iteration of a frag L1 / L2 kernel's K loop reads (the whole CTA):
    ``KU x rows x BK`` weights and their scales, rows = 2 BN for the L1 (gate and up, one dot or two), BN for
    the L2, KU the K blocks per loop trip (``KernelConfig.k_unroll``); ``constexprs`` by name (``named``).
    None for any other kernel."""
    cx = constexprs
    if not ({"W_KIND", "BN", "BK"} <= set(cx) and qualname.endswith(("_l1_kernel", "_l2_kernel"))):
        return None
    rows = (2 if qualname.endswith("_l1_kernel") else 1) * cx["BN"]
    bk = cx["BK"]
    per_row = {0: bk // 2 + bk // 32, 1: bk + bk // 32, 2: bk // 2 + bk // 16, 3: 2 * bk}.get(cx["W_KIND"])
    return None if per_row is None else rows * per_row * cx.get("KU", 1)


def loop_mix(cubin: bytes, warps: int, weight_bytes: int | None) -> dict:
    """The main K loop's instruction mix (per warp and iteration, by ``SASS_CLASSES`` class and by opcode),
    and with ``weight_bytes`` per iteration: warp instructions per weight byte for the CTA (``warps`` warps
    each run the loop) and the bandwidth at which every issue slot of the GPU would be busy."""
    import collections

    body = main_loop(sass_instructions(_cuobjdump(cubin, "--dump-sass")))
    ops = collections.Counter((t.split()[1] if t.startswith("@") else t.split()[0]).split(".")[0] for t in body)
    classes = collections.Counter(sass_class(t) for t in body)
    out = dict(loop_instr=len(body), classes=dict(classes.most_common()), opcodes=dict(ops.most_common()),
               predicated=sum(t.startswith("@") for t in body), weight_bytes=weight_bytes)
    if body and weight_bytes:
        per_byte = len(body) * warps / weight_bytes
        out.update(instr_per_byte=round(per_byte, 4),
                   issue_bound_gbs=round(SCHEDULERS * CLOCK_HZ / per_byte / 1e9, 1))
    return out


def compile_kernel(fn: Any, signature: dict, constexprs: dict, attrs: dict, options: dict):
    """One specialization of a ``@triton.jit`` or ``@gluon.jit`` function compiled for sm_90 (Triton's CUDA
    backend and ptxas): the CompiledKernel, its ``asm`` holding ttgir, ptx and cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    return triton.compile(source(fn, signature, constexprs, attrs), target=GPUTarget(*SM90), options=options)


def ptxas_report(ptx: str) -> dict:
    """ptxas rerun on the PTX with Triton's flags (sm_90a; the PTX carries any ``.maxnreg``): registers, stack
    frame and spill bytes as ptxas counts them, and its warnings and C75xx notes, which Triton does not show
    (C7511 / C7512 / C7514 / C7515: "wgmma.mma_async instructions are serialized", each with its reason; C7517: a
    wgmma wait it injected). Why rerun: a serialized wgmma waits for every MMA before the next instruction,
    so the kernel compiles and computes the same bits but loses the overlap its PTX asked for."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-lineinfo", "--fmad=false", "-v", "--gpu-name=sm_90a", src, "-o",
                            os.path.join(d, "k.cubin")], capture_output=True, text=True)
    log = r.stdout + r.stderr

    def num(pat):
        m = re.search(pat, log)
        return int(m.group(1)) if m else None

    notes = [x.strip() for x in log.splitlines() if "warning" in x.lower() or re.search(r"\(C7\d\d\d\)", x)]
    return dict(regs=num(r"Used (\d+) registers"), stack_frame=num(r"(\d+) bytes stack frame"),
                spill_stores=num(r"(\d+) bytes spill stores"), spill_loads=num(r"(\d+) bytes spill loads"),
                notes=notes, serialized=sorted({m for x in notes for m in re.findall(r"\((C75\d\d)\)", x)
                                                if "serialized" in x}))


def compile_one(module: str, qualname: str, signature: dict, constexprs: dict, attrs: dict, options: dict,
                sass: bool = False, ptxas: bool = False, digest: bool = False) -> dict:
    """Compile one recorded specialization for sm_90: its resources (``stack``: the stack frame, where ptxas
    puts spilled registers; these kernels use it for nothing else), with ``sass`` the K loop's instruction
    mix (``loop_mix``), with ``ptxas`` ptxas' own report (``ptxas_report``: its serialization notes), with
    ``digest`` the SASS digest (``sass_digest``), the cubin's sha256 and that of its PTX instructions
    (``ptx_code``), or the compiler's error."""
    import importlib

    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    t0 = time.time()
    try:
        k = compile_kernel(fn, signature, constexprs, attrs, options)
    except Exception as e:  # the compiler's message is the result
        return dict(ok=False, error=f"{type(e).__name__}: {e}"[-2000:], seconds=round(time.time() - t0, 2))
    res = dict(ok=True, shared=int(k.metadata.shared), seconds=round(time.time() - t0, 2), **_resources(k.asm["cubin"]))
    if sass:
        res["loop"] = loop_mix(k.asm["cubin"], options.get("num_warps", 4), weight_bytes_per_step(qualname, named(fn.arg_names, constexprs)))
    if ptxas:
        res["ptxas"] = ptxas_report(k.asm["ptx"])
    if digest:
        import hashlib

        res["sass_sha"] = sass_digest(_cuobjdump(k.asm["cubin"], "--dump-sass"))
        res["cubin_sha"] = hashlib.sha256(k.asm["cubin"]).hexdigest()
        res["ptx_sha"] = hashlib.sha256(ptx_code(k.asm["ptx"]).encode()).hexdigest()
    return res


def _tile(ln: Launch) -> dict:
    """The tile constexprs a loop report names (those the kernel has)."""
    cx = named(ln.fn.arg_names, ln.constexprs)
    keep = ("W_KIND", "BM", "BN", "BK", "GU", "FOLD", "SWORD", "WT", "SAHEAD", "KSPLIT", "KU")
    return {k: cx[k] for k in keep if k in cx}


def compile_all(launches: dict, jobs: int, sass: str = "", ptxas: bool = False, digest: bool = False) -> list[dict]:
    """Compile every recorded launch (``jobs`` worker processes); one result per launch. ``sass``: a
    substring of the kernel names whose K loops are counted (``loop_mix``); ``ptxas``: rerun ptxas on each
    for its notes (``ptxas_report``; about a second per specialization); ``digest``: each one's SASS digest."""
    work = []
    for (name, _), ln in launches.items():
        module, qualname = ln.fn.fn.__module__, ln.fn.fn.__qualname__
        work.append((ln, (module, qualname, ln.signature, ln.constexprs, ln.attrs, ln.options,
                          bool(sass) and sass in ln.kernel, ptxas, digest)))
    out = []
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as ex:
        futs = [(ln, ex.submit(compile_one, *args)) for ln, args in work]
        for ln, f in futs:
            r = f.result()
            out.append(dict(kernel=ln.kernel, spec=spec_id(ln.kernel, ln.key), warps=ln.options.get("num_warps"),
                            stages=ln.options.get("num_stages"),
                            maxnreg=ln.options.get("maxnreg"), cases=len(ln.cases), first_case=ln.cases[0],
                            all_cases=ln.cases, tile=_tile(ln), **r))
    return out


def _loop_line(r: dict) -> str:
    """One ``--sass`` report line: the tile, instructions per iteration by class, per weight byte, the bound."""
    lp = r["loop"]
    tile = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in r["tile"].items())
    mix = ", ".join(f"{k} {v}" for k, v in lp["classes"].items())
    head = f"{r['kernel'].rsplit('.', 1)[-1]} w{r['warps']} s{r['stages']} [{tile}] ({', '.join(sorted(set(r['all_cases'])))})"
    if "instr_per_byte" not in lp:
        return f"{head}\n    loop {lp['loop_instr']} instr/warp/iter: {mix}"
    return (f"{head}\n    loop {lp['loop_instr']} instr/warp/iter x {r['warps']} warps / {lp['weight_bytes']} weight B "
            f"= {lp['instr_per_byte']:.3f} instr/B -> issue bound {lp['issue_bound_gbs']:.0f} GB/s "
            f"({100 * lp['issue_bound_gbs'] / COPY_GBS:.0f}% of copy)\n    {mix}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="substring a case must hold (e.g. a row name)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes")
    ap.add_argument("--json", default="", help="write every launch's result here")
    ap.add_argument("--sass", default="", metavar="KERNEL_SUBSTRING",
                    help="count the K loop's SASS instructions of the kernels whose name holds this (e.g. _l1_kernel)")
    ap.add_argument("--ptxas", action="store_true",
                    help="rerun ptxas on each kernel for the notes Triton hides (wgmma serialization, C75xx)")
    ap.add_argument("--digest", default="", metavar="FILE", help="write each specialization's SASS digest here")
    ap.add_argument("--compare", default="", metavar="FILE",
                    help="compare each specialization's SASS digest with a --digest FILE of an earlier run")
    a = ap.parse_args(argv)
    t0 = time.time()
    launches = record(a.only)
    t1 = time.time()
    res = compile_all(launches, a.jobs, a.sass, a.ptxas, bool(a.digest or a.compare))
    bad = [r for r in res if not r["ok"]]
    for r in sorted(res, key=lambda r: (r["kernel"], r.get("regs") or 0)):
        short = r["kernel"].rsplit(".", 2)[-2:]
        cell = (f"regs {r['regs']:>3} spill {r['stack']:>4} shared {r['shared']:>6}" if r["ok"]
                else "FAILED " + r["error"].splitlines()[-1][:120])
        if r.get("ptxas", {}).get("serialized"):
            cell += " wgmma serialized " + ",".join(r["ptxas"]["serialized"])
        print(f"{'.'.join(short):40s} w{r['warps']} s{r['stages']} {cell}  ({r['first_case']}, {r['cases']} cases)")
    for r in res:
        if "loop" in r:
            print(_loop_line(r))
    print(f"{len(res)} specializations recorded in {t1 - t0:.1f}s, compiled in {time.time() - t1:.1f}s; "
          f"{len(bad)} failed", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    changed = a.compare and _report_compare(a.compare, res)
    if a.digest:
        with open(a.digest, "w") as f:
            json.dump(digests(res), f, indent=1, sort_keys=True)
    return 1 if bad or changed else 0


def digests(res: list[dict]) -> dict:
    """The ``--digest`` map of compiled results: {spec id: {"sass", "ptx", "cubin", "first_case"}} (failed ones
    left out)."""
    return {r["spec"]: dict(sass=r["sass_sha"], ptx=r["ptx_sha"], cubin=r["cubin_sha"], first_case=r["first_case"])
            for r in res if r["ok"]}


def _report_compare(path: str, res: list[dict]) -> bool:
    """Print ``compare_digests`` of the ``--digest`` file at ``path`` against ``res``; whether anything differs."""
    with open(path) as f:
        before = json.load(f)
    after = digests(res)
    c = compare_digests(before, after)
    cubins = sum(before[k]["cubin"] == after[k]["cubin"] for k in c["same"])
    for what in ("differ", "only_before", "only_after"):
        for k in c[what]:
            case = (after.get(k) or before[k])["first_case"]
            note = " same PTX instructions" if k in c["same_ptx"] else ""
            print(f"{what:12s} {k} ({case}){note}")
    print(f"SASS compared with {path}: {len(c['same'])} identical ({cubins} of them with identical cubins), "
          f"{len(c['differ'])} differ ({len(c['same_ptx'])} of them from the same PTX instructions), "
          f"{len(c['only_before'])} only before, {len(c['only_after'])} only now")
    return bool(c["differ"] or c["only_before"] or c["only_after"])


if __name__ == "__main__":
    sys.exit(main())
