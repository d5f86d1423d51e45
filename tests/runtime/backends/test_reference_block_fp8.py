"""The reference forward of the fp8_block row against an independent computation.

The independent side starts from the canonical source experts (never the kernel
layout), dequantizes them in fp64, and simulates the SM90 kernel's two activation
quantizations with its own code (docs/NUMERICS.md#fp8-block): per token per 128 of
H with ``s = amax / 448`` for the dispatch, per 64 of I with ``s = amax * (1/448)``
for the intermediate, after SwiGLU and the top-k weight (rsf folded in). Both
sides round the slot outputs to bf16 and sum them in order. What remains between
them is fp32 vs fp64 accumulation, so they agree to ~1e-7 (calc_diff); a kernel
layout with gate/up not interleaved, scales transposed, or one block scale doubled
must land far above.
"""
from __future__ import annotations

import pytest
import torch

from megamoe_runtime.backends.reference import reference_forward
from megamoe_runtime.errors import LayerSpecError
from megamoe_runtime.format import codecs, layout
from megamoe_runtime.format.canonical import ExpertTensors
from megamoe_runtime.format.formats import ActivationSpec, LayerSpec
from megamoe_runtime.testing import calc_diff

H, I, E, K, T = 256, 256, 4, 2, 24
#: measured 5e-11 (fp32 vs fp64 sums: a rare bf16 flip of a slot output); a power-of-two intermediate scale
#: (sgl-deep-gemm 0.1.3) gives 6e-4, a layout error far more
TOL = 1e-8


def _source(seed):
    gen = torch.Generator().manual_seed(seed)

    def w(n, k):  # a few blocks with their own magnitude, so every block scale differs
        mag = torch.rand(n // 128, k // 128, generator=gen).repeat_interleave(128, 0).repeat_interleave(128, 1)
        return torch.randn(n, k, generator=gen) * (0.02 + 0.1 * mag)

    return [ExpertTensors.quantize("fp8_block", w(I, H), w(I, H), w(H, I)) for _ in range(E)]


def _fp8_act(x64, group, divide):
    """The kernel's activation quantization, simulated: fp32 scale, RNE-satfinite E4M3; returns fp64 values."""
    x = x64.to(torch.float32).reshape(x64.shape[0], -1, group)
    amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-10)
    s = amax / 448.0 if divide else amax * torch.tensor(1 / 448, dtype=torch.float32)
    q = (x * (1.0 / s)).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32)
    return (q.double() * s.double()).reshape(x64.shape)


def independent_forward(experts, x, topk_w, topk_ids, rsf, clamp):
    xd = _fp8_act(x.double(), 128, divide=True)
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(topk_ids[t, k])
            ex = experts[e]
            g = xd[t] @ ex.gate.dequantize("fp8_block").double().t()
            u = xd[t] @ ex.up.dequantize("fp8_block").double().t()
            if clamp is not None:
                g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
            h = g * torch.sigmoid(g) * u * (float(topk_w[t, k]) * rsf)
            hd = _fp8_act(h[None], 64, divide=False)[0]
            y = hd @ ex.down.dequantize("fp8_block").double().t()
            out[t] += y.to(torch.bfloat16).double()
    return out.to(torch.bfloat16)


def _routing(seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=gen) * 2).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=gen), -1)
    return x, w, ids


def _spec(rsf, clamp):
    return LayerSpec(row="fp8_block", hidden=H, intermediate=I, num_experts=E, top_k=K,
                     routed_scaling_factor=rsf, activation=ActivationSpec(clamp=clamp))


@pytest.mark.parametrize("rsf,clamp", [(1.0, None), (2.5, 0.05)])
def test_reference_matches_independent_fp64_computation(rsf, clamp):
    experts = _source(1)
    x, w, ids = _routing(2)
    kt = layout.pack_expert_stack("fp8_block", experts)
    ref = reference_forward(_spec(rsf, clamp), kt, x, w, ids)
    ind = independent_forward(experts, x, w, ids, rsf, clamp)
    d = calc_diff(ref, ind)
    assert d < TOL, d


