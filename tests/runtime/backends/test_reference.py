"""Tests for megamoe_runtime.backends.reference, the forward numerics.

The backend decodes KERNEL-layout bytes (layout readers + codecs). The oracle
here is written independently, straight from docs/NUMERICS.md, in float64, on
the CANONICAL weights decoded by its own few lines (no layout, no codecs
dequantizers, its own RNE-on-a-grid quantizers), with the same rounding
points (bf16 after L1, requant of the intermediate, bf16 slots, combine).
The two meet only at the checkpoint-encoding bytes the codecs quantizers
produced, so a layout or ordering bug in the backend shows up as a
disagreement, and the negative controls prove that it does.
"""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from megamoe_runtime.backends import get_backend
from megamoe_runtime.format import codecs, layout, scales
from megamoe_runtime.backends.reference import (
    NvScalars,
    ReferenceBackend,
    activation_fp32,
    apply_clamp,
    combine_slots,
    reference_forward,
    reference_pairs,
    quantize_dispatch_nvfp4,
    reference_slots,
    shared_slot,
)
from megamoe_runtime.errors import LayoutError, MegaMoEError, ScaleError
from megamoe_runtime.format.canonical import ExpertTensors, ProjectionTensors
from megamoe_runtime.format.formats import ActivationSpec, LayerSpec, SharedSpec, get_row
from megamoe_runtime.testing import calc_diff

H, I, E, K, T = 128, 128, 4, 2, 16
S, I_S = 2, 64  # two shared experts of width 64, folded to 128
RSF = 0.75
#: Oracle agreement bound. Measured over 6 seeds x 22 cases: 0.0 (bitwise) for
#: every nvfp4 and mxfp4 case, <= 4.4e-9 for mxfp8 / bf16 (fp32 vs float64
#: accumulation flipping a rare bf16 rounding); negative controls give 7e-6 .. 1.
TOL = 1e-7

ACTS = {
    "swiglu": ActivationSpec("swiglu"),
    "swiglu_clamp_ab": ActivationSpec("swiglu", clamp=0.75, alpha=1.702, beta=1.0),
    "situ": ActivationSpec("situ", situ_beta=2.0, situ_linear_beta=1.5),
}
# row -> (activations, shared precisions) exercised
MATRIX = {
    "mxfp4": (("swiglu", "swiglu_clamp_ab", "situ"), (None, "mxfp8")),
    "mxfp8": (("swiglu", "swiglu_clamp_ab", "situ"), (None, "mxfp8")),
    "nvfp4": (("swiglu", "swiglu_clamp_ab"), (None, "bf16", "mxfp8")),
    "bf16": (("swiglu", "swiglu_clamp_ab"), (None, "bf16")),
}
CASES = [(r, a, s) for r, (acts, shs) in MATRIX.items() for a in acts for s in shs]


def _id(c):
    return f"{c[0]}-{c[1]}-shared_{c[2]}"


# =========================================================================== the float64 oracle

_E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def o_decode(row, p: ProjectionTensors) -> torch.Tensor:
    """Canonical projection -> float64 [out, in], global scale applied. Own code:
    low nibble first; UE8M0 byte s = 2^(s-127); E4M3 via torch's exact cast."""
    row = get_row(row)
    w = row.weight
    if w.element == "bf16":
        return p.weight.double()
    if w.element == "e2m1":
        b = p.weight.to(torch.int64)
        v = _E2M1[torch.stack((b & 15, b >> 4), dim=-1).reshape(b.shape[0], -1)]
    else:
        v = p.weight.to(torch.float32).double()
    if w.scale_encoding == "ue8m0":
        s, grp = torch.pow(2.0, p.scale.to(torch.float64) - 127), 32
    else:
        s, grp = p.scale.to(torch.float32).double(), 16
    v = v * s.repeat_interleave(grp, dim=1)
    return v * (1.0 if p.global_scale is None else p.global_scale)


def rne(v, mant, emin, vmax):
    """Round-half-even onto a minifloat grid, saturating at +-vmax (e4m3: 3, -6, 448;
    e2m1: 1, 0, 6)."""
    v = v.clamp(-vmax, vmax)
    e = torch.floor(torch.log2(v.abs())).clamp(min=emin)
    ulp = torch.pow(2.0, e - mant)
    return torch.round(v / ulp) * ulp


def o_mxfp8(a):
    """Per row per 32: UE8M0 = 2^ceil(log2(max(amax,1e-4)/448)), e4m3 RNE sat; dequantized."""
    g = a.reshape(*a.shape[:-1], -1, 32)
    amax = g.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    sc = torch.pow(2.0, torch.ceil(torch.log2(amax / 448)).clamp(-126, 127))
    return (rne(g / sc, 3, -6, 448) * sc).reshape(a.shape)


