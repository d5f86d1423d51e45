"""The triton backend's launch types (``backends/triton/launch.py``; docs/KERNELS.md "Launch types"): no GPU.

Every GEMM launch sets each kernel parameter by name, from exactly one group or from the launch itself; the
kernels are swapped for a recorder here, so these tests see what a launch passes without compiling anything.
That the outputs are unchanged is proven on the GPU (test_triton.py, ``bench/launch_digests.py``).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from megamoe_runtime.backends.triton import configs, l1, l2, launch, mma8  # noqa: E402
from megamoe_runtime.backends.triton.launch import (  # noqa: E402
    Activation, L1Epilogue, L2Epilogue, Rows, WeightOperand,
)
from megamoe_runtime.backends.triton.staging import RoutingPlan  # noqa: E402
from megamoe_runtime.format.formats import ActivationSpec, LayerSpec  # noqa: E402


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: records the grid, positional and keyword arguments."""

    def __init__(self, kernel):
        self.arg_names = list(kernel.arg_names)
        self.calls = []

    def __getitem__(self, grid):
        def launch_(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
        return launch_


def _plan(bm: int = 16, blocks: int = 3) -> RoutingPlan:
    i32 = torch.int32
    return RoutingPlan(torch.full((blocks * bm,), -1, dtype=i32), torch.full((blocks,), -1, dtype=i32),
                       torch.zeros(1, dtype=i32), bm, blocks, 2)


def _weights(kind: int, E: int = 2, N: int = 256, K: int = 256):
    if kind == configs.W_BF16:
        return torch.zeros(E, N, K, dtype=torch.bfloat16), None
    per = {configs.W_E2M1_MX: (K // 2, 32), configs.W_E2M1_NV: (K // 2, 16), configs.W_E4M3_MX: (K, 32)}[kind]
    w = torch.zeros(E, N, per[0], dtype=torch.float8_e4m3fn if kind == configs.W_E4M3_MX else torch.uint8)
    phys = torch.zeros(E, K // per[1] // 4, N, dtype=torch.int32)  # the MN-major view's contiguous base
    return w, phys.transpose(-1, -2)


def _launch_options(kwargs: dict) -> set:
    return {"num_warps", "num_stages", "enable_fp_fusion", "maxnreg", "launch_pdl"} & set(kwargs)


@pytest.mark.parametrize("kind", [configs.W_E2M1_MX, configs.W_E2M1_NV, configs.W_E4M3_MX, configs.W_BF16])
@pytest.mark.parametrize("shared", [False, True])
def test_l1_l2_launches_set_every_kernel_parameter_by_name(kind, shared, monkeypatch):
    rec1, rec2 = _Recorder(l1._l1_kernel), _Recorder(l2._l2_kernel)
    monkeypatch.setattr(l1, "_l1_kernel", rec1)
    monkeypatch.setattr(l2, "_l2_kernel", rec2)
    spec = LayerSpec("mxfp4", 256, 256, 2, 2, ActivationSpec("swiglu", clamp=7.0))
    w, ws = _weights(kind)
    rows = Rows(5, 2, 16, None if shared else _plan())
    frag = kind != configs.W_BF16
    op = WeightOperand.of(w, ws, kind, asm=True, frag=frag, fold=True, sword=True)
    tw = torch.ones(5, 2)
    cfg = configs.KernelConfig(block_m=16)
    x = torch.zeros(5, 256, dtype=torch.bfloat16)
    act = torch.zeros(5 if shared else 48, 256, dtype=torch.bfloat16)
    l1.launch_l1(cfg, x, op, rows, L1Epilogue(Activation.of(spec), tw, 2.5, True, configs.REQ_MX8, 2), act, 256, 256,
                 True)
    slots = torch.zeros(5, 3, 256, dtype=torch.bfloat16)
    l2.launch_l2(cfg, act, op, rows, L2Epilogue(tw), slots, 256, 256, True)
    for rec in (rec1, rec2):
        (grid, args, kwargs), = rec.calls
        assert args == (), "a launch passes no kernel argument by position"
        assert set(kwargs) - _launch_options(kwargs) == set(rec.arg_names), \
            sorted(set(kwargs) ^ set(rec.arg_names))
        assert grid[1] == (1 if shared else 3)
        assert kwargs["SHARED"] is shared and kwargs["W_KIND"] == kind and kwargs["FRAG"] is frag
        # a programmatic dependent launch only with the kernel's wait for the previous grid (_jit.pdl_start)
        assert kwargs.get("launch_pdl", False) == kwargs.get("PDL", False)
    assert rec1.calls[0][2]["GU"] is False  # only routed frag launches take the one-dot L1, and only when asked
    assert rec2.calls[0][2]["NSLOT"] == 3


def test_programmatic_dependent_launch_rule(monkeypatch):
    """``staging.pdl``: the kernel's wait and Triton's launch attribute together, by default, for an sm_90
    compile (a CPU device while recording, tools/sm90_compile.py) and Hopper GPUs; neither under the
    interpreter (its inline-PTX wait cannot run there), on an older GPU (no griddepcontrol) or with
    MEGAMOE_TRITON_PDL=0."""
    from megamoe_runtime.backends.triton import staging

    both, off = {"PDL": True, "launch_pdl": True}, {"PDL": False}
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MEGAMOE_TRITON_PDL", raising=False)
    assert staging.pdl(torch.device("cpu")) == both  # the default
    monkeypatch.setenv("MEGAMOE_TRITON_PDL", "1")
    assert staging.pdl(torch.device("cpu")) == both
    monkeypatch.setattr(staging, "_capability_major", lambda index: 9)
    assert staging.pdl(torch.device("cuda", 0)) == both
    monkeypatch.setattr(staging, "_capability_major", lambda index: 8)  # Ada: no griddepcontrol
    assert staging.pdl(torch.device("cuda", 0)) == off
    monkeypatch.setenv("MEGAMOE_TRITON_PDL", "0")
    assert staging.pdl(torch.device("cpu")) == off
    monkeypatch.setenv("MEGAMOE_TRITON_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert staging.pdl(torch.device("cpu")) == off


@pytest.mark.parametrize("block_m, req, I, expect", [
    (128, configs.REQ_MX8, 256, True),  # prefill tiles: every row
    (128, configs.REQ_NV4, 256, True),
    (32, configs.REQ_NV4, 256, True),  # the NVFP4 intermediate at every tile
    (32, configs.REQ_MX8, 256, False),  # mxfp8's mid tile: a CTA per SM fewer with it
    (64, configs.REQ_BF16, 256, False),
    (128, configs.REQ_NV4, 2 ** 24, False),  # 128 * I = 2^31: the 32-bit offsets would wrap
    (128, configs.REQ_NV4, 2 ** 24 - 128, True),
])
def test_l1_store_offsets_rule(block_m, req, I, expect, monkeypatch):
    """``l1.store32`` (docs/KERNELS.md "The intermediate's store") and what the launch passes: the rule's cases,
    its bound where ``BM * I`` reaches 2^31, and the launch deriving it from the routed plan's block size."""
    assert l1.store32(block_m, I, req) is expect
    rec = _Recorder(l1._l1_kernel)
    monkeypatch.setattr(l1, "_l1_kernel", rec)
    spec = LayerSpec("mxfp4", 256, 256, 2, 2, ActivationSpec("swiglu"))
    w, ws = _weights(configs.W_E2M1_MX)
    op = WeightOperand.of(w, ws, configs.W_E2M1_MX, asm=True, frag=True, fold=True, sword=True)
    epi = L1Epilogue(Activation.of(spec), torch.ones(5, 2), 2.5, True, req, 2)
    rows = Rows(5, 2, block_m, _plan(block_m, 1))
    l1.launch_l1(configs.KernelConfig(block_m=block_m), torch.zeros(5, 256, dtype=torch.bfloat16), op, rows, epi,
                 torch.zeros(block_m, 256, dtype=torch.bfloat16), 256, 256, True)
    assert rec.calls[0][2]["STORE32"] is l1.store32(block_m, 256, req)
    shared_rows = Rows(5, 2, block_m, None)  # the shared expert: every token once, rows not consecutive
    l1.launch_l1(configs.KernelConfig(block_m=block_m), torch.zeros(5, 256, dtype=torch.bfloat16), op, shared_rows,
                 epi, torch.zeros(5, 256, dtype=torch.bfloat16), 256, 256, True)
    assert rec.calls[1][2]["STORE32"] is False


@pytest.mark.parametrize("shared", [False, True])
def test_fp8_launches_set_every_kernel_parameter_by_name(shared, monkeypatch):
    rec1, rec2 = _Recorder(mma8._l1_fp8_kernel), _Recorder(mma8._l2_fp8_kernel)
    monkeypatch.setattr(mma8, "_l1_fp8_kernel", rec1)
    monkeypatch.setattr(mma8, "_l2_fp8_kernel", rec2)
    spec = LayerSpec("mxfp4", 256, 256, 2, 2, ActivationSpec("swiglu"))
    w, ws = _weights(configs.W_E2M1_MX)
    rows = Rows(5, 2, 16, None if shared else _plan())
    op = WeightOperand.of(w, ws, configs.W_E2M1_MX, asm=True)
    fc = mma8.Fp8Config()
    a8 = torch.zeros(48, 256, dtype=torch.uint8)
    asf = torch.zeros(48, 8, dtype=torch.uint8)
    epi = L1Epilogue(Activation.of(spec), torch.ones(5, 2), 1.0, not shared, configs.REQ_MX8, 0)
    mma8.launch_l1(fc, torch.zeros(5, 256, dtype=torch.uint8), torch.zeros(5, 8, dtype=torch.uint8), op, rows, epi,
                   a8, asf, 256, 256)
    mma8.launch_l2(fc, a8, asf, op, rows, torch.zeros(5, 3, 256, dtype=torch.bfloat16), 256, 256)
    for rec in (rec1, rec2):
        (_, args, kwargs), = rec.calls
        assert args == ()
        assert set(kwargs) - _launch_options(kwargs) == set(rec.arg_names), \
            sorted(set(kwargs) ^ set(rec.arg_names))


def test_groups_set_disjoint_parameters():
    """No kernel parameter comes from two groups (a later ``**`` would silently win)."""
    w, ws = _weights(configs.W_E2M1_NV)
    d = torch.zeros(1)
    spec = LayerSpec("nvfp4", 256, 256, 2, 2, ActivationSpec("swiglu"))
    groups = [Rows(5, 2, 16, _plan()).kernel_args(torch.device("cpu")),
              WeightOperand.of(w, ws, configs.W_E2M1_NV).kernel_args(d),
              L1Epilogue(Activation.of(spec), d, 1.0, False, configs.REQ_NV4, 1).kernel_args(d)]
    seen = set()
    for g in groups:
        assert not (seen & set(g)), seen & set(g)
        seen |= set(g)
    assert not (set(Rows(5, 2, 16).kernel_args(torch.device("cpu"))) & set(L2Epilogue(d).kernel_args(d)))


def test_weight_operand_applies_the_rules_that_make_a_choice_take_effect():
    w, ws = _weights(configs.W_E4M3_MX)
    op = WeightOperand.of(w, ws, configs.W_E4M3_MX, asm=True, frag=True, fold=True, sword=True)
    assert op.weight.dtype == torch.uint8 and op.weight.data_ptr() == w.data_ptr()  # E4M3 read as bytes
    assert op.fold and not op.sword  # scale words only for the E2M1 frag kernels (launch._scale_words)
    assert (op.stride_e, op.stride_n) == (w.stride(0), w.stride(1))
    assert op.scale_stride_e == ws.shape[-1] * ws.shape[-2] * 4
    assert not WeightOperand.of(w, ws, configs.W_E4M3_MX, asm=False, frag=True, fold=True).fold  # fold needs asm
    assert not WeightOperand.of(w, ws, configs.W_E4M3_MX, asm=True, frag=False, fold=True).fold  # ... and frag
    w4, ws4 = _weights(configs.W_E2M1_MX)
    assert WeightOperand.of(w4, ws4, configs.W_E2M1_MX, frag=True, sword=True).sword
    assert not WeightOperand.of(w4, ws4, configs.W_E2M1_MX, frag=False, sword=True).sword
    wb, _ = _weights(configs.W_BF16)
    b = WeightOperand.of(wb[0], None, configs.W_BF16)  # 2-D (a shared expert): no expert stride
    assert (b.stride_e, b.scale_stride_e) == (0, 0) and b.scales.numel() == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.fold = True


def test_activation_and_out_order():
    a = Activation.of(LayerSpec("mxfp4", 256, 256, 2, 2, ActivationSpec("swiglu", clamp=7.01, alpha=1.702, beta=1.0)))
    assert a.kind == 0 and a.has_clamp and a.clamp == float(torch.tensor(7.01).to(torch.bfloat16))
    s = Activation.of(LayerSpec("mxfp4", 256, 256, 2, 2, ActivationSpec("situ", situ_beta=3.0, situ_linear_beta=6.0)))
    assert (s.kind, s.has_clamp, s.situ_beta, s.situ_linear_beta) == (1, False, 3.0, 6.0)
    # the intermediate's K order: E2M1 L2 weights read split (1) / frag (2); others natural (0) / E4M3 frag (3)
    assert [L1Epilogue.order_for(e2m1, frag) for e2m1 in (True, False) for frag in (False, True)] == [1, 2, 0, 3]


def test_rows():
    r = Rows(37, 4, 16)
    assert r.shared and r.grid_m() == 3
    assert Rows(37, 4, 16, _plan(16, 7)).grid_m() == 7
    args = r.kernel_args(torch.device("cpu"))
    assert args["pair_ptr"].dtype == torch.int32 and (args["T"], args["TOPK"], args["BM"]) == (37, 4, 16)
    assert launch.Rows is Rows
