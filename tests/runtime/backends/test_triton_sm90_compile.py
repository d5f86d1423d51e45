"""Every triton kernel the forward launches compiles for Hopper (sm_90), on a machine without a GPU.

The interpreter tests never lower a kernel, so what only the GPU compiler rejects (a global that is not a
``tl.constexpr``, inline PTX that ptxas refuses, a register cap below what a tile needs) would pass them.
``tools/sm90_compile.py`` records each launch of the public forward over every row x token count x code
path (``bench/launch_digests.py``'s cases, plus the default forward on tiled weights) and compiles each
distinct specialization with Triton's CUDA backend and ptxas. That the compiled kernels compute the right
bits is the GPU tests' part.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]
TOOL = ROOT / "tools" / "sm90_compile.py"


def _env(extra_path: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _jit_kernels() -> set[str]:
    """Module-qualified names of every ``@triton.jit`` function named ``*_kernel`` in the backend."""
    import ast

    names = set()
    pkg = ROOT / "megamoe_runtime" / "backends" / "triton"
    for f in sorted(pkg.glob("*.py")):
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.FunctionDef) and (node.name.endswith("_kernel") or "_kernel_" in node.name):
                if any("jit" in ast.unparse(d) for d in node.decorator_list):
                    names.add(f"megamoe_runtime.backends.triton.{f.stem}.{node.name}")
    return names


def test_every_launched_kernel_compiles_for_sm90(tmp_path):
    out = tmp_path / "sm90.json"
    r = subprocess.run([sys.executable, str(TOOL), "--json", str(out)], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=1500)
    assert out.exists(), r.stderr[-3000:]
    res = json.loads(out.read_text())
    failed = [(x["kernel"], x["first_case"], x["error"][-400:]) for x in res if not x["ok"]]
    assert not failed, failed
    assert r.returncode == 0, r.stderr[-2000:]
    # every kernel of the backend was reached by some case (a kernel no case launches is not checked)
    assert _jit_kernels() <= {x["kernel"] for x in res}, sorted(_jit_kernels() - {x["kernel"] for x in res})
    # no spills: a kernel that spills to local memory runs far below its measured speed
    spills = [(x["kernel"], x["first_case"], x["local"]) for x in res if x["local"]]
    assert not spills, spills


_PLANTED = '''
import triton
import triton.language as tl

NOT_CONSTEXPR = 3.0  # a plain global: the interpreter reads it, the compiler refuses it


@triton.jit
def global_kernel(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) * NOT_CONSTEXPR)


@triton.jit
def bad_ptx_kernel(x_ptr):
    v = tl.load(x_ptr)
    y = tl.inline_asm_elementwise("prmt.b32.wrong $0, $1, 0, 0;", "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)
    tl.store(x_ptr, y)


@triton.jit
def fine_kernel(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1)
'''


def test_the_compile_check_catches_what_the_interpreter_lets_through(tmp_path):
    """Negative controls: a non-constexpr global and inline PTX that ptxas rejects fail to compile, and
    the well-formed kernel beside them compiles."""
    (tmp_path / "planted_kernels.py").write_text(_PLANTED)
    script = textwrap.dedent(f"""
        import json, runpy
        tool = runpy.run_path({str(TOOL)!r})
        opts = dict(num_warps=4, num_stages=3)
        out = {{name: tool["compile_one"]("planted_kernels", name, {{"x_ptr": "*i32"}}, {{}}, {{}}, opts)
               for name in ("global_kernel", "bad_ptx_kernel", "fine_kernel")}}
        print(json.dumps(out))
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=_env(str(tmp_path)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["fine_kernel"]["ok"], res["fine_kernel"]
    assert not res["global_kernel"]["ok"] and "NOT_CONSTEXPR" in res["global_kernel"]["error"], res["global_kernel"]
    assert not res["bad_ptx_kernel"]["ok"] and "ptxas" in res["bad_ptx_kernel"]["error"].lower(), res["bad_ptx_kernel"]