def o_nvfp4(a, gs):
    """Per row per 16: inv = 1/gs, sf = e4m3(max(amax/6*inv, 2^-9)), q = e2m1(a*inv/sf);
    returns q*sf*gs. The scaled values that feed a rounding are formed in fp32, as
    the kernel forms them: with bf16 inputs, exact E2M1 midpoints are common
    (e.g. x/amax = 5/24 -> 560/448 = 1.25), and only the fp32 value says which
    side of a tie a number is on. ``gs`` a float or a per-row column."""
    a32 = a.to(torch.float32)
    g = a32.reshape(*a.shape[:-1], -1, 16)
    gs32 = torch.as_tensor(gs, dtype=torch.float32)
    inv = 1.0 / gs32
    inv = inv.reshape(-1, 1, 1) if inv.dim() else inv
    amax = g.abs().amax(-1, keepdim=True)
    sf = rne((amax / 6 * inv).clamp(min=2.0 ** -9).double(), 3, -6, 448)
    q = rne((g * inv / sf.float()).double(), 1, 0, 6)
    gs64 = gs32.double().reshape(-1, 1, 1) if gs32.dim() else gs32.double()
    return (q * sf * gs64).reshape(a.shape)


def o_nvfp4_token(x):
    """DGv per-token dispatch: token scale fl32(amax_t/2688), x/scale in fp32, then
    NVFP4 with global 1."""
    ts = (x.abs().amax(-1).clamp(min=1e-12).float() / 2688.0)
    xs = x.float() / ts[:, None]
    return o_nvfp4(xs.double(), 1.0) * ts.double()[:, None]


def bf(v):
    return v.to(torch.bfloat16).to(torch.float64)


def o_act(act: ActivationSpec, g, u):
    if act.kind == "swiglu":
        return g * torch.sigmoid(act.alpha * g) * (u + act.beta)
    b, bl = act.situ_beta, act.situ_linear_beta
    return torch.sigmoid(g) * b * torch.tanh(g / b) * bl * torch.tanh(u / bl)


def o_l1(act, xq, G, U):
    g, u = bf(xq @ G.T), bf(xq @ U.T)
    if act.clamp is not None:
        c = bf(torch.tensor(act.clamp, dtype=torch.float64))
        g, u = torch.minimum(g, c), torch.clamp(u, -c, c)
    return o_act(act, g, u)


def o_nvfp4_unit_global(x):
    """Upstream DG fp4_fp4_mega_moe dispatch: NVFP4 with global 1, no token scale
    (DG tests/test_nvfp4_mega_moe.py ``_cast_to_nvfp4(x)``)."""
    return o_nvfp4(x, 1.0)


O_NVFP4_DISPATCH = {"nvfp4_mega_moe": o_nvfp4_token, "fp4_fp4_mega_moe": o_nvfp4_unit_global}


def oracle(spec: LayerSpec, experts_dq, x, w, ids, a2=None, shared_dq=None, shared_prec=None,
           nvfp4_entry="nvfp4_mega_moe"):
    """Straightforward per (token, slot) float64 forward, docs/NUMERICS.md."""
    row, act, rsf = spec.row, spec.activation, spec.routed_scaling_factor
    x = x.double()
    xq = {"mxfp4": o_mxfp8, "mxfp8": o_mxfp8, "nvfp4": O_NVFP4_DISPATCH[nvfp4_entry], "bf16": lambda v: v}[row](x)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        routed = []
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0 or e not in spec.local_experts:
                continue
            G, U, D = experts_dq[e]
            a = o_l1(act, xq[t], G, U)
            if row == "nvfp4":
                p = bf(o_nvfp4(a, a2) @ D.T)
                routed.append(bf(p * float(w[t, k])))
            else:
                wf = float(torch.tensor(float(w[t, k]) * rsf, dtype=torch.float32))  # fp32 w*rsf
                a = o_mxfp8(a * wf) if row != "bf16" else bf(a * wf)
                routed.append(bf(a @ D.T))
        sh = None
        if shared_dq is not None:
            xs = o_mxfp8(x[t]) if shared_prec == "mxfp8" else x[t]
            acc = 0
            for G, U, D in shared_dq:  # S experts: folded requant blocks never cross them
                a = o_l1(act, xs, G, U)
                a = o_mxfp8(a) if shared_prec == "mxfp8" else bf(a)
                acc = acc + a @ D.T
            sh = bf(acc)
        if row == "nvfp4":
            r = bf(sum(routed, torch.zeros(x.shape[1], dtype=torch.float64)))
            if rsf != 1.0:
                r = bf(r * rsf)
            out[t] = bf(r + sh) if sh is not None else r
        else:
            tot = sum(routed, torch.zeros(x.shape[1], dtype=torch.float64))
            out[t] = bf(tot + sh) if sh is not None else bf(tot)
    return out


