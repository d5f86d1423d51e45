"""The Gluon experiment of the block-FP8 row (``bench/gluon_block8.py``: its L2 and L1) compiles for Hopper
(sm_90) on a machine without a GPU, without spills, and its K loops keep wgmma groups in flight while they
promote.

Why: the experiment exists to get ``wgmma.wait_group 1`` into the L2's K loop (docs/KERNELS.md "Where prefill
still loses to DeepGEMM": Triton waits for every dot before its promotion), and ptxas may still serialize the
MMAs of a kernel it cannot prove safe (its C7514 / C7515 notes, which Triton does not show), so both the PTX
and the SASS K loop are checked. Negative controls: the same kernels with ``WAIT=0``, and a result carrying
ptxas' serialization note, must fail the check. That the kernels' output bytes equal block8's is the GPU run's
part (``--gpu``), not checked here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]


def _gluon_and_ptxas() -> str:
    """Why the check cannot run here, or ''."""
    try:
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait  # noqa: F401
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(90).path
    except Exception as exc:  # noqa: BLE001
        return f"Gluon / Triton's CUDA backend unavailable: {exc!r}"
    return "" if path and os.path.exists(path) else "no ptxas"


_SCRIPT = """
import json, sys
sys.path.insert(0, {bench!r})
import gluon_block8 as g
out = dict(pipelined=g.compile_only(32),
           control=g.compile_only(32, control=True, baseline=False),
           capped=g.compile_only(32, maxnreg=128, kernels=("l1",), baseline=False),
           w8=g.compile_only(32, maxnreg=128, kernels=("l2",), baseline=False, warps=8)
           + g.compile_only(64, kernels=("l2",), baseline=False, warps=8),
           l1t=[g.compile_launch(ln) for ln in g._record_l1(32, baseline=False, tma=True, unroll=2)]
           + [g.compile_launch(ln) for ln in g._record_l1(32, baseline=False, tma=True, serial=True, stages=3)])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    """block8's and the Gluon kernels (L2, L1) at their defaults, the Gluon ones with WAIT 0, and the Gluon L1
    capped at 128 registers (where it spills), all compiled for sm_90 in one subprocess (the launch recording
    replaces the process's Triton driver)."""
    why = _gluon_and_ptxas()
    if why:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run([sys.executable, "-c", _SCRIPT.format(bench=str(ROOT / "bench"))], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    return {"wait1": res["pipelined"], "wait0": res["control"], "capped": res["capped"], "w8": res["w8"],
            "l1t": res["l1t"]}


def _by_kernel(res: list, name: str) -> dict:
    (r,) = [x for x in res if x["kernel"] == name]
    assert "error" not in r, r["error"]
    return r


def test_gluon_l2_keeps_one_wgmma_in_flight(compiled):
    sys.path.insert(0, str(ROOT / "bench"))
    import gluon_block8

    g = _by_kernel(compiled["wait1"], "_l2_gluon_kernel")
    assert g["spill_bytes"] == 0 and g["stack"] == 0, g
    assert g["tile"] == dict(BM=32, BN=128, GA=64, UNROLL=gluon_block8.UNROLL, WAIT=1), g["tile"]
    # PTX: the K loop holds the MMAs and waits with one group outstanding; SASS: ptxas kept those waits
    waits = g["ptx_waits"]
    assert waits["loop_mma"] > 0 and waits["loop"].get("1", 0) >= waits["loop_mma"] // 2 - 1, g
    assert g["sass_loop_waits"].get("1", 0) > 0, g
    # ptxas' notes: at most the wgmma wait it adds at the loop's back edge, where none is in flight (C7517)
    assert all("C7517" in n for n in g["ptxas_warnings"]), g["ptxas_warnings"]
    assert g["fma_in_ptx"] == 0, g  # the promotions are separate multiplies and adds, as block8's
    assert gluon_block8.pipelined(g)
    # block8's prefill L2 beside it: compiled, no spills, and the wait for every dot the experiment removes
    b = _by_kernel(compiled["wait1"], "_l2_kernel")
    assert b["spill_bytes"] == 0 and b["ptx_waits"]["loop"] == {"0": 1}, b
    assert not gluon_block8.pipelined(b)
    # the same MMA instruction (m64n32k32 e4m3 -> f32) and the same round-to-nearest bf16 conversion as block8
    assert g["wgmma_forms"] == b["wgmma_forms"] == ["wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3"], (g, b)
    def cvts(r):
        return {c.replace("bf16x2", "bf16") for c in r["bf16_cvt"]}

    assert cvts(g) == cvts(b) == {"cvt.rn.bf16.f32"}, (g["bf16_cvt"], b["bf16_cvt"])


def test_gluon_l1_keeps_its_wgmmas_in_flight(compiled):
    """The L1 (gate and up dots, two wgmma groups per K block): ``wait_group 2`` while a block is promoted, no
    spills, and the same MMA instruction as block8's prefill L1."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gluon_block8

    g = _by_kernel(compiled["wait1"], "_l1_gluon_kernel")
    assert g["spill_bytes"] == 0 and g["stack"] == 0, g
    assert g["tile"] == dict(BM=32, BN=128, GA=64, UNROLL=gluon_block8.L1_UNROLL, WAIT=2), g["tile"]
    assert g["ptx_waits"]["loop"].get("2", 0) > 0 and g["sass_loop_waits"].get("2", 0) > 0, g
    assert not any("serialized" in n for n in g["ptxas_warnings"]) and g["fma_in_ptx"] == 0, g
    assert gluon_block8.pipelined(g)
    b = _by_kernel(compiled["wait1"], "_l1_kernel")
    assert b["spill_bytes"] == 0 and set(b["ptx_waits"]["loop"]) == {"0"} and not gluon_block8.pipelined(b), b
    assert g["wgmma_forms"] == b["wgmma_forms"] == ["wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3"]


def test_gluon_l1_with_tma_weights(compiled):
    """The L1 whose weights come by TMA: one interleaved [256, 128] box and one wgmma group per K block, the
    same MMA instruction as block8's. Pipelined (UNROLL 2): ``wait_group 1`` kept in the loop, no spills. Serial
    with 3 slots: small enough for two programs per SM (<= 128 registers, <= half of the 227 KB of shared
    memory), as block8's L1 runs."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gluon_block8

    piped, serial = compiled["l1t"]
    for r in (piped, serial):
        assert "error" not in r, r.get("error")
        assert r["kernel"] == "_l1t_gluon_kernel" and r["spill_bytes"] == 0 and r["stack"] == 0, r
        assert r["wgmma_forms"] == ["wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3"], r["wgmma_forms"]
        assert r["fma_in_ptx"] == 0
    assert gluon_block8.pipelined(piped) and piped["ptx_waits"]["loop"].get("1", 0) > 0, piped
    assert not gluon_block8.pipelined(serial), serial
    assert serial["regs"] <= 128 and serial["shared"] <= 227 * 1024 // 2, (serial["regs"], serial["shared"])


def test_negative_control_wait0_fails_the_check(compiled):
    sys.path.insert(0, str(ROOT / "bench"))
    import gluon_block8

    for name in ("_l2_gluon_kernel", "_l1_gluon_kernel"):
        g = _by_kernel(compiled["wait0"], name)
        assert g["tile"]["WAIT"] == 0
        assert set(g["ptx_waits"]["loop"]) == {"0"} and set(g["sass_loop_waits"]) == {"0"}, g
        assert not gluon_block8.pipelined(g)
    # and a kernel ptxas serialized fails it too, whatever its PTX says
    ok = _by_kernel(compiled["wait1"], "_l2_gluon_kernel")
    serialized = dict(ok, ptxas_warnings=["ptxas info : (C7514) Potential Performance Loss: wgmma.mma_async "
                                          "instructions are serialized due to ..."])
    assert gluon_block8.pipelined(ok) and not gluon_block8.pipelined(serialized)


def test_gluon_l2_two_warpgroups(compiled):
    """The 8-warp L2 ``--gpu`` times (two warpgroups of 64 weight rows): capped at 128 registers with 32-token
    row blocks, and uncapped with 64, it compiles without spills and keeps its wgmma group in flight."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gluon_block8

    for r in compiled["w8"]:
        assert "error" not in r, r["error"]
        assert r["warps"] == 8 and r["spill_bytes"] == 0 and gluon_block8.pipelined(r), r
    assert [r["tile"]["BM"] for r in compiled["w8"]] == [32, 64] and compiled["w8"][0]["regs"] <= 128


def test_spills_are_seen(compiled):
    """Negative control of the spill check: capped at 128 registers the Gluon L1 spills, which ptxas reports and
    cuobjdump's resource summary shows only as a stack frame (LOCAL stays 0)."""
    g = _by_kernel(compiled["capped"], "_l1_gluon_kernel")
    assert g["regs"] == 128 and g["spill_bytes"] > 0 and g["stack"] > 0, g


def test_wgmma_wait_counter_reads_the_loop():
    """``wgmma_waits`` on planted PTX: the waits inside the loop holding the MMAs, not those around it."""
    sys.path.insert(0, str(ROOT / "bench"))
    if _gluon_and_ptxas().startswith("Gluon"):
        pytest.skip("Gluon unavailable")
    import gluon_block8

    ptx = "\n".join([
        "wgmma.wait_group.sync.aligned 0;",
        "$L__BB0_3:",
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%r1}, %rd1, %rd2, 0, 1, 1;",
        "wgmma.wait_group.sync.aligned 1;",
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%r2}, %rd1, %rd2, 0, 1, 1;",
        "wgmma.wait_group.sync.aligned 1;",
        "@%p1 bra $L__BB0_3;",
        "$L__BB0_5:",
        "add.s32 %r3, %r3, 1;",
        "@%p2 bra $L__BB0_5;",
        "wgmma.wait_group.sync.aligned 0;",
    ])
    w = gluon_block8.wgmma_waits(ptx)
    assert w == dict(kernel={"0": 2, "1": 2}, loop={"1": 2}, loop_mma=2), w


