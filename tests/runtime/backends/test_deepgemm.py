"""DeepGEMM backend contract tests.

DeepGEMM's mega kernels need an SM100 GPU, so the backend is tested against
recording stand-ins of ``deep_gemm``, one per documented API version
(docs/KERNELS.md#entry-points, #symmetric-buffer): each stand-in has that version's exact entry-point and
symmetric-buffer signatures, buffer views with the documented shapes, dtypes
and strides, and checks every tensor it is handed. The stand-in is injected as
``deep_gemm`` into ``sys.modules``.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

import megamoe_runtime as mr
from megamoe_runtime.backends.deepgemm import DeepGemmBackend, detect_api, import_deep_gemm, shared_sf_rows
from megamoe_runtime.errors import BackendUnavailableError, MegaMoEError
from megamoe_runtime.format import codecs
from megamoe_runtime.layer.experts import DeepGemmMegaMoEExperts
from dg_standins import OneRankGroup

_ALIGN = 16  # the stand-ins align T like DeepGEMM does (to something), here 16


# --------------------------------------------------------------------------- stand-in construction


def _kind(mma_type, dgv_nv=False):
    return {"fp8xfp4": "mx", "fp8xfp8": "mx", "bf16xbf16": "bf16", "fp4xfp4": "nv"}[mma_type] if not dgv_nv else "dgv"


def _make_buffer_cls(mod, label):
    class Buf:
        def _init(self, group, num_experts, T, K, H, I, *, mma_type, num_shared=0, shared_dtype=None, **rest):
            assert isinstance(num_experts, int) and isinstance(T, int) and isinstance(K, int)
            mod.buffers.append((label, dict(num_experts=num_experts, T=T, K=K, H=H, I=I, mma_type=mma_type,
                                            num_shared=num_shared, shared_dtype=shared_dtype, **rest)))
            T = (T + _ALIGN - 1) // _ALIGN * _ALIGN
            self.group, self.num_experts, self.num_max_tokens_per_rank, self.num_topk = group, num_experts, T, K
            self.hidden, self.intermediate_hidden, self.mma_type = H, I, mma_type
            kind = _kind(mma_type, label == "NVFP4SymmBuffer")
            self.x = {"mx": torch.zeros(T, H, dtype=torch.float8_e4m3fn), "bf16": torch.zeros(T, H, dtype=torch.bfloat16),
                      "nv": torch.zeros(T, H // 2, dtype=torch.uint8), "dgv": torch.zeros(T, H // 2, dtype=torch.int8)}[kind]
            self.x_sf = {"mx": torch.zeros(T, H // 128, dtype=torch.int32), "bf16": None,
                         "nv": torch.zeros(T, H // 64, dtype=torch.int32),
                         "dgv": torch.zeros(T, H // 64, dtype=torch.int32)}[kind]
            self.topk_idx = torch.zeros(T, K, dtype=torch.int64)
            self.topk_weights = torch.full((T, K), 7.0, dtype=torch.float32)
            rows = -(-T // 8) * 128
            self.shared_l1_acts = self.x if kind == "mx" else None
            self.shared_l1_acts_sf = None
            if num_shared and (kind == "mx" or (kind == "dgv" and shared_dtype == torch.float8_e4m3fn)):
                self.shared_l1_acts_sf = torch.full((H // 128, rows), -1, dtype=torch.int32).t()  # strides (1, rows)
            if kind == "dgv":
                self.x_scales = torch.zeros(T, dtype=torch.float32)
                if num_shared:
                    self.shared_l1_acts = torch.zeros(T, H, dtype=shared_dtype)
            self.buffer = torch.zeros(8, dtype=torch.int8)
    Buf.__name__ = label
    return Buf


def _check_pair(pair, E_l, N, K, elem, group):
    w, sf = pair
    dt = {"e2m1": torch.int8, "e4m3": torch.float8_e4m3fn}[elem]
    assert w.dtype == dt and w.is_contiguous()
    assert tuple(w.shape) == ((E_l,) if E_l else ()) + (N, K // 2 if elem == "e2m1" else K)
    P = K // (4 * group)
    assert sf.dtype == torch.int32 and tuple(sf.shape) == ((E_l,) if E_l else ()) + (N, P)
    assert tuple(sf.stride()) == (((P * N,) if E_l else ()) + (1, N)), sf.stride()  # MN-major


def _check_common(mod, fn, y, l1, l2, buf, kw):
    assert isinstance(buf, (mod.SymmBuffer, getattr(mod, "NVFP4SymmBuffer", ()))) or type(buf).__name__.endswith("Buffer")
    T = y.shape[0]
    assert y.dtype == torch.bfloat16 and y.is_contiguous() and y.shape[1] == buf.hidden
    assert T <= buf.num_max_tokens_per_rank
    E_l = buf.num_experts // buf.group.size()
    H, I = buf.hidden, buf.intermediate_hidden
    stats = kw.get("cumulative_local_expert_recv_stats")
    if stats is not None:  # DeepGEMM: int32, contiguous, numel == E_l
        assert stats.dtype == torch.int32 and stats.is_contiguous() and stats.numel() == E_l
    if fn == "bf16_mega_moe":
        assert l1.dtype == l2.dtype == torch.bfloat16 and l1.shape == (E_l, 2 * I, H) and l2.shape == (E_l, H, I)
        assert l1.is_contiguous() and l2.is_contiguous()
    else:
        elem = "e4m3" if (fn == "fp8_fp8_mega_moe" or l1[0].dtype == torch.float8_e4m3fn) else "e2m1"
        group = 16 if fn in ("fp4_fp4_mega_moe", "nvfp4_mega_moe") else 32
        _check_pair(l1, E_l, 2 * I, H, elem, group)
        _check_pair(l2, E_l, H, I, elem, group)
    mod.calls.append((fn, y, l1, l2, buf, dict(kw)))
    y.fill_(1.0)


def make_standin(version: str) -> types.ModuleType:
    mod = types.ModuleType("deep_gemm")
    mod.calls, mod.buffers = [], []
    BufCls = _make_buffer_cls(mod, "SymmBuffer")

    if version == "dg-2604":
        class SymmBuffer(BufCls):
            def __init__(self, group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                         use_fp8_dispatch=True, activation="swiglu"):
                self._init(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                           mma_type="fp8xfp4" if use_fp8_dispatch else "bf16xbf16",
                           use_fp8_dispatch=use_fp8_dispatch, activation=activation)

        def fp8_fp4_mega_moe(y, l1_weights, l2_weights, sym_buffer, recipe=(1, 1, 32), activation="swiglu",
                             activation_clamp=None, fast_math=True):
            assert recipe == (1, 1, 32) and activation == "swiglu"
            _check_common(mod, "fp8_fp4_mega_moe", y, l1_weights, l2_weights, sym_buffer,
                          dict(recipe=recipe, activation=activation, activation_clamp=activation_clamp,
                               fast_math=fast_math))
        mod.SymmBuffer, mod.fp8_fp4_mega_moe = SymmBuffer, fp8_fp4_mega_moe
        return mod

    if version in ("dg-main", "dgz"):
        class SymmBuffer(BufCls):
            def __init__(self, group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                         num_ring_tokens, mma_type="fp8xfp4", activation="swiglu"):
                self._init(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                           mma_type=mma_type, activation=activation, num_ring_tokens=num_ring_tokens)

        def get_symm_buffer_for_mega_moe(group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                         intermediate_hidden, use_fp8_dispatch=None, mma_type="fp8xfp4",
                                         activation="swiglu"):
            assert use_fp8_dispatch is None, "mma_type is the current way; use_fp8_dispatch is deprecated"
            return SymmBuffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                              768, mma_type=mma_type, activation=activation)

        def fp8_fp4_mega_moe(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats=None,
                             recipe=(1, 1, 32), activation="swiglu", activation_clamp=None, fast_math=True):
            _check_common(mod, "fp8_fp4_mega_moe", y, l1_weights, l2_weights, sym_buffer,
                          dict(cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats, recipe=recipe, activation=activation, activation_clamp=activation_clamp,
                               fast_math=fast_math))

        def bf16_mega_moe(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats=None,
                          activation="swiglu", activation_clamp=None, fast_math=True):
            _check_common(mod, "bf16_mega_moe", y, l1_weights, l2_weights, sym_buffer,
                          dict(cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats, activation=activation, activation_clamp=activation_clamp, fast_math=fast_math))
        mod.SymmBuffer, mod.get_symm_buffer_for_mega_moe = SymmBuffer, get_symm_buffer_for_mega_moe
        mod.fp8_fp4_mega_moe, mod.bf16_mega_moe = fp8_fp4_mega_moe, bf16_mega_moe
        if version == "dgz":
            def fp8_fp8_mega_moe(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats=None,
                                 recipe=(1, 1, 32), activation="swiglu", activation_clamp=None, fast_math=True):
                assert sym_buffer.mma_type == "fp8xfp8"
                _check_common(mod, "fp8_fp8_mega_moe", y, l1_weights, l2_weights, sym_buffer,
                              dict(cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats, recipe=recipe, activation=activation, activation_clamp=activation_clamp,
                                   fast_math=fast_math))
            mod.fp8_fp8_mega_moe = fp8_fp8_mega_moe
        return mod

    # dg-newer and dgv share the shared-expert-capable buffer
    class SymmBuffer(BufCls):
        if version == "dg-newer":
            def __init__(self, group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                         num_shared_experts=0, mma_type="fp8xfp4", activation="swiglu", base=None):
                assert activation != "situ" or mma_type == "fp8xfp4"
                self._init(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                           mma_type=mma_type, activation=activation, num_shared=num_shared_experts)
        else:
            def __init__(self, group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                         num_shared_experts=0, mma_type="fp8xfp4", activation="swiglu"):
                self._init(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                           mma_type=mma_type, activation=activation, num_shared=num_shared_experts)

    def get_symm_buffer_for_mega_moe(group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                     intermediate_hidden, num_shared_experts=0, use_fp8_dispatch=None,
                                     mma_type="fp8xfp4", activation="swiglu"):
        return SymmBuffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                          num_shared_experts, mma_type=mma_type, activation=activation)

    def get_block_m_for_mega_moe(num_ranks, num_experts, num_max_tokens_per_rank, num_tokens, num_topk, mma_type):
        mod.block_m_calls.append((num_ranks, num_experts, num_max_tokens_per_rank, num_tokens, num_topk, mma_type))
        return 16

    def _shared(buf, s1, s2, scaled):
        if s1 is None:
            assert s2 is None
            return
        if scaled:
            _check_pair(s1, None, s1[0].shape[0], buf.hidden, "e4m3", 32)
            _check_pair(s2, None, buf.hidden, s2[0].shape[1], "e4m3", 32)
            w1, w2 = s1[0], s2[0]
        else:
            w1, w2 = s1, s2
            assert w1.dtype == w2.dtype == torch.bfloat16 and w1.is_contiguous() and w2.is_contiguous()
        width = w2.shape[1]
        assert width % buf.intermediate_hidden == 0 and w1.shape == (2 * width, buf.hidden)

    def bf16_mega_moe(y, l1_weights, l2_weights, sym_buffer, shared_l1_weights=None, shared_l2_weights=None,
                      cumulative_local_expert_recv_stats=None, activation="swiglu", activation_clamp=None,
                      fast_math=True):
        _shared(sym_buffer, shared_l1_weights, shared_l2_weights, False)
        _check_common(mod, "bf16_mega_moe", y, l1_weights, l2_weights, sym_buffer,
                      dict(cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats, activation=activation, activation_clamp=activation_clamp, fast_math=fast_math,
                           shared_l1_weights=shared_l1_weights, shared_l2_weights=shared_l2_weights))

    mod.block_m_calls = []
    mod.SymmBuffer, mod.get_symm_buffer_for_mega_moe = SymmBuffer, get_symm_buffer_for_mega_moe
    mod.get_block_m_for_mega_moe, mod.bf16_mega_moe = get_block_m_for_mega_moe, bf16_mega_moe

    if version == "dg-newer":
        def fp8_fp4_mega_moe(y, l1_weights, l2_weights, sym_buffer, shared_l1_weights=None, shared_l2_weights=None,
                             cumulative_local_expert_recv_stats=None, recipe=(1, 1, 32), activation="swiglu",
                             activation_clamp=None, fast_math=True, situ_beta=None, situ_linear_beta=None):
            assert (situ_beta is None) == (activation == "swiglu")
            _shared(sym_buffer, shared_l1_weights, shared_l2_weights, True)
            _check_common(mod, "fp8_fp4_mega_moe", y, l1_weights, l2_weights, sym_buffer,
                          dict(cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats, recipe=recipe, activation=activation, activation_clamp=activation_clamp,
                               fast_math=fast_math, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta,
                               shared_l1_weights=shared_l1_weights))

        def fp4_fp4_mega_moe(y, l1_weights, l2_weights, sym_buffer, shared_l1_weights=None, shared_l2_weights=None,
                             x_bf16=None, cumulative_local_expert_recv_stats=None, recipe=(1, 1, 16),
                             activation="swiglu", activation_clamp=None, fast_math=True, l1_alphas=None,
                             l2_alphas=None, a2_scales=None, routed_scaling_factor=1.0):
            E_l = sym_buffer.num_experts
            assert sym_buffer.mma_type == "fp4xfp4" and recipe == (1, 1, 16)
            assert l1_alphas.dtype == torch.float32 and l1_alphas.shape == (E_l, 2) and l1_alphas.is_contiguous()
            for t in (l2_alphas, a2_scales):
                assert t.dtype == torch.float32 and t.shape == (E_l,) and t.is_contiguous()
            assert bool((a2_scales > 0).all()) and isinstance(routed_scaling_factor, float)
            assert (shared_l1_weights is None) == (x_bf16 is None)
            if x_bf16 is not None:
                assert x_bf16.dtype == torch.bfloat16 and x_bf16.is_contiguous() and x_bf16.shape[0] >= y.shape[0]
            _shared(sym_buffer, shared_l1_weights, shared_l2_weights, False)
            _check_common(mod, "fp4_fp4_mega_moe", y, l1_weights, l2_weights, sym_buffer,
                          dict(cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats, recipe=recipe, activation=activation, activation_clamp=activation_clamp,
                               fast_math=fast_math, l1_alphas=l1_alphas, l2_alphas=l2_alphas, a2_scales=a2_scales,
                               routed_scaling_factor=routed_scaling_factor, x_bf16=x_bf16,
                               shared_l1_weights=shared_l1_weights))
        mod.fp8_fp4_mega_moe, mod.fp4_fp4_mega_moe = fp8_fp4_mega_moe, fp4_fp4_mega_moe
        return mod

    assert version == "dgv"

    def fp8_fp4_mega_moe(y, l1_weights, l2_weights, sym_buffer, shared_l1_weights=None, shared_l2_weights=None,
                         cumulative_local_expert_recv_stats=None, recipe=(1, 1, 32), activation="swiglu",
                         activation_clamp=None, activation_beta=None, activation_linear_beta=None, fast_math=True):
        _shared(sym_buffer, shared_l1_weights, shared_l2_weights, True)
        _check_common(mod, "fp8_fp4_mega_moe", y, l1_weights, l2_weights, sym_buffer,
                      dict(cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats, recipe=recipe, activation=activation, activation_clamp=activation_clamp,
                           activation_beta=activation_beta, activation_linear_beta=activation_linear_beta,
                           fast_math=fast_math, shared_l1_weights=shared_l1_weights))

    NvBuf = _make_buffer_cls(mod, "NVFP4SymmBuffer")

    class NVFP4SymmBuffer(NvBuf):
        def __init__(self, group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                     num_shared_experts=0, base=None, shared_dtype=torch.float8_e4m3fn):
            assert shared_dtype in (torch.bfloat16, torch.float8_e4m3fn)
            self._init(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                       mma_type="fp4xfp4", num_shared=num_shared_experts,
                       shared_dtype=shared_dtype if num_shared_experts else None)

    def nvfp4_mega_moe(y, l1_weights, l2_weights, sym_buffer, shared_l1_weights=None, shared_l2_weights=None,
                       cumulative_local_expert_recv_stats=None, activation_clamp=None, fast_math=True,
                       activation_alpha=1.0, activation_beta=0.0, l1_alpha=None, l2_alpha=None,
                       l2_activation_scale=1.0, use_x_scales=False):
        assert isinstance(sym_buffer, NVFP4SymmBuffer)
        E_l = sym_buffer.num_experts
        for t in (l1_alpha, l2_alpha):
            assert t.dtype == torch.float32 and t.shape == (E_l,) and t.is_contiguous()
        assert isinstance(l2_activation_scale, float) and l2_activation_scale > 0
        if shared_l1_weights is not None:
            _shared(sym_buffer, shared_l1_weights, shared_l2_weights, isinstance(shared_l1_weights, tuple))
        _check_common(mod, "nvfp4_mega_moe", y, l1_weights, l2_weights, sym_buffer,
                      dict(cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats, activation_clamp=activation_clamp, fast_math=fast_math, activation_alpha=activation_alpha,
                           activation_beta=activation_beta, l1_alpha=l1_alpha, l2_alpha=l2_alpha,
                           l2_activation_scale=l2_activation_scale, use_x_scales=use_x_scales,
                           shared_l1_weights=shared_l1_weights))
    def get_block_m_for_nvfp4_mega_moe(num_ranks, num_experts, num_max_tokens_per_rank, num_tokens, num_topk):
        return 16

    mod.fp8_fp4_mega_moe, mod.nvfp4_mega_moe, mod.NVFP4SymmBuffer = fp8_fp4_mega_moe, nvfp4_mega_moe, NVFP4SymmBuffer
    mod.get_block_m_for_nvfp4_mega_moe = get_block_m_for_nvfp4_mega_moe
    return mod


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def standin(monkeypatch):
    from megamoe_runtime.backends import deepgemm

    monkeypatch.setattr(deepgemm, "_BUFFERS", {})

    def install(version):
        mod = make_standin(version)
        monkeypatch.setitem(sys.modules, "deep_gemm", mod)
        return mod

    return install


def _backend(group=None, **kw):
    return DeepGemmBackend("cpu", check_device=False, max_num_tokens=20, group=group or OneRankGroup(), **kw)


def _filled_layer(spec, backend):
    layer = DeepGemmMegaMoEExperts(spec, backend=backend, init="zeros")
    g = torch.Generator().manual_seed(0)
    layer.begin_load()
    with torch.no_grad():
        for n, p in layer.named_parameters():
            if p.dtype == torch.float32:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
                continue
            base = p.transpose(-1, -2) if "scale" in n else p
            base.view(torch.uint8).copy_(torch.randint(0, 120, base.view(torch.uint8).shape, generator=g,
                                                       dtype=torch.uint8))
        if spec.row == "nvfp4":
            layer.l1_alpha[:, 1] = layer.l1_alpha[:, 0]
            layer.set_l2_activation_scale(0.25)
    layer.finish_load()
    return layer


def _inputs(T, H, K, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w = torch.rand(T, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[2, 0] = -1
    w[2, 0] = float("nan")  # a masked slot's weight is never read; the staged weight must be 0
    return x, w, ids


def _spec(row, H=256, I=128, **kw):
    return mr.LayerSpec(row, hidden=H, intermediate=I, num_experts=8, top_k=2, **kw)


# --------------------------------------------------------------------------- tests


VERSIONS = ["dg-2604", "dg-main", "dg-newer", "dgv", "dgz"]


def test_detect_api_per_version(standin):
    want = {
        "dg-2604": {"mxfp4": "fp8_fp4_mega_moe", "mxfp8": None, "nvfp4": None, "bf16": None},
        "dg-main": {"mxfp4": "fp8_fp4_mega_moe", "mxfp8": None, "nvfp4": None, "bf16": "bf16_mega_moe"},
        "dg-newer": {"mxfp4": "fp8_fp4_mega_moe", "mxfp8": "fp8_fp4_mega_moe", "nvfp4": "fp4_fp4_mega_moe",
                     "bf16": "bf16_mega_moe"},
        "dgv": {"mxfp4": "fp8_fp4_mega_moe", "mxfp8": None, "nvfp4": "nvfp4_mega_moe", "bf16": "bf16_mega_moe"},
        "dgz": {"mxfp4": "fp8_fp4_mega_moe", "mxfp8": "fp8_fp8_mega_moe", "nvfp4": None, "bf16": "bf16_mega_moe"},
    }
    for version, rows in want.items():
        api = detect_api(standin(version))
        assert api.flavour == version
        for row, fn in rows.items():
            assert api.entry_for(row)[0] == fn, (version, row)
    assert detect_api(standin("dg-newer")).situ_names("fp8_fp4_mega_moe") == ("situ_beta", "situ_linear_beta")
    assert detect_api(standin("dgv")).situ_names("fp8_fp4_mega_moe") == ("activation_beta", "activation_linear_beta")


CALLS = [("dg-2604", "mxfp4"), ("dg-main", "mxfp4"), ("dg-main", "bf16"), ("dg-newer", "mxfp4"),
         ("dg-newer", "mxfp8"), ("dg-newer", "nvfp4"), ("dg-newer", "bf16"), ("dgv", "mxfp4"), ("dgv", "nvfp4"),
         ("dgz", "mxfp8")]


@pytest.mark.parametrize("version,row", CALLS, ids=[f"{v}-{r}" for v, r in CALLS])
def test_call_contract(standin, version, row):
    mod = standin(version)
    H, I = (512, 512) if (version, row) == ("dg-newer", "nvfp4") else (256, 128)
    spec = _spec(row, H, I, routed_scaling_factor=2.5,
                 activation=mr.ActivationSpec("swiglu", clamp=7.0))
    group = OneRankGroup()
    layer = _filled_layer(spec, _backend(group))
    assert layer.backend.api.flavour == version
    T = 5
    x, w, ids = _inputs(T, H, 2, 8)
    y = layer(x, w, ids)
    assert y.shape == (T, H) and torch.equal(y, torch.ones(T, H, dtype=torch.bfloat16))
    fn, _, l1, l2, buf, kw = mod.calls[-1]
    assert fn == detect_api(mod).entry_for(row)[0]

    # kernel-layout parameters passed as they are: no copy, no re-layout
    if row == "bf16":
        assert l1 is layer.l1_weight and l2 is layer.l2_weight
    else:
        assert l1[0] is layer.l1_weight and l1[1] is layer.l1_scale and l2[1] is layer.l2_scale

    # staged dispatch input, exactly the reference's quantization
    if row == "bf16":
        assert torch.equal(buf.x[:T], x)
    elif fn == "nvfp4_mega_moe":
        packed, sf, tok = codecs.quantize_nvfp4_per_token(x)
        assert torch.equal(buf.x[:T].view(torch.uint8), packed) and torch.equal(buf.x_scales[:T], tok)
        assert torch.equal(buf.x_sf[:T], codecs.pack_bytes_int32(sf))
    elif fn == "fp4_fp4_mega_moe":
        packed, sf = codecs.quantize_nvfp4(x, 1.0)
        assert torch.equal(buf.x[:T], packed) and torch.equal(buf.x_sf[:T], codecs.pack_bytes_int32(sf))
    else:
        q, sf = codecs.quantize_mxfp8(x)
        assert torch.equal(buf.x[:T].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(buf.x_sf[:T], codecs.pack_bytes_int32(sf))

    # routing: int64 global ids, padding -1 / 0, masked weight 0, rsf folded unless the kernel takes it
    assert buf.topk_idx.dtype == torch.int64 and torch.equal(buf.topk_idx[:T], ids)
    assert bool((buf.topk_idx[T:] == -1).all()) and bool((buf.topk_weights[T:] == 0).all())
    assert buf.topk_weights[2, 0] == 0
    rsf = 1.0 if fn == "fp4_fp4_mega_moe" else 2.5
    valid = ids >= 0
    assert torch.equal(buf.topk_weights[:T][valid], (w * torch.tensor(rsf))[valid])

    # keyword arguments: exactly what this version understands
    assert kw.get("activation_clamp") == 7.0 and kw.get("fast_math", True) is True
    if fn == "fp4_fp4_mega_moe":
        assert kw["l1_alphas"] is layer.l1_alpha and kw["l2_alphas"] is layer.l2_global_scale
        assert kw["a2_scales"] is layer.a2_scales and kw["routed_scaling_factor"] == 2.5
    if fn == "nvfp4_mega_moe":
        assert kw["l1_alpha"] is layer.l1_alpha_gate and kw["l2_alpha"] is layer.l2_alpha
        assert kw["l2_activation_scale"] == 0.25 and kw["use_x_scales"] is True
        assert torch.equal(layer.l2_alpha, layer.l2_global_scale * 0.25)

    # buffer construction per version
    label, bkw = mod.buffers[-1]
    assert (bkw["num_experts"], bkw["T"], bkw["K"], bkw["H"], bkw["I"]) == (8, 20, 2, H, I)
    if version == "dg-2604":
        assert bkw["use_fp8_dispatch"] is True
    elif fn != "nvfp4_mega_moe":
        assert bkw["mma_type"] == spec.row_spec.mma_type
    assert label == ("NVFP4SymmBuffer" if fn == "nvfp4_mega_moe" else "SymmBuffer")

    # the one-time first-launch barrier, and the buffer is reused
    layer(x, w, ids)
    assert group.barriers == 1 and len(mod.buffers) == 1


def test_situ_argument_names_per_version(standin):
    situ = mr.ActivationSpec("situ", situ_beta=4.0, situ_linear_beta=25.0)
    for version, names in (("dg-newer", ("situ_beta", "situ_linear_beta")),
                           ("dgv", ("activation_beta", "activation_linear_beta"))):
        mod = standin(version)
        layer = _filled_layer(_spec("mxfp4", activation=situ), _backend())
        x, w, ids = _inputs(3, 256, 2, 8)
        layer(x, w, ids)
        kw = mod.calls[-1][-1]
        assert kw["activation"] == "situ" and (kw[names[0]], kw[names[1]]) == (4.0, 25.0)
    standin("dg-main")
    with pytest.raises(BackendUnavailableError, match="no SiTU parameters"):
        DeepGemmMegaMoEExperts(_spec("mxfp4", activation=situ), backend=_backend())


def test_missing_features_name_what_is_missing(standin):
    standin("dg-main")
    for row, msg in (("nvfp4", "no NVFP4 mega kernel"), ("mxfp8", "no MXFP8-weight mega kernel")):
        with pytest.raises(BackendUnavailableError, match=msg):
            DeepGemmMegaMoEExperts(_spec(row), backend=_backend())
    standin("dg-2604")
    with pytest.raises(BackendUnavailableError, match="no bf16_mega_moe"):
        DeepGemmMegaMoEExperts(_spec("bf16"), backend=_backend())
    gpt_oss = mr.ActivationSpec("swiglu", clamp=7.0, alpha=1.702, beta=1.0)
    with pytest.raises(BackendUnavailableError, match="activation_alpha"):
        DeepGemmMegaMoEExperts(_spec("mxfp4", activation=gpt_oss), backend=_backend())
    standin("dg-newer")
    with pytest.raises(BackendUnavailableError, match="multiples of 512"):
        DeepGemmMegaMoEExperts(_spec("nvfp4"), backend=_backend())
    with pytest.raises(BackendUnavailableError, match="deep_gemm"):
        DeepGemmBackend("cpu", check_device=False, module=types.ModuleType("deep_gemm"))


def test_fused_fp8_shared_expert_staging(standin):
    mod = standin("dg-newer")
    spec = _spec("mxfp4", shared=mr.SharedSpec("mxfp8", 1, 128))
    layer = _filled_layer(spec, _backend())
    assert layer.shared_fused
    T = 13
    x, w, ids = _inputs(T, 256, 2, 8)
    layer(x, w, ids)
    fn, _, _, _, buf, kw = mod.calls[-1]
    assert kw["shared_l1_weights"][0] is layer.shared_l1_weight and kw["shared_l1_weights"][1] is layer.shared_l1_scale
    assert mod.buffers[-1][1]["num_shared"] == 1
    assert mod.block_m_calls[-1] == (1, 8, buf.num_max_tokens_per_rank, T, 2, "fp8xfp4")
    _, sf = codecs.quantize_mxfp8(x)
    rows = shared_sf_rows(T, 16)
    assert rows[:6].tolist() == [0, 4, 8, 12, 16, 20] and rows[8:10].tolist() == [32, 36]
    assert torch.equal(buf.shared_l1_acts_sf[rows], codecs.pack_bytes_int32(sf))
    assert buf.shared_l1_acts_sf.stride() == (1, buf.shared_l1_acts_sf.shape[0])


def test_fused_shared_nvfp4_variants(standin):
    mod = standin("dg-newer")
    spec = _spec("nvfp4", 512, 512, shared=mr.SharedSpec("bf16", 1, 512))
    layer = _filled_layer(spec, _backend())
    x, w, ids = _inputs(4, 512, 2, 8)
    layer(x, w, ids)
    kw = mod.calls[-1][-1]
    assert kw["shared_l1_weights"] is layer.shared_l1_weight and torch.equal(kw["x_bf16"][:4], x)
    xb = kw["x_bf16"]
    layer(x, w, ids)
    assert mod.calls[-1][-1]["x_bf16"] is xb  # persistent allocation (CUDA graphs burn it in)
    # newer DG fuses BF16 shared only: an MXFP8 shared expert runs outside, decided at construction
    layer2 = _filled_layer(_spec("nvfp4", 512, 512, shared=mr.SharedSpec("mxfp8", 1, 512)), _backend())
    assert not layer2.shared_fused and "BF16 shared experts only" in layer2.shared_reason

    mod = standin("dgv")
    layer = _filled_layer(_spec("nvfp4", shared=mr.SharedSpec("mxfp8", 1, 128)), _backend())
    layer(x[:, :256], w, ids)
    fn, _, _, _, buf, kw = mod.calls[-1]
    assert fn == "nvfp4_mega_moe" and isinstance(kw["shared_l1_weights"], tuple)
    assert mod.buffers[-1][1]["shared_dtype"] == torch.float8_e4m3fn
    q, _ = codecs.quantize_mxfp8(x[:, :256])
    assert torch.equal(buf.shared_l1_acts[:4].view(torch.uint8), q.view(torch.uint8))


def test_dgv_needs_one_l1_alpha_per_expert(standin):
    standin("dgv")
    layer = _filled_layer(_spec("nvfp4"), _backend())
    with torch.no_grad():
        layer.l1_alpha[3, 1] *= 2
    layer.finish_load()
    x, w, ids = _inputs(3, 256, 2, 8)
    with pytest.raises(mr.errors.LayerSpecError, match=r"gate and up weight_scale_2 differ for local experts \[3\]"):
        layer(x, w, ids)


def test_token_limit_and_availability(standin):
    standin("dg-main")
    layer = _filled_layer(_spec("mxfp4"), _backend())
    x, w, ids = _inputs(21, 256, 2, 8)
    with pytest.raises(MegaMoEError, match="max_num_tokens=20"):
        layer(x, w, ids)
    ok = DeepGemmBackend.available("cpu")
    assert ok is not True and "SM100" in ok


def test_import_error_is_clear(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import deep_gemm -> ImportError
    with pytest.raises(BackendUnavailableError, match="needs the deep_gemm package"):
        import_deep_gemm()


@pytest.mark.parametrize("version", ["dg-main", "dg-newer", "dgv"])
def test_recv_stats_tensor_is_handed_to_the_kernel(standin, version):
    """`layer.track_expert_recv_stats()` hands the kernel its int32 [E_l] counter
    (the kernel increments it; the layer must not count a second time)."""
    mod = standin(version)
    layer = _filled_layer(_spec("mxfp4"), _backend())
    stats = layer.track_expert_recv_stats()
    x, w, ids = _inputs(5, 256, 2, 8)
    layer(x, w, ids)
    kw = mod.calls[-1][-1]
    assert kw["cumulative_local_expert_recv_stats"] is stats
    assert stats.dtype == torch.int32 and stats.shape == (8,) and int(stats.sum()) == 0


def test_recv_stats_refused_by_a_version_without_them(standin):
    standin("dg-2604")
    layer = _filled_layer(_spec("mxfp4"), _backend())
    layer.track_expert_recv_stats()
    x, w, ids = _inputs(5, 256, 2, 8)
    with pytest.raises(BackendUnavailableError, match="cumulative_local_expert_recv_stats"):
        layer(x, w, ids)


# --------------------------------------------------------------------------- review regressions


def test_single_rank_without_a_group_reuses_one_buffer(standin):
    """No group and no torch.distributed: every forward must find the buffer the
    first one built (a buffer is a collective allocation + barrier + sync)."""
    mod = standin("dg-main")
    backend = DeepGemmBackend("cpu", check_device=False, max_num_tokens=20)
    layer = _filled_layer(_spec("mxfp4"), backend)
    x, w, ids = _inputs(5, 256, 2, 8)
    for _ in range(3):
        layer(x, w, ids)
    assert len(mod.buffers) == 1
    # a second layer of the same configuration shares it too
    _filled_layer(_spec("mxfp4"), DeepGemmBackend("cpu", check_device=False, max_num_tokens=20))(x, w, ids)
    assert len(mod.buffers) == 1


def test_dgv_fp8_shared_sf_rows_use_the_nvfp4_block_m(standin):
    """DGv's NVFP4 kernel picks its block M with get_block_m_for_nvfp4_mega_moe
    (no mma_type); the shared SF row map must follow that block M."""
    mod = standin("dgv")
    calls = []

    def get_block_m_for_nvfp4_mega_moe(num_ranks, num_experts, num_max_tokens_per_rank, num_tokens, num_topk):
        calls.append((num_ranks, num_experts, num_max_tokens_per_rank, num_tokens, num_topk))
        return 32

    mod.get_block_m_for_nvfp4_mega_moe = get_block_m_for_nvfp4_mega_moe
    layer = _filled_layer(_spec("nvfp4", shared=mr.SharedSpec("mxfp8", 1, 128)), _backend())
    assert layer.shared_fused
    T = 13
    x, w, ids = _inputs(T, 256, 2, 8)
    layer(x, w, ids)
    buf = mod.calls[-1][4]
    assert calls == [(1, 8, buf.num_max_tokens_per_rank, T, 2)] and mod.block_m_calls == []
    _, sf = codecs.quantize_mxfp8(x)
    assert torch.equal(buf.shared_l1_acts_sf[shared_sf_rows(T, 32)], codecs.pack_bytes_int32(sf))
    # without it, an FP8 shared expert is not fused into nvfp4_mega_moe (the SF row map is unknown)
    del mod.get_block_m_for_nvfp4_mega_moe
    layer2 = _filled_layer(_spec("nvfp4", shared=mr.SharedSpec("mxfp8", 1, 128)), _backend())
    assert not layer2.shared_fused and "get_block_m_for_nvfp4_mega_moe" in layer2.shared_reason


def test_dgv_gate_up_alphas_equal_within_the_load_tolerance_pass(standin):
    """The loaders accept w1/w3 weight_scale_2 within relative 1e-5 (docs/SCALES.md#w1-w3-agreement);
    DGv's one-alpha check must not refuse what the load accepted."""
    mod = standin("dgv")
    layer = _filled_layer(_spec("nvfp4"), _backend())
    with torch.no_grad():
        layer.l1_alpha[3, 1] = layer.l1_alpha[3, 0] * (1 + 2e-6)
    layer.finish_load()
    assert not torch.equal(layer.l1_alpha[:, 0], layer.l1_alpha[:, 1])
    x, w, ids = _inputs(3, 256, 2, 8)
    layer(x, w, ids)
    assert mod.calls[-1][-1]["l1_alpha"] is layer.l1_alpha_gate


def test_forward_makes_no_host_to_device_tensors(standin):
    """No ``torch.tensor(...)`` of host data on the forward path: on CUDA each is a
    synchronizing H2D copy (and illegal while capturing a CUDA graph)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Lifts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.lift_fresh.default:
                self.n += 1
            return func(*args, **(kwargs or {}))

    for version, row, shared in (("dg-newer", "mxfp4", mr.SharedSpec("mxfp8", 1, 128)), ("dgv", "nvfp4", None),
                                 ("dg-main", "bf16", None)):
        standin(version)
        layer = _filled_layer(_spec(row, routed_scaling_factor=2.5, shared=shared), _backend())
        x, w, ids = _inputs(5, 256, 2, 8)
        layer(x, w, ids)
        with Lifts() as m:
            layer(x, w, ids)
        assert m.n == 0, (version, row)
    assert shared_sf_rows(5, 16, device="meta").device.type == "meta"


# --------------------------------------------------------------------------- NVFP4 dispatch per entry point


def _dg_cast_to_nvfp4(x: torch.Tensor, token_scale: torch.Tensor | None = None):
    """Independent model of DeepGEMM's NVFP4 input quantizer, written from its tests
    (deepseek-ai/DeepGEMM tests/test_nvfp4_mega_moe.py @794783a L14-38: per 16,
    ``sf = e4m3(max(amax/6, 2^-9))`` at global 1.0, RNE on the E2M1 grid by midpoint
    counting, sign only on a nonzero code). ``token_scale``: first divide each token
    by it (DGv's per-token ``x_scales``). Returns (decoded E2M1 values, sf bytes)."""
    xf = x.float()
    if token_scale is not None:
        xf = xf / token_scale[:, None]
    blocks = xf.view(x.shape[0], -1, 16)
    sf = (blocks.abs().amax(dim=2) / 6.0).clamp_min(2.0 ** -9).to(torch.float8_e4m3fn)
    v = (blocks / sf.float().unsqueeze(2)).abs()
    code = torch.zeros_like(v, dtype=torch.int64)
    for b in (0.25, 1.25, 2.5, 5.0):
        code += (v > b).long()
    for b in (0.75, 1.75, 3.5):
        code += (v >= b).long()
    mag = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])[code]
    vals = torch.where((blocks < 0) & (code != 0), -mag, mag)
    return vals.reshape(x.shape), sf.view(torch.uint8)


