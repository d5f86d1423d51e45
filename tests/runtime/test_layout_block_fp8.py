"""The block-FP8 row's kernel layout (docs/LAYOUT.md#sm90-block-fp8).

Three independent checks:
1. round trips: canonical -> kernel -> canonical is the identity on bytes, for the
   per-expert primitives and for the whole-stack pure function;
2. `sm90_transform` below, written here from the facts of sgl-deep-gemm 0.1.3 / 0.1.5's
   ``transform_weights_for_mega_moe_sm90`` (gate/up weight rows interleaved in runs of
   8 along N, the L1 scales and both L2 tensors untouched), must give the same bytes;
3. a lookup oracle that reads one element the way the SM90 kernel addresses it (weight
   row from the interleave, scale ``[gate block n/128]`` or ``[I/128 + up block]``, L2
   ``[h/128, i/128]``) must agree with the canonical dequantization everywhere, and must
   FAIL for a layout without the interleave, transposed scales, or one block scale doubled.
"""
from __future__ import annotations

import pytest
import torch

from megamoe_runtime.errors import LayoutError
from megamoe_runtime.format import codecs, layout
from megamoe_runtime.format.canonical import ExpertTensors, ProjectionTensors

ROW = "fp8_block"


def _proj(out, k, gen):
    b = torch.randint(0, 256, (out, k), dtype=torch.uint8, generator=gen)
    b[(b & 0x7F) == 0x7F] = 0x3C  # no E4M3 NaN
    s = torch.rand((out // 128, k // 128), generator=gen) * 0.02 + 1e-3
    return ProjectionTensors(b.view(torch.float8_e4m3fn), s)


def _expert(H, I, gen):
    return ExpertTensors(_proj(I, H, gen), _proj(I, H, gen), _proj(H, I, gen))


def _canonical_stacks(exs):
    w13 = torch.stack([torch.cat([e.gate.weight, e.up.weight]) for e in exs])
    s13 = torch.stack([torch.cat([e.gate.scale, e.up.scale]) for e in exs])
    return (w13, s13), (torch.stack([e.down.weight for e in exs]), torch.stack([e.down.scale for e in exs]))


def sm90_transform(w13, s13, w2, s2):
    """The package's transform restated: runs of 8 gate rows and 8 up rows alternate."""
    E, n2, k = w13.shape
    runs = w13.view(E, 2, n2 // 16, 8, k)  # (expert, half, run, row in run, k)
    return runs.permute(0, 2, 1, 3, 4).reshape(E, n2, k), s13, w2, s2


def _bytes(t):
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.int32)


@pytest.mark.parametrize("H,I,E", [(128, 128, 1), (256, 384, 3), (384, 256, 2)])
def test_round_trip_and_package_transform(H, I, E):
    gen = torch.Generator().manual_seed(H + I + E)
    exs = [_expert(H, I, gen) for _ in range(E)]
    kt = layout.pack_expert_stack(ROW, exs)
    layout.check_kernel_tensors(ROW, kt, E, H, I)
    assert kt.l1_scale.shape == (E, 2 * I // 128, H // 128) and kt.l1_scale.dtype == torch.float32
    assert kt.l2_scale.shape == (E, H // 128, I // 128) and kt.l1_scale.is_contiguous()
    for a, b in zip(exs, layout.unpack_expert_stack(ROW, kt)):
        for (_, p), (_, q) in zip(a.projections(), b.projections()):
            assert torch.equal(_bytes(p.weight), _bytes(q.weight)) and torch.equal(_bytes(p.scale), _bytes(q.scale))
    l1, l2 = _canonical_stacks(exs)
    pure = layout.block_fp8_kernel_layout(l1, l2)
    want = sm90_transform(*l1, *l2)
    for got, ref, via_experts in zip((pure.l1_weight, pure.l1_scale, pure.l2_weight, pure.l2_scale), want,
                                     (kt.l1_weight, kt.l1_scale, kt.l2_weight, kt.l2_scale)):
        assert torch.equal(_bytes(got), _bytes(ref)) and torch.equal(_bytes(got), _bytes(via_experts))
    (w13, s13), (w2, s2) = layout.block_fp8_canonical(pure)
    for a, b in zip((w13, s13, w2, s2), (*l1, *l2)):
        assert torch.equal(_bytes(a), _bytes(b))


def oracle_mismatches(kt, exs):
    """Elements where the kernel-addressed value differs from the canonical dequantization."""
    bad = 0
    I = kt.l1_weight.shape[1] // 2
    for e, ex in enumerate(exs):
        w = codecs.e4m3_decode(kt.l1_weight[e])
        n = torch.arange(I)
        for half, proj in ((0, ex.gate), (1, ex.up)):
            rows = 16 * (n // 8) + 8 * half + n % 8
            srows = half * (I // 128) + n // 128
            k = torch.arange(w.shape[1])
            got = w[rows] * kt.l1_scale[e][srows][:, k // 128]
            bad += int((got != proj.dequantize(ROW)).sum())
        h, i = torch.arange(kt.l2_weight.shape[1]), torch.arange(I)
        got = codecs.e4m3_decode(kt.l2_weight[e]) * kt.l2_scale[e][h // 128][:, i // 128]
        bad += int((got != ex.down.dequantize(ROW)).sum())
    return bad


def test_oracle_agrees_and_negative_controls_fail():
    gen = torch.Generator().manual_seed(7)
    H, I = 256, 256
    exs = [_expert(H, I, gen) for _ in range(2)]
    kt = layout.pack_expert_stack(ROW, exs)
    assert oracle_mismatches(kt, exs) == 0
    (w13, s13), (w2, s2) = _canonical_stacks(exs)
    not_interleaved = layout.KernelTensors(w13.clone(), kt.l1_scale, kt.l2_weight, kt.l2_scale)
    assert oracle_mismatches(not_interleaved, exs) > 0
    # scales stored [K/128, N/128] (a square 2x2 block grid, so the shapes still fit)
    transposed = layout.KernelTensors(kt.l1_weight, kt.l1_scale, kt.l2_weight, kt.l2_scale.transpose(1, 2).contiguous())
    assert oracle_mismatches(transposed, exs) > 0
    doubled = kt.l1_scale.clone()
    doubled[1, 3, 1] *= 2
    n_bad = oracle_mismatches(layout.KernelTensors(kt.l1_weight, doubled, kt.l2_weight, kt.l2_scale), exs)
    assert 16000 < n_bad <= 128 * 128  # that one block's elements (its zero bytes stay zero)
    # the scales' gate / up order: interleaving the scale rows as well (as the SM100 transform does) is wrong
    swapped = kt.l1_scale[:, [0, 2, 1, 3]].contiguous()
    assert oracle_mismatches(layout.KernelTensors(kt.l1_weight, swapped, kt.l2_weight, kt.l2_scale), exs) > 0


def test_refusals_name_the_tensor():
    gen = torch.Generator().manual_seed(8)
    kt = layout.allocate_kernel_tensors(ROW, 1, 256, 256)
    with pytest.raises(LayoutError, match="gate.scale.*block scale source shape"):
        layout.write_l1_scale(kt.l1_scale[0], torch.ones(2, 1), 0, where="expert 0.gate.scale")
    with pytest.raises(LayoutError, match="block scale source dtype torch.uint8"):
        layout.write_l2_scale(kt.l2_scale[0], torch.ones(2, 2, dtype=torch.uint8), where="expert 0.down.scale")
    with pytest.raises(LayoutError, match="multiples of the 128x128 scale block"):
        layout.allocate_kernel_tensors(ROW, 1, 256, 192)
    bad = layout.KernelTensors(kt.l1_weight, kt.l1_scale.to(torch.bfloat16), kt.l2_weight, kt.l2_scale)
    with pytest.raises(LayoutError, match="l1_scale: block scales must be contiguous float32"):
        layout.check_kernel_tensors(ROW, bad, 1, 256, 256)
    # bf16 scales widen exactly
    s = (torch.rand(2, 2, generator=gen) + 0.5).to(torch.bfloat16)
    layout.write_l2_scale(kt.l2_scale[0], s)
    assert torch.equal(kt.l2_scale[0], s.float())