_FLOW = """
import json, sys
sys.path.insert(0, {bench!r})
import gluon_block8 as g
from megamoe_runtime.backends.triton import block8

g.DEV, g.H, g.I, g.E = "cpu", 256, 128, 8


def l2(act, asf, w, ws, plan, slots, H, I, K, nslot, bm, wait=1, stages=4, unroll=8, maxnreg=None, warps=4):
    if unroll == 16:
        raise RuntimeError("planted failure")
    block8.launch_l2(block8.TILES["prefill"], act, asf, w, ws, plan, slots, H, I, K, nslot, bm, False)
    if stages == 6:
        slots.view(-1)[0] += 1  # a planted difference


def l1(xq, xs, w, ws, plan, tw, act, asf, H, I, K, clamp, rsf, bm, wait=2, stages=4, unroll=4, maxnreg=None):
    block8.launch_l1(block8.TILES["prefill"], xq, xs, w, ws, plan, tw, act, asf, H, I, K, clamp, rsf, bm, False)
    if stages == 5:
        asf.view(-1)[0] *= 2  # a planted difference


g.launch_l2, g.launch_l1 = l2, l1
print(json.dumps(dict(l2=g.gpu([16], 1), l1=g.gpu_l1([16], 1)), default=str))
"""


def test_gpu_flow_on_the_cpu():
    """``--gpu``'s flow at a small shape under the interpreter, the Gluon launches stood in for by block8's (what
    the CPU can run): every configuration is compared with block8's output and timed, the 64-token row block
    ones on the same pairs moved to that plan's rows; a configuration that raises is reported and the others
    still run; planted differences are counted (negative controls)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    r = subprocess.run([sys.executable, "-c", _FLOW.format(bench=str(ROOT / "bench"))], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    l2, l1 = res["l2"]["points"]["16"], res["l1"]["points"]["16"]
    assert "ms" in l2["block8"] and "ms" in l1["block8"]
    assert "planted failure" in l2["u16"]["error"]
    assert l2["u8_s6"]["differing_bytes"] > 0 and l1["s5_u4"]["scales_differing"] == 1
    cfg2, cfg1 = res["l2"]["variants"], res["l1"]["variants"]
    planted2 = {k for k, v in cfg2.items() if v["unroll"] == 16 or v["stages"] == 6}
    planted1 = {k for k, v in cfg1.items() if v["stages"] == 5}
    assert all(l2[k].get("differing_bytes", 1) > 0 or "error" in l2[k] for k in planted2)
    for pt, planted in ((l2, planted2), (l1, planted1)):
        rest = [k for k, v in pt.items() if isinstance(v, dict) and k != "block8" and k not in planted]
        assert len(rest) >= 4 and all(pt[k]["differing_bytes"] == 0 and pt[k]["ms"] > 0 for k in rest), pt
    assert res["l2"]["variants"]["w8_bm64_u8"]["bm"] == 64 and "w8_bm64_u8" in l2