@pytest.mark.parametrize("version", ["dg-newer", "dgv"])
def test_nvfp4_staged_x_is_the_reference_dispatch_of_the_entry_point(standin, version):
    """Each NVFP4 entry point gets x the way its own DeepGEMM test quantizes it
    (upstream fp4_fp4_mega_moe: global 1.0, no token scale; DGv nvfp4_mega_moe:
    per-token x_scales), byte for byte what `reference_forward(...,
    nvfp4_entry_point=backend.entry_point(spec))` decodes. Negative control: the
    other entry point's bytes differ on these tokens (amaxes over 5 decades)."""
    from megamoe_runtime.backends.reference import quantize_dispatch_nvfp4

    mod = standin(version)
    H, I = (512, 512) if version == "dg-newer" else (256, 128)
    spec = _spec("nvfp4", H, I)
    layer = _filled_layer(spec, _backend())
    entry = layer.backend.entry_point(spec)
    assert entry == {"dg-newer": "fp4_fp4_mega_moe", "dgv": "nvfp4_mega_moe"}[version]
    T = 6
    x, w, ids = _inputs(T, H, 2, 8)
    x = (x.float() * torch.logspace(-3, 2, T)[:, None]).to(torch.bfloat16)
    layer(x, w, ids)
    buf = mod.calls[-1][4]
    packed, sf, tok = quantize_dispatch_nvfp4(x, entry)
    assert torch.equal(buf.x[:T].view(torch.uint8), packed)
    assert torch.equal(buf.x_sf[:T], codecs.pack_bytes_int32(sf))
    staged_vals = codecs.e2m1_decode(codecs.unpack_e2m1(buf.x[:T].view(torch.uint8)))
    staged_sf = codecs.unpack_int32_bytes(buf.x_sf[:T], H // 16)
    if version == "dgv":
        assert torch.equal(buf.x_scales[:T], tok)
        assert torch.equal(tok, x.float().abs().amax(-1) / 2688.0)
        want_vals, want_sf = _dg_cast_to_nvfp4(x, tok)
    else:
        assert tok is None and not hasattr(buf, "x_scales")
        want_vals, want_sf = _dg_cast_to_nvfp4(x)
    assert torch.equal(staged_sf, want_sf)
    assert torch.equal(staged_vals, want_vals)  # -0.0 == 0.0: DeepGEMM writes +0, the codecs -0
    other = "nvfp4_mega_moe" if entry == "fp4_fp4_mega_moe" else "fp4_fp4_mega_moe"
    p2, sf2, _ = quantize_dispatch_nvfp4(x, other)
    assert not torch.equal(sf2.view(torch.uint8), sf.view(torch.uint8))
    assert not torch.equal(_dg_cast_to_nvfp4(x, None if version == "dgv" else x.float().abs().amax(-1) / 2688.0)[1],
                           staged_sf)


@pytest.mark.parametrize("version, entry", [("dg-newer", "fp4_fp4_mega_moe"), ("dgv", "nvfp4_mega_moe")])
def test_reference_backend_takes_the_entry_point_of_the_layers_backend(standin, version, entry):
    """ReferenceBackend().forward(layer) on a layer built for the deepgemm backend models
    the dispatch of the entry point that layer runs; an explicit entry point wins."""
    from megamoe_runtime.backends.reference import ReferenceBackend, reference_forward

    standin(version)
    H, I = (512, 512) if version == "dg-newer" else (256, 128)
    spec = _spec("nvfp4", H, I)
    layer = _filled_layer(spec, _backend())
    T = 4
    x, w, ids = _inputs(T, H, 2, 8)
    x = (x.float() * torch.logspace(-3, 2, T)[:, None]).to(torch.bfloat16)
    ref = ReferenceBackend()
    assert ref.entry_point_for(layer) == entry
    got = ref.forward(layer, x, w, ids)
    kt = layer.kernel_tensors()
    sc = ref._scalars(layer, x.device)
    want = reference_forward(spec, kt, x, w, ids, scalars=sc, nvfp4_entry_point=entry)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    other = "nvfp4_mega_moe" if entry == "fp4_fp4_mega_moe" else "fp4_fp4_mega_moe"
    forced = ReferenceBackend(nvfp4_entry_point=other).forward(layer, x, w, ids)
    assert torch.equal(forced.view(torch.int16),
                       reference_forward(spec, kt, x, w, ids, scalars=sc, nvfp4_entry_point=other).view(torch.int16))
    assert not torch.equal(forced.view(torch.int16), got.view(torch.int16))


# --------------------------------------------------------------------------- layout flavours


def _sgl_sm100_standin(typed: bool) -> types.ModuleType:
    """The SM100 API surface of an SGLang build that `deepgemm.package_layouts` reads (nothing here is called):
    ``fp8_fp4_mega_moe``, ``bf16_mega_moe`` and ``nvfp4_mega_moe`` without an ``NVFP4SymmBuffer`` (from
    0.1.7 a wrapper over ``fp8_fp4_mega_moe`` on an ``nvfp4xnvfp4`` buffer), and a
    ``transform_weights_for_mega_moe`` that takes ``mma_type`` (``typed``: 0.1.7 .. 0.2.5) or not."""
    mod = types.ModuleType("deep_gemm")
    mod.__version__ = "0.2.5" if typed else "0.1.5"

    def never(*args, **kwargs):
        raise AssertionError("a layout check must not launch anything")

    mod.fp8_fp4_mega_moe = mod.nvfp4_mega_moe = mod.bf16_mega_moe = never
    if typed:
        def transform_weights_for_mega_moe(l1_weights, l2_weights, activation="swiglu", mma_type="fp8xfp4"):
            never()
    else:
        def transform_weights_for_mega_moe(l1_weights, l2_weights, activation="swiglu"):
            never()
    mod.transform_weights_for_mega_moe = transform_weights_for_mega_moe
    return mod


def test_a_build_reading_another_layout_flavour_is_refused_naming_both(ckpts):
    """An nvfp4 folder (interleave8, megamoe.json "layout") into a DeepGEMM whose NVFP4 kernel reads the
    packed-FP4 flavour: the layer is not built, one line names both flavours (docs/LAYOUT.md#layout-flavours).
    The same build runs the mxfp4 row (interleave8); one without typed kinds gives no layout refusal."""
    from megamoe_runtime.format.formats import LAYOUT_SM100, LAYOUT_SM100_PACKED_FP4

    _, out = ckpts.converted("modelopt-nvfp4")
    ckpt = mr.open_checkpoint(out)
    assert ckpt.manifest.layout == ckpt.manifest.layout_flavour == LAYOUT_SM100
    index = ckpt.manifest.layers[0].index
    packed = DeepGemmBackend("cpu", check_device=False, module=_sgl_sm100_standin(typed=True))
    assert packed.api.layouts["nvfp4"][0] == LAYOUT_SM100_PACKED_FP4
    assert {packed.api.layouts[r][0] for r in ("mxfp4", "mxfp8", "bf16")} == {LAYOUT_SM100}
    with pytest.raises(BackendUnavailableError) as e:
        ckpt.build_layer(index, backend=packed)
    msg = str(e.value)
    assert "\n" not in msg and f"holds row 'nvfp4' in DeepGEMM layout '{LAYOUT_SM100}'" in msg, msg
    assert f"deep_gemm 0.2.5 reads that row in layout '{LAYOUT_SM100_PACKED_FP4}'" in msg, msg
    _, out4 = ckpts.converted("modelopt-mxfp4")
    ck4 = mr.open_checkpoint(out4)
    ck4.allocate_layer(ck4.manifest.layers[0].index, backend=packed, fuse_shared=False)
    # negative control: a build whose transform has no typed FP4 kinds is not refused for its layout
    plain = DeepGemmBackend("cpu", check_device=False, module=_sgl_sm100_standin(typed=False))
    assert plain.api.layouts["nvfp4"][0] == LAYOUT_SM100
    with pytest.raises(BackendUnavailableError) as e:
        ckpt.build_layer(index, backend=plain)
    assert "layout" not in str(e.value) and "NVFP4SymmBuffer" in str(e.value)
