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
            into[k] = Launch(k[0], self, dict(signature), dict(constexprs), dict(attrs), dict(options.__dict__), [])
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
    forward on tiled weights (``resolve_w_tile``: what a layer loaded on a GPU runs)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    import launch_digests
    from megamoe_runtime.backends.triton.configs import DEFAULT_W_TILE

    out = launch_digests.cases(cpu=False)
    for row in ("mxfp4", "mxfp8", "nvfp4"):
        for T in (1, 8, 64, 300):
            out.append(dict(row=row, T=T, name="layer_default", wt=DEFAULT_W_TILE))
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
    moe.asm_decode_ok = lambda device: True  # what the GPU's self-check answers
    for c in _cases(only):
        name = f"{c['row']}/{c['T']}/{c['name']}"
        with recording(name, launches):
            launch_digests.run_case(c, "cpu", cpu=False)
    return launches


def _resources(cubin: bytes) -> dict:
    """Registers, spill bytes and static shared memory of a cubin, from ``cuobjdump --dump-resource-usage``."""
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        txt = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    res = {}
    for key, pat in (("regs", r"REG:(\d+)"), ("stack", r"STACK:(\d+)"), ("local", r"LOCAL:(\d+)")):
        m = re.search(pat, txt)
        res[key] = int(m.group(1)) if m else None
    return res


def compile_one(module: str, qualname: str, signature: dict, constexprs: dict, attrs: dict, options: dict) -> dict:
    """Compile one recorded specialization for sm_90: its resources, or the compiler's error."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    t0 = time.time()
    try:
        k = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(*SM90), options=options)
    except Exception as e:  # the compiler's message is the result
        return dict(ok=False, error=f"{type(e).__name__}: {e}"[-2000:], seconds=round(time.time() - t0, 2))
    return dict(ok=True, shared=int(k.metadata.shared), seconds=round(time.time() - t0, 2), **_resources(k.asm["cubin"]))


def compile_all(launches: dict, jobs: int) -> list[dict]:
    """Compile every recorded launch (``jobs`` worker processes); one result per launch."""
    work = []
    for (name, _), ln in launches.items():
        module, qualname = ln.fn.fn.__module__, ln.fn.fn.__qualname__
        work.append((ln, (module, qualname, ln.signature, ln.constexprs, ln.attrs, ln.options)))
    out = []
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as ex:
        futs = [(ln, ex.submit(compile_one, *args)) for ln, args in work]
        for ln, f in futs:
            r = f.result()
            out.append(dict(kernel=ln.kernel, warps=ln.options.get("num_warps"), stages=ln.options.get("num_stages"),
                            maxnreg=ln.options.get("maxnreg"), cases=len(ln.cases), first_case=ln.cases[0], **r))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="substring a case must hold (e.g. a row name)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes")
    ap.add_argument("--json", default="", help="write every launch's result here")
    a = ap.parse_args(argv)
    t0 = time.time()
    launches = record(a.only)
    t1 = time.time()
    res = compile_all(launches, a.jobs)
    bad = [r for r in res if not r["ok"]]
    for r in sorted(res, key=lambda r: (r["kernel"], r.get("regs") or 0)):
        short = r["kernel"].rsplit(".", 2)[-2:]
        cell = (f"regs {r['regs']:>3} local {r['local']:>4} shared {r['shared']:>6}" if r["ok"]
                else "FAILED " + r["error"].splitlines()[-1][:120])
        print(f"{'.'.join(short):40s} w{r['warps']} s{r['stages']} {cell}  ({r['first_case']}, {r['cases']} cases)")
    print(f"{len(res)} specializations recorded in {t1 - t0:.1f}s, compiled in {time.time() - t1:.1f}s; "
          f"{len(bad)} failed", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