def test_numerics_negative_control_power_of_two_intermediate_scale(monkeypatch):
    """The tolerance sees the row's rounding: 0.1.3's UE8M0 intermediate scale must fail it."""
    experts = _source(1)
    x, w, ids = _routing(2)
    kt = layout.pack_expert_stack("fp8_block", experts)
    ind = independent_forward(experts, x, w, ids, 1.0, None)
    exact = codecs.quantize_fp8_act

    def pow2(x, group, *, reciprocal_scale):
        q, s = exact(x, group, reciprocal_scale=reciprocal_scale)
        if not reciprocal_scale:
            return q, s
        s = torch.pow(2.0, torch.ceil(torch.log2(s)))
        g = x.float().unflatten(-1, (-1, group))
        return codecs.e4m3_encode(g * (1.0 / s).unsqueeze(-1)).flatten(-2), s

    monkeypatch.setattr(codecs, "quantize_fp8_act", pow2)
    assert calc_diff(reference_forward(_spec(1.0, None), kt, x, w, ids), ind) > 100 * TOL


def test_negative_controls_fail():
    experts = _source(3)
    x, w, ids = _routing(4)
    spec = _spec(1.0, None)
    kt = layout.pack_expert_stack("fp8_block", experts)
    ind = independent_forward(experts, x, w, ids, 1.0, None)
    assert calc_diff(reference_forward(spec, kt, x, w, ids), ind) < TOL
    (w13, s13), (w2, s2) = layout.block_fp8_canonical(kt)
    broken = {
        "gate/up not interleaved": layout.KernelTensors(w13, kt.l1_scale, kt.l2_weight, kt.l2_scale),
        "L2 scales transposed": layout.KernelTensors(kt.l1_weight, kt.l1_scale, kt.l2_weight,
                                                     kt.l2_scale.transpose(1, 2).contiguous()),
        "L1 gate scales transposed": layout.KernelTensors(
            kt.l1_weight, torch.cat([s13[:, :2].transpose(1, 2), s13[:, 2:]], 1).contiguous(), kt.l2_weight,
            kt.l2_scale),
    }
    doubled = kt.l1_scale.clone()
    e_hot = int(ids[0, 0])
    doubled[e_hot, 0, 0] *= 2
    broken["one block scale doubled"] = layout.KernelTensors(kt.l1_weight, doubled, kt.l2_weight, kt.l2_scale)
    for what, bad in broken.items():
        d = calc_diff(reference_forward(spec, bad, x, w, ids), ind)
        assert d > 100 * TOL, (what, d)


def test_dispatch_and_intermediate_scales_are_the_kernels():
    """fp32 scales, not powers of two; the dispatch divides by 448, the intermediate multiplies by 1/448."""
    x = torch.tensor([[3.0] * 127 + [1000.0]])
    q, s = codecs.quantize_fp8_act(x, 128, reciprocal_scale=False)
    assert s.item() == torch.tensor(1000.0) / 448 and s.item() != 2.0 ** round(float(torch.log2(s)))
    assert float(codecs.e4m3_decode(q)[0, -1]) == 448.0
    _, s2 = codecs.quantize_fp8_act(torch.tensor([[1000.0] * 64]), 64, reciprocal_scale=True)
    assert s2.item() == (torch.tensor(1000.0) * torch.tensor(1 / 448, dtype=torch.float32)).item()
    _, z = codecs.quantize_fp8_act(torch.zeros(1, 128), 128, reciprocal_scale=False)
    assert z.item() == torch.tensor(1e-10) / 448  # the amax floor: an all-zero group gives no NaN


def test_other_activations_refused():
    spec = LayerSpec(row="fp8_block", hidden=H, intermediate=I, num_experts=E, top_k=K,
                     activation=ActivationSpec(alpha=1.702, beta=1.0))
    kt = layout.pack_expert_stack("fp8_block", _source(5))
    x, w, ids = _routing(6)
    with pytest.raises(LayerSpecError, match="plain SwiGLU"):
        reference_forward(spec, kt, x, w, ids)