def o_unquantized(spec, masters, x, w, ids, shared_masters=None):
    """Sanity model: bf16 master weights, no quantization or rounding at all."""
    x = x.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e >= 0:
                G, U, D = (m.double() for m in masters[e])
                out[t] += spec.routed_scaling_factor * float(w[t, k]) * (
                    o_act(spec.activation, x[t] @ G.T, x[t] @ U.T) @ D.T)
        for G, U, D in (shared_masters or []):
            G, U, D = G.double(), U.double(), D.double()
            out[t] += o_act(spec.activation, x[t] @ G.T, x[t] @ U.T) @ D.T
    return out


# =========================================================================== building cases


def quantize_proj(row, w: torch.Tensor) -> ProjectionTensors:
    el = get_row(row).weight
    if el.element == "bf16":
        return ProjectionTensors(w.to(torch.bfloat16))
    if el.scale_encoding == "e4m3":
        packed, sf, gs = codecs.quantize_nvfp4_weight(w)
        return ProjectionTensors(packed, sf, global_scale=gs)
    q, sf = (codecs.quantize_mxfp4 if el.element == "e2m1" else codecs.quantize_mxfp8)(w)
    return ProjectionTensors(q, sf)


def master_expert(gen, h, i, scale=1.0):
    """bf16 (gate [i,h], up [i,h], down [h,i]) with a few outlier input columns,
    so scale factors differ between groups."""
    def mat(o, n):
        m = torch.randn(o, n, generator=gen) / math.sqrt(n) * scale
        m[:, torch.randint(0, n, (3,), generator=gen)] *= 8
        return m.to(torch.bfloat16)
    return mat(i, h), mat(i, h), mat(h, i)


def routing(gen, t, k, e):
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    w = torch.rand(t, k, generator=gen) + 0.05
    return (w / w.sum(1, keepdim=True)).float(), ids


@dataclasses.dataclass
class Case:
    spec: LayerSpec
    masters: list
    experts: list  # canonical ExpertTensors
    kt: layout.KernelTensors
    scalars: NvScalars | None
    shared_masters: list | None
    shared_experts: list | None
    shared_kt: layout.KernelTensors | None
    x: torch.Tensor
    w: torch.Tensor
    ids: torch.Tensor
    a2: float | None

    def dq(self):
        return [tuple(o_decode(self.spec.row, p) for p in (ex.gate, ex.up, ex.down)) for ex in self.experts]

    def shared_dq(self):
        if self.shared_experts is None:
            return None
        return [tuple(o_decode(self.spec.shared.precision, p) for p in (ex.gate, ex.up, ex.down))
                for ex in self.shared_experts]

    def run(self, **kw):
        args = dict(scalars=self.scalars, shared=self.shared_kt)
        args.update(kw)
        spec = args.pop("spec", self.spec)
        kt = args.pop("kt", self.kt)
        return reference_forward(spec, kt, args.pop("x", self.x), args.pop("w", self.w),
                                 args.pop("ids", self.ids), **args)

    def oracle(self, **kw):
        return oracle(kw.get("spec", self.spec), kw.get("dq", self.dq()), kw.get("x", self.x),
                      kw.get("w", self.w), kw.get("ids", self.ids), self.a2,
                      self.shared_dq(), None if self.spec.shared is None else self.spec.shared.precision,
                      kw.get("nvfp4_entry", "nvfp4_mega_moe"))


def make_case(row, act="swiglu", shared=None, rsf=RSF, seed=0, t=T) -> Case:
    gen = torch.Generator().manual_seed(seed)
    sspec = None if shared is None else SharedSpec(shared, S, I_S)
    spec = LayerSpec(row, H, I, E, K, ACTS[act], shared=sspec, routed_scaling_factor=rsf)
    masters = [master_expert(gen, H, I, scale=1.0 + 0.5 * e) for e in range(E)]
    experts = [ExpertTensors(*(quantize_proj(row, m) for m in ms)) for ms in masters]
    kt = layout.pack_expert_stack(row, experts)
    x = (torch.randn(t, H, generator=gen) * torch.linspace(0.5, 3.0, t)[:, None]).to(torch.bfloat16)
    w, ids = routing(gen, t, K, E)
    scalars = a2 = None
    if row == "nvfp4":
        # a2 = amax of the (unquantized) expert intermediate / 2688, as DG's test picks it
        amax = max(float(o_act(spec.activation, x.double() @ g.double().T, x.double() @ u.double().T)
                         .abs().max()) for g, u, _ in masters)
        a2 = float(torch.tensor(amax / 2688.0, dtype=torch.float32))
        scalars = NvScalars(
            torch.tensor([[ex.gate.global_scale, ex.up.global_scale] for ex in experts], dtype=torch.float32),
            torch.tensor([ex.down.global_scale for ex in experts], dtype=torch.float32),
            torch.tensor(a2, dtype=torch.float32))
    sm = se = skt = None
    if shared is not None:
        sm = [master_expert(gen, H, I_S) for _ in range(S)]
        se = [ExpertTensors(*(quantize_proj(shared, m) for m in ms)) for ms in sm]
        skt = layout.pack_shared(shared, se)
    return Case(spec, masters, experts, kt, scalars, sm, se, skt, x, w, ids, a2)


