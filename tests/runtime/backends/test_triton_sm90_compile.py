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
    # no spills at decode sizes: there the kernels are bound by instruction issue, and a spill adds local-memory
    # traffic to every K step. Spills live in the stack frame (cuobjdump's STACK; its LOCAL stays 0 for them).
    # Left out: register caps a case sets on purpose (``maxnreg``), and the 300-token prefill tiles, whose
    # spills docs/KERNELS.md lists (those tiles were chosen by their measured speed, spills included).
    decode = [x for x in res if any(_tokens(c) <= 64 for c in x["all_cases"]) and not x["maxnreg"]]
    assert len(decode) > 100, len(decode)
    spills = [(x["kernel"], x["first_case"], x["stack"]) for x in decode if x["stack"]]
    assert not spills, spills


def _tokens(case: str) -> int:
    """The token count of a case name ``row/tokens/path``; 0 for the cases named by what they run
    (``decode_check``, ``helpers``: small launches)."""
    parts = case.split("/")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def test_decode_kernels_keep_their_wgmma_pipelined(tmp_path):
    """ptxas, not Triton, decides whether a kernel's wgmmas overlap: where it finds registers it cannot keep
    apart it serializes them (waits for each MMA before the next instruction) and says so only in its own
    notes, which Triton hides. The default decode kernels of the fp4 rows must not be serialized. The
    mxfp8 decode L1 (32-row tile, 64 registers) is, today (docs/KERNELS.md): it is the detector's positive
    control here, and the day it is fixed this test says so."""
    out = tmp_path / "ptxas.json"
    r = subprocess.run([sys.executable, str(TOOL), "--only", "layer_default", "--ptxas", "--json", str(out)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1500)
    assert out.exists() and r.returncode == 0, r.stderr[-3000:]
    res = [x for x in json.loads(out.read_text()) if x["kernel"].rsplit(".", 1)[-1] in ("_l1_kernel", "_l2_kernel")]
    dec = [x for x in res if any(_tokens(c) <= 64 for c in x["all_cases"])]
    assert len(dec) >= 12, len(dec)
    serialized = {(x["first_case"].split("/")[0], x["kernel"].rsplit(".", 1)[-1]): x["ptxas"]["serialized"]
                  for x in dec if x["ptxas"]["serialized"]}
    assert ("mxfp8", "_l1_kernel") in serialized, ("the mxfp8 decode L1 is no longer serialized: update "
                                                   "docs/KERNELS.md and this test", serialized)
    fp4 = {k: v for k, v in serialized.items() if k[0] in ("mxfp4", "nvfp4")}
    assert not fp4, fp4


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


_LOOPED = '''
import triton
import triton.language as tl


@triton.jit
def dot_loop_kernel(a_ptr, b_ptr, c_ptr, K, BK: tl.constexpr):
    """[64, K] @ [K, 16]: per K step one 64x16xBK wgmma product, BK / 16 HGMMA instructions."""
    m = tl.arange(0, 64)
    n = tl.arange(0, 16)
    k = tl.arange(0, BK)
    acc = tl.zeros((64, 16), tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptr + m[:, None] * K + k0 + k[None, :])
        b = tl.load(b_ptr + (k0 + k[:, None]) * 16 + n[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + m[:, None] * 16 + n[None, :], acc)


@triton.jit
def no_loop_kernel(a_ptr, b_ptr, c_ptr, K, BK: tl.constexpr):
    m = tl.arange(0, 64)
    n = tl.arange(0, 16)
    k = tl.arange(0, BK)
    acc = tl.dot(tl.load(a_ptr + m[:, None] * K + k[None, :]), tl.load(b_ptr + k[:, None] * 16 + n[None, :]))
    tl.store(c_ptr + m[:, None] * 16 + n[None, :], acc)


@triton.jit
def add_loop_kernel(a_ptr, b_ptr, c_ptr, K, BK: tl.constexpr):
    k = tl.arange(0, BK)
    acc = tl.zeros((BK,), tl.float32)
    for k0 in range(0, K, BK):
        acc += tl.load(a_ptr + k0 + k).to(tl.float32)
    tl.store(c_ptr + k, acc)
'''


def test_sass_loop_mix_counts_the_k_loop(tmp_path):
    """``--sass``'s loop finder and counts on planted kernels: the K loop of a 64x16xBK dot holds BK / 16
    HGMMAs and its cp.async copies, and nothing else of the kernel; negative controls: a kernel without
    a loop reports none, a loop without a dot has no MMA in it. The weight bytes per step follow the
    tile (2 BN kernel rows for the L1, BN for the L2, E2M1 half a byte per weight plus its scales)."""
    (tmp_path / "looped_kernels.py").write_text(_LOOPED)
    script = textwrap.dedent(f"""
        import json, runpy
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        import looped_kernels as lk
        tool = runpy.run_path({str(TOOL)!r})
        sig = {{"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "K": "i32", "BK": "constexpr"}}
        out = {{}}
        for name in ("dot_loop_kernel", "no_loop_kernel", "add_loop_kernel"):
            k = triton.compile(ASTSource(getattr(lk, name), sig, {{(4,): 64}}, {{(i,): [["tt.divisibility", 16]]
                               for i in range(4)}}), target=GPUTarget(*tool["SM90"]), options=dict(num_warps=4))
            out[name] = tool["loop_mix"](k.asm["cubin"], 4, 64 * 64 * 2)
        cx = dict(W_KIND=0, BN=64, BK=128)
        out["bytes"] = [tool["weight_bytes_per_step"]("m._l1_kernel", cx), tool["weight_bytes_per_step"]("m._l2_kernel", cx),
                        tool["weight_bytes_per_step"]("m._l2_kernel", dict(cx, W_KIND=1)),
                        tool["weight_bytes_per_step"]("m._combine_kernel", cx),
                        tool["weight_bytes_per_step"]("m._l1_kernel", dict(cx, KU=2))]
        out["classes"] = [tool["sass_class"](s) for s in ("@!P3 BRA 0x1100", "HGMMA.64x16x16.F32.BF16 R32, R96, gdesc[UR16], R32",
                          "LOP3.LUT R40, R80, 0xf000f, RZ, 0xc0, !PT", "LDGSTS.E.BYPASS.128 [R17], desc[UR16][R18.64]",
                          "UIADD3 UR5, UR5, 0x80, URZ", "HMUL2.BF16_V2 R96, R41, R90")]
        print(json.dumps(out))
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=_env(str(tmp_path)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    loop = res["dot_loop_kernel"]
    assert loop["loop_instr"] > 0 and loop["opcodes"].get("HGMMA") == 64 // 16, loop
    assert loop["classes"]["global/async load"] >= 1 and loop["classes"]["branch"] >= 1, loop
    assert loop["instr_per_byte"] == round(loop["loop_instr"] * 4 / (64 * 64 * 2), 4), loop
    assert res["no_loop_kernel"]["loop_instr"] == 0 and "instr_per_byte" not in res["no_loop_kernel"]
    assert res["add_loop_kernel"]["loop_instr"] > 0 and "mma" not in res["add_loop_kernel"]["classes"]
    assert res["bytes"] == [128 * (64 + 4), 64 * (64 + 4), 64 * (128 + 4), None, 2 * 128 * (64 + 4)]
    assert res["classes"] == ["branch", "mma", "bit ops", "global/async load", "uniform", "half2 math"]


_DIGESTED = '''
import triton
import triton.language as tl


@triton.jit
def plain_kernel(x_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < N) + 1.0, mask=i < N)


@triton.jit
def renamed_kernel(x_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < N) + 1.0, mask=i < N)


@triton.jit
def other_kernel(x_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < N) + 2.0, mask=i < N)
'''


def test_sass_digest_names_the_machine_code_not_the_kernel(tmp_path):
    """``--digest`` / ``--compare``: two kernels of the same body and different names have the same SASS digest
    (the ``Function :`` line is left out) while their cubins differ; a kernel that adds 2 instead of 1 has
    another (the negative control). ``--compare`` sorts specializations into same / differ (noting those whose
    PTX instructions are the same) / only before / only now, and fails on anything but same. ``ptx_code``
    drops what only the debugger reads (line table, DWARF, the labels of inlined helpers' ranges)."""
    (tmp_path / "digested_kernels.py").write_text(_DIGESTED)
    script = textwrap.dedent(f"""
        import json, runpy
        tool = runpy.run_path({str(TOOL)!r})
        opts = dict(num_warps=4, num_stages=3)
        sig = {{"x_ptr": "*fp32", "N": "i32", "BLOCK": "constexpr"}}
        out = {{name: tool["compile_one"]("digested_kernels", name, sig, {{(2,): 256}}, {{}}, opts, digest=True)
               for name in ("plain_kernel", "renamed_kernel", "other_kernel")}}
        res = [dict(out[n], kernel="m." + n, spec="m.k:" + n, first_case="c") for n in out]
        now = tool["digests"](res)
        plain, other = now["m.k:plain_kernel"], now["m.k:other_kernel"]
        before = dict(now, **{{"m.k:gone": plain}})
        before["m.k:other_kernel"] = dict(other, sass=plain["sass"])  # other SASS from the same PTX
        before["m.k:renamed_kernel"] = dict(other, first_case="c")  # other SASS and PTX
        out["compare"] = tool["compare_digests"](before, dict(now, **{{"m.k:new": plain}}))
        json.dump(before, open("before.json", "w"))
        out["changed_if_any_differs"] = tool["_report_compare"]("before.json", res)
        json.dump(now, open("before.json", "w"))
        out["changed_if_equal"] = tool["_report_compare"]("before.json", res)
        out["ptx_code"] = tool["ptx_code"]("mov.b32 %r1, 0;\\n$L__tmp3:\\n\\t.loc 1 2 3\\n$L__BB0_1:\\n"
                                           "\\t.file 1 \\"k.py\\"\\n\\t.section\\t.debug_info\\n{{ .b8 1 }}")
        print(json.dumps(out))
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=_env(str(tmp_path)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    plain, renamed, other = res["plain_kernel"], res["renamed_kernel"], res["other_kernel"]
    assert plain["ok"] and renamed["ok"] and other["ok"], res
    assert plain["sass_sha"] == renamed["sass_sha"] and plain["cubin_sha"] != renamed["cubin_sha"], res
    assert other["sass_sha"] != plain["sass_sha"] and other["ptx_sha"] != plain["ptx_sha"], res
    assert res["compare"] == dict(same=["m.k:plain_kernel"], differ=["m.k:other_kernel", "m.k:renamed_kernel"],
                                  same_ptx=["m.k:other_kernel"], only_before=["m.k:gone"],
                                  only_after=["m.k:new"]), res["compare"]
    assert res["changed_if_any_differs"] is True and res["changed_if_equal"] is False, res
    assert "differ       m.k:other_kernel (c) same PTX instructions" in r.stdout, r.stdout
    assert "SASS compared with before.json: 3 identical" in r.stdout, r.stdout
    assert res["ptx_code"] == "mov.b32 %r1, 0;\n$L__BB0_1:", res["ptx_code"]