# =========================================================================== 1. oracle agreement

@pytest.mark.parametrize("case_key", CASES, ids=_id)
def test_matches_float64_oracle(case_key):
    c = make_case(*case_key)
    ref = c.run()
    assert ref.dtype == torch.bfloat16 and ref.shape == (T, H)
    assert torch.isfinite(ref.float()).all()
    d = calc_diff(ref, c.oracle())
    print(f"calc_diff[{_id(case_key)}] = {d:.3e}")
    assert d < TOL, d
    # the result is not trivially small
    assert float(ref.float().abs().mean()) > 1e-3


ENTRIES = ("nvfp4_mega_moe", "fp4_fp4_mega_moe")


@pytest.mark.parametrize("shared", [None, "bf16"])
@pytest.mark.parametrize("entry", ENTRIES)
def test_nvfp4_reference_models_the_dispatch_of_its_entry_point(entry, shared):
    """DGv nvfp4_mega_moe takes x with a per-token scale, upstream fp4_fp4_mega_moe
    at global 1.0: reference_forward follows the entry point it is told (and the
    backend built for it), and the other entry point's oracle does not match
    (negative control: the conventions really differ on this input)."""
    c = make_case("nvfp4", "swiglu_clamp_ab", shared)
    ref = c.run(nvfp4_entry_point=entry)
    assert calc_diff(ref, c.oracle(nvfp4_entry=entry)) < TOL
    other = next(e for e in ENTRIES if e != entry)
    assert calc_diff(ref, c.oracle(nvfp4_entry=other)) > 1e3 * TOL
    if entry == "nvfp4_mega_moe":  # the default
        assert torch.equal(ref.view(torch.int16), c.run().view(torch.int16))
    layer = SimpleNamespace(spec=c.spec, l1_weight=c.kt.l1_weight, l1_scale=c.kt.l1_scale,
                                  l2_weight=c.kt.l2_weight, l2_scale=c.kt.l2_scale,
                                  l1_alpha=c.scalars.l1_alpha, l2_global_scale=c.scalars.l2_global_scale,
                                  l2_activation_scale=c.scalars.l2_activation_scale)
    via_backend = ReferenceBackend(nvfp4_entry_point=entry).forward(layer, c.x, c.w, c.ids)
    assert torch.equal(via_backend.view(torch.int16), c.run(nvfp4_entry_point=entry, shared=None).view(torch.int16))


def test_nvfp4_dispatch_quantizers():
    x = (torch.randn(6, 64, generator=torch.Generator().manual_seed(3)) * 40).to(torch.bfloat16)
    p, sf, tok = quantize_dispatch_nvfp4(x, "fp4_fp4_mega_moe")
    assert tok is None and torch.equal(codecs.dequantize_nvfp4(p, sf, 1.0).double(), o_nvfp4_unit_global(x.double()))
    p, sf, tok = quantize_dispatch_nvfp4(x, "nvfp4_mega_moe")
    assert torch.equal(codecs.dequantize_nvfp4(p, sf, 1.0).double() * tok.double()[:, None], o_nvfp4_token(x.double()))
    assert quantize_dispatch_nvfp4(x)[2] is not None  # default: DGv per-token
    with pytest.raises(MegaMoEError, match="unknown NVFP4 entry point 'nvfp4_moe'"):
        quantize_dispatch_nvfp4(x, "nvfp4_moe")
    with pytest.raises(MegaMoEError, match="known: fp4_fp4_mega_moe, nvfp4_mega_moe"):
        ReferenceBackend(nvfp4_entry_point="bogus")


@pytest.mark.parametrize("case_key", CASES, ids=_id)
def test_fast_math_flag_does_not_change_reference(case_key):
    c = make_case(*case_key, t=4)
    assert torch.equal(c.run(fast_math=True).view(torch.int16), c.run().view(torch.int16))


# =========================================================================== 2. sanity vs unquantized

SANITY = {"mxfp4": 0.05, "nvfp4": 0.05, "mxfp8": 5e-3, "bf16": 1e-3}


@pytest.mark.parametrize("row", list(MATRIX))
@pytest.mark.parametrize("shared", [None, "own"])
def test_close_to_unquantized_bf16_weights(row, shared):
    sh = None if shared is None else MATRIX[row][1][1]
    c = make_case(row, "swiglu", sh)
    ref = c.run()
    d = calc_diff(ref, o_unquantized(c.spec, c.masters, c.x, c.w, c.ids, c.shared_masters))
    print(f"sanity calc_diff[{row}, shared={sh}] = {d:.3e}")
    assert d < SANITY[row], d


# =========================================================================== 3. negative controls


def _mn_major_clone(sf):
    return layout.kernel_view_from_physical(layout.physical(sf).clone())


def _deinterleaved(kt):
    """L1 weight rows stored [gate | up] (no interleave); scales left correct."""
    bad = kt.l1_weight.clone()
    n = torch.tensor([layout.deinterleave_row(r, I) for r in range(2 * I)])
    src = kt.l1_weight[:, n]  # logical order
    bad.copy_(src)
    return dataclasses.replace(kt, l1_weight=bad)


def _halves_swapped(kt):
    """Kernel L1 weight rows [g0..7,u0..7,...] -> [u0..7,g0..7,...] (weights only)."""
    v = kt.l1_weight.unflatten(1, (2 * I // 16, 2, 8))
    return dataclasses.replace(kt, l1_weight=v.flip(2).flatten(1, 3).contiguous())


def _no_utccp(kt):
    """Scales interleaved but not UTCCP-permuted (logical row r stored at r)."""
    def undo(sf):
        mn = sf.shape[-2]
        perm = torch.tensor([layout.utccp_row(r) for r in range(mn)])
        out = _mn_major_clone(sf)
        out.copy_(sf[:, perm])
        return out
    return dataclasses.replace(kt, l1_scale=undo(kt.l1_scale), l2_scale=undo(kt.l2_scale))


def _scale_byte_plus_one(kt, e, step):
    """Add `step` to byte 0 of one int32 of expert e's L1 scale (+1 = one UE8M0
    exponent; +8 = one E4M3 exponent)."""
    bad = _mn_major_clone(kt.l1_scale)
    b0 = int(bad[e, 0, 0]) & 0xFF
    assert b0 + step < 0x7F
    bad[e, 0, 0] += step
    return dataclasses.replace(kt, l1_scale=bad)


def _gate_up_swapped(c):
    exs = [ExpertTensors(ex.up, ex.gate, ex.down) for ex in c.experts]
    return layout.pack_expert_stack(c.spec.row, exs)


WRONG_ACT = {"swiglu": "situ", "swiglu_clamp_ab": "swiglu", "situ": "swiglu"}
NEG_CASES = [("mxfp4", "swiglu_clamp_ab"), ("mxfp8", "situ"), ("nvfp4", "swiglu_clamp_ab"),
             ("bf16", "swiglu_clamp_ab")]


@pytest.mark.parametrize("row,act", NEG_CASES)
def test_negative_controls_fail_the_oracle(row, act):
    c = make_case(row, act)
    want = c.oracle()
    assert calc_diff(c.run(), want) < TOL
    e_hot = int(c.ids[0, 0])
    bad = {
        "interleave_missing": dict(kt=_deinterleaved(c.kt)),
        "kernel_halves_swapped": dict(kt=_halves_swapped(c.kt)),
        "gate_up_swapped": dict(kt=_gate_up_swapped(c)),
    }
    if c.spec.row_spec.has_scales:
        bad["utccp_missing"] = dict(kt=_no_utccp(c.kt))
        step = 1 if c.spec.row_spec.weight.scale_encoding == "ue8m0" else 8
        bad["scale_exponent_plus_one"] = dict(kt=_scale_byte_plus_one(c.kt, e_hot, step))
    wrong = WRONG_ACT[act]
    if wrong in c.spec.row_spec.activations:
        bad["wrong_activation"] = dict(spec=dataclasses.replace(c.spec, activation=ACTS[wrong]))
    else:
        bad["wrong_activation"] = dict(spec=dataclasses.replace(c.spec, activation=ACTS["swiglu"]))
    for name, kw in bad.items():
        d = calc_diff(c.run(**kw), want)
        print(f"negative control {row}/{name}: calc_diff = {d:.3e}")
        assert d > 10 * TOL, (name, d)


def test_negative_control_shared_utccp_and_interleave():
    c = make_case("mxfp4", "swiglu", "mxfp8")
    want = c.oracle()
    assert calc_diff(c.run(), want) < TOL
    skt = c.shared_kt
    bad_il = dataclasses.replace(skt, l1_weight=skt.l1_weight.unflatten(0, (2 * S * I_S // 16, 2, 8))
                                 .flip(1).flatten(0, 2).contiguous())
    bad_utccp = layout.KernelTensors(*_no_utccp(layout.KernelTensors(
        skt.l1_weight[None], skt.l1_scale[None], skt.l2_weight[None], skt.l2_scale[None])).named().values())
    bad_utccp = layout.KernelTensors(bad_utccp.l1_weight[0], bad_utccp.l1_scale[0],
                                     bad_utccp.l2_weight[0], bad_utccp.l2_scale[0])
    for name, sk in (("shared_halves_swapped", bad_il), ("shared_utccp_missing", bad_utccp)):
        d = calc_diff(c.run(shared=sk), want)
        print(f"negative control {name}: calc_diff = {d:.3e}")
        assert d > 10 * TOL, (name, d)


# =========================================================================== 4. edge cases


@pytest.mark.parametrize("row,shared", [("mxfp4", "mxfp8"), ("nvfp4", "bf16"), ("bf16", None),
                                        ("mxfp8", None)])
def test_masked_slots_with_nan_weights_do_not_leak(row, shared):
    c = make_case(row, "swiglu", shared)
    ids, w = c.ids.clone(), c.w.clone()
    ids[1, 0] = -1
    w[1, 0] = float("nan")
    ids[3, 1] = -1
    w[3, 1] = float("inf")
    ids[5] = -1  # fully masked token
    w[5] = float("nan")
    out = c.run(ids=ids, w=w)
    assert torch.isfinite(out.float()).all()
    w0 = torch.where(ids < 0, torch.zeros_like(w), w)
    assert torch.equal(out.view(torch.int16), c.run(ids=ids, w=w0).view(torch.int16))
    assert calc_diff(out, c.oracle(ids=ids, w=w0)) < TOL
    if shared is None:
        assert torch.equal(out[5], torch.zeros(H, dtype=torch.bfloat16))
    else:
        sh = shared_slot(c.spec, c.shared_kt, c.x)
        assert torch.equal(out[5].view(torch.int16), sh[5].view(torch.int16))
        assert not torch.equal(out[5], torch.zeros(H, dtype=torch.bfloat16))


@pytest.mark.parametrize("row,shared", [("mxfp4", "mxfp8"), ("nvfp4", "bf16"), ("bf16", "bf16"),
                                        ("mxfp8", None)])
def test_zero_tokens(row, shared):
    c = make_case(row, "swiglu", shared, t=4)
    x = torch.empty(0, H, dtype=torch.bfloat16)
    out = c.run(x=x, w=torch.empty(0, K), ids=torch.empty(0, K, dtype=torch.int64))
    assert out.shape == (0, H) and out.dtype == torch.bfloat16
    _, rs = c.run(x=x, w=torch.empty(0, K), ids=torch.empty(0, K, dtype=torch.int64), return_slots=True)
    assert rs.slots.shape[0] == 0 and rs.valid.shape[0] == 0


@pytest.mark.parametrize("row", ["mxfp4", "mxfp8", "bf16"])
def test_rsf_is_folded_into_the_weight_for_l1_stage_rows(row):
    c = make_case(row, "swiglu_clamp_ab", rsf=RSF)
    folded = (c.w * torch.tensor(RSF, dtype=torch.float32))
    spec1 = dataclasses.replace(c.spec, routed_scaling_factor=1.0)
    assert torch.equal(c.run().view(torch.int16), c.run(spec=spec1, w=folded).view(torch.int16))
    # and the slots carry the weight (so they differ from rsf=1 with raw weights)
    _, a = c.run(return_slots=True)
    _, b = c.run(spec=spec1, return_slots=True)
    assert not torch.equal(a.slots, b.slots)


@pytest.mark.parametrize("shared", [None, "bf16", "mxfp8"])
def test_rsf_is_applied_after_the_routed_sum_for_nvfp4(shared):
    c = make_case("nvfp4", "swiglu", shared, rsf=RSF)
    spec1 = dataclasses.replace(c.spec, routed_scaling_factor=1.0)
    out, rs = c.run(return_slots=True)
    out1, rs1 = c.run(spec=spec1, return_slots=True)
    assert torch.equal(rs.slots.view(torch.int16), rs1.slots.view(torch.int16))  # rsf not in slots
    routed = rs.slots[:, :K].float().sum(1).to(torch.bfloat16)  # K=2: fp32 sum is order-exact
    want = (routed.float() * RSF).to(torch.bfloat16)
    if shared is not None:
        want = (want.float() + rs.slots[:, K].float()).to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    # folding rsf into the weights instead is a different (wrong) model for nvfp4
    folded = c.run(spec=spec1, w=c.w * RSF)
    assert not torch.equal(folded, out)


@pytest.mark.parametrize("row,shared", [("mxfp4", "mxfp8"), ("nvfp4", "bf16"), ("bf16", None),
                                        ("mxfp8", None)])
def test_ep_slicing_two_ranks_sum_to_single_rank(row, shared):
    c = make_case(row, "swiglu_clamp_ab", shared)
    full, rs = c.run(return_slots=True)
    ranks = []
    for r in range(2):
        spec_r = c.spec.with_rank(r, 2)
        lo, hi = spec_r.local_experts.start, spec_r.local_experts.stop
        kt_r = layout.pack_expert_stack(row, c.experts[lo:hi])
        sc_r = None
        if c.scalars is not None:
            sc_r = NvScalars(c.scalars.l1_alpha[lo:hi], c.scalars.l2_global_scale[lo:hi],
                             c.scalars.l2_activation_scale)
        # weights of slots owned by the other rank are poisoned: they must not be read
        w_r = torch.where((c.ids >= lo) & (c.ids < hi), c.w, torch.full_like(c.w, float("nan")))
        # the shared expert runs once, on rank 0 here
        out_r, rs_r = reference_forward(spec_r, kt_r, c.x, w_r, c.ids, scalars=sc_r,
                                        shared=c.shared_kt if r == 0 else None, return_slots=True)
        assert torch.isfinite(out_r.float()).all()
        local = (c.ids >= lo) & (c.ids < hi)
        assert torch.equal(rs_r.valid[:, :K], local)
        ranks.append(rs_r)
    v0, v1 = ranks[0].valid[:, :K], ranks[1].valid[:, :K]
    assert not (v0 & v1).any() and torch.equal(v0 | v1, rs.valid[:, :K])
    summed = ranks[0].slots[:, :K].float() + ranks[1].slots[:, :K].float()
    assert torch.equal(summed.to(torch.bfloat16).view(torch.int16), rs.slots[:, :K].view(torch.int16))
    slots = rs.slots.clone()
    slots[:, :K] = summed.to(torch.bfloat16)
    if shared is not None:
        slots[:, K] = ranks[0].slots[:, K]
    merged = combine_slots(c.spec, slots, rs.valid)
    assert torch.equal(merged.view(torch.int16), full.view(torch.int16))


@pytest.mark.parametrize("row", ["mxfp4", "nvfp4", "bf16"])
def test_reference_pairs_equal_slots(row):
    c = make_case(row, "swiglu_clamp_ab")
    _, rs = c.run(return_slots=True)
    rs2 = reference_slots(c.spec, c.kt, c.x, c.w, c.ids, scalars=c.scalars)
    assert torch.equal(rs2.valid, rs.valid) and torch.equal(rs2.slots.view(torch.int16), rs.slots.view(torch.int16))
    t, k = (c.ids >= 0).nonzero(as_tuple=True)
    y = reference_pairs(c.spec, c.kt, c.x[t], c.w[t, k], c.ids[t, k], scalars=c.scalars)
    assert torch.equal(y.view(torch.int16), rs.slots[t, k].view(torch.int16))
    with pytest.raises(MegaMoEError, match="does not own"):
        spec1 = c.spec.with_rank(1, 2)
        reference_pairs(spec1, layout.pack_expert_stack(row, c.experts[2:]), c.x[:1], c.w[0, :1],
                        torch.tensor([0]), scalars=None if c.scalars is None else NvScalars(
                            c.scalars.l1_alpha[2:], c.scalars.l2_global_scale[2:],
                            c.scalars.l2_activation_scale))


def test_refusals():
    c = make_case("mxfp4", "swiglu", t=4)
    ids = c.ids.clone()
    ids[2, 1] = ids[2, 0]
    with pytest.raises(MegaMoEError, match="more than once"):
        c.run(ids=ids)
    ids = c.ids.clone()
    ids[0, 0] = E
    with pytest.raises(MegaMoEError, match="out of range"):
        c.run(ids=ids)
    with pytest.raises(MegaMoEError, match="bfloat16"):
        c.run(x=c.x.float())
    with pytest.raises(MegaMoEError, match=r"\[4, 2\]"):
        c.run(w=c.w[:, :1])
    n = make_case("nvfp4", "swiglu", t=4)
    with pytest.raises(LayoutError, match="MN-major"):  # P = H/64 = 2: a row-major scale
        n.run(kt=dataclasses.replace(n.kt, l1_scale=n.kt.l1_scale.contiguous()))
    with pytest.raises(MegaMoEError, match="NvScalars"):
        n.run(scalars=None)
    with pytest.raises(MegaMoEError, match="finite and > 0"):
        n.run(scalars=dataclasses.replace(n.scalars, l2_activation_scale=torch.tensor(0.0)))
    with pytest.raises(MegaMoEError, match="no shared"):
        c.run(shared=make_case("mxfp4", "swiglu", "mxfp8", t=4).shared_kt)


@pytest.mark.parametrize("name, index, shown", [("l1_alpha", (3, 1), "[3, 1]"), ("l2_global_scale", (2,), "[2]"),
                                                  ("l2_activation_scale", (), "")])
def test_nv_scalars_refuse_fp32_subnormals(name, index, shown):
    """The reference's own NvScalars check applies the load checks' rule (`scales.is_valid_scale`,
    docs/FORMATS.md#subnormal-scales): an fp32 subnormal is refused in one line naming the tensor, index and
    value; fp32's smallest normal 2^-126 still runs. Before, every value > 0 ran."""
    n = make_case("nvfp4", "swiglu", t=4)
    sub = 2.0 ** -130
    assert not scales.is_valid_scale(sub) and scales.is_valid_scale(scales.FP32_MIN_NORMAL)
    for v in (sub, 0.0, float("nan")):
        t = getattr(n.scalars, name).clone()
        t[index] = v
        with pytest.raises(ScaleError) as ei:
            n.run(scalars=dataclasses.replace(n.scalars, **{name: t}))
        msg = str(ei.value)
        assert "\n" not in msg and f"NvScalars.{name}{shown} = {v!r} (1 of {t.numel()} invalid)" in msg, msg
        assert scales.SCALE_RULE in msg, msg
    t = getattr(n.scalars, name).clone()
    t[index] = scales.FP32_MIN_NORMAL
    assert n.run(scalars=dataclasses.replace(n.scalars, **{name: t})).shape == n.x.shape


def test_duplicate_masked_ids_are_fine():
    c = make_case("bf16", "swiglu", t=4)
    ids = c.ids.clone()
    ids[0] = -1  # two -1 in one token are not duplicates
    c.run(ids=ids)


# =========================================================================== activation math


def test_activation_math():
    g = torch.linspace(-12, 12, 97).to(torch.bfloat16)
    u = torch.linspace(9, -9, 97).to(torch.bfloat16)
    a = activation_fp32(ACTS["swiglu"], g, u)
    gf, uf = g.float(), u.float()
    assert torch.allclose(a, torch.nn.functional.silu(gf) * uf, rtol=1e-6, atol=1e-6)
    a = activation_fp32(ACTS["swiglu_clamp_ab"], g, u)
    assert torch.allclose(a, gf * torch.sigmoid(1.702 * gf) * (uf + 1.0), rtol=1e-5, atol=1e-6)
    s = ACTS["situ"]
    a = activation_fp32(s, g, u)
    want = torch.sigmoid(gf) * 2.0 * torch.tanh(gf / 2.0) * 1.5 * torch.tanh(uf / 1.5)
    assert torch.allclose(a, want, rtol=1e-5, atol=1e-6)
    # SiTU tends to SwiGLU as the betas grow (DG test_mega_moe_situ.py)
    big = ActivationSpec("situ", situ_beta=1e4, situ_linear_beta=1e4)
    assert torch.allclose(activation_fp32(big, g, u), activation_fp32(ACTS["swiglu"], g, u), rtol=1e-3, atol=1e-3)


def test_clamp_is_one_sided_on_gate_two_sided_on_up_with_bf16_bound():
    g = torch.tensor([-5.0, 0.5, 5.0]).to(torch.bfloat16)
    u = torch.tensor([-5.0, 0.5, 5.0]).to(torch.bfloat16)
    cg, cu = apply_clamp(g, u, 1.001)  # 1.001 -> bf16 1.0
    assert cg.tolist() == [-5.0, 0.5, 1.0]
    assert cu.tolist() == [-1.0, 0.5, 1.0]
    cg, cu = apply_clamp(g, u, None)
    assert cg.tolist() == g.tolist() and cu.tolist() == u.tolist()


# =========================================================================== the Backend


@pytest.mark.parametrize("row,shared", [("mxfp4", "mxfp8"), ("nvfp4", "bf16"), ("bf16", None)])
def test_reference_backend_on_a_layer(row, shared):
    c = make_case(row, "swiglu", shared, t=6)
    be = get_backend("reference", "cpu")
    assert isinstance(be, ReferenceBackend) and be.name == "reference"
    assert be.supports(c.spec) is True and be.supports_fused_shared(c.spec) is True
    layer = SimpleNamespace(spec=c.spec, **c.kt.named())
    if c.scalars is not None:
        layer.l1_alpha, layer.l2_global_scale = c.scalars.l1_alpha, c.scalars.l2_global_scale
        layer.l2_activation_scale = c.scalars.l2_activation_scale
    if c.shared_kt is not None:
        for k, v in c.shared_kt.named().items():
            setattr(layer, "shared_" + k, v)
    out = be.forward(layer, c.x, c.w, c.ids, shared_input=c.x if shared else None)
    assert torch.equal(out.view(torch.int16), c.run().view(torch.int16))
    if shared:  # without shared_input the shared expert is not fused
        assert torch.equal(be.forward(layer, c.x, c.w, c.ids).view(torch.int16),
                           c.run(shared=None).view(torch.int16))
